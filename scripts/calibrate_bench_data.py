"""Fit the bench's calibrated data to recorded real attention, and show real against synthetic.

    python3 scripts/record_attention.py --device cpu --length L --save-layers 0,...,29 --out REC/sL   # per length
    python3 scripts/calibrate_bench_data.py REC/s1024 REC/s2048 REC/s4096 REC/s8000 --out OUT \
        [--write-profile] [--extra-stats docs/accuracy/gemma-2026-11-22/attention-stats.json]
    python3 scripts/calibrate_bench_data.py REC/g8192 REC/g32000 --shipped --longer '' --out OUT2   # another model

From the recordings (qkv-layer*.safetensors of every layer, one decode step each): the
per-head (middle top-0.9 budget, sink mass, local mass) of the longest recording and the
power law of the middle budget over context become the profile
(src/kvsieve/data/attention-profile.json with --write-profile). Then synthetic steps of the
same shape (one per recorded layer, seeded; --longer-steps at the longer lengths) are drawn at each recorded length and at longer
ones, and the same statistics are computed on both: OUT/compare.md (table), OUT/compare.json,
OUT/real-vs-synthetic.png (sorted attention curves, budget against context).
Tactic's KV read at P = 0.9 (its threshold plan, one step) is measured on both too.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.bench.attention_stats import LOCAL, SINK, head_stats, summarise  # noqa: E402
from kvsieve.bench.data import PROFILE_PATH, Profile, Structure, calibrated_qkv, load_profile  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402

ROWS = ("budget_0.5", "budget_0.9", "budget_0.99", "middle_0.9", "page_budget_0.9", "sink", "local", "union_0.9")


def load_recording(path):
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "qkv-layer*.safetensors")),
                   key=lambda f: int(f.rsplit("layer", 1)[1].split(".")[0]))
    if not files:
        raise SystemExit(f"{path}: no qkv-layer*.safetensors (record with --save-layers)")
    return [load_file(f) for f in files]


def tactic_read(q, k, threshold=0.9) -> float:
    """KV fraction Tactic's threshold selection reads for one step: q [Hq, D], k [Hkv, S, D]."""
    m = make_method("tactic", threshold=threshold)
    kk = k[None].float()
    lengths = torch.tensor([k.shape[1]])
    st = m.prepare(kk, lengths)
    sel = m.select(q[None].float(), kk, lengths, st)
    return float(sel.read_fraction(lengths).mean())


def step_stats(steps, with_tactic: bool):
    layers = [head_stats(s["q"].float(), s["k"].float(), curve=True) for s in steps]
    summ = summarise(layers)
    if with_tactic:
        reads = [tactic_read(s["q"], s["k"]) for s in steps]
        summ["tactic_read_0.9"] = {"mean": sum(reads) / len(reads)}
    return layers, summ


def synthetic_steps(profile, like, S, n, seed0=0):
    """n synthetic steps of the recording's shape."""
    Hq, D = like[0]["q"].shape
    Hkv = like[0]["k"].shape[0]
    out = []
    for i in range(n):
        q, k, v = calibrated_qkv(1, Hq, Hkv, S, D, torch.float32, seed=seed0 + 1000 * S + i, device="cpu",
                                 profile=profile)
        out.append({"q": q[0], "k": k[0]})
    return out


def fit_profile(recs, structure) -> Profile:
    lengths = sorted(recs)
    ref = lengths[-1]
    heads = []
    for s in recs[ref]["layers"]:
        heads += list(zip(s["middle_0.9"], s["sink"], s["local"]))
    # power law of the middle budget: least squares of log(middle_0.9) on log(middle length), all heads
    xs, ys = [], []
    for L in lengths:
        for s in recs[L]["layers"]:
            xs += [math.log(L - SINK - LOCAL)] * len(s["middle_0.9"])
            ys += [math.log(max(v, 1e-6)) for v in s["middle_0.9"]]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    return Profile([tuple(round(v, 6) for v in h) for h in heads], ref, round(-slope, 4), structure,
                   source=f"{len(heads)} query heads of {recs[ref]['model']} at {ref} tokens; "
                          f"exponent fitted over {', '.join(map(str, lengths))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-profile", action="store_true", help=f"write the fitted profile (to --profile-path)")
    ap.add_argument("--profile-path", default=PROFILE_PATH, help="where --write-profile writes (default: %(default)s)")
    ap.add_argument("--structure", default="", help="Structure overrides for the fit, e.g. 'qnoise=1.5,shared=2'")
    ap.add_argument("--longer", default="16384,32000", help="synthetic-only lengths (extrapolation)")
    ap.add_argument("--extra-stats", default="", help="attention-stats.json of another model to plot beside")
    ap.add_argument("--no-tactic", action="store_true")
    ap.add_argument("--shipped", action="store_true",
                    help="draw the synthetic steps from the shipped profile instead of one fitted to these recordings "
                         "(to check it against another model's recordings)")
    ap.add_argument("--longer-steps", type=int, default=8, help="synthetic steps at each longer length")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    recs = {}
    for path in args.recordings:
        meta = json.load(open(os.path.join(path, "attention-stats.json")))
        steps = load_recording(path)
        layers, summ = step_stats(steps, not args.no_tactic)
        recs[meta["length"]] = {"steps": steps, "layers": layers, "summary": summ, "model": os.path.basename(meta["model"])}
        print(f"real {meta['length']}: " + ", ".join(f"{k} {v.get('median', v['mean']):.4f}" for k, v in summ.items()),
              flush=True)
    over = {k: float(v) for k, v in (x.split("=") for x in args.structure.split(",") if x.strip())}
    profile = load_profile() if args.shipped else fit_profile(recs, Structure(**over))
    if args.write_profile and not args.shipped:
        d = profile.to_json()
        heads = ",\n".join(json.dumps(list(h)) for h in d.pop("heads"))
        with open(args.profile_path, "w") as f:  # one head per line
            f.write(json.dumps(d, indent=1)[:-2] + ',\n "heads": [\n' + heads + "\n]\n}\n")
    like = recs[max(recs)]["steps"]
    synth = {}
    longer = [int(x) for x in args.longer.split(",") if x.strip()]
    for L in sorted(recs) + longer:
        n = args.longer_steps if L in longer else len(like)
        layers, summ = step_stats(synthetic_steps(profile, like, L, n), not args.no_tactic)
        synth[L] = {"layers": layers, "summary": summ}
        print(f"synthetic {L}: " + ", ".join(f"{k} {v.get('median', v['mean']):.4f}" for k, v in summ.items()),
              flush=True)
    res = {"profile": profile.to_json(), "real": {L: r["summary"] for L, r in recs.items()},
           "synthetic": {L: r["summary"] for L, r in synth.items()}, "command": " ".join(sys.argv)}
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(compare_table(res))
    print(compare_table(res))
    extra = json.load(open(args.extra_stats)) if args.extra_stats else None
    try:
        plot(recs, synth, profile, extra, os.path.join(args.out, "real-vs-synthetic.png"))
    except ImportError:
        pass
    return 0


def compare_table(res) -> str:
    cols = sorted(set(res["real"]) | set(res["synthetic"]), key=int)
    lines = ["| statistic (median over heads; mean where marked) | " + " | ".join(f"{c} real / synthetic" for c in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    keys = list(ROWS) + ["tactic_read_0.9", "key_locality_1", "key_locality_256"]
    for key in keys:
        cells = []
        for c in cols:
            pair = []
            for side in ("real", "synthetic"):
                s = res[side].get(c, {}).get(key)
                pair.append("-" if s is None else f"{s.get('median', s['mean']):.3f}")
            cells.append(" / ".join(pair))
        mark = " (mean)" if key.startswith(("tactic", "key_loc")) else ""
        lines.append(f"| {key}{mark} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(recs, synth, profile, extra, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(recs)
    fig, ax = plt.subplots(1, len(lengths) + 1, figsize=(4 * (len(lengths) + 1), 3.4))
    for a, L in zip(ax, lengths):
        for side, color, src in (("real", "C0", recs[L]["layers"]), ("synthetic", "C3", synth[L]["layers"])):
            for i, layer in enumerate(src):
                for h, c in enumerate(layer["curve"]):
                    a.plot(layer["curve_x"], c, color=color, alpha=0.08, lw=0.7,
                           label=side if i == 0 and h == 0 else None)
        a.set_xscale("log")
        a.axhline(0.9, color="grey", lw=0.5)
        a.set_title(f"{L} tokens: sorted cumulative mass")
        a.set_xlabel("fraction of context")
        a.legend(fontsize=7)
    a = ax[-1]
    for side, color, data in (("real", "C0", {L: r["summary"] for L, r in recs.items()}),
                              ("synthetic", "C3", {L: r["summary"] for L, r in synth.items()})):
        xs = sorted(data)
        a.plot(xs, [data[x]["middle_0.9"]["median"] for x in xs], "o-", color=color, label=f"{side} middle, median")
        a.plot(xs, [data[x]["budget_0.9"]["median"] for x in xs], "s--", color=color, label=f"{side} all, median")
    if extra:
        glob_layers = [L for L in extra["layers"] if L["window"] is None]
        vals = sorted(v for L in glob_layers for v in L["budget_0.9"])
        a.plot([extra["length"]], [vals[len(vals) // 2]], "k*", ms=10,
               label=f"{os.path.basename(extra['model'])[:24]} global layers, median")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_title(f"top-0.9 budget vs context (exponent {profile.exponent:.2f})")
    a.set_xlabel("context (tokens)")
    a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
