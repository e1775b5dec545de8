"""GPU check + benchmark of the engine on the embedded model (installs nothing).

    python3 scripts/gpu_engine.py --out OUT [--parts check,single,crossover,concurrent]
                                  [--model gemma3-270m --lengths 8192,16384,32000]

check:      graph replay == eager decode (greedy tokens) per method, seeds reproduce;
single:     the built-in ~4K-token prompt at batch 1, every method, tokens/s through the engine
            (what `kvsieve generate` runs), KV read and agreement with dense;
crossover:  batch 1 at several prompt lengths with dense_below=0 (sparse forced on);
concurrent: 32 requests of mixed lengths (1K-7.5K) submitted together: aggregate tokens/s,
            time to first token and time per output token, p50/p99 (sparse forced on).
served:     the same requests at the engine's defaults (its GPU crossover on, as generate
            and serve run them).
chat:       64 short requests (64-512 tokens, 64 new tokens each) submitted together, dense (a
            chat server's load: prefill is many small prompts).
e2e8b:      the Llama-3.1-8B shape (random weights) at batch 1-8, 8K-128K, steady-state decode.
cb8b, cb64: continuous batching on that shape: 24 requests of 8K-32K (32 new tokens) and
            64 requests of 8K-64K (64 new tokens), submitted together; dense, tactic, lserve.
batchrule:  tactic at the engine's defaults on that shape (its threshold plan's batch-wide
            crossover and index payback) against dense: 1 x 32K, 4 x 32K, 16 x 8K, 8 x 32K,
            300 new tokens each.
Writes OUT/engine.json and prints a table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch
from needs_gpu import need_cuda  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402
from kvsieve.model.cli import DEFAULT_QUESTION  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402
from kvsieve.patterns import model_head_options  # noqa: E402
from kvsieve.prompts import document_prompt  # noqa: E402

METHODS = {"dense": {}, "tactic": {}, "quest": {}, "lserve": {}, "hybrid": {}, "tactic-2.5%": {"budget": 100}}
MODEL_DIR = [None]  # the loaded model's directory (main)


def opts_for(name, model):
    """(method, options) as `kvsieve generate` runs it: the model's shipped heads added
    (patterns.model_head_options: lserve's and hybrid's own streaming heads, every dynamic
    method's dense heads; other models run without)."""
    method, o = name.split("-")[0], dict(METHODS[name])
    if MODEL_DIR[0] is not None:
        o.update(model_head_options(method, o, MODEL_DIR[0], model.cfg.num_layers, model.cfg.num_kv_heads))
    return method, o


def doc_ids(tok, n):
    doc, _, _ = document_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)), n)
    return tok.encode(doc + DEFAULT_QUESTION, add_special_tokens=True)  # the model's BOS, if it has one


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def single(model, tok, log, new_tokens=128):
    ids = doc_ids(tok, 4000)
    rows, dense_tokens = [], None
    for name in METHODS:
        method, o = opts_for(name, model)
        eng = LLMEngine(model, tok, method, kv_pages=(len(ids) + new_tokens) // 16 + 8, max_num_seqs=1, **o)
        warm = eng.warmup()
        params = SamplingParams(new_tokens, ignore_eos=True)
        best = None
        for _ in range(3):
            eng.stats.decode_s = eng.stats.decode_tokens = 0
            out = eng.generate([ids], params)[0]
            tps = eng.stats.decode_tokens / eng.stats.decode_s
            best = max(best or 0, tps)
        graph_ms = None
        if eng.runner.batch is not None and eng.runner.batch.graphs:  # the step graph alone, no host work
            g = next(iter(eng.runner.batch.graphs.values()))[0]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                g.replay()
            torch.cuda.synchronize()
            graph_ms = (time.perf_counter() - t0) / 50 * 1e3
        if name == "dense":
            dense_tokens = out.tokens
        agree = sum(a == b for a, b in zip(out.tokens, dense_tokens)) / len(dense_tokens)
        rows.append({"method": name, "prompt": len(ids), "tok_s": best, "kv_fraction": out.kv_fraction,
                     "attended": out.method, "agree_dense": agree, "warmup_s": warm, "captures": eng.runner.captures, "graph_ms": graph_ms,
                     "answer": tok.decode(out.tokens[:12])})
        log(rows[-1])
    return rows


def crossover(model, tok, log, lengths=(1024, 2048, 4096, 7600), new_tokens=64):
    rows = []
    full = doc_ids(tok, max(lengths) + 100)
    for n in lengths:
        ids = full[:1] + full[-(n - 1):] if full[0] == tok.bos_token_id else full[-n:]
        for name in ("dense", "tactic", "quest", "lserve", "tactic-2.5%"):
            method, o = opts_for(name, model)
            eng = LLMEngine(model, tok, method, kv_pages=(len(ids) + new_tokens) // 16 + 8, max_num_seqs=1,
                            dense_below=0, **o)
            eng.warmup()
            eng.generate([ids], SamplingParams(new_tokens, ignore_eos=True))
            eng.stats.decode_s = eng.stats.decode_tokens = 0
            out = eng.generate([ids], SamplingParams(new_tokens, ignore_eos=True))[0]
            rows.append({"method": name, "prompt": len(ids), "tok_s": eng.stats.decode_tokens / eng.stats.decode_s,
                         "kv_fraction": out.kv_fraction})
            log(rows[-1])
    return rows


def run_batch(eng, prompts, new_tokens):
    """Warm up as `kvsieve serve` does (every length bucket, here up to the longest prompt's),
    submit every prompt at once, run to completion: throughput and latency."""
    longest = max(map(len, prompts))
    eng.warmup([n for n in eng.warmup_lengths() if n < 2 * longest])
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(new_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    tpot = [o.decode_s / max(len(o.tokens) - 1, 1) for o in outs]
    ttft = [o.ttft_s for o in outs]
    return {"requests": len(prompts), "wall_s": wall, "tok_s": sum(len(o.tokens) for o in outs) / wall,
            "decode_tok_s": eng.stats.decode_tokens / eng.stats.decode_s, "prefill_s": eng.stats.prefill_s,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "kv_fraction": sum(o.kv_fraction for o in outs) / len(outs), "pool_pages": eng.scheduler.num_pages,
            "captures": eng.runner.captures, "composes": eng.runner.composes, "row_joins": eng.runner.row_joins,
            "preemptions": eng.stats.preemptions, "attended_densely": sum(bool(o.attended_densely) for o in outs)}


def concurrent(model, tok, log, n=32, new_tokens=128, forced=True):
    rng = random.Random(0)
    base = doc_ids(tok, 7600)
    prompts = [base[-rng.randint(1024, 7500):] for _ in range(n)]
    rows = []
    for name in ("dense", "tactic", "lserve", "quest"):
        method, o = opts_for(name, model)
        # forced: the method itself, not dense; else the engine's crossover, as generate and serve run
        eng = LLMEngine(model, tok, method, max_num_seqs=n, dense_below=0 if forced else None, **o)
        rows.append({"method": name, **run_batch(eng, prompts, new_tokens)})
        log(rows[-1])
        del eng
        gc.collect()
    return rows


def served(model, tok, log):
    """concurrent's requests at the engine's defaults (its GPU crossover on)."""
    return concurrent(model, tok, log, forced=False)


def chat(model, tok, log, n=64, new_tokens=64):
    rng = random.Random(1)
    base = doc_ids(tok, 2000)
    prompts = [base[-rng.randint(64, 512):] for _ in range(n)]
    eng = LLMEngine(model, tok, "dense", max_num_seqs=n)
    row = {"method": "dense", **run_batch(eng, prompts, new_tokens)}
    log(row)
    return [row]


def check(model, tok, log):
    """Greedy tokens of graph replay vs eager, per method; seeded sampling reproduces."""
    ids = doc_ids(tok, 3000)
    prompts = [ids, ids[-1500:], ids[-2200:]]
    rows = []
    for name in METHODS:
        method, o = opts_for(name, model)
        res = {}
        for graphs in (False, True):
            eng = LLMEngine(model, tok, method, dense_below=0, graphs=graphs, max_num_seqs=4, **o)
            res[graphs] = [x.tokens for x in eng.generate(prompts, SamplingParams(40, ignore_eos=True))]
        same = sum(a == b for x, y in zip(res[False], res[True]) for a, b in zip(x, y)) / sum(map(len, res[True]))
        rows.append({"check": "graph==eager", "method": name, "token_agreement": same, "captures": eng.runner.captures})
        log(rows[-1])
    eng = LLMEngine(model, tok, "tactic", max_num_seqs=4)
    p = SamplingParams(24, temperature=0.8, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    a = eng.generate([prompts[0]], p)[0].tokens
    b = eng.generate([prompts[0], prompts[1]], p)[0].tokens
    rows.append({"check": "seed reproduces across batch", "equal": a == b})
    log(rows[-1])
    return rows


def e2e8b(model, tok, log):
    """Llama-3.1-8B-shaped random weights through the engine (the embedded model is not used)."""
    from kvsieve.bench import e2e

    del model
    torch.cuda.empty_cache()
    big = e2e.random_model()
    rows = []
    for S, B in ((131072 - 64, 1), (32768, 8), (16384, 1), (8192, 1)):
        tok_b = int(round(0.025 * S))
        for method, o in (("dense", {}), ("tactic", {"budget": tok_b}), ("quest", {"budget": tok_b}),
                          ("tactic", {"threshold": 0.9})):
            try:
                r = e2e.decode_tokens_per_s(big, method, S, B, **o)
            except torch.cuda.OutOfMemoryError as e:
                r = {"method": method, "context": S, "batch": B, "note": f"OOM {e}"[:200]}
            torch.cuda.empty_cache()
            rows.append(r)
            log(r)
    return rows


def cb8b(model, tok, log, n=24, lo=8192, hi=32768, new_tokens=32, methods=("dense", "tactic", "lserve")):
    """Continuous batching on the 8B shape: n requests with contexts drawn from [lo, hi]."""
    from kvsieve.bench import e2e
    from kvsieve.bench.kernels import half_streaming

    del model
    torch.cuda.empty_cache()
    big = e2e.random_model()
    cfg = big.cfg
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    lens = [rng.randint(lo, hi) for _ in range(n)]
    prompts = [torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist() for L in lens]
    rows = []
    for method, o in (("dense", {}), ("tactic", {"budget": 512}),
                      ("lserve", {"budget": 512, "streaming_heads": half_streaming(cfg.num_layers, cfg.num_kv_heads)})):
        if method not in methods:
            continue
        eng = LLMEngine(big, None, method, max_num_seqs=n, step_tokens=8192, prefill_chunk=8192, **o)
        rows.append({"method": method, "options": {k: v for k, v in o.items() if k != "streaming_heads"},
                     "contexts": [lo, hi], **run_batch(eng, prompts, new_tokens)})
        log(rows[-1])
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def cb64(model, tok, log, methods=("dense", "tactic", "lserve"), new_tokens=64):
    """The issue's continuous-batching run: 64 requests of 8K-64K tokens, 64 new tokens each."""
    return cb8b(model, tok, log, n=64, lo=8192, hi=65536, new_tokens=new_tokens, methods=methods)


def batchrule(model, tok, log, new_tokens=300, cases=((1, 32768), (4, 32768), (16, 8192), (8, 32768))):
    """tactic's threshold plan at the engine's defaults (no dense_below) on the 8B shape: which
    requests are indexed and plan (the batch's total against 96K tokens), and what that costs
    against dense. Random weights attend uniformly, so a plan reads ~all of the cache there and
    the engine's other rule moves such a request to dense after 4 steps: a stress case.
    "tactic, dense steps": every request indexed, every step under the rule (the cost of
    holding an index that does not plan)."""
    from kvsieve.bench import e2e
    from kvsieve.engine.engine import EngineStats

    del model
    torch.cuda.empty_cache()
    big = e2e.random_model()
    rows = []
    for label in ("dense", "tactic", "tactic, dense steps"):
        g = torch.Generator().manual_seed(2)  # the same prompts for each
        eng = LLMEngine(big, None, label.split(",")[0], max_num_seqs=16, step_tokens=8192, prefill_chunk=8192)
        eng.warmup([8192, 32768])
        if label == "tactic, dense steps":
            eng._index_or_dense = lambda req: None
            eng.runner.step_dense_below["default"] = 1 << 40
        for B, S in cases:
            prompts = [torch.randint(0, big.cfg.vocab_size, (S,), generator=g).tolist() for _ in range(B)]
            eng.stats = EngineStats()
            captures, composes = eng.runner.captures, eng.runner.composes
            t0 = time.perf_counter()
            outs = eng.generate(prompts, SamplingParams(new_tokens, ignore_eos=True))
            st = eng.stats
            rows.append({"method": label, "batch": B, "context": S, "new_tokens": new_tokens,
                         "wall_s": time.perf_counter() - t0, "prefill_s": st.prefill_s,
                         "decode_tok_s": st.decode_tokens / st.decode_s, "kv_fraction": [o.kv_fraction for o in outs],
                         "attended_densely": [o.attended_densely for o in outs],
                         "captures": eng.runner.captures - captures, "composes": eng.runner.composes - composes,
                         "dense_below": eng.dense_below, "dense_step_below": eng.dense_step_below})
            log(rows[-1])
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="check,single,crossover,concurrent")
    ap.add_argument("--model", help="model for the embedded-model parts (default: the embedded model)")
    ap.add_argument("--lengths", help="crossover prompt lengths, comma-separated")
    ap.add_argument("--methods", help="cb8b/cb64: methods to run, comma-separated (default dense,tactic,lserve; "
                    "one call per method keeps a long run within a time limit)")
    ap.add_argument("--new-tokens", type=int, help="cb8b/cb64: new tokens per request (default 32 / 64)")
    args = ap.parse_args()
    need_cuda()
    os.makedirs(args.out, exist_ok=True)
    embedded = any(p not in ("e2e8b", "cb8b", "cb64", "batchrule") for p in args.parts.split(","))
    model, tok, MODEL_DIR[0] = load_model(args.model, dtype=torch.bfloat16, device="cuda") if embedded else (None, None, None)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "command": " ".join(sys.argv)}

    def log(r):
        print(json.dumps(r), flush=True)

    for part in args.parts.split(","):
        t0 = time.perf_counter()
        kw = {"lengths": tuple(int(x) for x in args.lengths.split(","))} if part == "crossover" and args.lengths else {}
        if part in ("cb8b", "cb64") and args.methods:
            kw["methods"] = tuple(args.methods.split(","))
        if part in ("cb8b", "cb64") and args.new_tokens:
            kw["new_tokens"] = args.new_tokens
        result[part] = globals()[part](model, tok, log, **kw)
        print(f"## {part}: {time.perf_counter() - t0:.1f} s", flush=True)
        tag = args.parts.replace(',', '-') + (f"-{args.methods.replace(',', '-')}" if args.methods else "") \
            + (f"-{args.new_tokens}" if args.new_tokens else "")
        with open(os.path.join(args.out, f"engine-{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
