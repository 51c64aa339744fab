"""Host index arrays to the device in one copy, each starting on a 16-byte boundary."""

from __future__ import annotations

import numpy as np
import torch


def to_device_aligned(parts: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """The integer host arrays ``parts`` as flat int64 tensors on ``device``, from one staging copy (pinned,
    not waiting for the device, on CUDA), each starting on a 16-byte boundary.

    Triton compiles a kernel once per 16-byte alignment class of each pointer argument: views packed
    end to end would start at offsets that change with a step's sizes, and vLLM's steps would compile
    new variants while serving. Each part is padded to an even length.
    """
    device = torch.device(device)
    sizes = [int(np.size(a)) for a in parts]
    padded = [n + n % 2 for n in sizes]  # int64: two elements make 16 bytes
    flat = np.zeros(sum(padded), dtype=np.int64)
    start = 0
    for a, n, w in zip(parts, sizes, padded, strict=True):
        flat[start : start + n] = np.asarray(a).reshape(-1)
        start += w
    staged = torch.from_numpy(flat)
    if device.type == "cuda":
        staged = staged.pin_memory()
    if device.type != "cpu":
        staged = staged.to(device, non_blocking=True)
    return [t[:n] for t, n in zip(torch.split(staged, padded), sizes, strict=True)]
