"""Tactic's protected clusters ranked by the 8-bit box (ops.select.quantize_box, what the
index keeps) against the exact min/max box it rounds outward, on real decode steps.

    python3 scripts/box_codes_probe.py --length 7680 --offsets 0,20000,40000 --out OUT [--dtype bfloat16]

Records one decode step of the embedded model (float32) on the built-in text at each offset
(model.record), casts the keys to --dtype, and per layer builds tactic's index at its
defaults. Then, per layer, for both boxes: the protected set (256 tokens per KV head), and
tactic's whole selection (the reference select(): threshold, union, protect, dense heads).
Reports, over layers and offsets, the share of protected tokens the two sets share, the
attention mass each protected set holds, and each selection's read, mass and output error
against dense attention. Writes OUT/box-codes.json and prints a summary line per offset."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import kvsieve.methods.tactic as tactic_module  # noqa: E402
from kvsieve import make_method  # noqa: E402
from kvsieve.eval.cli import read_text  # noqa: E402
from kvsieve.eval.harness import special_prefix  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402
from kvsieve.model.record import record_decode_step  # noqa: E402
from kvsieve.ops.select import box_bounds, cluster_box, select_by_budget, summary_scores  # noqa: E402
from kvsieve.patterns import dense_heads_for  # noqa: E402


def exact_bounds(st, k):
    """The exact channel-wise min/max box of st's clusters over keys k [B, Hkv, S, D]."""
    B, Hkv, S, D = k.shape
    lo, hi = cluster_box(k.flatten(0, 1), st.assign[..., :S].flatten(0, 1), st.sizes.shape[-1])
    return lo.view(B, Hkv, -1, D), hi.view(B, Hkv, -1, D)


def layer_figures(m, q, k, v, layer):
    """Protected-set overlap and both selections' read, mass and error for one layer."""
    B, Hkv, S, D = k.shape
    lengths = torch.tensor([S])
    st = m.prepare(k, lengths, layer)
    exact = exact_bounds(st, k)
    n_valid = st.num_clusters[:, None].expand(B, Hkv)
    logits = torch.einsum("hgd,hsd->hgs", q[0].double().view(Hkv, -1, D), k[0].double()) * D ** -0.5
    probs = logits.softmax(-1)  # [Hkv, G, S]
    dense = torch.einsum("hgs,hsd->hgd", probs, v[0].double())
    out = {}
    protected = {}
    for name, (lo, hi) in (("codes", box_bounds(st.box, st.box_step, st.centroids)), ("exact", exact)):
        _, bound = summary_scores(q, lo, hi, n_valid)
        chosen, _, _ = select_by_budget(bound.masked_fill(st.sizes == 0, float("-inf")), st.sizes,
                                        torch.full((B, Hkv), m.config.protect))
        tokens = chosen.gather(-1, st.assign[..., :S].clamp(min=0)) & (st.assign[..., :S] >= 0)
        protected[name] = tokens[0]  # [Hkv, S]
        original = tactic_module.box_bounds
        if name == "exact":
            tactic_module.box_bounds = lambda *_: exact
        try:
            mask = m.select(q, k, lengths, st).mask[0]  # [Hkv, S]
        finally:
            tactic_module.box_bounds = original
        sel = torch.where(mask[:, None, :], logits, float("-inf")).softmax(-1)
        approx = torch.einsum("hgs,hsd->hgd", sel, v[0].double())
        err = (approx - dense).norm(dim=-1) / dense.norm(dim=-1)
        out[name] = {"protect_mass": float((probs * tokens[0][:, None, :]).sum(-1).mean()),
                     "read": float(mask.double().mean()), "mass": float((probs * mask[:, None, :]).sum(-1).mean()),
                     "error": float(err.mean())}
    a, b = protected["codes"], protected["exact"]
    out["shared"] = float((a & b).sum() / (a | b).sum().clamp(min=1))
    out["same_selection"] = out["codes"]["read"] == out["exact"]["read"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=7680)
    ap.add_argument("--offsets", default="0,20000,40000")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model, tok, model_dir = load_model(None, dtype=torch.float32, device="cpu")
    ids = tok.encode(read_text(None), add_special_tokens=False)
    pre = special_prefix(tok)
    need = args.length - len(pre)
    dt = getattr(torch, args.dtype)
    cfg = model.cfg
    m = make_method("tactic", dense_heads=dense_heads_for("tactic", {}, model_dir, cfg.num_layers, cfg.num_kv_heads))
    rows = []
    for offset in (int(x) for x in args.offsets.split(",")):
        start = min(offset, len(ids) - need)
        t0 = time.time()
        with torch.no_grad():
            rec = record_decode_step(model, pre + ids[start:start + need])
            layers = [dict(layer=i, **layer_figures(m, rec.q[i].to(dt), rec.k[i].to(dt), rec.v[i].to(dt), i))
                      for i in range(cfg.num_layers)]
        rows.append({"offset": start, "seconds": round(time.time() - t0, 1), "layers": layers})
        mean = lambda f: sum(f(L) for L in layers) / len(layers)  # noqa: E731
        print(f"offset {start}: protected tokens shared {mean(lambda L: L['shared']):.4f} "
              f"(min {min(L['shared'] for L in layers):.4f}); protected mass codes "
              f"{mean(lambda L: L['codes']['protect_mass']):.4f} exact {mean(lambda L: L['exact']['protect_mass']):.4f}; "
              f"read {mean(lambda L: L['codes']['read']):.4f} / {mean(lambda L: L['exact']['read']):.4f}, "
              f"mass {mean(lambda L: L['codes']['mass']):.4f} / {mean(lambda L: L['exact']['mass']):.4f}, "
              f"error {mean(lambda L: L['codes']['error']):.4f} / {mean(lambda L: L['exact']['error']):.4f}; "
              f"same selection in {sum(L['same_selection'] for L in layers)}/{len(layers)} layers")
    res = {"model": str(model_dir), "length": args.length, "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "offsets": rows}
    with open(os.path.join(args.out, "box-codes.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
