"""Sliding windows and learned sink logits through kvarn.ops and PagedKV.attend: the reference path equals
kvarn.reference.paged_attention called directly, and the kernels (under the Triton interpreter) agree with it.

Each step poisons what the window leaves unread (block-table entries before the first query's window point at
a block of 0xFF bytes, NaN scales; the sink slot is NaN once that window has left tile 0), so a path that
reads them, or ignores the window, returns NaN.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracle import attention_args, build_cache, check_attention

from kvarn import ops
from kvarn import reference as R
from kvarn.config import KVarNConfig
from kvarn.paged import PagedKV, TilePlanner

try:
    from interpreted import INTERPRETER_MARKS
except ImportError:  # no Triton: the kernel cases skip
    INTERPRETER_MARKS = [pytest.mark.interpreter, pytest.mark.skip(reason="Triton is not installed")]

WINDOW = 90
"""Keys a query sees: its edge falls inside a 64-token tile."""


def _logits(hq: int) -> torch.Tensor:
    return torch.randn(hq, generator=torch.Generator().manual_seed(7)) * 3


def test_ops_reference_passes_window_and_sink_logits():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    state = build_cache(cfg, [5, 70, 200, 257], 2, torch.float16, seed=4)
    query = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(4))
    args = attention_args(state, query, cfg, sink=True)
    z = _logits(4)
    want = R.paged_attention(*args, window=WINDOW, sink_logits=z)
    got = ops.paged_attention(*args, window=WINDOW, sink_logits=z, impl="reference")
    assert torch.equal(got, want)
    out = torch.full_like(query, float("nan"))
    assert ops.paged_attention(*args, window=WINDOW, sink_logits=z, out=out, impl="reference") is out
    assert torch.equal(out, want)
    plain = ops.paged_attention(*args, impl="reference")
    assert not torch.equal(ops.paged_attention(*args, window=WINDOW, impl="reference"), plain)
    assert not torch.equal(ops.paged_attention(*args, sink_logits=z, impl="reference"), plain)


def _poisoned_view(kv: PagedKV, table: torch.Tensor, first: int, sink_slots) -> torch.Tensor:
    """The block table ``attend`` gets when a step's first query is at ``first``: entries before its window's
    tile point at block 0 (unused, filled with 0xFF), and a sink slot that window has left is made NaN."""
    g = kv.cfg.group_size
    seen = max(0, first - WINDOW + 1) // g
    kv.cache[0] = 0xFF
    view = table.clone()
    view[:, :seen] = 0
    if seen > 0 and sink_slots is not None:
        kv.tail_k[sink_slots] = float("nan")
        kv.tail_v[sink_slots] = float("nan")
    return view


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=INTERPRETER_MARKS)])
@pytest.mark.parametrize("sink", [False, True], ids=["no_sink_slot", "sink_slot"])
def test_paged_kv_attends_within_the_window_with_sink_logits(impl, sink):
    """Prompt chunks (mid-tile starts, spanning tiles) and decode steps through TilePlanner and PagedKV: each
    step's output is the reference's on the same storage (bit for bit on the reference path)."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv, hq, d = cfg.group_size, 2, 4, 64
    gen = torch.Generator().manual_seed(11)
    length = 300
    k, v = (torch.randn(length, hkv, d, generator=gen).half() for _ in range(2))
    q = torch.randn(length, hq, d, generator=gen).half()
    z = _logits(hq)
    planner = TilePlanner(2, g, num_sink_slots=1 if sink else 0)
    kv = PagedKV.allocate(cfg, 8, hkv, 2, torch.float16, "cpu", num_sink_slots=1 if sink else 0, impl=impl)
    table = torch.arange(1, 9)[None]  # block 0 is the poison
    done = 0
    for n in [100, 70, 1, 1, 60, 68]:
        qsl, lens = torch.tensor([0, n]), torch.tensor([done + n])
        step = planner.plan(qsl, lens, table, n)
        kn, vn, qn = k[done : done + n], v[done : done + n], q[done : done + n]
        kv.store(step, kn, vn)
        view = _poisoned_view(kv, table, done, step.sink_slots)
        got = kv.attend(step, qn, view, lens, qsl, key=kn, value=vn, window=WINDOW, sink_logits=z)
        args = (qn, kv.cache, view, lens, kv.tail_k, kv.tail_v, step.head_slots, cfg, qsl, step.sink_slots)
        args += (None, kn, vn)
        if impl == "reference":
            assert torch.equal(got, R.paged_attention(*args, window=WINDOW, sink_logits=z)), n
        else:
            check_attention(got, args, window=WINDOW, sink_logits=z)
        kv.write_late_tail(step, kn, vn)
        done += n
