"""A/B of the page summaries' update through the engine (GPU): quest and lserve at their
defaults on the Llama-3.1-8B shape (random weights; fixed budgets read the same whatever
the weights), batch 1, sparse forced on, with the one-launch update (kernels.pages) and
with the torch twin's launches, next to dense.

    python3 scripts/page_update_ab.py --contexts 16384,32768 [--out OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from needs_gpu import need_cuda  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve import dispatch  # noqa: E402
from kvsieve.bench import e2e  # noqa: E402
from kvsieve.ops import pages as rpages  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="16384,32768")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    need_cuda()
    model = e2e.random_model()
    fused = dispatch.update_page_summaries
    rows = []
    for S in map(int, args.contexts.split(",")):
        for method, update in (("dense", "-"), ("quest", "one launch"), ("quest", "torch"),
                               ("lserve", "one launch"), ("lserve", "torch")):
            dispatch.update_page_summaries = rpages.update_page_summaries if update == "torch" else fused
            r = e2e.decode_tokens_per_s(model, method, S, 1)
            r["update"] = update
            rows.append(r)
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
    dispatch.update_page_summaries = fused
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "page-update-ab.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
