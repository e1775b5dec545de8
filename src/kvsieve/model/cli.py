"""`kvsieve generate`: a long prompt through a model with a chosen sparse method."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_QUESTION = "\n\nQuestion: What is the archive access code?\nAnswer: The archive access code is"


def register(sub) -> None:
    from ..cli import add_method_options

    p = sub.add_parser("generate", help="generate from a (long) prompt with sparse decode attention",
                       description="With no prompt, runs a built-in ~4K-token document (Python's docs with "
                                   "one planted fact) and asks for the fact.")
    p.add_argument("--model", help="Hugging Face model directory (config.json + *.safetensors) or .gguf file "
                                   "(default: the embedded SmolLM2-135M-Instruct)")
    add_method_options(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", help="file holding a prompt (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="send prompts as raw text, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-dense", action="store_true", help="also run dense; print both answers and agreement")
    p.add_argument("--kv-pages", type=int, help="KV pool size in 16-token pages (default: just enough)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_generate)


def read_prompts(args, tok) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the built-in document was used."""
    from ..prompts import document_prompt

    texts = list(args.prompt or [])
    for f in args.prompt_file or []:
        path = Path(f)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {f!r} not found; pass an existing text file to --prompt-file")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        doc, _, _ = document_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)), 4000)
        return [tok.encode(doc + DEFAULT_QUESTION, add_special_tokens=False)], True
    ids = []
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"prompt {i} is empty; give some text with --prompt or --prompt-file")
        if not args.no_chat and getattr(tok, "chat_template", None):
            t = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        ids.append(tok.encode(t, add_special_tokens=False))
    return ids, False


def cmd_generate(args) -> int:
    import torch

    from ..cli import method_options
    from ..patterns import STREAMING_METHODS, pattern_for
    from .loader import load_model
    from .runner import Engine, SamplingConfig

    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.kv_pages is not None and args.kv_pages <= 0:
        raise ValueError(f"--kv-pages must be >= 1, got {args.kv_pages}")
    opts = method_options(args)
    from ..methods import config_for

    config_for(args.method, **opts)  # fail on bad options before loading anything
    model, tok, model_dir = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    heads = pattern_for(args.method, args.streaming_heads, model_dir, model.cfg.num_layers, model.cfg.num_kv_heads)
    if heads is not None:
        opts["streaming_heads"] = heads
    prompts, builtin = read_prompts(args, tok)

    def run(method, options):
        eng = Engine(model, method, kv_pages=args.kv_pages, progress=not args.no_progress and not args.json,
                     **options)
        return eng.generate(prompts, args.max_new_tokens, sampling)

    res = run(args.method, opts)
    texts = [tok.decode(t, skip_special_tokens=True) for t in res.tokens]
    report = {
        "text": texts[0] if len(texts) == 1 else texts,
        "method": args.method,
        "options": {k: v for k, v in opts.items() if k != "streaming_heads"},
        "streaming_heads": None if heads is None else args.streaming_heads or "shipped pattern",
        "model": str(model_dir),
        "prompt_tokens": res.prompt_tokens[0] if len(prompts) == 1 else res.prompt_tokens,
        "generated_tokens": res.generated_tokens,
        "prefill_s": round(res.prefill_s, 4),
        "index_s": round(res.index_s, 4),
        "decode_s": round(res.decode_s, 4),
        "decode_tokens_per_s": round(res.decode_tokens_per_s, 3),
        "kv_fraction": round(res.kv_fraction, 5),
        "kv_bytes": res.kv_bytes,
        "builtin_prompt": builtin,
    }
    if args.compare_dense:
        dense = run("dense", {})
        dtexts = [tok.decode(t, skip_special_tokens=True) for t in dense.tokens]
        report["dense"] = {"text": dtexts[0] if len(dtexts) == 1 else dtexts,
                           "decode_tokens_per_s": round(dense.decode_tokens_per_s, 3)}
        report["agreement"] = round(token_agreement(dense.tokens, res.tokens), 4)
    if args.json:
        print(json.dumps(report))
        return 0
    for i, t in enumerate(texts):
        print(t if len(texts) == 1 else f"[{i}] {t}")
    if args.compare_dense:
        print(f"--- dense answer: {report['dense']['text']}")
        print(f"--- agreement with dense: {report['agreement']:.0%} of generated tokens")
    print(f"--- {args.method}: prompt {res.prompt_tokens} tokens, {res.generated_tokens} generated, "
          f"KV read {res.kv_fraction:.1%}, prefill {res.prefill_s:.1f} s, "
          f"decode {res.decode_tokens_per_s:.1f} tok/s, KV cache {res.kv_bytes / 2**20:.1f} MiB", file=sys.stderr)
    return 0


def token_agreement(ref: list[list[int]], other: list[list[int]]) -> float:
    """Fraction of reference tokens that the other run reproduced at the same position."""
    total = sum(len(r) for r in ref)
    same = sum(a == b for r, o in zip(ref, other) for a, b in zip(r, o))
    return same / total if total else 1.0
