"""Shared timing and environment helpers of the benchmarks (CUDA only)."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import torch
import triton


def _load_tolerances():
    """``tests/tolerances.py``, the one table of tolerances (the benchmarks' correctness gates use it too)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "tolerances.py"
    spec = importlib.util.spec_from_file_location("kvarn_test_tolerances", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOL = _load_tolerances()


def code_hash(root: Path | None = None) -> str:
    """sha256 (12 hex digits) of the ``kvarn`` package's ``.py`` files, by path then content.

    Names the code a run measured where the checkout's git state does not (a copied working tree
    whose ``.git`` is older than its files); ``python -c "from benchmarks._common import code_hash;
    print(code_hash())"`` at a commit gives the same digest for the same files.
    """
    import hashlib

    root = Path(__file__).resolve().parents[1] if root is None else root
    digest = hashlib.sha256()
    for path in sorted((root / "kvarn").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def environment() -> dict:
    """GPU, torch, triton, the git commit (``-dirty`` if the tree differs from it) and :func:`code_hash`."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit or "unknown",
        "code": code_hash(),
    }


def capture_graph(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` run eagerly, then on a side stream, then captured: ``(graph, what the captured call returned)``."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def time_graph(fn, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median device time of ``fn`` in microseconds, replayed from a CUDA graph (L2 flushed per replay)."""
    graph, _ = capture_graph(fn)
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return ms * 1e3


def time_eager(fn, calls: int = 200) -> tuple[float, float]:
    """``fn`` called eagerly ``calls`` times back to back: (host µs per call, wall µs per call).

    Host: the time the calling thread spends issuing the calls (measured before synchronizing, so
    the GPU work overlaps it; ``calls`` launches stay well inside CUDA's launch queue). Wall: from
    the first call to the end of the last one's GPU work. Where wall exceeds the CUDA-graph device
    time, the difference is host time the GPU waited for.
    """
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def copy_bandwidth(n_bytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * n_bytes / ms / 1e6
