"""How many GPUs this process can see (for ``cap_workers_to_gpu_pool``).

``CUDA_VISIBLE_DEVICES``, when set, defines visibility (its entries are
counted; empty or ``-1`` means none); otherwise torch's
``cuda.device_count()`` when torch is importable, otherwise the lines of
``nvidia-smi -L``; zero when none of them answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["visible_gpu_count"]


def visible_gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip()]
        return 0 if not entries or entries[0].strip() == "-1" else len(entries)
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch, or a torch without CUDA support
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=10)
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            return 0
    return 0
