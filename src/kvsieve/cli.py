"""`kvsieve` command line. User errors print one line and exit with code 2."""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional


class UsageError(ValueError):
    """A user-facing error: bad option, bad file, bad input."""


def add_method_options(p: argparse.ArgumentParser) -> None:
    from .methods import METHOD_NAMES  # (torch loads inside main's Ctrl-C handling, not at import)

    p.add_argument("--method", default="tactic", help=f"one of: {', '.join(METHOD_NAMES)} (default tactic)")
    p.add_argument("--threshold", type=float, help="tactic/hybrid: attention-mass threshold P in (0, 1] (0.92)")
    p.add_argument("--cluster-size", type=int, help="tactic/hybrid: average tokens per cluster (16; larger "
                                                   "where a head would pass 4096 clusters: 32 at 128K tokens)")
    p.add_argument("--protect", type=int, help="tactic/hybrid threshold mode: tokens of clusters whose members "
                                               "could score highest, taken before the mass threshold (256; 0: off)")
    p.add_argument("--protect-bound", choices=["radius", "box"], help="tactic/hybrid: rank protected clusters by "
                   "their members' channel-wise min/max (box, the default) or by q.c + |q| r (radius)")
    p.add_argument("--dense-heads", metavar="L:H,...|FILE|none", help="tactic/hybrid (threshold mode), quest, "
                   "lserve: KV heads attended densely, as layer:head pairs (7:2,18:2) or a `kvsieve calibrate` "
                   "file's, or none (default: the embedded model's, 7:2,18:2; other models: none)")
    p.add_argument("--budget", type=int, help="quest/lserve: token budget of selected pages; tactic: fixed "
                                              "per-KV-head token budget instead of the threshold (GPU fast path)")
    p.add_argument("--page-size", type=int, help="quest/lserve: logical page size in tokens")
    p.add_argument("--physical-page-size", type=int, help="quest/lserve: physical page size in tokens, a multiple "
                                                          "of the page size (quest: the page size; lserve: 64)")
    p.add_argument("--sink", type=int, help="sink tokens always attended (lserve/hybrid: of the streaming heads)")
    p.add_argument("--local", type=int, help="local window tokens always attended (lserve/hybrid: of the streaming "
                   "heads)")
    p.add_argument("--streaming-heads", metavar="FILE", help="lserve/hybrid: streaming-heads pattern from `kvsieve "
                   "calibrate` ('none': no streaming head; default: the shipped pattern of the embedded model)")
    p.add_argument("--prefill-local", type=int, help="lserve/hybrid: local window of streaming heads during "
                                                     "prefill (default: model positions / 8, up to 8192)")
    p.add_argument("--dense-prefill", action="store_const", const=False, dest="sparse_prefill",
                   help="lserve/hybrid: prefill every head densely (no block-sparse prefill)")


def method_options(args: argparse.Namespace) -> dict:
    """The method options the user actually gave (unset ones keep the method's defaults)."""
    names = {"threshold": "threshold", "cluster_size": "cluster_size", "protect": "protect",
             "protect_bound": "protect_bound", "budget": "budget",
             "page_size": "page_size", "physical_page_size": "physical_page_size", "sink": "sink",
             "local": "local", "prefill_local": "prefill_local",
             "sparse_prefill": "sparse_prefill"}
    opts = {dst: getattr(args, src) for src, dst in names.items() if getattr(args, src, None) is not None}
    if getattr(args, "dense_heads", None) is not None:
        opts["dense_heads"] = parse_heads(args.dense_heads)
    from .methods import REGISTRY

    method = getattr(args, "method", None)
    if method in REGISTRY:  # the user's flags, named as typed
        flag = {dst: "--dense-prefill" if src == "sparse_prefill" else "--" + src.replace("_", "-")
                for src, dst in {**names, "dense_heads": "dense_heads"}.items()}
        accepted = REGISTRY[method][1].accepted_options()
        unknown = [flag[k] for k in opts if k not in accepted]
        if unknown:
            takes = [f for k, f in flag.items() if k in accepted]
            raise ValueError(f"{', '.join(unknown)} does not apply to --method {method}; its options: "
                             f"{', '.join(takes) or 'none'}")
    return opts


def parse_heads(text: str) -> tuple:
    """'7:2,18:2' -> ((7, 2), (18, 2)); 'none' -> (); a file's dense_heads (kvsieve calibrate)."""

    if text.strip().lower() == "none":
        return ()
    if not text.strip():
        raise ValueError("--dense-heads is empty; give layer:kv_head pairs (e.g. 7:2,18:2), a pattern file, "
                         "or 'none' for no dense head")
    if text.endswith(".json") or Path(text).is_file():
        from .patterns import load_dense_heads

        return load_dense_heads(text, required=True)
    try:
        heads = tuple((int(a), int(b)) for a, b in (p.split(":") for p in text.split(",") if p.strip()))
    except ValueError:
        raise ValueError(f"--dense-heads must be layer:kv_head pairs separated by commas, e.g. 7:2,18:2; "
                         f"got {text!r}") from None
    if any(a < 0 or b < 0 for a, b in heads):
        raise ValueError(f"--dense-heads: layers and KV heads are counted from 0, got {text!r}; give "
                         "layer:kv_head pairs such as 7:2,18:2")
    return heads


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(seq_len=args.seq_len, seed=args.seed, data=args.data)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line (`kvsieve: error: ...`), exit code 2."""

    def error(self, message):
        where = "" if self.prog == "kvsieve" else f"{self.prog}: "  # (a subcommand's)
        self.exit(2, f"kvsieve: error: {where}{message}; see {self.prog} --help\n")

    def parse_args(self, args=None, namespace=None):
        """Arguments no parser takes are named with the help of the command they followed."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(ns, "command", None)
            where = f"{self.prog} {command}" if command else self.prog
            self.exit(2, f"kvsieve: error: unrecognized arguments: {' '.join(extras)}; see {where} --help\n")
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvsieve", description="Adaptive sparse attention for long-context decoding.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"kvsieve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="sparse_decode on one synthetic decode step: KV read and error per method")
    d.add_argument("--seq-len", type=int, default=8192, help="cached tokens of the synthetic decode step (8192)")
    d.add_argument("--seed", type=int, default=0, help="seed of the synthetic q, k, v (0)")
    d.add_argument("--data", choices=("calibrated", "clustered"), default="calibrated",
                   help="calibrated: attention shaped like a real model's (default); clustered: a stress case "
                        "that page summaries cannot see")
    d.set_defaults(func=cmd_demo)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands that live next to their features (model, eval, bench)."""
    found = []
    for mod in ("kvsieve.model.cli", "kvsieve.eval.cli", "kvsieve.eval.calibrate", "kvsieve.bench.cli",
                "kvsieve.server.cli"):
        try:
            found.append(__import__(mod, fromlist=["register"]).register)
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("kvsieve"):
                raise
    return found


def _one_line_warnings(default):
    """A warnings.showwarning that prints kvsieve's own warnings as one line (`kvsieve:
    warning: ...`) and hands the others to `default`."""
    package = Path(__file__).parent.resolve()

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UserWarning) and Path(filename).resolve().is_relative_to(package):
            print(f"kvsieve: warning: {message}", file=sys.stderr if file is None else file)
        else:
            default(message, category, filename, lineno, file, line)

    return show


def main(argv=None) -> int:
    _escape_unencodable_output()
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warnings(warnings.showwarning)
        return _run(argv)


def _escape_unencodable_output() -> None:
    """On a terminal or pipe whose encoding is not UTF-8 (PYTHONIOENCODING=ascii, a cp1252
    console), write characters it cannot hold as \\U escapes: an answer with an emoji is
    shown, not lost to an encoding error after the model has run."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("_", "-")
        if encoding not in ("utf-8", "utf8", "utf-8-sig") and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # (a closed or detached stream: leave it)
                pass


def _joined_values(argv: list) -> list:
    """argv with `--dense-heads -1:0` as `--dense-heads=-1:0`: argparse takes a value that
    starts with '-' and is not a plain number for an option, and would answer "expected one
    argument" instead of the range error the value deserves."""
    out = []
    for a in argv:  # (argparse also takes a prefix of the flag: --dense-head, --dense-h)
        if out and out[-1].startswith("--dense-h") and "--dense-heads".startswith(out[-1]) and re.match(r"-\d", a):
            out[-1] = f"--dense-heads={a}"
        else:
            out.append(a)
    return out


def _debug() -> bool:
    """KVSIEVE_DEBUG set to anything but "", 0, false, no or off: errors and Ctrl-C raise, with
    their tracebacks."""
    return os.environ.get("KVSIEVE_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def _subcommand_flags(parser: argparse.ArgumentParser, command: Optional[str]) -> set:
    """The long flags of `command`'s parser (empty when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return {s for a in action.choices[command]._actions for s in a.option_strings if s.startswith("--")}
    return set()


def _as_flags(message: str, flags: set) -> str:
    """A config error in the user's words: a field the command has a flag for, named as the
    flag (cluster_size -> --cluster-size; a one-word field only where it is the subject of
    the sentence: before "must", "=", " (" or " set", in a message naming no flag yet), so a CLI
    error never names a Python field."""
    ours = "--" in message  # (a message of the CLI's own: its one-word names are plain words, "sink + local")

    def flag(m: re.Match) -> str:
        word, after = m.group(1), message[m.end():]
        name = "--" + word.replace("_", "-")
        python_hint = after.startswith("=...")  # (a keyword of the Python API named beside the flag)
        subject = not python_hint and ("_" in word or (not ours and re.match(r" must\b|=| \(| set\b", after)))
        return name if name in flags and subject else word

    return re.sub(r"(?<![-\w./\\'])([a-z][a-z0-9_]*)(?![-\w/]|\.\w)", flag, message)


def _run(argv) -> int:
    flags: set = set()
    try:
        parser = build_parser()  # (imports torch: a Ctrl-C there is an interrupt too)
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(_joined_values(argv))
        args.argv = argv
        flags = _subcommand_flags(parser, getattr(args, "command", None))
        return args.func(args)
    except BrokenPipeError:  # stdout closed early (`kvsieve generate | head`): not a user error
        sys.stdout = open(os.devnull, "w")  # (the interpreter's flush at exit would fail again)
        return 141  # (128 + SIGPIPE, as a tool the signal ends)
    except (ValueError, OSError, UsageError, ModuleNotFoundError) as e:  # OSError: an unreadable file, a full disk
        if _debug():
            raise
        if isinstance(e, ValueError) and not isinstance(e, UsageError):
            e = _as_flags(str(e), flags)
        if isinstance(e, ModuleNotFoundError) and e.name and "pip install" not in str(e):  # (ours name their
            # extra; no name: not a missing install, e.g. an import cut short by Ctrl-C: its own message)
            e = f"missing dependency {e.name!r}: run `bash scripts/setup.sh` or `pip install 'kvsieve[model]'`"
        print(f"kvsieve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever the step was
        if _debug():
            raise
        sys.stdout.flush()
        print("\nkvsieve: interrupted", file=sys.stderr)
        return 130
