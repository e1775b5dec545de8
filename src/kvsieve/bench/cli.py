"""`kvsieve bench`: kernel-level decode step, clustering vs prefill, end-to-end decode (GPU)."""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict


def register(sub) -> None:
    p = sub.add_parser("bench", help="GPU benchmarks: sparse decode step vs the best dense kernels, "
                                     "clustering vs prefill, end-to-end 8B-shaped decode",
                       description="Llama-3.1-8B attention shapes (32 query / 8 KV heads, D=128, bf16). "
                                   "Prints a table; writes bench.json and bench.png to --out.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--contexts", default="8192,32768,131072,262144", help="comma-separated context lengths")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--budgets", default="0.01,0.025,0.05", help="token budgets as fractions of the context")
    p.add_argument("--thresholds", default="0.9", help="tactic thresholds P (fitted budget; '' to skip)")
    p.add_argument("--data", default="calibrated", choices=("calibrated", "calibrated-gemma3", "clustered"),
                   help="decode-step inputs: attention calibrated to SmolLM2's recorded attention, to "
                        "Gemma 3 270M's global layers (diffuse), or the clustered stress case (keys scattered in "
                        "position, queries aimed at two keys)")
    p.add_argument("--index-seeds", default="0,1,2,3",
                   help="tactic's K-means seeds: the first index is timed, every one's output error is reported "
                        "and the matched-fidelity table takes the worst (one seed: '0')")
    p.add_argument("--cluster-context", type=int, default=131072, help="context for clustering vs prefill (0: skip)")
    p.add_argument("--e2e-contexts", default="32768,131008",
                   help="end-to-end contexts, at most 131024: 48 tokens are decoded within the 8B shape's 131072 "
                        "positions ('' to skip)")
    p.add_argument("--e2e-batches", default="1,8", help="batch sizes of the end-to-end decode rows")
    p.add_argument("--prefill-contexts", default="32768,65536,131072",
                   help="contexts for prefill attention, dense vs unified block-sparse ('' to skip)")
    p.add_argument("--prefill-e2e-contexts", default="32768,65536,131072",
                   help="contexts for whole-model prefill, dense vs lserve, at most 131072 ('' to skip)")
    p.add_argument("--out", default="bench-results", help="output directory")
    p.set_defaults(func=cmd_bench)


def _ints(s, name):
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {s!r}")
    if any(v <= 0 for v in vals):
        raise ValueError(f"--{name} values must be positive, got {s!r}")
    return vals


def _seeds(s):
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--index-seeds must be comma-separated integers, got {s!r}")
    if not vals or any(v < 0 or v >= 1 << 63 for v in vals) or len(set(vals)) != len(vals):
        raise ValueError(f"--index-seeds must be distinct integers in [0, 2^63), at least one, got {s!r}")
    return vals


def _fractions(s, name):
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated numbers, got {s!r}")
    if any(not (0 < v <= 1) for v in vals):
        raise ValueError(f"--{name} values must be in (0, 1], got {s!r}")
    return vals


def check_sizes(args, contexts, batches, e2e_contexts, e2e_batches, prefill_e2e) -> None:
    """Refuse up front what a later part of the run would (its results would be lost)."""
    from .attention_stats import LOCAL, SINK
    from .e2e import LLAMA31_8B, MAX_CONTEXT, NEW_TOKENS

    for name, sizes, part, wanted in (("batches", batches, "contexts", contexts),
                                      ("e2e-batches", e2e_batches, "e2e-contexts", e2e_contexts)):
        if wanted and not sizes:
            raise ValueError(f"--{name} is empty; give at least one batch size, or --{part} '' to skip that part")
    least = 2 * (SINK + LOCAL)
    if args.data != "clustered" and any(c < least for c in contexts):
        raise ValueError(f"--data {args.data} needs --contexts of at least {least} tokens, got {args.contexts} "
                         "(--data clustered takes any multiple of 16)")
    if args.cluster_context < 0:
        raise ValueError(f"--cluster-context must be >= 0 (0: skip), got {args.cluster_context}")
    if any(c > MAX_CONTEXT for c in e2e_contexts):
        raise ValueError(f"--e2e-contexts must be at most {MAX_CONTEXT} (the 8B shape's "
                         f"{LLAMA31_8B['max_position_embeddings']} positions less the {NEW_TOKENS} decoded tokens), "
                         f"got {args.e2e_contexts}")
    if any(c > LLAMA31_8B["max_position_embeddings"] for c in prefill_e2e):
        raise ValueError(f"--prefill-e2e-contexts must be at most {LLAMA31_8B['max_position_embeddings']} (the 8B "
                         f"shape's positions), got {args.prefill_e2e_contexts}")


def cmd_bench(args) -> int:
    contexts, batches = _ints(args.contexts, "contexts"), _ints(args.batches, "batches")
    budgets, thresholds = _fractions(args.budgets, "budgets"), _fractions(args.thresholds, "thresholds")
    index_seeds = _seeds(args.index_seeds)
    e2e_contexts = _ints(args.e2e_contexts, "e2e-contexts") if args.e2e_contexts else []
    e2e_batches = _ints(args.e2e_batches, "e2e-batches")
    prefill_contexts = _ints(args.prefill_contexts, "prefill-contexts") if args.prefill_contexts else []
    prefill_e2e = _ints(args.prefill_e2e_contexts, "prefill-e2e-contexts") if args.prefill_e2e_contexts else []
    if any(c % 16 for c in contexts):
        raise ValueError(f"--contexts must be multiples of 16 (the page size), got {args.contexts}")
    check_sizes(args, contexts, batches, e2e_contexts, e2e_batches, prefill_e2e)
    import torch

    if not torch.cuda.is_available():
        raise ValueError("kvsieve bench needs a CUDA GPU (none visible); run it on a GPU machine")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError("kvsieve bench needs triton: pip install 'kvsieve[triton]'", name="triton")
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot write to --out {args.out!r}: {e.strerror}; choose a writable directory")

    from . import e2e, kernels, prefill

    def log(x):
        print(json.dumps(asdict(x) if hasattr(x, "__dataclass_fields__") else x, default=str), file=sys.stderr,
              flush=True)

    t0 = time.time()
    result = kernels.run(contexts, batches, budgets, thresholds, log,
                         cluster_context=args.cluster_context or None, data=args.data, index_seeds=index_seeds)
    result["e2e"] = e2e.run(e2e_contexts, e2e_batches, log=log) if e2e_contexts else []
    result["prefill"] = prefill.run(prefill_contexts, prefill_e2e, log=log)
    command = "kvsieve " + shlex.join(getattr(args, "argv", sys.argv[1:]))
    result.update({"date": time.strftime("%Y-%m-%d"), "command": command, "seconds": time.time() - t0,
                   "torch": torch.__version__, "triton": triton.__version__})
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(format_table(result))
    try:
        if result["rows"]:  # the plot shows the kernel table (absent with --contexts '')
            plot(result, os.path.join(args.out, "bench.png"))
    except ImportError:
        print("(matplotlib not installed: no plot)")
    return 0


def _f(x, fmt):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(result) -> str:
    sw = max([36] + [len(r["setting"]) for r in result["rows"]])  # (a setting is never cut)
    lines = [f"device: {result['device']}   copy bandwidth: {result['copy_bandwidth_gbs']:.0f} GB/s   "
             f"data: {result.get('data', '-')}",
             f"{'ctx':>7} {'B':>3} {'method':<13} {'setting':<{sw}} {'step ms':>8} {'sel ms':>7} {'attn ms':>8} "
             f"{'KV read':>8} {'attn GB/s':>9} {'%copy':>6} {'%c stk':>6} {'speedup':>8} {'clean L2':>8} {'err':>8} "
             f"{'worst':>8} {'mass':>6} {'min':>6}"][:2 if result["rows"] else 1]  # no kernel header without its rows
    for r in result["rows"]:
        lines.append(f"{r['context']:>7} {r['batch']:>3} {r['method']:<13} {r['setting']:<{sw}} "
                     f"{_f(r['step_ms'], '.4f'):>8} {_f(r['select_ms'], '.4f'):>7} {_f(r['attn_ms'], '.4f'):>8} "
                     f"{_f(r['kv_fraction'], '.2%'):>8} {_f(r['attn_gbs'], '.0f'):>9} "
                     f"{_f(r['attn_bw_fraction'], '.0%'):>6} {_f(r.get('attn_stack_bw_fraction'), '.0%'):>6} "
                     f"{_f(r['speedup'], '.2f'):>8} "
                     f"{_f(r.get('speedup_clean'), '.2f'):>8} "
                     f"{_f(r['rel_err_vs_dense'], '.1e'):>8} {_f(r.get('rel_err_max'), '.1e'):>8} "
                     f"{_f(r.get('attn_mass'), '.3f'):>6} "
                     f"{_f(r.get('attn_mass_min'), '.3f'):>6} {r['note'][:40]}")
    lines += format_matched(result.get("matched", []))
    c = result.get("clustering")
    if c and c.get("note"):
        lines.append(f"clustering at {c['context']}: {c['note']}")
    elif c:
        lines.append(f"clustering at {c['context']} (1 layer, 8 KV heads): windowed {c['cluster_windowed_ms']:.1f} ms "
                     f"= {c['cluster_windowed_fraction']:.1%} of dense prefill attention {c['prefill_attention_ms']:.1f}"
                     f" ms; full K-means {c['cluster_full_ms']:.1f} ms = {c['cluster_full_fraction']:.1%}")
    for r in result.get("e2e", []):
        if "tokens_per_s" in r:
            lines.append(f"e2e ctx {r['context']:>7} B {r['batch']:>2} {r['method']:<7} {str(r['options']):<18} "
                         f"{r['tokens_per_s']:8.1f} tok/s  step {r['step_ms']:.2f} ms  KV read {r['kv_fraction']:.2%}"
                         f"  (engine: prefill {r['prefill_s']:.1f} s, warm-up {r['warmup_s']:.1f} s)"
                         + (f"  {r['note']}" if r.get("note") else ""))
        else:
            lines.append(f"e2e ctx {r['context']:>7} B {r['batch']:>2} {r['method']:<7} {r.get('note', '')}")
    pre = result.get("prefill") or {}
    if pre.get("kernels") or pre.get("e2e"):
        lines.append(f"prefill (batch 1; unified = 50% streaming KV heads, sink {pre['sink']} + local {pre['local']}):")
    for r in pre.get("kernels", []):
        lines.append(f"prefill attn ctx {r['context']:>7} {r['method']:<20} {_f(r.get('ms'), '9.2f')} ms "
                     f"{_f(r.get('tflops'), '6.0f')} TFLOP/s  speedup {_f(r.get('speedup'), '.2f')}  "
                     f"{r.get('note', '')}")
    for r in pre.get("e2e", []):
        lines.append(f"prefill e2e  ctx {r['context']:>7} {r['method']:<20} {_f(r.get('prefill_s'), '9.3f')} s "
                     f"{_f(r.get('tokens_per_s'), '8.0f')} tok/s  speedup {_f(r.get('speedup'), '.2f')}  "
                     f"{r.get('note', '')}")
    return "\n".join(lines)


def format_matched(matched) -> list:
    """The matched-fidelity table: per cell and method, the fastest setting under each error bound."""
    if not matched:
        return []
    bounds = [k for k in matched[0] if k.startswith("err<=")]
    lines = ["matched fidelity: fastest setting whose output error vs dense is within the bound (speedup vs the "
             "best dense kernel; KV read; error, tactic's the worst of its index seeds)",
             f"{'ctx':>7} {'B':>3} {'method':<14} " + " ".join(f"{b:<40}" for b in bounds)]
    rows = []
    for m in matched:
        cells = []
        for b in bounds:
            e = m[b]
            cells.append("none" if e is None else
                         f"{e['setting']} {e['speedup']:.2f}x {e['kv_fraction']:.1%} {e['rel_err']:.3f}")
        rows.append((m, cells))
    width = max([40] + [len(c) + 1 for _, cells in rows for c in cells])  # (a setting is never cut)
    lines[-1] = f"{'ctx':>7} {'B':>3} {'method':<14} " + " ".join(f"{b:<{width}}" for b in bounds)
    for m, cells in rows:
        lines.append(f"{m['context']:>7} {m['batch']:>3} {m['method']:<14} " + " ".join(f"{c:<{width}}" for c in cells))
    return lines


def plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("speedup")]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, B in zip(axes[0], batches):
        series = sorted({(r["method"], r["setting"]) for r in rows if r["batch"] == B and "reference" not in r["setting"]})
        for m, s in series:
            pts = sorted((r["context"], r["speedup"]) for r in rows if r["batch"] == B and (r["method"], r["setting"]) == (m, s))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{m} {s}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(10, color="grey", ls=":")
        ax.set_title(f"batch {B}: decode step speedup vs best dense")
        ax.set_xlabel("context (tokens)")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
