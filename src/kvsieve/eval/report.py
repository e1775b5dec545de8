"""report.md and PNG plots from an evaluation's results (the dict written to results.json)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ..patterns import DENSE_HEAD_METHODS

EQUAL_COST_FRACTIONS = (0.05, 0.1, 0.2)
COMPARED = ("tactic", "hybrid", "quest", "lserve", "streaming")


@dataclass
class Report:
    summary: str
    plots: List[str] = field(default_factory=list)


def _fmt(x, spec=".3f") -> str:
    return "—" if x is None else format(x, spec)


def fidelity_cells(results: Dict, length: int) -> List[Dict]:
    cells = [c for c in results["cells"] if c["task"] == "fidelity" and c["length"] == length]
    return sorted(cells, key=lambda c: (c["method"] != "dense", c["method"], c["knob"] or 0))


def at_equal_cost(cells: List[Dict], method: str, metric: str, fraction: float) -> Optional[float]:
    """metric of `method` linearly interpolated at `fraction` of KV read; None outside the
    measured range (no extrapolation)."""
    pts = sorted((c["kv_fraction"], c[metric]) for c in cells if c["method"] == method)
    if len(pts) < 2 or not pts[0][0] <= fraction <= pts[-1][0]:
        return None
    return float(np.interp(fraction, [p[0] for p in pts], [p[1] for p in pts]))


def _table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fidelity_section(results: Dict, length: int) -> str:
    cells = fidelity_cells(results, length)
    rows = [[c["label"], _fmt(c["kv_fraction"], ".1%"), _fmt(c["mass_mean"]), _fmt(c["mass_p10"]),
             _fmt(c["mass_reaching"]["0.9"], ".0%"), _fmt(c["out_err_mean"], ".3g"), _fmt(c["ppl"], ".3f"),
             _fmt(c["kl"], ".2e"), _fmt(c["top1_agree"], ".0%")] for c in cells]
    out = [f"### Context {length} tokens ({cells[0]['samples']} text windows x {cells[0]['decode_tokens']} "
           "teacher-forced decode steps)" if cells else f"### Context {length}",
           _table(["method", "KV read", "mass", "mass p10", "heads >= 0.9", "out err", "ppl", "KL(dense||m)",
                   "top-1 = dense"], rows)]
    eq_rows = []
    for f in EQUAL_COST_FRACTIONS:
        for m in COMPARED:
            vals = [at_equal_cost(cells, m, k, f) for k in ("mass_mean", "out_err_mean", "kl")]
            if any(v is not None for v in vals):
                eq_rows.append([f"{f:.0%}", m, _fmt(vals[0]), _fmt(vals[1], ".3g"), _fmt(vals[2], ".2e")])
    if eq_rows:
        out += ["", f"Equal cost at {length} tokens (each method's sweep interpolated at the same fraction of KV read; "
                "— where the sweep does not reach it):", "",
                _table(["KV read", "method", "mass", "out err", "KL"], eq_rows)]
    return "\n".join(out)


def threshold_section(results: Dict) -> str:
    rows = []
    for c in sorted((c for c in results["cells"] if c["task"] == "fidelity" and c["method"] == "tactic"),
                    key=lambda c: (c["length"], c["knob"])):
        reach = c["mass_reaching"].get(f"{c['knob']:g}")
        rows.append([str(c["length"]), f"{c['knob']:g}", _fmt(c["kv_fraction"], ".1%"), _fmt(c["mass_mean"]),
                     _fmt(c["mass_p10"]), _fmt(reach, ".0%") if reach is not None else "—"])
    if not rows:
        return ""
    return "\n".join(["## Does tactic's achieved mass track P?", "",
                      "mass: mean over layers, heads and steps of the dense softmax mass on the selected tokens; "
                      "p10: its 10th percentile; reach P: share of (step, layer, head) at or above P.", "",
                      _table(["context", "P", "KV read", "mass", "mass p10", "reach P"], rows)])


def retrieval_section(results: Dict) -> str:
    cells = [c for c in results["cells"] if c["task"] == "retrieval"]
    if not cells:
        return ""
    variants = list(dict.fromkeys(c["variant"] for c in cells))
    labels = list(dict.fromkeys(c["label"] for c in cells))
    rows = []
    for lab in labels:
        mine = [c for c in cells if c["label"] == lab]
        row = [lab, _fmt(np.mean([c["kv_fraction"] for c in mine]), ".1%")]
        for v in variants:
            sc = [c["score"] for c in mine if c["variant"] == v]
            row.append(_fmt(np.mean(sc), ".2f") if sc else "—")
        rows.append(row)
    lengths = sorted({c["length"] for c in cells})
    return "\n".join(["## Retrieval", "",
                      f"Score: fraction of expected strings in the greedy answer, mean over depths and lengths "
                      f"{', '.join(map(str, lengths))}. Dense is the ceiling the model itself reaches.", "",
                      _table(["method", "KV read", *variants], rows)])


def suite_summary(results: Dict) -> List[Dict]:
    """Per suite point (label): its method, mean KV read and found/total over dense's correct
    cases, overall ("all"), per length and per needle kind. found counts exact-match answers."""
    cells = [c for c in results["cells"] if c["task"] == "suite"]
    dense = {c["length"]: c for c in cells if c["method"] == "dense"}
    out = []
    for lab in dict.fromkeys(c["label"] for c in cells):
        mine = [c for c in cells if c["label"] == lab]
        row = {"label": lab, "method": mine[0]["method"], "kv": {}, "found": {}}
        for c in mine:
            d = dense.get(c["length"])
            right = [i for i, s in enumerate(d["scores"] if d else ()) if s == 1.0]
            groups = [("all", None), (c["length"], None)] + [(k, k) for k in dict.fromkeys(c["kinds"])]
            for key, kind in groups:
                idx = [i for i in right if kind is None or c["kinds"][i] == kind]
                hit, tot = row["found"].get(key, (0, 0))
                row["found"][key] = (hit + sum(c["scores"][i] == 1.0 for i in idx), tot + len(idx))
            row["kv"][c["length"]] = c["kv_fraction"]
        row["kv"]["all"] = float(np.mean(list(row["kv"].values())))
        out.append(row)
    return out


def suite_section(results: Dict) -> str:
    """Retrieval-suite table: per point, the share of dense's correct cases it also answers
    right (overall, per length, per kind), with the KV fraction it read (overall, per length)."""
    cells = [c for c in results["cells"] if c["task"] == "suite"]
    if not cells:
        return ""
    lengths = sorted({c["length"] for c in cells})
    kinds = list(dict.fromkeys(k for c in cells for k in c["kinds"]))
    dense = {c["length"]: c for c in cells if c["method"] == "dense"}

    def found(row, key) -> str:
        hit, tot = row["found"].get(key, (0, 0))
        if not tot:  # dense answered no case there (a base or tiny model)
            return "—"
        share = f"{hit / tot:.1%}".replace(".0%", "%")  # 98.6% is not the 99% target
        return f"{share} ({hit}/{tot})"

    rows = [[r["label"], _fmt(r["kv"]["all"], ".1%"), found(r, "all")] + [found(r, L) for L in lengths]
            + [found(r, k) for k in kinds] + [_fmt(r["kv"].get(L), ".1%") for L in lengths]
            for r in suite_summary(results)]
    n = sum(len(c["scores"]) for c in dense.values())
    right = sum(s == 1.0 for c in dense.values() for s in c["scores"])
    return "\n".join(["## Retrieval suite", "",
                      f"{_count(n, 'case')} (needle kinds {', '.join(kinds)}; lengths {', '.join(map(str, lengths))}). "
                      f"Dense answers {right} right: found = the share of those a method also answers right (exact "
                      f"match); the cases dense misses ({n - right}) are not counted. KV read: mean fraction of the "
                      "cache read per decode step (overall: the mean over lengths).", "",
                      _table(["method", "KV read", "found", *map(str, lengths), *kinds,
                              *(f"KV {L}" for L in lengths)], rows)])


def _count(n: int, noun: str) -> str:
    """ "1 case", "3 cases" """
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _window_note(results: Dict) -> List[str]:
    cfg = results.get("model_config", {})
    judged = next((c.get("judged_layers") for c in results["cells"] if c["task"] == "fidelity"), None)
    if not judged or len(judged) == cfg.get("num_layers"):
        return []
    return [f"- sliding-window layers: every method attends to the model's own window on {cfg['num_layers'] - len(judged)}"
            f" of {cfg['num_layers']} layers; mass and out err are over the other {len(judged)} (global) layers "
            f"{judged}, KV read over the whole cache (so dense reads less than 100%)"]


def _streaming_note(heads: Dict) -> str:
    """e.g. "lserve 22, hybrid 11 of 90 KV heads stream (shipped pattern)"."""
    methods = heads.get("methods") or {"lserve and hybrid": heads}  # results written before per-method ratios
    scope = " of the global layers" if heads.get("global_layers_only") else ""
    return (", ".join(f"{m} {v['streaming']}" for m, v in methods.items())
            + f" of {heads['kv_heads']} KV heads{scope} stream ({heads['file']})")


def _dense_heads_note(results: Dict) -> List[str]:
    """e.g. "- dense KV heads of tactic and quest (...): 7:2 (shipped pattern)", one line per
    list (absent in older results)."""
    dense = results.get("dense_heads")
    if not dense:
        return []
    by_list: Dict[str, List[str]] = {}
    for m in DENSE_HEAD_METHODS:
        if m in dense:
            by_list.setdefault(", ".join(f"{a}:{b}" for a, b in dense[m]) or "none", []).append(m)
    names = {h: ms[0] if len(ms) == 1 else f"{', '.join(ms[:-1])} and {ms[-1]}" for h, ms in by_list.items()}
    source = f" ({dense['file']})" if dense.get("file") else ""
    return [f"- dense KV heads of {names[h]} (layer:head, attended densely): {h}{source}" for h in by_list]


def write_report(results: Dict, out_dir) -> Report:
    out_dir = Path(out_dir)
    lengths = sorted({c["length"] for c in results["cells"] if c["task"] == "fidelity"})
    plots = []
    try:
        from . import plots as plotting

        plots = plotting.make_all(results, out_dir)
    except ImportError:
        pass
    parts = [f"# kvsieve eval: {Path(results['model']).name}", "",
             f"- device: {results['device']}, dtype {results['dtype']}, date {results['date']}",
             f"- command: `{results['command']}`",
             f"- wall time: {sum(r['wall_s'] for r in results['runs']):.0f} s over "
             f"{_count(len(results['runs']), 'invocation')} (" + "; ".join(
                 f"{r['date']}: {r['wall_s']:.0f} s, {_count(r['new_cells'], 'new cell')}" for r in results["runs"]) + ")",
             "- streaming heads (lserve, hybrid): " + (
                 "none: no pattern for this model, so lserve = hierarchical page selection on every head and "
                 "hybrid = tactic" if results["streaming_heads"] is None else
                 _streaming_note(results["streaming_heads"])),
             *_dense_heads_note(results),
             *([f"- fidelity text: {results['text']} ({results['text_tokens']} tokens)"] if lengths else []),
             *_window_note(results),
             f"- versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items())]
    if lengths:
        parts += ["", "## Attention and next-token fidelity", "",
                  "mass: dense softmax mass on the tokens read; out err: ||o - o_dense|| / ||o_dense|| per head, "
                  "dense in float64 on the same q, k, v; ppl of the true next tokens; KL(dense || method) of the "
                  "next-token distribution in nats; top-1 = dense: same argmax token as dense."]
        parts += ["\n" + fidelity_section(results, L) for L in lengths]
    parts += [x for s in (threshold_section(results), retrieval_section(results), suite_section(results)) if s
              for x in ("", s)] + [""]
    parts += [f"![{p}]({p})" for p in plots]
    text = "\n".join(parts) + "\n"
    (out_dir / "report.md").write_text(text)
    summary = "\n\n".join(s for s in [*(fidelity_section(results, L) for L in lengths), retrieval_section(results),
                                       suite_section(results)] if s)
    return Report(summary, plots)
