"""`kvsieve serve`: an OpenAI-compatible HTTP server on the engine."""
from __future__ import annotations

import errno
import os
import signal
import socket
import sys
from typing import List

from ..config import MODEL_HELP

SHUTDOWN_STEP_MARGIN_S = 60.0  # past --shutdown-timeout, for the engine step running at the deadline


def register(sub) -> None:
    from ..cli import add_method_options

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, per-request method)",
                       description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and "
                                   "/metrics. A request may pick its own sparse method with the extra body field "
                                   '"kvsieve": {"method": "tactic", "threshold": 0.95}.')
    p.add_argument("--model", help=MODEL_HELP)
    add_method_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; the server has "
                                                       "no authentication, so expose it with care)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model directory's name)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default 64)")
    p.add_argument("--kv-pages", type=int, help="KV pool size in 16-token pages (default: room for --max-num-seqs "
                   "requests of the model's full length, within --gpu-memory-fraction on CUDA and "
                   "--cpu-kv-gib on the CPU)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9, help="CUDA: share of free GPU memory the "
                   "engine may take: the default KV pool 70%% of it, method indexes and step graphs the rest "
                   "(default 0.9)")
    p.add_argument("--cpu-kv-gib", type=float, default=2.0, help="CPU: most GiB the default KV pool takes "
                                                                 "(default 2)")
    p.add_argument("--device", help="default cuda when a GPU is present, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--max-waiting", type=int, default=256, help="queue limit; past it requests get 503 with "
                                                                "Retry-After (default 256)")
    p.add_argument("--dense-below", type=int, help="a request attends densely while its context (prompt and "
                   "generated tokens) is shorter than this, and is indexed where it gets there with enough tokens "
                   "left to repay the index (default: the measured crossover on CUDA, 0 on the CPU; 0 forces the "
                   "method)")
    p.add_argument("--max-method-configs", type=int, default=32, help="distinct per-request kvsieve settings "
                   "in use by running or waiting requests at once (default 32; unused ones are released)")
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds of a 503 (default 1)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="on Ctrl-C/SIGTERM, seconds requests in "
                   "flight may run before they are aborted (default 30)")
    p.add_argument("--no-warmup", action="store_true", help="skip kernel compilation before serving (CUDA)")
    p.add_argument("--warmup-methods", default="", metavar="M,...", help="more methods whose kernels the CUDA "
                   "warm-up compiles, at their defaults, for requests that pick them in the kvsieve field (e.g. "
                   "quest,lserve, or all; default: only --method and dense; others compile on first use)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def server_heads(method: str, opts: dict, streaming_path, model_dir, num_layers: int, num_kv_heads: int) -> dict:
    """Adds to `opts` the heads the server's own method runs with (patterns.model_head_options)
    and returns those a request naming another method runs with (patterns.model_heads: each
    streaming method's own ratio of --streaming-heads FILE, the user's --dense-heads). A
    server of any method takes --streaming-heads: its per-request lserve and hybrid stream it."""
    from ..patterns import DENSE_HEAD_METHODS, STREAMING_METHODS, model_head_options, model_heads

    given = opts.get("dense_heads") if method in DENSE_HEAD_METHODS else None  # (before a pattern drops any)
    opts.update(model_head_options(method, opts, model_dir, num_layers, num_kv_heads,
                                   streaming_path if method in STREAMING_METHODS else None))
    return model_heads(model_dir, num_layers, num_kv_heads, streaming_path, given)


def warmup_methods(text: str) -> List[str]:
    """--warmup-methods: comma-separated method names, or "all"; each checked by name."""
    from ..methods import METHOD_NAMES

    names = [m.strip() for m in text.split(",") if m.strip()]
    if "all" in names:
        return list(METHOD_NAMES)
    bad = [m for m in names if m not in METHOD_NAMES]
    if bad:
        raise ValueError(f"--warmup-methods names {bad[0]!r}, not a method; give a comma-separated list of "
                         f"{', '.join(METHOD_NAMES)}, or all")
    return list(dict.fromkeys(names))


def _positive(name: str, value, zero_ok: bool = False, real: bool = False) -> None:
    """A count >= 1 (>= 0 with zero_ok); real: a finite number > 0. NaN and inf are refused."""
    if value is None:
        return
    if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
        want = ">= 0" if zero_ok else "> 0" if real else ">= 1"
        finite = "a finite number " if real or value != value or value == float("inf") else ""
        raise ValueError(f"--{name} must be {finite}{want}, got {value}")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a busy port fails at once)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve ({e}); use an address such as 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        fix = "pick another --port or stop the process using it" if e.errno == errno.EADDRINUSE else \
            "give a --host address of this machine (127.0.0.1, or 0.0.0.0 for every interface)"
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); {fix}") from None
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as e:
        raise ValueError(f"missing dependency {e.name!r} for `kvsieve serve`: pip install 'kvsieve[serve]' "
                         "(or bash scripts/setup.sh serve)") from None
    from ..cli import method_options
    from ..engine import LLMEngine, resolve_device
    from ..methods import config_for
    from ..model.loader import load_model
    from .app import create_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_num_seqs", "kv_pages", "max_method_configs", "max_waiting"):  # (every request waits first)
        _positive(name.replace("_", "-"), getattr(args, name))
    for name in ("dense_below", "retry_after", "shutdown_timeout"):
        _positive(name.replace("_", "-"), getattr(args, name), zero_ok=True)
    if not 0 < args.gpu_memory_fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty; give the name clients send, or leave the option out "
                         "(the model directory's name)")
    _positive("cpu-kv-gib", args.cpu_kv_gib, real=True)
    opts = method_options(args)
    config_for(args.method, **opts)  # bad options fail before anything loads
    warm_methods = warmup_methods(args.warmup_methods)
    device, dtype = resolve_device(args.device, args.dtype)
    sock = bind(args.host, args.port)
    model, tok, model_dir = load_model(args.model, dtype=dtype, device=device)
    cfg = model.cfg
    shipped = server_heads(args.method, opts, args.streaming_heads, model_dir, cfg.num_layers, cfg.num_kv_heads)
    eng = LLMEngine(model, tok, args.method, kv_pages=args.kv_pages, max_num_seqs=args.max_num_seqs,
                    max_waiting=args.max_waiting, dense_below=args.dense_below,
                    gpu_memory_fraction=args.gpu_memory_fraction, cpu_kv_gib=args.cpu_kv_gib, **opts)
    name = args.served_model_name or model_dir.name
    app = create_app(eng, name, streaming_heads=shipped, max_method_configs=args.max_method_configs,
                     retry_after_s=args.retry_after)  # uvicorn lets requests finish, then the rest abort
    if device.type == "cuda" and not args.no_warmup:
        lengths = eng.warmup_lengths()  # requests of any length find their kernels compiled
        # each method as a request naming it runs (the model's heads; the server's own is its default)
        took = eng.warmup(lengths, methods=[app.state.server.method({"method": m}) for m in warm_methods])
        print(f"kvsieve serve: warm-up of {', '.join(dict.fromkeys([args.method, *warm_methods]))} at "
              f"{', '.join(map(str, lengths))} tokens: {took:.1f} s", file=sys.stderr)
    sch = eng.scheduler
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]
    print(f"kvsieve serve: {name} ({args.method}) on {device} {str(dtype).replace('torch.', '')}, KV pool "
          f"{sch.num_pages} pages = {sch.num_pages * sch.page_size} tokens, max {sch.max_num_seqs} running, "
          f"{args.max_waiting} waiting; http://{host}:{port}/v1", file=sys.stderr)
    # uvicorn cancels the streams still open past its own timeout: leave the driver time to
    # finish the engine step it is in at the deadline (seconds on a CPU) and end them with "abort"
    config = uvicorn.Config(app, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_STEP_MARGIN_S)
    # uvicorn re-raises the signal that stopped it once it has shut down: Ctrl-C as
    # KeyboardInterrupt, SIGTERM through the handler in place before run(), this one
    previous = signal.signal(signal.SIGTERM, _stopped_by_sigterm)
    try:
        _make_server(config, app, args.shutdown_timeout).run(sockets=[sock])
    except (KeyboardInterrupt, _SigTerm):  # (a graceful shutdown: exit 0)
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        # shut down: another Ctrl-C while Python exits (torch's teardown takes a moment) ends it
        # at once, not with a KeyboardInterrupt in interpreter shutdown (status 130)
        signal.signal(signal.SIGINT, _quit_now)
    return 0


def _quit_now(signum, frame):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _SigTerm(Exception):
    pass


def _stopped_by_sigterm(signum, frame):
    raise _SigTerm()


def _make_server(config, app, shutdown_timeout: float):
    """A uvicorn.Server that stops taking requests from the first Ctrl-C/SIGTERM on (uvicorn
    closes the listening socket: new connections are refused; a request on a connection
    already open gets 503, as does /health), while the requests in flight finish (up to
    --shutdown-timeout, then they are aborted)."""
    import uvicorn

    class Server(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig, frame) -> None:
            server = app.state.server
            server.draining = True
            self.signals += 1
            if self.signals == 2 and sig == signal.SIGINT:
                # uvicorn would force-quit here and cut the streams mid-body: abort them now
                # instead (each ends with finish_reason "abort" within one engine step)
                print("kvsieve serve: aborting the requests in flight (Ctrl-C again to quit at once)",
                      file=sys.stderr)
                server.driver.stop(drain_s=0.0, wait=False)
                return
            if self.signals >= 3 and sig == signal.SIGINT:  # "at once": uvicorn's forced exit cancels the
                # handlers mid-await and logs a traceback for each; the requests were aborted already
                print("kvsieve serve: quit", file=sys.stderr)
                _quit_now(sig, frame)
            # requests still running at the deadline are aborted by the driver, so their
            # clients get a clean end (503 / finish_reason "abort") before uvicorn gives up
            server.driver.stop(drain_s=shutdown_timeout, wait=False)
            super().handle_exit(sig, frame)

    return Server(config)
