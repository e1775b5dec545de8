#!/usr/bin/env python3
"""Load test for `kvsieve serve` (a server on this machine only).

Replays a bounded workload: for each method (`--methods`, sent per request in the
`kvsieve` extra body) and each concurrency in `--concurrency`, N streaming requests with
prompts of about `--prompt-tokens` tokens and exactly `--max-tokens` new tokens
(ignore_eos), at most C in flight. Reports per cell: output throughput (tokens/s),
requests/s, TTFT, TPOT and end-to-end latency p50/p99, mean KV fraction read, errors.

    python3 -m kvsieve serve --method tactic &
    python3 scripts/load_test.py --requests 64 --concurrency 1,8,32 --prompt-tokens 512,2048 \\
        --max-tokens 64 --methods dense,tactic --out load.json --plot load.png

TTFT: from sending the request to the first text chunk; TPOT: (last chunk - first chunk) /
(completion tokens - 1), per request; tokens come from the usage chunk the server sends.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from urllib.parse import urlparse

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WORDS = ("the system reads a long document about rivers mountains cities and old machines then answers "
         "questions about what it found while the engine keeps only the keys that matter for each step of "
         "decoding so memory traffic falls as the context grows longer and longer every day").split()


def int_list(s: str):
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return out


def make_prompt(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of English-like text (common words are one token each)."""
    words = [rng.choice(WORDS) for _ in range(max(tokens - 12, 1))]
    for i in range(12, len(words), 12):
        words[i - 1] += "."
    return "Document: " + " ".join(words) + "\nQuestion: summarize the document in one sentence.\nAnswer:"


def percentile(xs, q: float):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one(client, url: str, body: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    rec = {"status": None, "ttft_s": None, "tpot_s": None, "e2e_s": None, "completion_tokens": 0,
           "prompt_tokens": 0, "kv_fraction": None, "error": None}
    first = last = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:200]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    rec["error"] = msg["error"].get("message")
                    continue
                for c in msg.get("choices") or []:
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        last = time.perf_counter()
                        first = first or last
                if msg.get("usage"):
                    u = msg["usage"]
                    rec["completion_tokens"], rec["prompt_tokens"] = u["completion_tokens"], u["prompt_tokens"]
                    rec["kv_fraction"] = (u.get("kvsieve") or {}).get("kv_fraction")
    except Exception as e:  # connection refused, timeout: counted, never fatal
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    rec["e2e_s"] = time.perf_counter() - t0
    if first is not None:
        rec["ttft_s"] = first - t0
        if rec["completion_tokens"] > 1:
            rec["tpot_s"] = (last - first) / (rec["completion_tokens"] - 1)
    return rec


async def cell(args, model: str, method, concurrency: int, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    path = "/v1/completions" if args.endpoint == "completions" else "/v1/chat/completions"
    bodies = []
    for i in range(args.requests + args.warmup):
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        prompt = make_prompt(args.prompt_tokens[i % len(args.prompt_tokens)], rng)
        if args.endpoint == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        kv = dict(args.kvsieve)
        if method:
            kv["method"] = method
        if kv:
            body["kvsieve"] = kv
        bodies.append(body)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=args.url, limits=limits) as client:
        for b in bodies[:args.warmup]:  # e.g. the first request of a new kvsieve setting builds its method
            await one(client, path, b, args.timeout)
        sem = asyncio.Semaphore(concurrency)

        async def limited(b):
            async with sem:
                return await one(client, path, b, args.timeout)

        t0 = time.perf_counter()
        recs = await asyncio.gather(*(limited(b) for b in bodies[args.warmup:]))
        wall = time.perf_counter() - t0
    ok = [r for r in recs if r["status"] == 200 and not r["error"]]
    errors = {}
    for r in recs:
        if r not in ok:
            key = str(r["status"] or r["error"].split(":")[0])
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r["completion_tokens"] for r in ok)

    def stats(key):
        xs = [r[key] for r in ok if r[key] is not None]
        return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "mean": sum(xs) / len(xs) if xs else None}

    fr = [r["kv_fraction"] for r in ok if r["kv_fraction"] is not None]
    return {"method": method or "server default", "concurrency": concurrency, "requests": len(recs),
            "ok": len(ok), "errors": errors, "wall_s": wall, "output_tokens": out_tokens,
            "prompt_tokens_mean": sum(r["prompt_tokens"] for r in ok) / len(ok) if ok else None,
            "throughput_tok_s": out_tokens / wall if wall else None, "requests_per_s": len(ok) / wall if wall else None,
            "ttft_s": stats("ttft_s"), "tpot_s": stats("tpot_s"), "e2e_s": stats("e2e_s"),
            "kv_fraction_mean": sum(fr) / len(fr) if fr else None}


def plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, method in enumerate(dict.fromkeys(r["method"] for r in results)):
        rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["concurrency"])
        cs = [r["concurrency"] for r in rows]
        for ax, key in zip(axes[:2], ("ttft_s", "tpot_s")):
            for q, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(cs, [r[key][q] for r in rows], style, color=f"C{i}", label=f"{method} {q}")
        axes[2].plot(cs, [r["throughput_tok_s"] for r in rows], "-o", color=f"C{i}", label=method)
    for ax, title in zip(axes, ("time to first token (s)", "time per output token (s)", "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server, as serve prints it (with or without /v1; loopback only; default %(default)s)")
    p.add_argument("--requests", type=int, default=32, help="requests per (method, concurrency) cell")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="comma-separated, e.g. 1,4,16")
    p.add_argument("--prompt-tokens", type=int_list, default=[256], help="approximate prompt lengths, cycled")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (ignore_eos)")
    p.add_argument("--methods", default="", help="comma-separated kvsieve methods (default: the server's)")
    p.add_argument("--kvsieve", type=json.loads, default={}, help='more options, e.g. \'{"threshold": 0.9}\'')
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each cell")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG of latency and throughput against concurrency")
    args = p.parse_args(argv)
    args.url = args.url.rstrip("/").removesuffix("/v1")  # (serve prints the OpenAI base_url, .../v1)
    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        p.error(f"--url must point at this machine ({', '.join(sorted(LOOPBACK))}), got {host!r}")
    if args.requests < 1 or args.max_tokens < 1 or args.warmup < 0:
        p.error("--requests and --max-tokens must be >= 1, --warmup >= 0")
    if not isinstance(args.kvsieve, dict):
        p.error("--kvsieve must be a JSON object")
    import httpx

    try:
        models = httpx.get(args.url + "/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        print(f"load_test: no kvsieve server at {args.url} ({e}); start one with `python3 -m kvsieve serve`",
              file=sys.stderr)
        return 2
    model = models[0]["id"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] or [None]
    results = []
    for mi, method in enumerate(methods):
        for ci, c in enumerate(args.concurrency):
            r = asyncio.run(cell(args, model, method, c, args.seed + 1000 * mi + ci))
            results.append(r)
            fmt = lambda x, k=1000: "-" if x is None else f"{x * k:.1f}"  # noqa: E731
            print(f"{r['method']:>14} c={c:<4} ok {r['ok']}/{r['requests']} {r['throughput_tok_s'] or 0:8.1f} tok/s  "
                  f"TTFT p50 {fmt(r['ttft_s']['p50'])} p99 {fmt(r['ttft_s']['p99'])} ms  "
                  f"TPOT p50 {fmt(r['tpot_s']['p50'])} p99 {fmt(r['tpot_s']['p99'])} ms  "
                  f"KV read {fmt(r['kv_fraction_mean'], 100)}%" + (f"  errors {r['errors']}" if r["errors"] else ""),
                  flush=True)
    report = {"url": args.url, "model": model, "endpoint": args.endpoint, "requests": args.requests,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "kvsieve": args.kvsieve,
              "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"load_test: results in {args.out}", file=sys.stderr)
    else:
        print(json.dumps(report))
    if args.plot:
        plot(results, args.plot)
        print(f"load_test: plot in {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
