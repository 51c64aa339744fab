"""Launch plans (``kvarn.kernels._plan``) on the CPU: the launcher recorded once, replayed with new inputs.

The kernels are replaced by fakes that note their arguments, so these tests check the bookkeeping
(which tensor goes where, what is allocated anew, when a call is not planned); that a replay
launches the real kernels to the same result is ``test_kernels_gpu.py::test_launch_plans_gpu``.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest
import torch

pytest.importorskip("triton")

from kernel_oracle import attention_args, build_cache

from kvarn.config import KVarNConfig
from kvarn.kernels._plan import Plan


class FakeCompiled:
    """A compiled kernel whose ``run`` notes what it was launched with (Triton's launcher call)."""

    function = "fn"
    packed_metadata = "meta"

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def run(self, g0, g1, g2, stream, function, meta, launch_metadata, enter, exit_, *args):
        assert (function, meta, launch_metadata, enter, exit_) == ("fn", "meta", None, None, None)
        self.log.append(("replay", self.name, (g0, g1, g2), stream, list(args)))


class FakeKernel:
    """A JIT kernel: ``kernel[grid](*args, **kwargs)`` binds like Triton and notes the bound arguments."""

    def __init__(self, real, log: list):
        # the parameters of the kernel's Python function (a JIT or, under the interpreter, an interpreted one)
        sig = inspect.signature(real.fn).parameters.values()
        self.params = [types.SimpleNamespace(name=p.name, default=p.default) for p in sig]
        self.name = real.fn.__name__
        self.log = log
        self.compiled = FakeCompiled(self.name, log)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            rest = [kwargs[p.name] if p.name in kwargs else p.default for p in self.params[len(args) :]]
            grid3 = (*grid, 1, 1)[:3]
            self.log.append(("launch", self.name, grid3, None, list(args) + rest))
            return self.compiled

        return launch


@pytest.fixture
def fakes(monkeypatch):
    """The attention module with fake kernels and plans switched on as on a GPU (stream 7)."""
    attention = importlib.import_module("kvarn.kernels.attention")
    plan = importlib.import_module("kvarn.kernels._plan")
    log: list = []
    for name in ("_attn_kernel", "_prologue_kernel", "_epilogue_kernel"):
        monkeypatch.setattr(attention, name, FakeKernel(getattr(attention, name), log))
    store = importlib.import_module("kvarn.kernels.store")  # write_tail: a multi-query call's step K/V
    monkeypatch.setattr(store, "_prepare_kernel", FakeKernel(store._prepare_kernel, log))
    monkeypatch.setattr(store, "WRITE_TAIL_PLANS", plan.Planner())
    stream = {"id": 7}
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda dev: stream["id"])
    monkeypatch.setattr(plan, "_driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(plan, "_replayable", lambda: True)
    monkeypatch.setattr(attention, "PLANS", plan.Planner())
    return attention, log, stream


def _case(cfg: KVarNConfig, seed: int, batch: int = 3, multi: bool = False):
    """Decode arguments, or (``multi``) a multi-query step of 2 queries a sequence with its ``key, value``."""
    state = build_cache(cfg, [cfg.group_size * 2 + 5 + i for i in range(batch)], 2, torch.float16, seed)
    n = 2 if multi else 1
    q = torch.randn(batch * n, 4, cfg.head_dim, generator=torch.Generator().manual_seed(seed)).half()
    qsl = torch.arange(0, batch * n + 1, n, dtype=torch.int32) if multi else None
    return attention_args(state, q, cfg, qsl)


def _same_launch(replayed, launched, inputs, held) -> None:
    """A replay's arguments against the launcher's for the same inputs: a tensor is passed as its address (an
    input's own; an allocation's or the merge counters' that of a tensor in ``held`` of the same layout),
    the rest equal."""
    assert replayed[1:3] == launched[1:3]
    for a, b in zip(replayed[4], launched[4], strict=True):
        if isinstance(b, torch.Tensor):
            assert type(a) is int
            if any(b is t for t in inputs):
                assert a == b.data_ptr()
            else:
                layout = (b.shape, b.dtype, b.stride())
                assert any(t.data_ptr() == a and (t.shape, t.dtype, t.stride()) == layout for t in held)
        else:
            assert a == b


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi_query_with_kv"])
@pytest.mark.parametrize("knobs", [{}, {"fuse_query": False, "fuse_merge": False, "num_splits": 2}])
def test_a_replay_launches_what_the_launcher_would(fakes, knobs, multi):
    attention, log, _ = fakes
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    attention.paged_attention(*_case(cfg, 0, multi=multi), **knobs)  # a shape's first call: only its key noted
    assert len(attention.PLANS.plans) == 1 and not isinstance(next(iter(attention.PLANS.plans.values())), Plan)
    log.clear()
    first = attention.paged_attention(*_case(cfg, 1, multi=multi), **knobs)  # the second: recorded
    recorded = [e for e in log if e[0] == "launch"]
    assert len(recorded) >= 1 + multi and len(attention.PLANS.plans) == 1  # multi: write_tail's launch too
    assert all(isinstance(p, Plan) for p in attention.PLANS.plans.values())
    args = _case(cfg, 2, multi=multi)
    log.clear()
    out = attention.paged_attention(*args, **knobs)
    replayed = list(log)
    assert replayed and all(e[0] == "replay" and e[3] == 7 for e in replayed)
    (plan,) = attention.PLANS.plans.values()
    held = [out, *plan.keep, *(t for t in plan.workspaces[7][0] if t is not None)]
    attention.PLANS.enabled = False
    log.clear()
    want = attention.paged_attention(*args, **knobs)
    launched = list(log)
    assert len(replayed) == len(launched) == len(recorded)
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    for r, w in zip(replayed, launched, strict=True):
        _same_launch(r, w, inputs, held)
    assert out.shape == want.shape and out.dtype == want.dtype and out is not first


def test_workspaces_are_reused_per_stream_and_the_output_is_new(fakes):
    attention, log, stream = fakes
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    knobs = {"fuse_query": False, "fuse_merge": False, "num_splits": 2}  # prologue, attention, epilogue
    for seed in (0, 1):  # key noted, then recorded
        attention.paged_attention(*_case(cfg, seed), **knobs)
    calls, outs, allocs = [], [], []
    for s in (7, 7, 8):
        stream["id"] = s
        log.clear()
        calls.append(_case(cfg, 2))  # kept alive: ids below stay unique
        outs.append(attention.paged_attention(*calls[-1], **knobs))
        inputs = {a.data_ptr() for a in calls[-1] if isinstance(a, torch.Tensor)}
        (plan,) = attention.PLANS.plans.values()
        pointers = []  # the tensor arguments of each launch (the plan's positions count the launch's own first)
        for e, (_, template, inp, alloc) in zip(log, plan.launches, strict=True):
            first = len(template) - len(e[4])
            pointers += [e[4][pos - first] for pos, _ in inp + alloc]
        allocs.append({a for a in pointers if a not in inputs})
    addrs = [o.data_ptr() for o in outs]
    assert len(set(addrs)) == 3 and all(o in a for o, a in zip(addrs, allocs, strict=True))
    reused = allocs[0] & allocs[1]  # the prologue's queries, the partials, the running max and sum
    assert len(reused) >= 3 and addrs[0] not in reused and addrs[1] not in reused
    assert not allocs[2] & reused  # another stream: its own workspaces


def test_calls_that_are_not_planned_run_the_launcher(fakes):
    attention, log, _ = fakes
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    args = list(_case(cfg, 1))
    # the query copied (last stride not 1): the launcher makes a tensor no plan can trace
    q = args[0]
    args[0] = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype)[..., ::2].copy_(q)
    for _ in range(3):
        log.clear()
        attention.paged_attention(*args)
        assert log and all(e[0] == "launch" for e in log)
    assert list(attention.PLANS.plans.values()) == [None]
    # one tensor passed as two inputs: recorded as no plan; a multi-query call without key, value: never keyed
    args = list(_case(cfg, 1))
    args[9] = args[6]  # sink_slots is tail_slots
    same = _case(cfg, 3)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)  # queries inside one tile each: checked on the host
    multi = attention_args(build_cache(cfg, [300, 200], 2, torch.float16, 4), torch.randn(5, 4, 64).half(), cfg, qsl)
    multi = (*multi[:11], None, None)
    for call in (args, multi):
        for _ in range(3):
            log.clear()
            attention.paged_attention(*call)
            assert log and all(e[0] == "launch" for e in log)
    assert list(attention.PLANS.plans.values()) == [None, None]
    log.clear()
    for _ in range(3):
        attention.paged_attention(*same, empty=torch.empty)  # the default allocator: planned
    attention.paged_attention(*same, empty=lambda *s, **k: torch.empty(*s, **k))  # another one: not
    assert [e[0] for e in log] == ["launch", "launch", "replay", "launch"]


def test_a_new_alignment_or_layout_is_a_new_plan(fakes):
    attention, log, _ = fakes
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    args = list(_case(cfg, 1))
    for _ in range(2):
        attention.paged_attention(*args)
    q = args[0]
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    args[0] = flat[1:].view(q.shape).copy_(q)  # 2 bytes past a 16-byte boundary
    log.clear()
    attention.paged_attention(*args)
    assert log[0][0] == "launch" and len(attention.PLANS.plans) == 2
    out = torch.empty_like(q)
    for seed in (2, 4):
        attention.paged_attention(*_case(cfg, seed), out=out)
    log.clear()
    got = attention.paged_attention(*_case(cfg, 3), out=out)
    assert got is out and log[0][0] == "replay" and len(attention.PLANS.plans) == 3
    q = args[0]  # the misaligned query; an out= of the same layout and alignment gets a plan
    other = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    for _ in range(3):
        attention.paged_attention(*args, out=other)
    log.clear()
    with pytest.raises(ValueError, match="share memory"):  # the same key: checked before any replay
        attention.paged_attention(*args, out=q)
    assert not log


def test_replays_wait_while_a_triton_launch_hook_calls_anything():
    """Triton 3.6+ keeps its launch hooks as chains that are never ``None``: an empty one is idle."""
    plan = importlib.import_module("kvarn.kernels._plan")
    from triton import knobs

    chain = type(knobs.runtime.launch_enter_hook)()
    assert plan._idle(None) and plan._idle(chain) and plan._idle(knobs.runtime.launch_enter_hook)
    chain.add(print)
    assert not plan._idle(chain) and not plan._idle(print)


def test_write_tail_replays_its_plan(fakes):
    """``write_tail`` on its own (``KVarNCache``'s steps): planned, inputs traced; a strided ``k`` is copied
    by the launcher, so that shape is never replayed."""
    _, log, _ = fakes
    store = importlib.import_module("kvarn.kernels.store")
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    pool = torch.zeros(3, cfg.group_size, 2, 64, dtype=torch.float16)

    def call(k):
        v, mapping = torch.randn_like(k), torch.tensor([5, 130, -1], dtype=torch.int32)
        store.write_tail(k, v, pool, pool.clone(), mapping, cfg)
        return [k, v, mapping]

    for strided in (False, True):
        kinds, first = [], None
        for _ in range(3):
            log.clear()
            k = torch.randn(3, 2, 128 if strided else 64).half()
            inputs = call(k[..., ::2] if strided else k)
            kinds.append(log[0][0])
            first = first or log[0]
            if log[0][0] == "replay":
                args = log[0][4]
                assert args[0] == inputs[0].data_ptr() and args[1] == inputs[1].data_ptr()
                assert args[4] == inputs[2].data_ptr()
                assert args[5:] == first[4][5:]
        assert kinds == (["launch"] * 3 if strided else ["launch", "launch", "replay"])


def test_the_scratch_slot_list_is_a_view_of_one_growing_arange():
    """``_rows(n)``: ``arange(n)`` int32, a view of one buffer per device that grows (the old one kept alive)."""
    attention = importlib.import_module("kvarn.kernels.attention")
    cpu = torch.device("cpu")
    attention._aranges.pop(("cpu", 0), None)
    small = attention._rows(5, cpu)
    assert small.dtype == torch.int32 and torch.equal(small, torch.arange(5, dtype=torch.int32))
    base = attention._aranges[("cpu", 0)]
    assert small.data_ptr() == base.data_ptr() and base.numel() >= attention.MIN_COUNTERS
    big = attention._rows(base.numel() + 1, cpu)
    assert torch.equal(big, torch.arange(base.numel() + 1, dtype=torch.int32))
    assert attention._aranges[("cpu", 0)] is not base and any(t is base for t in attention._retired)


def test_plans_are_dropped_least_recently_used_first(monkeypatch):
    """Beyond ``MAX_PLANS`` keys the least recently used goes: a plan that keeps replaying survives any
    number of one-off shapes (vLLM's mixed batches), which a first-in-first-out drop would not."""
    plan = importlib.import_module("kvarn.kernels._plan")
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda dev: 7)
    monkeypatch.setattr(plan, "_driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(plan, "_replayable", lambda: True)
    monkeypatch.setattr(plan, "MAX_PLANS", 4)
    planner = plan.Planner()
    planner.plans[("hot", 0)] = types.SimpleNamespace(replay=lambda inputs, addrs, stream: "replayed")
    for i in range(10):
        assert planner.call(lambda: ("hot",), [], lambda empty: "ran") == "replayed"
        assert planner.call(lambda i=i: ("once", i), [], lambda empty: "ran") == "ran"
    assert ("hot", 0) in planner.plans and len(planner.plans) == 4
    assert list(planner.plans)[-1] == ("once", 9, 0)  # the newest key last, the oldest one-offs gone
