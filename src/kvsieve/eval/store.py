"""Results directory: finished cells appended to cells.jsonl, so a re-run skips them.

A cell is keyed by an id naming everything it depends on inside one evaluation (task,
length, method point, ...) plus a fingerprint of the run-wide inputs (model, text,
decode length, package version); cells with another fingerprint are recomputed.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Dict, List, Optional

import torch


class ResultStore:
    def __init__(self, out: str, fingerprint: Dict):
        self.dir = Path(out)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"cannot write to the output directory {out!r} ({e.strerror}); "
                             "pass a writable --out directory") from e
        self.fingerprint = hashlib.sha1(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.cells: Dict[str, Dict] = {}
        path = self.dir / "cells.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    cell = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interrupted run
                if not isinstance(cell, dict) or not isinstance(cell.get("id"), str):
                    continue  # not a cell this store wrote: measured again
                if cell.get("fingerprint") == self.fingerprint:
                    self.cells[cell["id"]] = cell

    def get(self, cell_id: str) -> Optional[Dict]:
        return self.cells.get(cell_id)

    def put(self, cell_id: str, cell: Dict) -> Dict:
        cell = {"id": cell_id, "fingerprint": self.fingerprint, **cell}
        path = self.dir / "cells.jsonl"
        with open(path, "a") as f:
            if path.stat().st_size and not _ends_with_newline(path):  # (a line cut short by a kill)
                f.write("\n")
            f.write(json.dumps(cell) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.cells[cell_id] = cell
        return cell

    def log_run(self, run: Dict) -> List[Dict]:
        """Append one invocation's summary to runs.jsonl; return every run with this fingerprint
        (so the report can state the total time a resumed evaluation took)."""
        path = self.dir / "runs.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({**run, "fingerprint": self.fingerprint}) + "\n")
        runs = []
        for line in path.read_text().splitlines():
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted run
        return [r for r in runs if isinstance(r, dict) and r.get("fingerprint") == self.fingerprint]

    # dense next-token distributions, kept so KL can be computed for cells run later
    def _tensor_path(self, name: str) -> Path:
        return self.dir / "dense" / f"{name}-{self.fingerprint}.pt"

    def load_tensor(self, name: str):
        """The tensor saved under `name`, or None: never saved, or unreadable (a run stopped
        while writing it before saves were atomic; the caller recomputes it)."""
        p = self._tensor_path(name)
        if not p.is_file():
            return None
        try:
            return torch.load(p)
        except (EOFError, RuntimeError, pickle.UnpicklingError):
            return None

    def save_tensor(self, name: str, t) -> None:
        """Written to a temporary file, then renamed: a run stopped mid-write leaves no half file."""
        p = self._tensor_path(name)
        p.parent.mkdir(exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        torch.save(t, tmp)
        os.replace(tmp, p)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
