"""GGUF files: read their metadata, check it, and convert them once (through transformers' own
GGUF reader, de-quantised to float32) into a safetensors directory of the model cache, with
the RoPE scaling transformers' reader drops carried over."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import torch

from .cache import (cache_errors, cache_lock, check_entry_place, is_converted, remove_stale_staging, staging_dir,
                    write_manifest)
from .config import ModelConfig, positive_number

# GGUF general.architecture values kvsieve runs (llama.cpp stores Mistral models as "llama")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


# GGUF metadata (after "<arch>.") that llama.cpp requires of these models: transformers' reader fills a
# missing key from its config defaults, a silently different model (a 32-layer one for a missing block_count)
GGUF_REQUIRED = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                 "attention.layer_norm_rms_epsilon")
GGUF_REQUIRED_GEMMA3 = ("attention.key_length", "attention.sliding_window")  # transformers' defaults differ
# llama.cpp's RoPE scaling keys (after "<arch>.rope.scaling.") kvsieve reads, and those it accepts at neutral values
GGUF_ROPE_KEYS = ("type", "factor", "original_context_length", "finetuned", "yarn_beta_fast", "yarn_beta_slow")
GGUF_ROPE_NEUTRAL = {"attn_factor": 1.0, "yarn_ext_factor": 1.0, "yarn_attn_factor": 1.0}
GGUF_FIX = "convert the model again with llama.cpp's convert_hf_to_gguf.py, or pass its Hugging Face directory"

# token texts llama.cpp ends generation on whatever the metadata says (llama-vocab.cpp, its
# end-of-generation set): a GGUF often names no end-of-turn token (gemma3-270m's has no
# tokenizer.ggml.eot_token_id, yet Gemma 3 ends its turns with <end_of_turn>)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
             "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
EOG_BY_TEXT = "kvsieve.eog_by_text"  # read_gguf's key: the ids of the vocabulary's EOG_TEXTS tokens, in that order


def _gguf_head_dim(arch: str, meta: dict) -> int:
    return meta.get(f"{arch}.attention.key_length") or \
        meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"]


def check_gguf_metadata(arch: str, meta: dict, tensor_names, where) -> None:
    """One ValueError naming the key where a GGUF file's metadata (key -> value) lacks what the
    model needs, disagrees with its blk.N tensors, or rotates part of each head only."""
    for key in GGUF_REQUIRED + (GGUF_REQUIRED_GEMMA3 if arch == "gemma3" else ()):
        v = meta.get(f"{arch}.{key}")
        if not positive_number(v):
            got = "lacks the metadata key" if v is None else f"has {v!r} for"
            raise ValueError(f"GGUF file {where} {got} {arch}.{key}, which the model needs; {GGUF_FIX}")
    blocks = meta[f"{arch}.block_count"]
    layers = {int(n.split(".")[1]) for n in tensor_names if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if layers != set(range(blocks)):
        raise ValueError(f"GGUF file {where} has {arch}.block_count = {blocks}, but tensors of {len(layers)} "
                         f"layers (blk.{min(layers, default=0)}..blk.{max(layers, default=0)}); {GGUF_FIX}")
    heads, kv = meta[f"{arch}.attention.head_count"], meta.get(f"{arch}.attention.head_count_kv", 1)
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ValueError(f"GGUF file {where} has {arch}.attention.head_count_kv = {kv!r}, which does not divide "
                         f"{arch}.attention.head_count = {heads} (each KV head serves a group of query heads); {GGUF_FIX}")
    vocab = meta.get("tokenizer.ggml.tokens.count")
    for name in ("bos", "eos", "eot", "eom", "padding", "unknown"):
        t = meta.get(f"tokenizer.ggml.{name}_token_id")
        if vocab is not None and t is not None and not 0 <= t < vocab:
            raise ValueError(f"GGUF file {where} has tokenizer.ggml.{name}_token_id = {t}, outside its vocabulary of "
                             f"{vocab} tokens; {GGUF_FIX}")
    head_dim = _gguf_head_dim(arch, meta)
    rotated = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotated != head_dim:
        what = "RoPE on part of each head, which kvsieve does not run" if rotated < head_dim else GGUF_FIX
        raise ValueError(f"GGUF file {where} has {arch}.rope.dimension_count = {rotated} for heads of {head_dim} "
                         f"(attention.key_length, or embedding_length / attention.head_count): {what}")


def gguf_rope_scaling(arch: str, meta: dict, freq_factors: Optional[list], where) -> Optional[dict]:
    """The RoPE scaling a GGUF file describes, as a Hugging Face rope_parameters entry (rope_theta
    left out; None for plain RoPE). llama.cpp's `<arch>.rope.scaling.*` keys give linear or YaRN
    scaling (a factor without a type is linear, as llama.cpp reads it); the rope_freqs tensor
    (`freq_factors`, how llama.cpp's converter stores Llama 3.1/3.2's llama3 scaling) divides each
    inverse frequency by its factor, carried exactly as LongRoPE with equal short and long factors.
    A setting kvsieve cannot run is one ValueError naming it: nothing is dropped."""
    pre = f"{arch}.rope.scaling."
    keys = {k[len(pre):]: v for k, v in meta.items() if k.startswith(pre)}
    for k, v in keys.items():
        if k not in GGUF_ROPE_KEYS and GGUF_ROPE_NEUTRAL.get(k) != v:
            raise ValueError(f"GGUF file {where} sets {pre}{k} = {v!r}, a RoPE scaling setting kvsieve does not "
                             "run; pass the model's Hugging Face directory instead")
    factor = keys.get("factor") or meta.get(f"{arch}.rope.scale_linear")
    kind = keys.get("type", "linear" if factor else "none")
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"GGUF file {where} has RoPE scaling {pre}type = {kind!r}, which kvsieve does not run "
                         "(it runs none, linear, yarn and Llama 3.1's rope_freqs)")
    scaling = None
    if kind != "none" and factor and factor != 1.0:
        scaling = {"rope_type": kind, "factor": factor}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = keys.get("original_context_length") or \
                meta[f"{arch}.context_length"]
            scaling.update({b: keys[f"yarn_{b}"] for b in ("beta_fast", "beta_slow") if f"yarn_{b}" in keys})
    if freq_factors is None or all(f == 1.0 for f in freq_factors):
        return scaling
    head_dim = _gguf_head_dim(arch, meta)
    if scaling or arch == "gemma3" or len(freq_factors) != head_dim // 2:
        why = (f"together with {pre}type = {kind!r}" if scaling else "on a Gemma 3 model" if arch == "gemma3"
               else f"with {len(freq_factors)} factors for head_dim {head_dim}")
        raise ValueError(f"GGUF file {where} has a rope_freqs tensor {why}, which kvsieve does not run; "
                         "pass the model's Hugging Face directory instead")
    return {"rope_type": "longrope", "short_factor": list(freq_factors), "long_factor": list(freq_factors),
            "factor": 1.0, "attention_factor": 1.0,
            "original_max_position_embeddings": meta[f"{arch}.context_length"]}

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
            elif key == "tokenizer.ggml.tokens":
                meta["tokenizer.ggml.tokens.count"] = len(field.data)
                meta[EOG_BY_TEXT] = _ids_of(field, EOG_TEXTS)
        return meta, {t.name: t for t in reader.tensors}
    except Exception as e:  # not a GGUF file, truncated
        raise ValueError(f"could not read GGUF file {gguf} ({e.__class__.__name__}: {e}): it is cut short or not a "
                         "GGUF file; download it again") from e


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
    check_entry_place(out)
    meta, tensors = read_gguf(gguf)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {gguf.name}; kvsieve runs "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    if (meta.get("split.count") or 1) > 1:
        raise ValueError(f"{gguf.name} is shard {meta.get('split.no', 0) + 1} of a GGUF split in {meta['split.count']} "
                         "files; merge them into one first (llama.cpp: llama-gguf-split --merge FIRST-SHARD OUT.gguf)")
    check_gguf_metadata(arch, meta, tensors, gguf)
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        from gguf import dequantize

        freqs = dequantize(freqs.data, freqs.tensor_type).reshape(-1).tolist()
    rope = gguf_rope_scaling(arch, meta, freqs, gguf)
    print(f"kvsieve: converting {gguf.name} to safetensors in {out} (once, ~30 s)", file=sys.stderr)
    remove_stale_staging(out)
    tmp = staging_dir(out)
    try:
        tok, model = _read_gguf_model(gguf, arch, meta)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _check_converted(_with_gguf_config(tmp / "config.json", rope, meta.get(f"{arch}.rope.freq_base_swa"),
                                         _gemma3_query_scalar(arch, meta)), gguf)
        write_manifest(tmp)
        mode = tmp.stat().st_mode & 0o666  # files as readable as the directory (safetensors writes 0600)
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(mode)
        shutil.rmtree(out, ignore_errors=True)  # a damaged entry of ours (check_entry_place)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_converted(cfg: dict, gguf: Path) -> None:
    """The converted config is one kvsieve runs (else the error now, and nothing cached)."""
    try:
        ModelConfig.from_hf(cfg)
    except (KeyError, TypeError) as e:
        raise ValueError(f"could not read GGUF file {gguf}: its converted config.json lacks {e}; {GGUF_FIX}") from e


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

    from .loader import load_tokenizer  # (loader imports this module)

    level = hf_logging.get_verbosity()
    # transformers reads the GGUF's folder as a model directory: a tokenizer.json lying beside the file
    # would replace the GGUF's own tokenizer (and its chat template). It reads a folder of the file alone.
    with tempfile.TemporaryDirectory(prefix="kvsieve-gguf-") as alone:
        (Path(alone) / "model.gguf").symlink_to(gguf.resolve())
        try:
            tok = load_tokenizer(alone, gguf_file="model.gguf")
            hf_logging.set_verbosity_error()
            model, info = AutoModelForCausalLM.from_pretrained(alone, gguf_file="model.gguf", dtype=torch.float32,
                                                               output_loading_info=True, ignore_mismatched_sizes=True)
        except Exception as e:  # transformers raises many kinds; the user needs one line
            raise ValueError(f"could not read GGUF file {gguf}: {e.__class__.__name__}: {_first_line(e)}; "
                             "pass a valid Llama-family or Gemma 3 .gguf or a Hugging Face directory") from e
        finally:
            hf_logging.set_verbosity(level)
    c = model.config
    for key, attr in GGUF_CONFIG.items():
        want, got = meta.get(f"{arch}.{key}"), getattr(c, attr, None)
        if attr == "head_dim":  # (Qwen2's config has none: hidden / heads)
            got = got or c.hidden_size // c.num_attention_heads
        if want is not None and got != want and arch == "qwen3" and attr == "head_dim":
            raise ValueError(f"GGUF file {gguf} has heads of {want} (qwen3.attention.key_length), but transformers' "
                             f"Qwen3 GGUF reader assumes {got}; pass the model's Hugging Face directory instead")
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
    _end_of_turn_tokens(model, meta)
    _eos_into_tokenizer(tok, model.config.eos_token_id)
    # the weights are de-quantised float32 now; drop the GGUF marker so they save as plain safetensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return tok, model


def _first_line(e: Exception) -> str:
    """An exception's first line (its class name where it has no message)."""
    return (str(e).strip().splitlines() or [e.__class__.__name__])[0]


def _ids_of(tokens_field, texts) -> list:
    """The ids of the tokens (a GGUF token-list field) whose text is one of `texts`, in the order of texts."""
    want = {t.encode(): i for i, t in enumerate(texts)}
    found = {}
    for token_id, part in enumerate(tokens_field.data):
        rank = want.get(bytes(tokens_field.parts[part]))
        if rank is not None:
            found.setdefault(rank, token_id)
    return [found[r] for r in sorted(found)]


def _end_of_turn_tokens(model, meta: dict) -> None:
    """The GGUF's end-of-generation tokens as llama.cpp takes them: those its metadata names
    (tokenizer.ggml.eot_token_id, .eom_token_id) and those whose text is one of EOG_TEXTS
    (transformers' reader keeps its EOS alone), added to the config's and the generation
    config's end tokens, after its EOS (check_gguf_metadata checked the ids against the
    vocabulary)."""
    extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
    extra += meta.get(EOG_BY_TEXT, [])
    eos = model.config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    ends = list(dict.fromkeys(eos + extra))
    if ends != eos:
        model.config.eos_token_id = ends
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = ends


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


def _gemma3_query_scalar(arch: str, meta: dict) -> Optional[int]:
    """Gemma 3's query_pre_attn_scalar as llama.cpp derives it (a GGUF does not store it, and
    transformers' reader keeps its default 256): the key length, but hidden / heads for the
    27B model (62 layers; 168 there, against a head dim of 128). None for other architectures."""
    if arch != "gemma3":
        return None
    if meta.get("gemma3.block_count") == 62:
        return meta["gemma3.embedding_length"] // meta["gemma3.attention.head_count"]
    return meta["gemma3.attention.key_length"]


def _with_gguf_config(config_file: Path, scaling: Optional[dict], local_theta, query_scalar=None) -> dict:
    """The converted config.json with what transformers' reader drops, written back once: the
    GGUF's RoPE scaling (on Gemma 3 the global layers'), Gemma 3's local RoPE base where the
    file has one, and its query_pre_attn_scalar (_gemma3_query_scalar)."""
    cfg = json.loads(config_file.read_text())
    before = json.dumps(cfg, sort_keys=True)
    if query_scalar is not None:
        cfg["query_pre_attn_scalar"] = query_scalar
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("model_type") == "gemma3_text":  # (transformers 4 wrote rope_theta, rope_local_base_freq)
        full = rope.get("full_attention", {"rope_theta": cfg.get("rope_theta")})
        local = rope.get("sliding_attention", {"rope_theta": cfg.get("rope_local_base_freq")})
        rope = {"full_attention": {**full, **(scaling or {})},
                "sliding_attention": {**local, **({"rope_theta": local_theta} if local_theta else {})}}
    elif scaling:
        rope = {"rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), **scaling}
    else:
        rope = None
    if rope is not None:
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = rope
    if json.dumps(cfg, sort_keys=True) != before:
        config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg
