"""Pool `kvsieve eval --tasks suite` results over seeds: found counts summed, KV read averaged.

    python3 scripts/pool_suite.py SEED0.json SEED1a.json+SEED1b.json ... --out DIR

Each argument is one seed's results.json; `a.json+b.json` joins two runs of the same seed
(b adds only the points a lacks, so a point measured twice counts once). Writes DIR/pooled.md
(a table: every point, found over dense's correct cases per seed and pooled, KV read overall
and at the longest length) and DIR/suite-curve-pooled.png (the points every seed has).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.eval.plots import suite_curve  # noqa: E402
from kvsieve.eval.report import suite_summary  # noqa: E402


def seed_rows(spec: str) -> dict:
    """label -> suite_summary row for one seed (its runs joined, first run first)."""
    rows: dict = {}
    for path in spec.split("+"):
        for r in suite_summary(json.load(open(path))):
            rows.setdefault(r["label"], r)
    return rows


def pool(seeds: list) -> list:
    """Rows of the labels every seed has: found summed per key, KV read averaged."""
    common = [lab for lab in seeds[0] if all(lab in s for s in seeds)]
    out = []
    for lab in common:
        rows = [s[lab] for s in seeds]
        keys = set.intersection(*(set(r["found"]) for r in rows))
        found = {k: tuple(sum(r["found"][k][i] for r in rows) for i in range(2)) for k in keys}
        kv = {k: sum(r["kv"][k] for r in rows) / len(rows) for k in set.intersection(*(set(r["kv"]) for r in rows))}
        out.append({"label": lab, "method": rows[0]["method"], "found": found, "kv": kv})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seeds", nargs="+", help="results.json per seed (a.json+b.json: two runs of one seed)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    missing = [p for s in args.seeds for p in s.split("+") if not os.path.isfile(p)]
    if missing:
        print(f"error: no such results file: {missing[0]}; pass each seed's results.json", file=sys.stderr)
        return 2
    try:
        seeds = [seed_rows(s) for s in args.seeds]
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or not an eval results file
        print(f"error: not a `kvsieve eval` results.json ({e!r}); pass the results.json of --tasks suite runs",
              file=sys.stderr)
        return 2
    pooled = pool(seeds)
    if not pooled:
        print("error: no suite point is in every seed's results; pass results of `kvsieve eval --tasks suite`",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    longest = max(k for r in pooled for k in r["kv"] if k != "all")
    head = ["point", *(f"seed {i}" for i in range(len(seeds))), "pooled", "KV read", f"KV at {longest}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_label = {r["label"]: r for r in pooled}
    for lab in dict.fromkeys(lab for s in seeds for lab in s):
        per = [f"{s[lab]['found']['all'][0]}/{s[lab]['found']['all'][1]}" if lab in s else "" for s in seeds]
        cells = ["", "", ""]
        if lab in by_label:
            p = by_label[lab]
            hit, tot = p["found"]["all"]
            cells = [f"{100 * hit / max(tot, 1):.1f}% ({hit}/{tot})", f"{100 * p['kv']['all']:.1f}%",
                     f"{100 * p['kv'][longest]:.1f}%" if longest in p["kv"] else ""]
        lines.append("| " + " | ".join([lab, *per, *cells]) + " |")
    (out / "pooled.md").write_text("\n".join(lines) + "\n")
    suite_curve({}, out / "suite-curve-pooled.png", rows=pooled,  # rows and title given: no results needed
                title=f"retrieval suite pooled over {len(seeds)} seeds: found vs KV read (ringed: default; dotted: 99%)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
