"""Where a decode step's time goes: kernel-by-kernel profile of the engine's CUDA-graph step.

    python3 scripts/step_profile.py --out OUT [--cases dense:8192x1,dense:32768x8,dense:dead24]
                                    [--steps 10]

The Llama-3.1-8B shape with random weights (bench.e2e.random_model), driven through
LLMEngine as `generate` and `serve` drive it. For each case the engine reaches its steady
state (every request decoding), then `--steps` steps run under torch.profiler: per kernel
name the device time per step, the sum of all kernels per step, and the step's wall time,
so the difference is the GPU's idle time (launch gaps, host work, the one sync).
Cases: METHOD:CONTEXTxBATCH (tactic: a 512-token budget, tactic=N: N tokens,
tactic-threshold: the default threshold plan), or
METHOD:dead24 (24 rows, one live request of 32K: the other 23 finished, their rows kept,
as under continuous batching).
Writes OUT/step-profile.json and prints a table per case.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict

import torch
from needs_gpu import need_cuda  # noqa: E402
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.bench import e2e  # noqa: E402
from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402

GROUPS = [("gemm", r"gemm|gemv|cutlass|nvjet|sm90_xmma|ampere_|Kernel2|splitKreduce"),
          ("attention", r"_split_kernel|_merge_kernel"),
          ("rms_norm", r"rms_norm"), ("rope", r"rope"), ("silu_mul", r"silu_mul"),
          ("kv_write", r"_store_kv|index_put|scatter|IndexKernel|index_elementwise"),
          ("sampling", r"argmax|softmax|topk|sort|multinomial|exponential|max_|reduce"),
          ("plan", r"score|select|budget|compact|window|rank|union|fit|logits|centroid|cluster")]


def group_of(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.I):
            return g
    return "other"


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: every tensor once (fused q/k/v and gate/up
    tensors, not their per-projection views), the embedding table not (one row per token)."""
    seen, total = set(), 0
    for name, w in model.w.items():
        ptr = w.untyped_storage().data_ptr()
        if name == "model.embed_tokens.weight" or ptr in seen:
            continue
        seen.add(ptr)
        total += w.untyped_storage().nbytes()
    return total


def engine_for(model, method, context, batch, new_tokens, pages=None, **opts):
    pages = pages or batch * (-(-(context + new_tokens + 16) // 16)) + 64
    return LLMEngine(model, None, method, kv_pages=pages, max_num_seqs=max(batch, 1), step_tokens=context + batch,
                     prefill_chunk=context, dense_below=0, **opts)


def host_profile(eng, steps: int, top: int = 25) -> list:
    """cProfile of `steps` engine steps: the host functions by cumulative time per step."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    rows = [{"function": f"{os.path.basename(fn)}:{line}({name})", "calls_per_step": nc / steps,
             "own_ms": tt / steps * 1e3, "cum_ms": ct / steps * 1e3}
            for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items()]
    return sorted(rows, key=lambda r: -r["cum_ms"])[:top]


def run_case(model, spec: str, steps: int, host: bool = False) -> dict:
    method, shape = spec.split(":")
    opts = {}
    if method == "tactic-threshold":  # tactic's default threshold plan
        method = "tactic"
    elif method.startswith("tactic"):  # tactic: a 512-token budget; tactic=N: N tokens
        method, opts = "tactic", {"budget": int(method.partition("=")[2] or 512)}
    g = torch.Generator().manual_seed(0)
    V = model.cfg.vocab_size
    if shape == "dead24":
        context, batch = 32768, 24
        eng = engine_for(model, method, context, batch, 64, pages=(context + 23 * 1100) // 16 + 256, **opts)
        eng.warmup(prompt_tokens=2048)
        # under 64 tokens left when the others finish: the batch is not rebuilt smaller (SHRINK_MIN_STEPS)
        eng.add_request(torch.randint(0, V, (context,), generator=g).tolist(), SamplingParams(60, ignore_eos=True))
        for _ in range(23):
            eng.add_request(torch.randint(0, V, (1024,), generator=g).tolist(), SamplingParams(2, ignore_eos=True))
        live_target = 1
    else:
        context, batch = (int(x) for x in shape.split("x"))
        eng = engine_for(model, method, context, batch, 32 + 2 * steps, **opts)
        eng.warmup(prompt_tokens=2048)
        for _ in range(batch):
            eng.add_request(torch.randint(0, V, (context,), generator=g).tolist(),
                            SamplingParams(32 + 2 * steps, ignore_eos=True))
        live_target = batch
    while True:  # to the steady state: the target number of live requests, all decoding
        eng.step()
        live = [r for r in eng.scheduler.running if not r.prefilling]
        if len(live) == live_target and len(eng.scheduler.running) == live_target and not eng.scheduler.waiting:
            break
    for _ in range(4):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    host_rows = host_profile(eng, steps) if host else None
    per_kernel = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            k = per_kernel[ev.name]
            k[0] += ev.device_time_total / steps / 1e3
            k[1] += 1
    kernels = sorted(({"name": n[:90], "group": group_of(n), "ms_per_step": v[0], "launches_per_step": v[1] / steps}
                      for n, v in per_kernel.items()), key=lambda r: -r["ms_per_step"])
    groups = defaultdict(lambda: [0.0, 0.0])
    for k in kernels:
        groups[k["group"]][0] += k["ms_per_step"]
        groups[k["group"]][1] += k["launches_per_step"]
    busy = sum(k["ms_per_step"] for k in kernels)
    rest = wall_ms - sum(v[0] for g, v in groups.items() if g in ("attention", "plan"))
    wb = weight_bytes(model)
    return {"case": spec, "context": context, "batch": batch, "wall_ms": wall_ms, "kernel_ms": busy,
            "gemm_GBps": wb / groups["gemm"][0] / 1e6 if groups["gemm"][0] else None,
            "non_attention_ms": rest, "non_attention_GBps": wb / rest / 1e6,
            "idle_ms": wall_ms - busy, "last_step": eng.runner.last_step,
            "groups": {g: {"ms": v[0], "launches": v[1]} for g, v in sorted(groups.items(), key=lambda x: -x[1][0])},
            "kernels": kernels[:40], "host": host_rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="dense:8192x1,dense:32768x8,dense:dead24")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--host", action="store_true", help="also profile the host side (cProfile) of the steps")
    args = ap.parse_args()
    need_cuda()
    if not 1 <= args.steps <= 12:
        ap.error(f"--steps {args.steps}: give 1-12 (the dead24 case's live request has 60 tokens to decode)")
    os.makedirs(args.out, exist_ok=True)
    model = e2e.random_model()
    from kvsieve.bench.timing import copy_bandwidth_gbs
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "command": " ".join(sys.argv), "copy_GBps": copy_bandwidth_gbs(), "weight_bytes": weight_bytes(model),
           "cases": []}
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s, weights read per step {res['weight_bytes'] / 1e9:.2f} GB")
    for spec in args.cases.split(","):
        r = run_case(model, spec, args.steps, args.host)
        res["cases"].append(r)
        print(f"\n## {spec}: wall {r['wall_ms']:.2f} ms/step, kernels {r['kernel_ms']:.2f} ms, "
              f"idle {r['idle_ms']:.2f} ms ({r['last_step']}); GEMMs {r['gemm_GBps'] or 0:.0f} GB/s, "
              f"non-attention {r['non_attention_ms']:.2f} ms = {r['non_attention_GBps']:.0f} GB/s")
        for g, v in r["groups"].items():
            print(f"  {g:10s} {v['ms']:7.3f} ms  {v['launches']:6.0f} launches")
        for k in r["kernels"][:14]:
            print(f"    {k['ms_per_step']:7.3f} ms {k['launches_per_step']:5.0f}x  {k['name']}")
        for h in r["host"] or []:
            print(f"    host {h['cum_ms']:7.3f} ms cum {h['own_ms']:7.3f} own {h['calls_per_step']:6.0f}x  {h['function']}")
        with open(os.path.join(args.out, "step-profile.json"), "w") as f:
            json.dump(res, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
