"""Pool `scripts/suite_cases.py --jsonl` lines (one per method option and seed) over seeds:
found / dense's right answers per setting, overall and per length, and the KV read.

    python3 scripts/pool_options.py docs/accuracy/seeds0-5-2026-11-25/*.jsonl [--plot curve.png]

A file's seed and dtype come from its name (`...-float32-seed3.jsonl`, `...-bf16-seed3.jsonl`);
a setting counts a seed once (the first line for it), `{}` is the method's defaults at the run
(--defaults 'tactic={"threshold": 0.93}' pools a run of the defaults with one naming them).
A `kvsieve eval --tasks suite` results.json (`.json`) counts too: each non-dense cell on the
cases its dense cell answered right, its knob as {"threshold": P} (tactic/hybrid) or
{"fraction": f} (page methods), seed and dtype from the run. --plot draws found against the KV
read at the longest length for the settings pooled over every seed of their dtype.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path


def pool(paths, methods=None, defaults=None):
    """{(dtype, method, options json): {"seeds": set, "by_length": {L: [found, of]}, "kv": [by-length dicts]}}
    for the lines of `methods` (None: all); defaults {method: options dict} replaces a line's `{}`."""
    out = defaultdict(lambda: {"seeds": set(), "by_length": defaultdict(lambda: [0, 0]), "kv": []})
    for path in paths:
        name = Path(path).name
        if name.endswith(".json"):
            seed, dtype, lines = results_lines(path)
        else:
            found = re.search(r"seed(\d+)", name)
            if not found:
                raise SystemExit(f"{path}: no seedN in the file name")
            seed, dtype = found.group(1), "bfloat16" if re.search(r"bf16|bfloat16", name) else "float32"
            lines = map(json.loads, open(path))
        for r in lines:
            if methods and r["method"] not in methods:
                continue
            opts = {k: v for k, v in r["options"].items() if k != "method"} or (defaults or {}).get(r["method"], {})
            cell = out[(dtype, r["method"], json.dumps(opts, sort_keys=True))]
            if seed in cell["seeds"]:
                continue
            cell["seeds"].add(seed)
            for case, (ok, _) in r["cases"].items():
                n = cell["by_length"][int(case.split("-")[3])]
                n[0] += bool(ok)
                n[1] += 1
            cell["kv"].append(r["kv_by_length"])
    return out


def results_lines(path):
    """(seed, dtype, lines) of an eval results.json's suite cells, in suite_cases.py's line form:
    per non-dense cell, the cases its length's dense cell answered right."""
    try:
        res = json.loads(Path(path).read_text())
        cells = [c for c in res["cells"] if c["task"] == "suite"]
        seed, dtype = str(res["plan"]["seed"]), res["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a `kvsieve eval --tasks suite` results.json ({e})")
    dense = {c["length"]: c for c in cells if c["method"] == "dense"}
    by_setting = defaultdict(lambda: {"cases": {}, "kv_by_length": {}})
    for c in cells:
        if c["method"] == "dense" or c["length"] not in dense:
            continue
        knob = {} if c["knob"] is None else {"threshold" if c["method"] in ("tactic", "hybrid") else "fraction": c["knob"]}
        line = by_setting[(c["method"], json.dumps(knob))]
        line["method"], line["options"] = c["method"], knob
        right = [i for i, s in enumerate(dense[c["length"]]["scores"]) if s == 1.0]
        line["cases"].update({c["cases"][i]: [c["scores"][i] == 1.0, c["answers"][i]] for i in right})
        line["kv_by_length"][str(c["length"])] = sum(c["kv_fractions"][i] for i in right) / max(len(right), 1)
    return seed, "bfloat16" if dtype in ("bf16", "bfloat16") else dtype, list(by_setting.values())


def summaries(cells) -> list:
    """One dict per pooled setting: dtype, method, opts (json), seeds, found, of, by_length
    {L: [found, of]}, kv_mean (mean over lengths), kv_last (at the longest length)."""
    lengths = sorted({L for c in cells.values() for L in c["by_length"]})
    rows = []
    for (dtype, method, opts), c in sorted(cells.items()):
        rows.append({"dtype": dtype, "method": method, "opts": opts, "seeds": sorted(c["seeds"]),
                     "found": sum(f for f, _ in c["by_length"].values()),
                     "of": sum(n for _, n in c["by_length"].values()), "by_length": dict(c["by_length"]),
                     "kv_mean": sum(sum(k.values()) / len(k) for k in c["kv"]) / len(c["kv"]),
                     "kv_last": sum(k[str(lengths[-1])] for k in c["kv"]) / len(c["kv"])})
    return rows


def short_label(opts: str) -> str:
    """'{"threshold": 0.95, "dense_heads": [[7, 2]]}' -> 'P0.95 dense 7:2' (plot labels)."""
    names = {"threshold": "P{}", "protect": "protect {}", "protect_bound": "{}", "budget": "{}"}
    parts = []
    for k, v in json.loads(opts).items():
        if k == "dense_heads":
            parts.append("dense " + ",".join(f"{a}:{b}" for a, b in v))
        else:
            parts.append(names.get(k, k + "={}").format(v))
    return " ".join(parts) or "default"


def frontier(pts):
    """The points (read, found, ...) no other point beats on both (less read, more found), by read."""
    return [p for p in sorted(pts) if not any(q[0] <= p[0] and q[1] >= p[1] and q[:2] != p[:2] for q in pts)]


def plot(rows, path: str, dtype: str = "float32", target: float = 99.0) -> list:
    """Found (% of dense's right answers) against the KV read at the longest length: every `dtype`
    setting pooled on every seed seen for that dtype (settings on fewer seeds ran on other cases:
    the table only), a line per method through its frontier. Returns the plotted rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["dtype"] == dtype]
    seeds = set().union(*(r["seeds"] for r in rows)) if rows else set()
    rows = [r for r in rows if set(r["seeds"]) == seeds]
    if not rows:
        raise SystemExit(f"--plot: no {dtype} setting was pooled over every seed")
    # left: every setting; right: the low-read corner where tactic's and hybrid's settings crowd
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.4]})
    zoom = max((100 * r["kv_last"] for r in rows if r["method"] in ("tactic", "hybrid")), default=25) + 2
    for i, method in enumerate(sorted({r["method"] for r in rows})):
        pts = sorted((100 * r["kv_last"], 100 * r["found"] / r["of"], r["opts"]) for r in rows if r["method"] == method)
        front = frontier(pts)
        for j, ax in enumerate(axes):
            line, = ax.plot([x for x, _, _ in front], [y for _, y, _ in front], "o-", label=method, color=f"C{i}")
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "o", color=line.get_color(), alpha=0.45)
            for x, y, opts in pts:  # each label once: on the zoom if it is there
                if (x <= zoom) == (j == 1):
                    ax.annotate(short_label(opts), (x, y), textcoords="offset points", fontsize=7,
                                xytext=(5, 4 if i % 2 == 0 else -11), color=line.get_color())
    ys = [100 * r["found"] / r["of"] for r in rows if 100 * r["kv_last"] <= zoom]
    axes[1].set_xlim(min(100 * r["kv_last"] for r in rows) - 1, zoom)
    axes[1].set_ylim(min(ys + [target]) - 0.15, max(ys + [target]) + 0.15)
    axes[1].set_title(f"the low-read corner (≤ {zoom:.0f}% read)")
    for ax in axes:
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set_xlabel("KV read at the longest prompt (%)")
        ax.set_ylabel("found (% of dense's right answers)")
    axes[0].set_title(f"retrieval suite, {dtype}, seeds {','.join(sorted(seeds))}: {rows[0]['of']} cases")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", nargs="+", help="suite_cases.py --jsonl files and/or eval results.json files")
    ap.add_argument("--methods", help="comma-separated methods to keep (default: all)")
    ap.add_argument("--defaults", action="append", default=[], metavar="METHOD=JSON",
                    help="the options METHOD's defaults had in these runs, e.g. 'tactic={\"threshold\": 0.93}'")
    ap.add_argument("--plot", metavar="PNG", help="also draw found against KV read (float32 settings on every seed)")
    args = ap.parse_args()
    defaults = {}
    for d in args.defaults:
        method, _, opts = d.partition("=")
        try:
            defaults[method] = json.loads(opts)
        except json.JSONDecodeError as e:
            ap.error(f"--defaults {d!r}: {e}; give METHOD=JSON, e.g. 'tactic={{\"threshold\": 0.93}}'")
    cells = pool(args.jsonl, args.methods and set(args.methods.split(",")), defaults)
    lengths = sorted({L for c in cells.values() for L in c["by_length"]})
    rows = summaries(cells)
    print("| dtype | method | options | seeds | found | " + " | ".join(map(str, lengths))
          + " | KV read, mean of lengths | KV read at the longest |")
    print("|---" * (7 + len(lengths)) + "|")
    for r in rows:
        per = " | ".join("{}/{}".format(*r["by_length"][L]) if L in r["by_length"] else "" for L in lengths)
        print(f"| {r['dtype']} | {r['method']} | `{r['opts']}` | {','.join(r['seeds'])} | "
              f"{100 * r['found'] / r['of']:.1f}% ({r['found']}/{r['of']}) | {per} | {100 * r['kv_mean']:.1f}% | "
              f"{100 * r['kv_last']:.1f}% |")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
