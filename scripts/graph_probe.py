"""Graph replay against eager decode on the GPU, per method variant: greedy tokens of three
prompts of the built-in document (3,000 / 1,500 / 2,200 tokens, batched), with the
heads `kvsieve generate` adds. Where they differ, the first differing token per prompt.

    DT=float32 python3 scripts/graph_probe.py [KVSIEVE_KERNELS=reference ...]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_engine  # noqa: E402  (puts ../src on the path)
from needs_gpu import need_cuda  # noqa: E402
from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402

VARIANTS = [("lserve", {}), ("lserve", {"budget": 4096}), ("quest", {"budget": 6144}), ("hybrid", {}),
            ("lserve", {"max_num_seqs": 1})]


def main() -> int:
    need_cuda()
    dt = getattr(torch, os.environ.get("DT", "bfloat16"))
    model, tok, gpu_engine.MODEL_DIR[0] = load_model(None, dtype=dt, device="cuda")
    ids = gpu_engine.doc_ids(tok, 3000)
    prompts = [ids, ids[-1500:], ids[-2200:]]
    for name, extra in VARIANTS:
        method, o = gpu_engine.opts_for(name, model)
        o.update(extra)
        seqs = o.pop("max_num_seqs", 4)
        res = []
        for graphs in (False, True):
            eng = LLMEngine(model, tok, method, dense_below=0, graphs=graphs, max_num_seqs=seqs, **o)
            res.append([x.tokens for x in eng.generate(prompts, SamplingParams(40, ignore_eos=True))])
        agree = sum(a == b for p, q in zip(*res) for a, b in zip(p, q)) / sum(map(len, res[1]))
        print(json.dumps({"method": name, "extra": extra, "dtype": str(dt).split(".")[-1],
                          "kernels": os.environ.get("KVSIEVE_KERNELS", "auto"), "eager=graph": agree,
                          "first_diff": [next((i for i, (a, b) in enumerate(zip(p, q)) if a != b), None)
                                         for p, q in zip(*res)]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
