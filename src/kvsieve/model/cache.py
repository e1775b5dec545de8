"""The model cache: converted GGUF models as safetensors directories under $KVSIEVE_CACHE_DIR
(else ~/.cache/kvsieve), each written once under a lock shared by processes, with clear errors
where the cache cannot be used."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """$KVSIEVE_CACHE_DIR (~ expanded, made absolute), else ~/.cache/kvsieve."""
    return Path(os.path.abspath(os.path.expanduser(os.environ.get("KVSIEVE_CACHE_DIR", "").strip()
                                                   or os.path.join("~", ".cache", "kvsieve"))))


@contextmanager
def cache_errors():
    """An OSError of the model cache (read-only, not a directory, another user's private entry, a
    full disk) as one ValueError naming the path and KVSIEVE_CACHE_DIR. Errors kvsieve raises
    itself (a message, no errno) pass unchanged."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:  # (safetensors' own error for a failed write: a full disk, os error 28)
        if "os error" not in str(e):
            raise
        raise ValueError(f"cannot use the model cache {cache_root()} ({e}); free some space or set "
                         "KVSIEVE_CACHE_DIR to a directory you can read and write") from e
    except OSError as e:
        if e.errno is None:
            raise
        root = cache_root()
        where = f": {e.filename}" if e.filename and Path(e.filename) != root else ""
        raise ValueError(f"cannot use the model cache {root} ({e.strerror or e}{where}); set KVSIEVE_CACHE_DIR to a "
                         "directory you can read and write") from e


@contextmanager
def cache_lock(out: Path):
    """An exclusive lock on cache entry `out` across processes: commands started together
    (a server and a generate, parallel eval jobs) convert a model once, the others wait for it."""
    from filelock import FileLock

    if out.parent.exists() and not out.parent.is_dir():
        raise ValueError(f"the model cache {out.parent} is not a directory; set KVSIEVE_CACHE_DIR to a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        yield


MANIFEST = "kvsieve-entry.json"  # written into a converted entry after its files: their names and sizes
# what a conversion writes, by version: an entry of another version (or none) is converted again.
# 2: a GGUF's end-of-generation tokens found by their text, as llama.cpp finds them (gguf.EOG_TEXTS)
CONVERSION_FORMAT = 2
CONVERTED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json", MANIFEST)


def check_entry_place(out: Path) -> None:
    """Before a conversion replaces `out`: refuse (ValueError) what kvsieve did not write there, a
    file, a link, or a directory holding other files (a user's model folder named like the entry
    in KVSIEVE_CACHE_DIR was deleted); a damaged entry of its own files is replaced."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"{out} is in the place of the model cache's entry but is not a directory kvsieve wrote; "
                         "move or delete it (kvsieve converts the model there)")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in CONVERTED_FILES and p.suffix != ".safetensors")
        if foreign:
            raise ValueError(f"{out} is not a model kvsieve converted (it holds {foreign[0]!r}) and would be replaced; "
                             "move it, or set KVSIEVE_CACHE_DIR to another directory")


def write_manifest(d: Path) -> None:
    """Record d's files and sizes (MANIFEST), so that an entry damaged later (a file deleted or
    truncated by hand) is converted again instead of failing to load."""
    files = {f.name: f.stat().st_size for f in sorted(d.iterdir()) if f.is_file() and f.name != MANIFEST}
    (d / MANIFEST).write_text(json.dumps({"format": CONVERSION_FORMAT, "files": files}, indent=1))


def is_converted(out: Path) -> bool:
    """out is a complete converted entry of this version's conversion: every file its manifest
    lists is there at its size, and the manifest's format is CONVERSION_FORMAT (an entry an
    earlier version wrote, with or without a manifest, is converted again)."""
    if not (is_hf_dir(out) and (out / "tokenizer_config.json").is_file()):
        return False
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != CONVERSION_FORMAT:
            return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    try:
        return isinstance(files, dict) and all((out / n).stat().st_size == size for n, size in files.items())
    except OSError:
        return False


def in_cache(d: Path) -> bool:
    """d is an entry of the model cache (a converted model kvsieve can convert again)."""
    try:
        return Path(d).resolve().parent == cache_root().resolve()
    except OSError:
        return False


def damaged_fix(d: Path, otherwise: str) -> str:
    """The fix to suggest for an unreadable model directory d."""
    if in_cache(d):
        return f"the model cache's entry {d} is damaged: delete it, and kvsieve converts the model again on the next run"
    return otherwise


def is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def staging_dir(out: Path) -> Path:
    """A new directory `<name>.<8 hex>.tmp` beside `out` for one conversion, made under the user's
    umask like any other (mkdtemp's 0700 kept a shared cache's entries private to their converter)."""
    while True:
        tmp = out.parent / f"{out.name}.{secrets.token_hex(4)}.tmp"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def remove_stale_staging(out: Path) -> None:
    """Delete the staging directories of `out` that conversions killed before their cleanup
    (SIGTERM, SIGKILL, out of memory) left behind: under the entry's lock, none is running.
    (mkdtemp's names, which older versions used, have the same form.)"""
    stale = re.compile(re.escape(out.name) + r"\.[a-z0-9_]{8}\.tmp")
    for p in out.parent.iterdir():
        if stale.fullmatch(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
