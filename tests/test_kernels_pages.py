"""Pages for the varlen prefill path: ``write_record_pages`` / ``write_row_pages`` and ``PagedKV.read_pages``.

The kernels (``kvarn/kernels/pages.py``) run under the Triton interpreter on tiny shapes when no
CUDA device is present (the ``interpreter`` tests), and compiled at full size on a GPU (``gpu``).
What is held:

- Model-frame page values against the reference (:mod:`kvarn.reference.pages`): equal, or one ulp
  of the page dtype apart (the fp32 rotation back sums in another order, and a record's fp32
  values go through a hi/lo tf32 split), or, for an element far smaller than its row, within
  ``PAGE_ROW_ABS`` of the row's largest value (cancellation in those sums); at most
  ``PAGE_ULP_FRACTION`` of the elements differ by more than that slack. Within ``read_pages`` the step's
  rows may also carry the one-pool-ulp differences between the kernel's and the reference's ``prepare``.
- The step's own tokens take exactly the pool form ``write_tail`` stores: the kernel's pages from
  model-frame rows equal, bit for bit, its pages from the pool that the ``write_tail`` kernel wrote.
- ``read_pages`` on the reference path gives the bits of the implementation it replaced (the glue of
  ``decode_records``, ``from_pool(prepare(...))``, ``@ H`` and ``index_copy``, kept here as the oracle),
  and writes every page row exactly once.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
from kernel_oracle import make_kv

from kvarn import ops
from kvarn import reference as R
from kvarn.config import KVarNConfig
from kvarn.paged import PagedKV, PageLayout, TilePlanner, split_prefill

PAGE_ULP_FRACTION = 0.01
"""Most elements of a page that may differ from the reference by one ulp (beyond ``PAGE_ROW_ABS``).
fp32 sum-order differences (~1e-7 relative) cross an fp16 rounding boundary for ~1e-3 of values, bf16 ~1e-4."""
PAGE_ROW_ABS = 2.0**-16
"""Of a row's largest ``|value|``: the absolute slack of an element much smaller than its row. Two fp32 sums
of ``D <= 256`` terms in different orders (and a record's hi/lo split, ``2^-22`` relative per term) differ
by at most ``~D * 2^-24`` of the row's scale in the worst case; 2^-16 bounds D = 256 with room."""

KERNEL_MODULES = (
    "kvarn.kernels._common",
    "kvarn.kernels.launch_rules",
    "kvarn.kernels.encode",
    "kvarn.kernels.tail",
    "kvarn.kernels.store",
    "kvarn.kernels.dequant",
    "kvarn.kernels.pages",
)


def _kernels():
    """``kvarn.kernels.pages`` and ``store``: interpreted on the CPU (reloaded if first imported compiled)."""
    if importlib.util.find_spec("triton") is None:
        return None, None
    mods = {n: importlib.import_module(n) for n in KERNEL_MODULES}
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret and type(mods["kvarn.kernels.pages"]._row_pages_kernel).__name__ != "InterpretedFunction":
        mods = {n: importlib.reload(sys.modules[n]) for n in KERNEL_MODULES}
    return mods["kvarn.kernels.pages"], mods["kvarn.kernels.store"]


pages_k, store_k = _kernels()
INTERPRETED = pages_k is not None and type(pages_k._row_pages_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="kernels compiled here (CUDA present: see the gpu tests)"
)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 pages past 65504
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def check_pages(got: torch.Tensor, want: torch.Tensor, row_abs: float = PAGE_ROW_ABS) -> float:
    """Assert kernel pages ``got`` match reference pages ``want`` (``[..., D]``); returns the fraction that differ
    by more than ``row_abs`` of their row's largest ``|value|``."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double().cpu(), want.double().cpu()
    assert not g.isnan().any(), "page values hold NaN (an unwritten element?)"
    big = ~torch.isfinite(w)  # past the page dtype's range (saturated inputs): inf on both sides
    assert torch.equal(g[big], w[big]), "page values past the dtype's range differ"
    scale = w.abs().amax(-1, keepdim=True)  # a row past the range (inf) is held to its infs only
    g, w = g.masked_fill(big, 0), w.masked_fill(big, 0)
    err = (g - w).abs()
    info = torch.finfo(want.dtype)
    ulp = info.eps * w.abs().clamp_min(info.tiny)  # one ulp at |want| (at most; eps is the ulp at 1)
    slack = err <= row_abs * scale
    assert bool(((err <= 1.01 * ulp) | slack).all()), (
        f"page values differ by {float((err - ulp).max()):.3g} past one ulp"
    )
    frac = float((~slack).float().mean())  # one-ulp flips (not explained by a row's cancellation)
    assert frac <= PAGE_ULP_FRACTION, f"{frac:.4f} of page values differ"
    return frac


def _records(cfg: KVarNConfig, n_blocks: int, hkv: int, dtype: torch.dtype, seed: int, device=DEV) -> torch.Tensor:
    """``[n_blocks, Hkv, record_bytes]`` records of random model-frame tiles (block 0 left zero)."""
    k, v = make_kv(n_blocks - 1, cfg.group_size, hkv, cfg.head_dim, dtype, seed)
    cache = torch.zeros(n_blocks, hkv, cfg.record_bytes, dtype=torch.uint8, device=device)
    blocks = torch.arange(1, n_blocks, device=device)
    src = torch.ones_like(blocks) if cfg.seq_smooth else None  # one sequence
    R.store_tiles(k.to(device), v.to(device), blocks, cache, cfg, src)
    return cache


def _pool(slots: int, cfg: KVarNConfig, hkv: int, dtype: torch.dtype, seed: int, device=DEV) -> tuple:
    """Pool-form K/V ``[slots, G, Hkv, D]`` of random model-frame tokens (written by the reference)."""
    k, v = make_kv(slots, cfg.group_size, hkv, cfg.head_dim, torch.float32, seed)
    tail_k = torch.zeros(slots, cfg.group_size, hkv, cfg.head_dim, dtype=dtype, device=device)
    tail_v = torch.zeros_like(tail_k)
    n = slots * cfg.group_size
    R.write_tail(
        k.reshape(n, hkv, -1).to(device),
        v.reshape(n, hkv, -1).to(device),
        tail_k,
        tail_v,
        torch.arange(n, device=device),
        cfg,
    )
    return tail_k, tail_v


def _poisoned_pages(n: int, cfg: KVarNConfig, hkv: int, dtype: torch.dtype, device=DEV) -> list[torch.Tensor]:
    return [torch.full((n, cfg.group_size, hkv, cfg.head_dim), float("nan"), dtype=dtype, device=device) for _ in "kv"]


def _cfg(case: str, d: int) -> KVarNConfig:
    over = {"smooth": {"smooth_keys": True}, "norotate": {"rotate": False}}.get(case, {})
    name = {"seq_smooth": "kvarn_k4v2_g64_ks", "g128": "kvarn_k2v2_g128"}.get(case, "kvarn_k4v2_g64")
    return KVarNConfig.from_preset(name, head_dim=d, **over)


def _record_case(cfg, page_dtype, pool_dtype, sink: bool, impl_fn, seed: int = 1, device=DEV):
    """Record pages of a 2-row block table written by ``impl_fn``: 5 entries into 6 pages, the last left alone."""
    hkv = 2
    cache = _records(cfg, 6, hkv, page_dtype, seed, device)
    block_table = torch.tensor([[3, 1, 5, 0], [2, 4, 0, 0]], dtype=torch.int32, device=device)
    rows = torch.tensor([0, 0, 0, 1, 1], device=device)
    tiles = torch.tensor([0, 1, 2, 0, 1], device=device)
    tail_k, tail_v = _pool(3, cfg, hkv, pool_dtype, seed + 1, device)
    sinks = torch.tensor([2, -1], dtype=torch.int32, device=device) if sink else None
    pages = _poisoned_pages(6, cfg, hkv, page_dtype, device)
    impl_fn(cache, block_table, rows, tiles, *pages, cfg, tail_k, tail_v, sinks)
    return pages


RECORD_CASES = [
    ("plain", 64, torch.float16, torch.float16),
    ("plain", 64, torch.bfloat16, torch.float16),
    ("plain", 128, torch.bfloat16, torch.bfloat16),
    ("g128", 128, torch.float16, torch.bfloat16),
    ("plain", 256, torch.bfloat16, torch.float16),
    ("smooth", 64, torch.float16, torch.float16),
    ("seq_smooth", 128, torch.bfloat16, torch.bfloat16),
    ("norotate", 64, torch.float16, torch.float16),
]


@pytest.mark.interpreter
@needs_interpreter
@pytest.mark.parametrize("sink", [False, True], ids=["records", "sink"])
@pytest.mark.parametrize("case,d,page_dtype,pool_dtype", RECORD_CASES)
def test_record_pages_match_reference(case, d, page_dtype, pool_dtype, sink):
    cfg = _cfg(case, d)
    got = _record_case(cfg, page_dtype, pool_dtype, sink, pages_k.write_record_pages)
    want = _record_case(cfg, page_dtype, pool_dtype, sink, R.write_record_pages)
    for g, w in zip(got, want, strict=True):
        assert g[5].isnan().all() and w[5].isnan().all(), "a page past the entries was written"
        if case == "norotate":
            assert torch.equal(g[:5], w[:5])
        check_pages(g[:5], w[:5])
    if sink:  # entry 0 (row 0, tile 0) came from sink slot 2; entry 3 (row 1, no sink) from its record
        tail_k, _ = _pool(3, cfg, 2, pool_dtype, 2)
        check_pages(got[0][0], R.rows_to_pages(tail_k[2], cfg, page_dtype, from_model=False))


def _row_case(cfg, page_dtype, pool_dtype, impl_fn, from_model: bool, seed: int = 3):
    """Rows into 3 poisoned pages of ``G`` rows: 7 sources (one ``-1``: zeros) at scattered rows."""
    hkv, g = 2, cfg.group_size
    gen = torch.Generator().manual_seed(seed)
    dst = torch.randperm(3 * g, generator=gen)[:7]
    if from_model:
        x = torch.randn(9, 2 * hkv, cfg.head_dim, generator=gen) * 3
        x[2, 0, 5], x[4, 1, 0], x[6, 3, 1] = float("nan"), float("inf"), -3e38  # prepare's input policy
        k, v = x[:, :hkv].to(page_dtype), x[:, hkv:].to(page_dtype)
        rows, slots = torch.tensor([4, 0, 8, -1, 2, 6, 3]), None
    else:
        k, v = _pool(4, cfg, hkv, pool_dtype, seed)
        rows, slots = torch.tensor([0, g + 5, 2 * g - 1, -1, 3, g, 2 * g + 1]), torch.tensor([3, 0, 2])
    pages = _poisoned_pages(3, cfg, hkv, page_dtype, "cpu")
    impl_fn(k, v, rows, dst, *pages, cfg, from_model, slots, pool_dtype if from_model else None)
    return pages, dst, (k, v)


ROW_CASES = [
    ("plain", 64, torch.float16, torch.float16),
    ("plain", 64, torch.bfloat16, torch.bfloat16),
    ("plain", 128, torch.bfloat16, torch.float16),
    ("plain", 128, torch.float16, torch.bfloat16),
    ("plain", 256, torch.bfloat16, torch.float16),
    ("norotate", 64, torch.float16, torch.float16),
]


@pytest.mark.interpreter
@needs_interpreter
@pytest.mark.parametrize("from_model", [True, False], ids=["model", "pool"])
@pytest.mark.parametrize("case,d,page_dtype,pool_dtype", ROW_CASES)
def test_row_pages_match_reference(case, d, page_dtype, pool_dtype, from_model):
    cfg = _cfg(case, d)
    got, dst, _ = _row_case(cfg, page_dtype, pool_dtype, pages_k.write_row_pages, from_model)
    want, _, _ = _row_case(cfg, page_dtype, pool_dtype, R.write_row_pages, from_model)
    for g, w in zip(got, want, strict=True):
        flat_g, flat_w = g.view(-1, *g.shape[2:]), w.view(-1, *w.shape[2:])
        assert torch.equal(flat_g.isnan().all(-1).all(-1), flat_w.isnan().all(-1).all(-1)), "wrote other rows"
        assert (flat_g[dst[3]] == 0).all(), "a -1 source row must write zeros"
        check_pages(flat_g[dst], flat_w[dst])


@pytest.mark.interpreter
@needs_interpreter
@pytest.mark.parametrize("case,d,page_dtype,pool_dtype", ROW_CASES)
def test_step_rows_take_the_pool_form_write_tail_stores(case, d, page_dtype, pool_dtype):
    """Pages from model-frame rows == pages from the pool the ``write_tail`` kernel wrote, bit for bit."""
    _step_rows_bit_exact(_cfg(case, d), page_dtype, pool_dtype, "cpu")


def _step_rows_bit_exact(cfg, page_dtype, pool_dtype, device, tokens: int = 70, hkv: int = 2):
    g = cfg.group_size
    gen = torch.Generator().manual_seed(tokens + cfg.head_dim)
    x = torch.randn(tokens, 2 * hkv, cfg.head_dim, generator=gen) * torch.rand(tokens, 1, 1, generator=gen) * 40
    x[3, 0, 7], x[5, 1, 2] = float("nan"), float("-inf")
    k, v = (t.to(page_dtype).to(device) for t in (x[:, :hkv], x[:, hkv:]))
    slots = -(-tokens // g)
    tail_k = torch.zeros(slots, g, hkv, cfg.head_dim, dtype=pool_dtype, device=device)
    tail_v = torch.zeros_like(tail_k)
    mapping = torch.randperm(slots * g, generator=gen)[:tokens].to(device)  # token i -> pool row mapping[i]
    store_k.write_tail(k, v, tail_k, tail_v, mapping, cfg)
    dst = torch.randperm(slots * g, generator=gen)[:tokens].to(device)
    from_model = _poisoned_pages(slots, cfg, hkv, page_dtype, device)
    from_pool = _poisoned_pages(slots, cfg, hkv, page_dtype, device)
    rows = torch.arange(tokens, device=device)
    pages_k.write_row_pages(k, v, rows, dst, *from_model, cfg, True, None, pool_dtype)
    pages_k.write_row_pages(tail_k, tail_v, mapping, dst, *from_pool, cfg, False)
    for a, b in zip(from_model, from_pool, strict=True):
        assert torch.equal(a.view(-1, hkv, cfg.head_dim)[dst], b.view(-1, hkv, cfg.head_dim)[dst])
    if not cfg.rotate:  # no rotation back: the pool form itself, cast
        want = R.from_pool(tail_k.view(-1, hkv, cfg.head_dim)[mapping]).to(page_dtype)
        assert torch.equal(from_model[0].view(-1, hkv, cfg.head_dim)[dst], want)


# read_pages: the whole read-back of a step with prompt chunks


def _read_pages_before(kv: PagedKV, plan, block_table, layout: PageLayout, key, value, dtype) -> tuple:
    """``PagedKV.read_pages`` as it was before the page kernels (the oracle of the reference path, bit for bit)."""
    cfg, g = kv.cfg, kv.cfg.group_size
    heads, d = kv.cache.shape[1], cfg.head_dim
    dev = kv.cache.device
    h = ops.hadamard_matrix(d, dev) if cfg.rotate else None

    def model_frame(x):
        return x if h is None else x @ h

    ix = layout.on(dev)
    pages = [torch.zeros(layout.num_pages, g, heads, d, dtype=dtype, device=dev) for _ in range(2)]
    n_rec = ix["rec_row"].shape[0]
    if n_rec:
        blocks = block_table[ix["rec_row"], ix["rec_tile"]].long()
        tiles = ops.decode_records(kv.cache[blocks], cfg, impl="reference")
        for page, x in zip(pages, tiles, strict=True):
            page[:n_rec] = model_frame(x).transpose(1, 2).to(dtype)
        if plan.sink_slots is not None and layout.sink_pages.size:
            sinks = plan.sink_slots[ix["sink_rows"]].long()
            for page, pool in zip(pages, (kv.tail_k, kv.tail_v), strict=True):
                held = ops.from_pool(pool.index_select(0, sinks.clamp(min=0)))
                keep = (sinks >= 0).view(-1, 1, 1, 1)
                page[ix["sink_pages"]] = torch.where(keep, model_frame(held).to(dtype), page[ix["sink_pages"]])
    if ix["held_dst"].shape[0]:
        slots = plan.head_slots[ix["held_rows"]].long()
        for page, pool in zip(pages, (kv.tail_k, kv.tail_v), strict=True):
            held = pool.index_select(0, slots).reshape(-1, heads, d).index_select(0, ix["held_src"])
            page.view(-1, heads, d).index_copy_(0, ix["held_dst"], model_frame(ops.from_pool(held)).to(dtype))
    tokens = ix["step_rows"] >= 0  # the step's tokens (the rest: padding rows)
    for page, x in zip(pages, (key, value), strict=True):
        new = ops.from_pool(ops.prepare(x[ix["step_rows"][tokens]], kv.tail_k.dtype, cfg.rotate, impl="reference"))
        page.view(-1, heads, d).index_copy_(0, ix["step_dst"][tokens], model_frame(new).to(dtype))
    return pages[0], pages[1]


def _mixed_steps(g: int) -> list:
    """Step 1: requests of 100, 70, 64 and 2G + 30 tokens. Step 2: request 0 continues inside a tile (held
    rows from its head slot), request 1 decodes, request 2 continues from a tile boundary, request 3 adds a
    chunk ending one past a tile boundary."""
    return [([100, 70, 64, 2 * g + 30], [100, 70, 64, 2 * g + 30]), ([90, 1, 130, g + 1], [190, 71, 194, 3 * g + 31])]


def _prefill_step(cfg, pool_dtype, model_dtype, sink: bool, device=DEV, hkv: int = 2, steps=None, blocks: int = 10):
    """A ``PagedKV`` after the first of ``steps`` (``(new tokens, lengths after)`` per request; default
    :func:`_mixed_steps`), and the last step's plan, block table, :class:`PageLayout` (requests of at least
    64 queries) and K/V. With ``sink``, the first tiles come from their sink slots."""
    g = cfg.group_size
    steps = steps or _mixed_steps(g)
    batch = len(steps[0][0])
    blocks = max(blocks, -(-max(steps[-1][1]) // g) + 1)
    n_sink = batch if sink else 0
    planner = TilePlanner(2 * batch, g, num_sink_slots=n_sink)
    kv = PagedKV.allocate(
        cfg, batch * blocks, hkv, 2 * batch, pool_dtype, device, num_sink_slots=n_sink, impl="reference"
    )
    host_table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)  # the planner reads it on the host
    gen = torch.Generator().manual_seed(7)
    for i, (news, lens) in enumerate(steps):
        qsl = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
        step = planner.plan(qsl, torch.tensor(lens), host_table, int(qsl[-1]), device=device)
        k, v = (torch.randn(int(qsl[-1]), hkv, cfg.head_dim, generator=gen).to(model_dtype).to(device) for _ in "kv")
        kv.store(step, k, v)
        if i < len(steps) - 1:  # the last step's late tail goes in after its attention (read_pages)
            kv.write_late_tail(step, k, v)
    split = split_prefill(qsl.numpy(), np.array(steps[-1][1]), device, min_queries=64)
    return kv, step, host_table.to(device), PageLayout.of(split.rows, g), k, v


@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.float16, torch.bfloat16)])
def test_read_pages_reference_path_is_the_old_glue_bit_for_bit(dtype, pool_dtype, sink):
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    kv, step, table, layout, k, v = _prefill_step(cfg, pool_dtype, dtype, sink, "cpu")
    chunks = kv.read_pages(step, table, layout, k, v, dtype)
    want_k, want_v = _read_pages_before(kv, step, table, layout, k, v, dtype)
    assert torch.equal(chunks.k, want_k) and torch.equal(chunks.v, want_v)
    assert layout.num_pages == chunks.k.shape[0] and (not sink or layout.sink_pages.size)


def test_read_pages_writes_every_page_row_once():
    """Record pages whole; of the query tiles' pages, head-slot rows, step rows and zero padding, disjoint."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    kv, step, table, layout, k, v = _prefill_step(cfg, torch.float16, torch.float16, True, "cpu")
    kv.read_pages(step, table, layout, k, v, torch.float16)
    g, ix = cfg.group_size, layout.on("cpu")
    n_rec = ix["rec_row"].shape[0]
    written = torch.cat([torch.arange(n_rec * g), ix["held_dst"], ix["step_dst"]])
    assert written.shape[0] == layout.num_pages * g and torch.equal(
        written.sort().values, torch.arange(written.shape[0])
    )
    pad = ix["step_dst"][ix["step_rows"] < 0]
    for s, used in enumerate(layout.seqused_k):  # the padding: each query tile's page past its keys
        page = int(layout.arrays["block_table"][s, (used - 1) // g])
        past = torch.arange(page * g + used - (used - 1) // g * g, (page + 1) * g)
        assert torch.isin(past, pad).all()
    assert pad.numel() == sum(-u % g for u in layout.seqused_k)


def _with_kernels(monkeypatch):
    """``impl="triton"`` reaches this module's (interpreted) page kernels."""
    table = {"write_record_pages": pages_k.write_record_pages, "write_row_pages": pages_k.write_row_pages}
    monkeypatch.setattr(ops, "_triton_ops", lambda: table)


@pytest.mark.interpreter
@needs_interpreter
@pytest.mark.parametrize(
    "preset,d,dtype,pool_dtype,sink",
    [
        ("kvarn_k4v2_g64", 64, torch.float16, torch.float16, True),
        ("kvarn_k4v2_g64", 128, torch.bfloat16, torch.bfloat16, False),
        ("kvarn_k4v2_g64_ks", 64, torch.bfloat16, torch.float16, True),
    ],
)
def test_read_pages_kernels_match_the_reference(monkeypatch, preset, d, dtype, pool_dtype, sink):
    _with_kernels(monkeypatch)
    _read_pages_both(KVarNConfig.from_preset(preset, head_dim=d), dtype, pool_dtype, sink, "cpu")


def _read_pages_both(cfg, dtype, pool_dtype, sink, device, hkv=2, steps=None, blocks=10):
    kv, step, table, layout, k, v = _prefill_step(cfg, pool_dtype, dtype, sink, device, hkv, steps, blocks)
    want = kv.read_pages(step, table, layout, k, v, dtype)
    kv.impl = "triton"
    got = kv.read_pages(step, table, layout, k, v, dtype)
    ix = layout.on(device)
    step_rows = ix["step_dst"][ix["step_rows"] >= 0]
    other = torch.ones(layout.num_pages * cfg.group_size, dtype=torch.bool, device=device)
    other[step_rows] = False
    for a, b in ((got.k, want.k), (got.v, want.v)):
        a, b = a.view(-1, hkv, cfg.head_dim), b.view(-1, hkv, cfg.head_dim)
        check_pages(a[other], b[other])  # records, sinks, head-slot rows, padding
        # The step's rows: the kernel's pool form is write_tail's (bit for bit, _step_rows_bit_exact), which may
        # hold an element one ulp of the pool dtype off the reference's prepare (check_prepared); rotated back,
        # that moves every element of the row by up to eps(pool) times the row's scale.
        check_pages(a[step_rows], b[step_rows], 2 * torch.finfo(pool_dtype).eps)
        assert (a[ix["step_dst"][ix["step_rows"] < 0]] == 0).all()
    assert got.cu_q == want.cu_q and got.seqused_k == want.seqused_k


GPU_CASES = [
    ("kvarn_k4v2_g128", 128, torch.bfloat16, torch.bfloat16, True),
    ("kvarn_k4v2_g128", 128, torch.float16, torch.float16, False),
    ("kvarn_k4v2_g64", 64, torch.bfloat16, torch.float16, True),
    ("kvarn_k2v2_g128", 256, torch.bfloat16, torch.bfloat16, False),
    ("kvarn_k4v2_g128_ks", 128, torch.bfloat16, torch.bfloat16, True),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("preset,d,dtype,pool_dtype,sink", GPU_CASES)
def test_read_pages_gpu(preset, d, dtype, pool_dtype, sink):
    """Compiled kernels, 8 KV heads: read_pages against its reference path on the device (the mixed step,
    then one 8K-token prompt chunk continuing inside a tile), and the step's rows bit for bit against
    ``write_tail``'s pool (3000 tokens)."""
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    _read_pages_both(cfg, dtype, pool_dtype, sink, "cuda", hkv=8)
    g = cfg.group_size
    long = [([g + 5], [g + 5]), ([8192], [g + 5 + 8192])]
    _read_pages_both(cfg, dtype, pool_dtype, sink, "cuda", hkv=8, steps=long, blocks=80)
    _step_rows_bit_exact(cfg, dtype, pool_dtype, "cuda", tokens=3000, hkv=8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case,d,page_dtype,pool_dtype", RECORD_CASES)
def test_record_pages_gpu(case, d, page_dtype, pool_dtype):
    cfg = _cfg(case, d)
    got = _record_case(cfg, page_dtype, pool_dtype, True, pages_k.write_record_pages, device="cuda")
    want = _record_case(cfg, page_dtype, pool_dtype, True, R.write_record_pages, device="cuda")
    for g, w in zip(got, want, strict=True):
        assert g[5].isnan().all()
        check_pages(g[:5], w[:5])
