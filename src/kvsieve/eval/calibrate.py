"""`kvsieve calibrate`: find a model's streaming heads offline on real text (LServe's static
sparsity, DuoAttention-style criterion).

Criterion: dense teacher-forced decode over windows of real text; at every step, layer and
KV head, the share of the dense softmax mass that a Λ mask (the first `sink` + the last
`local` tokens, the window the head will see at decode) keeps, averaged over the head's
query group, the steps and the windows. The `ratio` of KV heads with the highest Λ mass
(ranked over all layers) become streaming heads: they lose the least by seeing only Λ.
The relative output error of Λ attention is recorded alongside, for inspection.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ..methods.base import recent_and_sink
from ..ops.attention import attend
from .metrics import attention_fidelity
from .runs import PrefilledBatch
from .sweep import MethodPoint


class LambdaMass:
    """Engine observer: Λ-mask mass and output error per (layer, KV head), summed over steps."""

    def __init__(self, num_layers: int, num_kv_heads: int, sink: int, local: int):
        self.sink, self.local = sink, local
        self.mass = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.err = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.count = torch.zeros(num_layers, dtype=torch.float64)

    def __call__(self, layer, q, k, v, sel, lengths, out) -> None:
        B, Hkv, S, _ = k.shape
        lam = recent_and_sink(lengths, S, self.sink, self.local, k.device)[:, None, :].expand(B, Hkv, S)
        mass, err = attention_fidelity(q, k, v, lam, lengths, attend(q, k, v, lam)[0])
        self.mass[layer] += mass.view(B, Hkv, -1).mean(-1).sum(0).cpu()
        self.err[layer] += err.view(B, Hkv, -1).mean(-1).sum(0).cpu()
        self.count[layer] += B

    def means(self):
        n = self.count.clamp(min=1)[:, None]
        return self.mass / n, self.err / n


def measure_lambda_mass(model, windows, steps: int, sink: int, local: int):
    """windows: token lists of prompt length + steps. Returns (mass, err), each
    [layers, kv_heads] float64, from `steps` teacher-forced dense decode steps per window."""
    L = len(windows[0]) - steps
    cfg = model.cfg
    obs = LambdaMass(cfg.num_layers, cfg.num_kv_heads, sink, local)
    batch = PrefilledBatch(model, [w[:L] for w in windows], steps)
    engine = batch.engine(MethodPoint("dense"))
    engine.score(batch.cache, batch.reqs, batch.lengths, torch.tensor([w[L:] for w in windows]), observe=obs)
    return obs.means()


def register(sub) -> None:
    from ..methods.hybrid import HybridConfig

    p = sub.add_parser("calibrate", help="find a model's streaming heads on real text; writes a pattern file "
                                         "for --streaming-heads (lserve, hybrid)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--model", help="Hugging Face directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--ratio", type=float, default=0.5, help="fraction of KV heads made streaming, in [0, 1] (0.5)")
    p.add_argument("--sink", type=int, default=HybridConfig.sink, help="Λ sink tokens (decode default 128)")
    p.add_argument("--local", type=int, default=HybridConfig.local, help="Λ local tokens (decode default 256)")
    p.add_argument("--text-file", help="calibration text (default: Python's pydoc_data.topics)")
    p.add_argument("--length", type=int, help="tokens per calibration window (default min(4096, half the "
                                                "model's positions))")
    p.add_argument("--windows", type=int, default=2, help="calibration windows spread over the text (2)")
    p.add_argument("--steps", type=int, default=16, help="teacher-forced decode steps per window (16)")
    p.add_argument("--out", help="pattern file to write (default: <model name>.streaming.json)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from ..model.loader import load_model
    from ..patterns import check_ratio, choose_streaming, save_pattern
    from .cli import read_text
    from .harness import text_windows

    check_ratio(args.ratio)
    for name in ("sink", "local"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.windows < 1 or args.steps < 1:
        raise ValueError(f"--windows and --steps must be >= 1, got {args.windows}, {args.steps}")
    text = read_text(args.text_file)
    t0 = time.time()
    model, tok, model_dir = load_model(args.model, device=args.device)
    limit = model.cfg.max_positions
    length = args.length or min(4096, limit // 2)
    if not args.sink + args.local < length <= limit - args.steps:
        raise ValueError(f"--length must exceed sink + local ({args.sink + args.local}) and leave room for "
                         f"--steps within the model's {limit} positions, got {length}")
    out = Path(args.out or f"{model_dir.name}.streaming.json")
    if not out.parent.is_dir():
        raise ValueError(f"cannot write {str(out)!r}: directory {str(out.parent)!r} does not exist")
    ids = tok.encode(text, add_special_tokens=False)
    windows = text_windows(ids, length, args.steps, args.windows)
    mass, err = measure_lambda_mass(model, windows, args.steps, args.sink, args.local)
    pattern = choose_streaming(mass.tolist(), args.ratio)
    save_pattern(out, pattern, {"lambda_mass": mass.tolist(), "lambda_err": err.tolist()}, {
        "model": model_dir.name, "ratio": args.ratio, "sink": args.sink, "local": args.local,
        "criterion": "mean dense softmax mass kept by the sink+local (Λ) mask per KV head over teacher-forced "
                     "decode steps on real text; the `ratio` heads with the most mass stream",
        "calibration": {"text": args.text_file or "pydoc_data.topics", "windows": args.windows,
                        "length": length, "steps": args.steps, "date": time.strftime("%Y-%m-%d"),
                        "seconds": round(time.time() - t0, 1)}})
    n = sum(map(sum, pattern))
    kept = mass[torch.tensor(pattern)]
    print(f"{n} of {mass.numel()} KV heads stream (ratio {args.ratio}); their Λ mass: min {kept.min():.3f}, "
          f"mean {kept.mean():.3f}; the others' mean {mass[~torch.tensor(pattern)].mean():.3f}" if n and
          n < mass.numel() else f"{n} of {mass.numel()} KV heads stream")
    for i, row in enumerate(pattern):
        flags = " ".join(f"{'S' if f else '.'}{m:.2f}" for f, m in zip(row, mass[i].tolist()))
        print(f"layer {i:>3}: {flags}")
    print(f"wrote {out} ({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0
