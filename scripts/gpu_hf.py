"""The Hugging Face drop-in (kvsieve.hf) on the GPU: transformers' own generate() on the
embedded model, dense (SDPA) against kvsieve methods, on the built-in ~4K-token document.

    python3 scripts/gpu_hf.py --out OUT [--methods tactic,quest] [--new-tokens 64] [--dtype bfloat16]
                              [--dense-below default,0]

Prints and writes OUT/hf.json: per method and dense_below setting, decode tokens/s (generate's
wall after a warm-up call, minus the prefill measured on its own), KV read, steps attended with
SDPA, the answer and token agreement with dense. `default` is what enable() does for a user
(SDPA under the engine's CUDA crossover); 0 forces the method's plan and paged kernels. The
drop-in rides transformers' DynamicCache (its per-layer torch.cat stays), so this measures what a
transformers user gets, not the engine's speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from needs_gpu import need_cuda  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import kvsieve.hf  # noqa: E402
from kvsieve.model.cli import DEFAULT_QUESTION  # noqa: E402
from kvsieve.model.loader import resolve_model_dir  # noqa: E402
from kvsieve.prompts import document_prompt  # noqa: E402


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="tactic,quest,lserve")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dense-below", default="default,0",
                    help="comma list of enable(dense_below=) settings; 'default' is None (the crossover)")
    args = ap.parse_args()
    need_cuda(args.device, dry_run=True)
    import transformers

    d = resolve_model_dir(None)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    doc, _, _ = document_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)))
    ids = torch.tensor([tok.encode(doc + DEFAULT_QUESTION)], device=args.device)
    n = args.new_tokens

    def gen(new):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    rows, dense_tokens = [], None
    belows = [None if b == "default" else int(b) for b in args.dense_below.split(",") if b]
    # dense again at the end: a drift between the two dense rows is the run's own noise
    runs = [("dense", None)] + [(m, b) for m in args.methods.split(",") if m for b in belows] + [("dense", None)]
    for method, below in runs:
        state = None if method == "dense" else kvsieve.hf.enable(model, method=method, dense_below=below)
        gen(4)  # warm-up: compilation and allocator
        prefill = min(timed(lambda: gen(1)) for _ in range(2))
        if state is not None:  # the KV read of the timed call only
            state.kv_read_sum, state.kv_read_steps, state.attended_densely = 0.0, 0, 0
        out = []
        wall = min(timed(lambda: out.append(gen(n))) for _ in range(2))
        toks = out[0][0, ids.shape[1]:].tolist()
        dense_tokens = dense_tokens or toks
        agree = sum(a == b for a, b in zip(toks, dense_tokens)) / len(dense_tokens)
        row = {"method": method, "dense_below": "default" if below is None else below,
               "attended_densely": 0 if state is None else state.attended_densely, "prompt": ids.shape[1], "new_tokens": n, "dtype": args.dtype,
               "decode_tok_s": (n - 1) / max(wall - prefill, 1e-9), "wall_s": wall, "prefill_s": prefill,
               "kv_fraction": 1.0 if state is None else state.kv_fraction, "agree_dense": agree,
               "answer": tok.decode(toks[:8], skip_special_tokens=True)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if state is not None:
            kvsieve.hf.disable(model)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hf.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device, "date": time.strftime("%Y-%m-%d"),
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "command": "python3 " + " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
