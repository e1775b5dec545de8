"""need_cuda(): the GPU scripts' one-line refusal on a machine without a CUDA GPU (as
`kvsieve bench` gives), instead of a traceback from deep inside torch."""
from __future__ import annotations

import sys
from pathlib import Path

import torch


def need_cuda(device="cuda", dry_run: bool = False) -> None:
    """Exit with code 2 and one line when `device` is a CUDA device and none is visible
    (dry_run: the script offers --device cpu)."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        name = Path(sys.argv[0]).name
        dry = " (or --device cpu for a dry run)" if dry_run else ""
        print(f"{name}: needs a CUDA GPU (none visible); run it on the GPU machine{dry}", file=sys.stderr)
        raise SystemExit(2)
