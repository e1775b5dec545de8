"""What the engine's entry points accept: prompts, per-prompt sampling settings and the
constructor's sizes, each refused with one error that names the value and the fix."""
from __future__ import annotations

import numbers
import operator
from typing import List, Mapping, Optional, Sequence, Union

import torch

from .scheduler import SamplingParams, _token_id

Prompt = Union[str, Sequence[int]]  # text (encoded with the engine's tokenizer) or token ids


def plain_int(value) -> int:
    """value as a Python int: an int, a NumPy integer or a 0-d integer tensor (TypeError for a
    bool, a float or anything else; ValueError for a tensor of several values)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.dtype == torch.bool:
            raise TypeError(value)
        value = value.item()
    return _token_id(value)


def check_sizes(**given) -> None:
    """One clear error for a constructor size that is not a count (or a fraction) in range."""
    counts = {"kv_pages": 1, "kv_page_size": 1, "prefill_chunk": 1, "dense_below": 0, "max_num_seqs": 1,
              "step_tokens": 1}
    required = ("kv_page_size", "max_num_seqs", "step_tokens")
    for name, v in given.items():
        if v is None and name not in required:
            continue
        if name in ("paged", "graphs"):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True, False or None (the default), got {v!r}")
        elif name in counts:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < counts[name]:
                raise ValueError(f"{name} must be an integer >= {counts[name]}"
                                 + ("" if name in required else " (or None: the default)") + f", got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, numbers.Real) or not (
                0 < v <= 1 if name == "gpu_memory_fraction" else 0 < v < float("inf")):
            raise ValueError(f"{name} must be a number {'in (0, 1]' if name == 'gpu_memory_fraction' else '> 0'}, "
                             f"got {v!r}")


def check_params(params) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__} {str(params)[:40]}; "
                         "e.g. SamplingParams(max_new_tokens=64)")


def prompt_token_ids(prompt: Prompt, tokenizer, vocab: int) -> List[int]:
    """A prompt as a list of token ids: a str is encoded with `tokenizer` as it stands (no
    chat template); token ids (a list, or a 1-D integer tensor or array) must lie in
    [0, vocab). Raises ValueError naming the first bad one."""
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError("a prompt must be text (str) or token ids, got bytes; decode it first (e.g. .decode())")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: build the engine with one, or pass token ids")
        return list(tokenizer.encode(prompt))
    if getattr(prompt, "ndim", 1) != 1:
        raise ValueError(f"a prompt of token ids must be 1-D, got shape {tuple(prompt.shape)}; "
                         "pass one request's ids (e.g. input_ids[0])")
    raw = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    try:
        ids = [operator.index(t) for t in raw]
    except TypeError:
        raise ValueError(f"a prompt must be text or a sequence of integer token ids, got {type(prompt).__name__} "
                         f"{str(prompt)[:40]!r}") from None
    if any(isinstance(t, bool) for t in raw):
        raise ValueError("a prompt's token ids must be integers, got booleans (True/False); pass the ids")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab})")
    return ids


def params_per_prompt(prompts, params) -> List[SamplingParams]:
    """generate()'s arguments checked: a list of prompts, and one SamplingParams for all or
    one per prompt; returns the settings of each prompt."""
    if isinstance(prompts, Mapping):  # (a tokenizer's output: iterating it gives its keys)
        raise ValueError(f"generate() takes a list of prompts, got a {type(prompts).__name__} (a tokenizer's output?); "
                         "pass its token ids, one list per prompt, e.g. enc['input_ids'] without padding")
    if prompts is None or isinstance(prompts, (set, frozenset)) or not hasattr(prompts, "__len__") \
            or not hasattr(prompts, "__getitem__"):
        raise ValueError(f"generate() takes a list of prompts (each text or token ids), got {type(prompts).__name__}; "
                         "e.g. generate(['Hello'], params)")
    if getattr(prompts, "ndim", 1) != 1:  # (a [B, S] input_ids tensor: rows may be padded)
        raise ValueError(f"generate() takes a list of prompts, got a {getattr(prompts, 'ndim')}-D "
                         f"{type(prompts).__name__}; pass one list of token ids per prompt, without padding "
                         "(e.g. [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)])")
    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ValueError("generate() takes a list of prompts (each text or token ids); got "
                         + ("one str: wrap it in a list" if len(prompts) else "none"))
    first = prompts[0]
    if isinstance(first, numbers.Integral) or (getattr(first, "ndim", None) == 0 and not isinstance(first, str)):
        raise ValueError("generate() takes a list of prompts; got one list of token ids: wrap it in a list (a 1-D "
                         "tensor or array of ids too)")
    if not isinstance(params, SamplingParams) and not (
            isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params)):
        raise ValueError(f"params must be a SamplingParams or a list of them (one per prompt), got "
                         f"{type(params).__name__} {str(params)[:40]}")
    per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per) != len(prompts):
        raise ValueError(f"got {len(per)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
    return per


def check_score_lists(prompts, continuations) -> None:
    """score()'s prompts and continuations: lists of the same length, each entry token ids."""
    for name, given in (("prompts", prompts), ("continuations", continuations)):
        if getattr(given, "ndim", 1) != 1 or isinstance(given, Mapping) or not hasattr(given, "__len__"):
            raise ValueError(f"score() takes a list of {name} (each token ids or text), got "
                             f"{getattr(given, 'ndim', '')}{'-D ' if hasattr(given, 'ndim') else ''}"
                             f"{type(given).__name__}; pass one list of token ids per entry, without padding")
    if not len(prompts):
        raise ValueError("no prompt given; pass at least one prompt")
    for name, given in (("prompts", prompts), ("continuations", continuations)):
        if isinstance(given, str) or isinstance(given[0] if len(given) else None, int):
            raise ValueError(f"score() takes a list of {name} (each token ids or text); got one "
                             f"{'str' if isinstance(given, str) else 'list of token ids'}: wrap it in a list")
    if len(continuations) != len(prompts):
        raise ValueError(f"got {len(continuations)} continuations for {len(prompts)} prompts; pass one per prompt")
    if any(len(c) < 1 for c in continuations):
        raise ValueError("every continuation needs at least one token to feed")


def resolve_device(device: Optional[str], dtype: Optional[str]):
    """(torch.device, torch.dtype): CUDA when present unless told otherwise; bfloat16 on
    CUDA, float32 on the CPU unless told otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device!r} is not a device torch knows ({e}); use cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for but no CUDA GPU is available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: kvsieve runs on cpu or cuda devices; use --device cpu or --device cuda")
    if dev.type == "cpu":  # (one CPU device: "cpu:0" reached the weights' loader, which refused it)
        dev = torch.device("cpu")
    if dtype is None:
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    if isinstance(dtype, torch.dtype):  # (the Python API's torch.bfloat16 as the CLI's "bfloat16")
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return dev, getattr(torch, dtype)
