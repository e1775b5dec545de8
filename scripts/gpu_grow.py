"""GPU check of long generations: Tactic's folds (TacticConfig.fold_mode) and requests whose
generation takes them past their method's crossover (indexed at that decode step).

    python3 scripts/gpu_grow.py --out OUT [--parts long,grow8b] [--new-tokens 3000]

long:   the embedded model, a short chat prompt and --new-tokens greedy tokens (ignore_eos),
        tactic forced on (dense_below=0) with fold_mode "cluster" and "nearest", and dense:
        KV read, decode tokens/s, tokens equal to dense's (the common prefix and in all),
        clusters in use at the end.
grow8b: the Llama-3.1-8B shape (random weights), 8 requests of 6,000 tokens, 4,000 new
        tokens each, at the engine's defaults: dense, and tactic at a 256-token budget (its
        crossover 8,192 tokens: the requests start dense and are indexed as they cross).
        Decode tokens/s before and after the crossover, from each decode step's time.
Writes OUT/grow.json and prints one line per run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
from needs_gpu import need_cuda  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402

PROMPT = "Write a long, detailed history of the printing press, chapter by chapter."


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def long_generation(log, new_tokens: int, device: str = "cuda"):
    model, tok, _ = load_model(None, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"])
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rows, dense = [], None
    for name, method, opts in (("dense", "dense", {}), ("tactic, cluster folds", "tactic", {"fold_mode": "cluster"}),
                               ("tactic, nearest folds", "tactic", {"fold_mode": "nearest"})):
        eng = LLMEngine(model, tok, method, dense_below=0, **opts)
        eng.warmup([len(ids) + new_tokens])
        out = eng.generate([ids], params)[0]
        st = eng.stats
        row = {"run": name, "prompt_tokens": len(ids), "new_tokens": len(out.tokens), "kv_fraction": out.kv_fraction,
               "decode_tok_s": st.decode_tokens / st.decode_s, "captures": eng.runner.captures}
        if method == "tactic":
            states = eng.runner.batch.states["default"] if eng.runner.batch is not None else []
            row["clusters_end"] = [int(s.num_clusters.max()) for s in states][:3]
        if dense is None:
            dense = out.tokens
        else:
            row.update(prefix_equal=common_prefix(out.tokens, dense),
                       equal_fraction=sum(a == b for a, b in zip(out.tokens, dense)) / len(dense))
        rows.append(row)
        log(row)
        del eng
        gc.collect()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def grow8b(log, batch=8, prompt=6000, new_tokens=4000):
    from kvsieve.bench import e2e

    big = e2e.random_model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, big.cfg.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
    from kvsieve.methods import tactic

    fold_s = [0.0, 0]
    fold = tactic.fold_rows

    def timed_fold(*a, **k):  # each step's folds, their own time (synchronized)
        if not a[4]:  # (no row due)
            return fold(*a, **k)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fold(*a, **k)
        torch.cuda.synchronize()
        fold_s[0] += time.perf_counter() - t
        fold_s[1] += 1
        return out

    tactic.fold_rows = timed_fold
    rows = []
    for label, method, opts in (("dense", "dense", {}), ("tactic", "tactic", {"budget": 256}),
                                ("tactic, nearest folds", "tactic", {"budget": 256, "fold_mode": "nearest"})):
        eng = LLMEngine(big, None, method, max_num_seqs=batch, step_tokens=8192, prefill_chunk=8192, **opts)
        eng.warmup([8192, 16384])
        fold_s[:] = [0.0, 0]
        cross = eng.dense_below_for("default") if method != "dense" else None
        ids = [eng.add_request(p, SamplingParams(new_tokens, ignore_eos=True)) for p in prompts]
        before, after, t_all = [0, 0.0], [0, 0.0], time.perf_counter()
        finished, steps = {}, []
        while eng.has_unfinished:
            running = [r for r in eng.scheduler.running if not r.prefilling]
            ctx = min((len(r.prompt) + len(r.output) for r in running), default=0)
            t0 = time.perf_counter()
            outs = eng.step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            n = sum(len(o.new_tokens) for o in outs if o.id in ids)
            if running and len(running) == batch:
                side = before if ctx < 8192 else after
                side[0] += n
                side[1] += dt
                if ctx >= 8192:
                    steps.append(dt)
            finished.update({o.id: o for o in outs if o.finished})
        outs = [finished[i] for i in ids]
        steps.sort()
        med = steps[len(steps) // 2] if steps else 0.0
        row = {"run": label, "options": opts, "batch": batch, "prompt": prompt, "new_tokens": new_tokens,
               "crossover": cross, "wall_s": time.perf_counter() - t_all,
               "tok_s_under_8192": before[0] / before[1] if before[1] else None,
               "tok_s_over_8192": after[0] / after[1] if after[1] else None,
               "step_ms_median_over_8192": 1e3 * med, "tok_s_at_median_step": batch / med if med else None,
               "slow_steps_over_8192": sum(d > 2 * med for d in steps),
               "slow_steps_extra_s": sum(d - med for d in steps if d > 2 * med),
               "folds": fold_s[1], "fold_s": fold_s[0],
               "kv_fraction": [round(o.kv_fraction, 3) for o in outs],
               "attended_densely": [o.attended_densely for o in outs], "captures": eng.runner.captures}
        rows.append(row)
        log(row)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="long,grow8b")
    ap.add_argument("--new-tokens", type=int, default=3000)
    ap.add_argument("--device", default="cuda", help="long: where to run (cpu for a quick dry run)")
    args = ap.parse_args()
    need_cuda(args.device, dry_run=True)
    os.makedirs(args.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d")}

    def log(row):
        print(json.dumps(row), flush=True)

    for part in args.parts.split(","):
        report[part] = long_generation(log, args.new_tokens, args.device) if part == "long" else grow8b(log)
        with open(os.path.join(args.out, "grow.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
