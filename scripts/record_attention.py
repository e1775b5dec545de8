"""Record one real decode step's attention inputs from a model on real text, and summarise
them: what a realistic synthetic generator has to reproduce (issue: realistic bench data).

    python3 scripts/record_attention.py --model gemma3-270m --length 32000 --out OUT [--save-layers 5,11]

Per layer and query head, from the post-RoPE q, k, v the layer's attention sees, the
statistics of kvsieve.bench.attention_stats (top-P budgets, sink and local mass, page
budget, GQA union, key locality).
Layers with a sliding window (Gemma's local layers) are summarised over their window.
Writes OUT/attention-stats.json, OUT/attention-curves.png and, for --save-layers,
OUT/qkv-layer<N>.safetensors (fp16: q [Hq, D], k and v [Hkv, S, D]).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.bench.attention_stats import head_stats  # noqa: E402
from kvsieve.eval.cli import read_text  # noqa: E402
from kvsieve.eval.harness import special_prefix  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402
from kvsieve.model.record import record_decode_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--length", type=int, default=8000)
    ap.add_argument("--offset", type=int, default=20000, help="token offset of the window in the text")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--save-layers", default="", help="comma-separated layers whose q, k, v to save (fp16)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model, tok, model_dir = load_model(args.model, dtype=torch.float32, device=args.device)
    cfg = model.cfg
    ids = tok.encode(read_text(None), add_special_tokens=False)
    pre = special_prefix(tok)
    need = args.length - len(pre)
    start = min(args.offset, len(ids) - need)
    if start < 0 or args.length > cfg.max_positions:
        raise SystemExit(f"--length {args.length} needs more text than the {len(ids)} tokens or more positions "
                         f"than the model's {cfg.max_positions}")
    prompt = pre + ids[start:start + need]
    t0 = time.time()
    with torch.no_grad():
        rec = record_decode_step(model, prompt)
    rec_s = time.time() - t0
    layers = []
    for i in range(cfg.num_layers):
        s = head_stats(rec.q[i][0].float(), rec.k[i][0].float(), cfg.layer_window(i))
        layers.append({"layer": i, "window": cfg.layer_window(i), **s})
    save = [int(x) for x in args.save_layers.split(",") if x.strip()]
    if save:
        from safetensors.torch import save_file

        for i in save:
            save_file({"q": rec.q[i][0].half().contiguous().cpu(), "k": rec.k[i][0].half().contiguous().cpu(),
                       "v": rec.v[i][0].half().contiguous().cpu()}, os.path.join(args.out, f"qkv-layer{i}.safetensors"))
    res = {"model": str(model_dir), "length": args.length, "text": "pydoc_data.topics", "offset": start,
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "record_s": rec_s, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "layers": layers}
    with open(os.path.join(args.out, "attention-stats.json"), "w") as f:
        json.dump(res, f)
    print(f"recorded {args.length} tokens in {rec_s:.1f} s")
    print("layer window  budget@0.9 (mean/max over heads)  page_budget@0.9  sink  local  key_loc(1/256)")
    for L in layers:
        b, pb = L["budget_0.9"], L["page_budget_0.9"]
        kl = L["key_locality"]
        print(f"{L['layer']:5d} {str(L['window']):6s}  {sum(b) / len(b):6.3f} / {max(b):6.3f}  "
              f"{sum(pb) / len(pb):6.3f}  {sum(L['sink']) / len(b):.2f}  {sum(L['local']) / len(b):.2f}  "
              f"{kl.get('1', float('nan')):.2f}/{kl.get('256', float('nan')):.2f}")
    try:
        plot(res, os.path.join(args.out, "attention-curves.png"))
    except ImportError:
        pass
    return 0


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    glob = [L for L in res["layers"] if L["window"] is None] or res["layers"]
    fig, ax = plt.subplots(1, len(glob), figsize=(4 * len(glob), 3.2), squeeze=False)
    for a, L in zip(ax[0], glob):
        for h, c in enumerate(L["curve"]):
            a.plot(L["curve_x"], c, label=f"head {h}")
        a.set_xscale("log")
        a.set_title(f"layer {L['layer']}: sorted cumulative mass")
        a.set_xlabel("fraction of context (sorted by score)")
        a.axhline(0.9, color="grey", lw=0.5)
    ax[0][0].legend(fontsize=7)
    fig.suptitle(f"{os.path.basename(res['model'])}, {res['length']} tokens, one decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
