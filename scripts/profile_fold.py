"""Where a Tactic fold's time goes (GPU, Llama-3.1-8B attention shapes: 32 layers x 8 KV heads x
128 channels, bf16): the engine's maintain_layers on a batch of 8 rows, one row's fold due.

    python3 scripts/profile_fold.py [--prompt 8192] [--batch 8] [--modes cluster,nearest]

Per mode: wall time of a block fold (256 tokens alone) and of a whole-region re-cluster
(the region grown by half), synchronized, and the torch profiler's top operations by device
and host time for the block fold.
"""
from __future__ import annotations

import argparse
import time

import torch

from kvsieve import make_method


def states_for(m, keys, prompt, batch):
    """One index per layer for `batch` rows of `prompt` keys each (keys [L, B, Hkv, S, D])."""
    lengths = torch.full((batch,), prompt, device=keys.device)
    return [m.prepare(k[:, :, :prompt], lengths) for k in keys]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fold_once(m, states, keys, host):
    readers = [lambda b, s, e, k=k: k[b, :, s:e] for k in keys]
    lengths = torch.tensor(host, device=keys.device)
    sync(keys.device)
    t = time.perf_counter()
    m.maintain_layers(states, lengths, host, readers)
    sync(keys.device)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--modes", default="cluster,nearest")
    ap.add_argument("--device", default="cuda", help="cpu: a quick dry run")
    args = ap.parse_args()
    L, B, H, D, P = args.layers, args.batch, 8, 128, args.prompt
    S = P + 4096
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(L, B, H, S, D, device=dev, dtype=torch.bfloat16, generator=g)
    for mode in args.modes.split(","):
        m = make_method("tactic", budget=256, fold_mode=mode)
        states = states_for(m, keys, P, B)
        host = [P] * B
        times = []
        for _ in range(6):  # row 0 grows by fold_every tokens: folds due at each
            host = [host[0] + m.config.fold_every] + host[1:]
            for st in states:
                st.grow_positions(max(st.assign.shape[-1], host[0] + 1024))
            times.append(fold_once(m, states, keys, host))
        print(f"{mode}: fold wall ms, six folds of 256 tokens (first: a whole region; later ones"
              f" block or whole): {[round(1e3 * t, 1) for t in times]}", flush=True)
        host = [host[0] + m.config.fold_every] + host[1:]
        readers = [lambda b, s, e, k=k: k[b, :, s:e] for k in keys]
        lengths = torch.tensor(host, device=dev)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            m.maintain_layers(states, lengths, host, readers)
            sync(dev)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=40), flush=True)


if __name__ == "__main__":
    main()
