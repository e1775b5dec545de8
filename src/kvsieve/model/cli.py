"""`kvsieve generate`: a long prompt through a model with a chosen sparse method."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..config import MODEL_HELP
from ..engine.scheduler import TEXT_CHARS_PER_POSITION, too_long_fix

DEFAULT_QUESTION = "\n\nQuestion: What is the archive access code?\nAnswer: The archive access code is"


def register(sub) -> None:
    from ..cli import add_method_options

    p = sub.add_parser("generate", help="generate from a (long) prompt with sparse decode attention",
                       description="With no prompt, runs a built-in ~4K-token document (Python's docs with "
                                   "one planted fact) and asks for the fact.")
    p.add_argument("--model", help=MODEL_HELP)
    add_method_options(p)
    p.add_argument("--prompt", action=_InOrder, help="prompt text, - for standard input (repeat for a batch; "
                   "answers come in the order of --prompt and --prompt-file on the command line)")
    p.add_argument("--prompt-file", action=_InOrder, help="file holding a prompt (repeatable; - reads stdin)")
    p.add_argument("--no-chat", action="store_true", help="send prompts as raw text, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in [0, 1] (default 1: off; 0: the most likely token)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off; -1 too)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--compare-dense", action="store_true", help="also run dense; print both answers and agreement")
    p.add_argument("--kv-pages", type=int, help="KV pool size in 16-token pages (default: room for every prompt)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", help="default cuda when a GPU is present, else cpu")
    p.add_argument("--dense-below", type=int, help="a request attends densely while its context (prompt and "
                   "generated tokens) is shorter than this, and is indexed where it gets there with enough tokens "
                   "left to repay the index (default: the measured crossover on CUDA, 0 on the CPU; 0 forces the "
                   "method)")
    p.add_argument("--no-warmup", action="store_true", help="skip kernel compilation before the request (CUDA)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="do not stream tokens as they come")
    p.set_defaults(func=cmd_generate)


class _InOrder(argparse.Action):
    """--prompt / --prompt-file: each also appends (flag, value) to args.prompts, so a batch
    keeps the command line's order."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (getattr(namespace, self.dest, None) or []) + [values])
        namespace.prompts = (getattr(namespace, "prompts", None) or []) + [(option_string, values)]


def read_text_file(f: str, flag: str, what: str = "prompt file") -> str:
    """A UTF-8 text file's contents, or one clear error (missing, a directory, not UTF-8):
    nothing is decoded with replacement characters. "-" reads standard input. A file and
    standard input give the same text: line endings kept as they are ("\\r\\n" stays), a
    leading byte-order mark dropped (it marks the encoding; it is not text)."""
    if f == "-":
        try:
            return sys.stdin.buffer.read().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(f"{flag} - (standard input) is not UTF-8 text ({e.reason} at byte {e.start}); "
                             "convert it, e.g. iconv -f latin1 -t utf-8") from None
    path = Path(f)
    if path.is_dir():
        raise ValueError(f"{flag} {f!r} is a directory; pass a text file")
    if path.exists() and not path.is_file() and not path.is_fifo():  # (a pipe: <(command), mkfifo)
        raise ValueError(f"{flag} {f!r} is not a regular file or a pipe; pass a text file")
    if not path.is_file() and not path.is_fifo():
        raise FileNotFoundError(f"{what} {f!r} not found; pass an existing text file to {flag}")
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {f!r} is not UTF-8 text ({e.reason} at byte {e.start}); convert it, "
                         f"e.g. iconv -f latin1 -t utf-8") from None


def read_prompts(args, tok, limit: int | None = None) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the built-in document was used. limit: the
    model's positions; a prompt that cannot fit them with --max-new-tokens is refused here,
    before the KV pool is sized for it (text far too long for them, before tokenizing it)."""
    from ..prompts import document_prompt

    given = getattr(args, "prompts", None) or [("--prompt", t) for t in args.prompt or []] + \
        [("--prompt-file", f) for f in args.prompt_file or []]
    texts, names = [], []
    stdin_by = [flag for flag, value in given if value == "-"]
    if len(stdin_by) > 1:
        raise ValueError(f"standard input ('-') is given {len(stdin_by)} times ({', '.join(stdin_by)}), but it can be "
                         "read once; give it to one flag, and the other prompts as text or files")
    for flag, value in given:
        names.append(f"--prompt-file {value!r}" if flag == "--prompt-file" else f"--prompt {len(names) + 1}")
        if flag == "--prompt-file" or value == "-":
            texts.append(read_text_file(value, flag))
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raw = value[e.start].encode("utf-8", "surrogateescape")
            raise ValueError(f"{names[-1]} is not UTF-8 text (byte 0x{raw.hex()} at character {e.start}); give UTF-8 "
                             "text, or a converted file to --prompt-file (e.g. iconv -f latin1 -t utf-8)") from None
        texts.append(value)
    if not texts:
        doc, _, _ = document_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)), 4000)
        ids = [tok.encode(doc + DEFAULT_QUESTION, add_special_tokens=True)]
        check_fits(ids, ["the built-in prompt"], 0, args.max_new_tokens, limit)
        return ids, True
    ids = []
    chat = not args.no_chat and getattr(tok, "chat_template", None)
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"{names[i]} is empty{' (only whitespace)' if t else ''}; give some text")
        if limit is not None and len(t) > TEXT_CHARS_PER_POSITION * limit:
            raise ValueError(f"{names[i]} has {len(t):,} characters, more than {TEXT_CHARS_PER_POSITION} a position "
                             f"could hold in the model's {limit:,} positions; shorten it (kvsieve never truncates)")
    if not args.no_chat and not chat:
        print("kvsieve: this model has no chat template; the prompts are sent as raw text", file=sys.stderr)
    for t in texts:
        if chat:  # the template writes the special tokens itself
            t = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        ids.append(tok.encode(t, add_special_tokens=not chat))  # raw text: the tokenizer's BOS (Gemma needs it)
    if limit is not None and any(len(p) + args.max_new_tokens > limit for p in ids):
        check_fits(ids, names, template_tokens(tok) if chat else 0, args.max_new_tokens, limit)
    return ids, False


def template_tokens(tok) -> int:
    """Tokens the chat template adds around a user message (that message's text cannot use them)."""
    empty = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    return len(tok.encode(empty, add_special_tokens=False))


def check_fits(ids: list[list[int]], names: list[str], wrapper: int, new_tokens: int, limit: int | None) -> None:
    """One error for the first prompt whose tokens plus new_tokens pass the model's `limit`
    positions; wrapper: its tokens that are the chat template's, so the fix counts the text's."""
    for name, p in zip(names, ids):
        if limit is not None and len(p) + new_tokens > limit:
            of = f" ({wrapper} of them the chat template)" if wrapper else ""
            fix = too_long_fix(len(p) - wrapper, new_tokens, limit - wrapper, "its text" if wrapper else "the prompt")
            raise ValueError(f"{name} has {len(p)} tokens{of} and --max-new-tokens is {new_tokens}, but the model "
                             f"allows {limit} positions; {fix} (kvsieve never truncates)")


# generate's warm-up runs up to this many prompts' lengths as one batch (more: the longest alone, so the
# warm-up never prefills much more than one prompt's worth per method; their batch is then captured in the run)
WARM_TOGETHER = 8


def cmd_generate(args) -> int:
    from ..cli import method_options
    from ..engine import LLMEngine, SamplingParams, resolve_device
    from ..methods import config_for
    from ..patterns import model_head_options
    from .loader import load_model

    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.kv_pages is not None and args.kv_pages <= 0:
        raise ValueError(f"--kv-pages must be >= 1, got {args.kv_pages}")
    if args.dense_below is not None and args.dense_below < 0:
        raise ValueError(f"--dense-below must be >= 0, got {args.dense_below}")
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    opts = method_options(args)
    config_for(args.method, **opts)  # fail on bad options before loading anything
    device, dtype = resolve_device(args.device, args.dtype)
    model, tok, model_dir = load_model(args.model, dtype=dtype, device=device)
    opts.update(model_head_options(args.method, opts, model_dir, model.cfg.num_layers, model.cfg.num_kv_heads,
                                   args.streaming_heads))
    prompts, builtin = read_prompts(args, tok, model.cfg.max_positions)
    pages = args.kv_pages or sum(-(-(len(p) + args.max_new_tokens) // 16) for p in prompts)
    eng = LLMEngine(model, tok, args.method, kv_pages=pages, max_num_seqs=max(len(prompts), 1),
                    dense_below=args.dense_below, **opts)
    # at the prompts' lengths, together: kernels specialised on the context's size bucket compile here, and the
    # prompts' decode batch is captured here, not in the request (the prompts take it back)
    lengths = [len(p) for p in prompts] if len(prompts) <= WARM_TOGETHER else [max(map(len, prompts))]
    warm = 0.0 if args.no_warmup or device.type != "cuda" else eng.warmup(prompt_tokens=lengths, together=True)
    stream = not args.json and not args.no_progress and len(prompts) == 1
    try:
        res = run_requests(eng, tok, prompts, params, None, stream)
    except ValueError as e:  # the engine's refusal, in the flag's name
        raise ValueError(re.sub(r"(?<![\w.-])max_new_tokens\b", "--max-new-tokens", str(e))) from None
    texts = [tok.decode(o.tokens, skip_special_tokens=True) for o in res]
    st = eng.stats
    gen = sum(len(o.tokens) for o in res)
    frac = sum(o.kv_fraction for o in res) / len(res)
    report = {
        "text": texts[0] if len(texts) == 1 else texts,
        "method": args.method,
        "options": {k: v for k, v in opts.items() if k != "streaming_heads"},
        "streaming_heads": None if opts.get("streaming_heads") is None else args.streaming_heads or "shipped pattern",
        "model": str(model_dir),
        "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "prompt_tokens": len(prompts[0]) if len(prompts) == 1 else [len(p) for p in prompts],
        "generated_tokens": gen if len(res) == 1 else [len(o.tokens) for o in res],
        "prefill_s": round(st.prefill_s, 4),
        "decode_s": round(st.decode_s, 4),
        "decode_tokens_per_s": round(st.decode_tokens / st.decode_s, 3) if st.decode_s else 0.0,
        "warmup_s": round(warm, 3),
        "kv_fraction": round(frac, 5),
        "kv_fraction_per_request": [round(o.kv_fraction, 5) for o in res],
        "attended": ["dense" if o.attended_densely else o.method for o in res],
        "dense_reason": [o.dense_reason for o in res],
        "dense_below": eng.dense_below,
        "dense_step_below": eng.dense_step_below,
        "kv_bytes": eng.runner.cache.page_bytes * sum(-(-(len(p) + len(o.tokens)) // eng.scheduler.page_size)
                                                 for p, o in zip(prompts, res)),
        "ttft_s": [round(o.ttft_s, 4) for o in res],
        "builtin_prompt": builtin,
    }
    if args.compare_dense:
        before = (st.prefill_s, st.decode_s, st.decode_tokens)
        dense = run_requests(eng, tok, prompts, params, "dense", False)
        after = (eng.stats.prefill_s, eng.stats.decode_s, eng.stats.decode_tokens)  # eng.stats accumulates
        d_prefill, d_decode, d_tokens = (a - b for a, b in zip(after, before))
        dtexts = [tok.decode(o.tokens, skip_special_tokens=True) for o in dense]
        report["dense"] = {"text": dtexts[0] if len(dtexts) == 1 else dtexts, "prefill_s": round(d_prefill, 4),
                           "decode_s": round(d_decode, 4),
                           "decode_tokens_per_s": round(d_tokens / d_decode, 3) if d_decode else 0.0}
        report["agreement"] = round(token_agreement([o.tokens for o in dense], [o.tokens for o in res]), 4)
        report["first_divergence"] = [first_divergence(d.tokens, o.tokens) for d, o in zip(dense, res)]
        if len(res) == 1:
            report["first_divergence"] = report["first_divergence"][0]
    dense_note = attended_densely_note(args, eng, [o.dense_reason for o in res])
    if args.json:
        if dense_note:  # (stderr: the JSON on stdout stays clean)
            print(dense_note, file=sys.stderr)
        print(json.dumps(report))
        return 0
    if not stream:
        for i, t in enumerate(texts):
            print(t if len(texts) == 1 else f"[{i}] {t}")
    if args.compare_dense:
        for i, t in enumerate(dtexts):
            print(f"--- dense answer: {t}" if len(dtexts) == 1 else f"--- dense answer [{i}]: {t}")
        first = [first_divergence(d.tokens, o.tokens) for d, o in zip(dense, res)]
        where = ("the same tokens" if all(f is None for f in first) else
                 "first differs at generated token " + ", ".join("-" if f is None else str(f) for f in first))
        print(f"--- agreement with dense: {report['agreement']:.0%} of generated tokens at the same position "
              f"({where})")
    if warm:
        print(f"--- warm-up (kernel compilation, step-graph capture): {warm:.1f} s", file=sys.stderr)
    if dense_note:
        print(dense_note, file=sys.stderr)
    attended = ", ".join(sorted(set(report["attended"])))
    print(f"--- {args.method} ({attended} attention) on {device} {report['dtype']}: prompt {report['prompt_tokens']} "
          f"tokens, {gen} generated, KV read {frac:.1%}, prefill {report['prefill_s']:.2f} s, "
          f"{_decode_speed(report['decode_tokens_per_s'])}", file=sys.stderr)
    if args.compare_dense:
        d = report["dense"]
        print(f"--- dense on {device} {report['dtype']}: prefill {d['prefill_s']:.2f} s, "
              f"{_decode_speed(d['decode_tokens_per_s'])}", file=sys.stderr)
        if device.type == "cpu" and attended != "dense" and report["decode_tokens_per_s"] < d["decode_tokens_per_s"]:
            print("--- on the CPU a sparse plan runs as torch reference code (a few hundred small operations a "
                  "layer), so it decodes slower than dense here; speed is measured on a GPU "
                  "(docs/benchmarks.md)", file=sys.stderr)
    return 0


def _decode_speed(tokens_per_s: float) -> str:
    """"decode 123.4 tok/s", or what stood for it when no decode step ran (each answer's one
    token came from its prefill)."""
    return f"decode {tokens_per_s:.1f} tok/s" if tokens_per_s else "no decode step (one token each, from the prefill)"


def attended_densely_note(args, eng, reasons) -> str:
    """The stderr line saying why some prompt attended densely under a sparse method ("" if
    none did); reasons: each request's RequestOutput.dense_reason."""
    from ..engine.crossover import DENSE_ABOVE, DENSE_AFTER

    if args.method == "dense" or not any(reasons):
        return ""
    if "windowed_model" in reasons:
        window = eng.model.cfg.sliding_window
        return (f"--- attended as dense: every layer of this model attends its own sliding window of {window} tokens, "
                f"so {args.method} has no layer to run on (kv_fraction is the windows' share)")
    why = []
    if "not_indexed" in reasons:
        payback = eng.runner.methods["default"].index_payback_tokens
        few = f", or --max-new-tokens is under the {payback} tokens that repay its index" \
            if args.max_new_tokens < payback else ""
        total = ""
        if eng.dense_step_below:  # a batch-wide plan: its payback grows near that line (Tactic.index_payback_at)
            total = f" ({eng.dense_step_below} for the prompts together, with enough new tokens to repay its index)"
        line = (f"the --dense-below of {eng.dense_below} tokens" if getattr(args, "dense_below", None) is not None
                else f"this device's dense/sparse crossover of {eng.dense_below} tokens")
        why.append(f"the prompt and its answer stayed below {line}{total}, or too few new tokens were left past "
                   f"it to repay its index{few}")
    if "plans_read_most" in reasons:
        why.append(f"{args.method}'s plans read more than {DENSE_ABOVE:.0%} of the cache for {DENSE_AFTER} steps in a "
                   "row, so it attended densely from there (sparse would be slower)")
    return f"--- attended densely: {'; and '.join(why)}; pass --dense-below 0 to force {args.method}"


def run_requests(eng, tok, prompts, params, method, stream: bool):
    """Run prompts through the engine; with stream, print the (single) answer as it comes."""
    from ..server.text import Detokenizer  # (no server dependency)

    if not stream:
        return eng.generate(prompts, params, method=method)
    out, det = None, Detokenizer(tok)  # a character split over tokens is printed once complete
    for out in eng.stream(prompts[0], params, method=method):
        sys.stdout.write(det.add(out.new_tokens, out.finished))
        sys.stdout.flush()
    sys.stdout.write("\n")
    return [out]


def first_divergence(ref: list[int], other: list[int]):
    """Index of the first generated token where `other` differs from `ref` (a shorter answer
    differs where it ends), or None where the two are the same."""
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return i
    return None if len(ref) == len(other) else min(len(ref), len(other))


def token_agreement(ref: list[list[int]], other: list[list[int]]) -> float:
    """Fraction of reference tokens that the other run reproduced at the same position (tokens
    that line up again after a divergence count too: first_divergence says where it begins)."""
    total = sum(len(r) for r in ref)
    same = sum(a == b for r, o in zip(ref, other) for a, b in zip(r, o))
    return same / total if total else 1.0
