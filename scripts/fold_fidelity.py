"""Tactic's index after a long generation from a short prompt: built at P tokens and folded
(TacticConfig.fold_mode) up to T, against one built at T, on real SmolLM2 attention (every
layer of one decode step at T tokens of pydoc text), CPU, float64 oracle.

    python3 scripts/fold_fidelity.py [--length 8000] [--prompts 64,512,2048] [--seeds 0,1]
        [--modes cluster,nearest] [--record-cache /tmp/rec8k.pt]

Per setting: fraction of the KV cache attended, true attention mass of what each query head's
KV head attends (mean, min, heads under 0.8), relative output error vs dense (mean, max),
clusters in use and the largest one. Recording takes ~2.5 min (--record-cache keeps it);
each setting ~20 s on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KVSIEVE_KERNELS", "reference")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from fit_fidelity import recorded  # noqa: E402
from kvsieve.eval.fit_fidelity import dense_reference, masked_output  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402


def folded_index(m, k, prompt: int, length: int, step: int = 8):
    """m's index of keys k [1, Hkv, >=length, D] prepared at `prompt` tokens, then appended to
    `length` in steps of `step` tokens (each append folds what is due)."""
    st = m.prepare(k[:, :, :prompt], torch.tensor([prompt]))
    st.widen(st.centroids.shape[2], length)
    for n in list(range(prompt + step, length, step)) + [length]:
        m.append(st, k, torch.tensor([n]))
    return st


def measure(qs, ks, vs, prompt: int, length: int, **options) -> dict:
    masses, errs, kv, clusters, largest = [], [], 0.0, 0, 0
    for q, k, v in zip(qs, ks, vs):
        lengths = torch.tensor([length])
        logits, p, dense = dense_reference(q, k, v, lengths)
        m = make_method("tactic", **options)
        st = folded_index(m, k, prompt, length)
        sel = m.select(q, k, lengths, st)
        union = sel.mask.repeat_interleave(q.shape[1] // k.shape[1], 1)
        masses.append((p * union).sum(-1).reshape(-1))
        out = masked_output(logits, v, union)
        errs.append(((out - dense).norm(dim=-1) / dense.norm(dim=-1)).reshape(-1))
        kv += float(sel.mask.float().mean()) / len(qs)
        clusters = max(clusters, int(st.num_clusters[0]))
        largest = max(largest, int(st.sizes.max()))
    mass, err = torch.cat(masses), torch.cat(errs)
    return {"kv_fraction": kv, "mass_mean": float(mass.mean()), "mass_min": float(mass.min()),
            "heads_under_0.8": int((mass < 0.8).sum()), "err_mean": float(err.mean()), "err_max": float(err.max()),
            "clusters": clusters, "largest_cluster": largest}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=8000)
    ap.add_argument("--prompts", default="64,512,2048")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--modes", default="cluster,nearest")
    ap.add_argument("--record-cache")
    args = ap.parse_args(argv)
    qs, ks, vs = recorded(args.length, args.record_cache)
    print(f"SmolLM2-135M, {args.length} tokens of pydoc text, {len(qs)} layers; tactic defaults\n")
    print("| index | seed | KV read | mass mean | mass min | heads < 0.8 | error mean | error max | clusters | largest |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    settings = [(f"built at {args.length}", args.length, "cluster")]
    settings += [(f"built at {P}, folded ({mode})", P, mode) for P in map(int, args.prompts.split(","))
                 for mode in args.modes.split(",")]
    for name, prompt, mode in settings:
        for seed in map(int, args.seeds.split(",")):
            r = measure(qs, ks, vs, prompt, args.length, fold_mode=mode, seed=seed)
            print(f"| {name} | {seed} | {r['kv_fraction']:.3f} | {r['mass_mean']:.4f} | {r['mass_min']:.3f} | "
                  f"{r['heads_under_0.8']} | {r['err_mean']:.4f} | {r['err_max']:.3f} | {r['clusters']} | "
                  f"{r['largest_cluster']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
