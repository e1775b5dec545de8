"""Where a Tactic fold's time goes (GPU, Llama-3.1-8B attention shapes: 32 layers x 8 KV heads x
128 channels, bf16): the engine's maintain_layers on a batch of 8 rows of `--prompt` tokens.

    python3 scripts/profile_fold.py [--prompt 8192] [--batch 8] [--modes cluster,nearest] [--profile]

Per fold mode and plan (fixed budget 256, the threshold default): the synchronized wall time
of six steps where one row's fold is due, then six where every row's is (requests of one
length fold at the same step: kvsieve.hf's padded batches, same-length prompts). With
--profile, the torch profiler's top operations of one more one-row fold.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from needs_gpu import need_cuda  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from kvsieve import make_method  # noqa: E402


def states_for(m, keys, prompt, batch):
    """One index per layer for `batch` rows of `prompt` keys each (keys [L, B, Hkv, S, D])."""
    lengths = torch.full((batch,), prompt, device=keys.device)
    return [m.prepare(k[:, :, :prompt], lengths) for k in keys]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fold_step(m, states, readers, host, device):
    """One step's maintain_layers at host lengths; its synchronized wall time (s)."""
    lengths = torch.tensor(host, device=device)
    sync(device)
    t = time.perf_counter()
    m.maintain_layers(states, lengths, host, readers)
    sync(device)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--modes", default="cluster,nearest")
    ap.add_argument("--profile", action="store_true", help="the torch profiler's table of one more fold")
    ap.add_argument("--device", default="cuda", help="cpu: a quick dry run")
    args = ap.parse_args()
    need_cuda(args.device, dry_run=True)
    L, B, H, D, P = args.layers, args.batch, 8, 128, args.prompt
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(L, B, H, P + 4096, D, device=dev, dtype=torch.bfloat16, generator=g)
    readers = [lambda b, s, e, k=k: k[b, :, s:e] for k in keys]
    for mode in args.modes.split(","):
        for plan, opts in (("budget 256", {"budget": 256}), ("threshold", {})):
            m = make_method("tactic", fold_mode=mode, **opts)
            states = states_for(m, keys, P, B)
            for st in states:
                st.grow_positions(P + 4096)
            host, times = [P] * B, {1: [], B: []}
            for due in (1,) * 6 + (B,) * 6:  # the first `due` rows grow by fold_every tokens: their folds are due
                host = [h + (m.config.fold_every if i < due else 0) for i, h in enumerate(host)]
                times[due].append(round(1e3 * fold_step(m, states, readers, host, dev), 1))
            print(f"{mode} folds, {plan}: ms a step, one row due {times[1]}; all {B} rows due {times[B]}", flush=True)
            if args.profile:
                host = [host[0] + m.config.fold_every] + host[1:]
                acts = [torch.profiler.ProfilerActivity.CPU] + \
                    ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with torch.profiler.profile(activities=acts) as prof:
                    fold_step(m, states, readers, host, dev)
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=40),
                      flush=True)


if __name__ == "__main__":
    main()
