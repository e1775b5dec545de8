"""Pool `scripts/suite_cases.py --jsonl` lines (one per method option and seed) over seeds:
found / dense's right answers per setting, overall and per length, and the KV read.

    python3 scripts/pool_options.py docs/accuracy/seeds0-5-2026-11-25/*.jsonl

A file's seed and dtype come from its name (`...-float32-seed3.jsonl`, `...-bf16-seed3.jsonl`);
a setting counts a seed once (the first line for it), `{}` is the method's defaults at the run
(--defaults 'tactic={"threshold": 0.93}' pools a run of the defaults with one naming them).
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
        seed = re.search(r"seed(\d+)", name)
        if not seed:
            raise SystemExit(f"{path}: no seedN in the file name")
        dtype = "bfloat16" if re.search(r"bf16|bfloat16", name) else "float32"
        for line in open(path):
            r = json.loads(line)
            if methods and r["method"] not in methods:
                continue
            opts = {k: v for k, v in r["options"].items() if k != "method"} or (defaults or {}).get(r["method"], {})
            cell = out[(dtype, r["method"], json.dumps(opts, sort_keys=True))]
            if seed.group(1) in cell["seeds"]:
                continue
            cell["seeds"].add(seed.group(1))
            for case, (ok, _) in r["cases"].items():
                n = cell["by_length"][int(case.split("-")[3])]
                n[0] += bool(ok)
                n[1] += 1
            cell["kv"].append(r["kv_by_length"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--methods", help="comma-separated methods to keep (default: all)")
    ap.add_argument("--defaults", action="append", default=[], metavar="METHOD=JSON",
                    help="the options METHOD's defaults had in these runs, e.g. 'tactic={\"threshold\": 0.93}'")
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
    print("| dtype | method | options | seeds | found | " + " | ".join(map(str, lengths))
          + " | KV read, mean of lengths | KV read at the longest |")
    print("|---" * (7 + len(lengths)) + "|")
    for (dtype, method, opts), c in sorted(cells.items()):
        found = sum(f for f, _ in c["by_length"].values())
        of = sum(n for _, n in c["by_length"].values())
        kv_mean = sum(sum(k.values()) / len(k) for k in c["kv"]) / len(c["kv"])
        kv_last = sum(k[str(lengths[-1])] for k in c["kv"]) / len(c["kv"])
        per = " | ".join("{}/{}".format(*c["by_length"][L]) if L in c["by_length"] else "" for L in lengths)
        print(f"| {dtype} | {method} | `{opts}` | {','.join(sorted(c['seeds']))} | {100 * found / of:.1f}% "
              f"({found}/{of}) | {per} | {100 * kv_mean:.1f}% | {100 * kv_last:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
