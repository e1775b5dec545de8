"""Decode speed of the engine's two CPU paths on the embedded model: the paged path (the
kernels' torch twins, the default) against the gather-and-mask reference path (paged=False).

    python3 scripts/cpu_paths.py [--methods dense,tactic,quest,streaming] [--new-tokens 16]

Prints per method and path: decode tok/s, KV read and the first tokens (they must agree).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402
from kvsieve.model.cli import DEFAULT_QUESTION  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402
from kvsieve.prompts import document_prompt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="dense,tactic,quest,streaming")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    model, tok, _ = load_model(None)
    doc, _, _ = document_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)))
    ids = tok.encode(doc + DEFAULT_QUESTION)
    print(f"prompt {len(ids)} tokens, {args.new_tokens} new, device {model.device}, {model.dtype}")
    for m in args.methods.split(","):
        for paged in (True, False):
            eng = LLMEngine(model, tok, m, paged=paged)
            out = eng.generate([ids], SamplingParams(args.new_tokens, ignore_eos=True))[0]
            st = eng.stats
            print(f"{m:10s} {'paged' if paged else 'reference':9s} {st.decode_tokens / st.decode_s:6.2f} tok/s  "
                  f"KV read {out.kv_fraction:.3f}  {tok.decode(out.tokens[:4])!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
