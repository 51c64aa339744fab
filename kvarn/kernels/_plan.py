"""Launch plans: an eager launcher's host work done once per call shape, then replayed.

A launcher (:func:`kvarn.kernels.attention.paged_attention`) checks its arguments, picks the
launch (split count, variant flags), allocates its workspaces and launches one to three Triton
kernels. Eagerly, the launcher's Python and Triton's argument binding cost several times the launch
itself (the tuning table of ``docs/internals/kernels.md`` has the figures). None of that depends on the
tensors' values: only on their shapes, strides, dtypes, devices and 16-byte alignment (what Triton
specializes on) and on the call's other arguments.

So the second call of a shape (the first only notes its key: vLLM's mixed batches change shape
nearly every step, and recording shapes that never come back would only add cost) runs the
launcher under a :class:`Recorder`, which notes every allocation the launcher makes through it
(:meth:`Recorder.empty`) and every kernel launch (the compiled kernel, the grid, all arguments in
the kernel's order). A :class:`Plan` built from that record traces each tensor argument to where
it came from: an input of the call (by identity), an allocation, or a buffer the launcher declared
long-lived (:func:`persistent`). Any other tensor (a copy or cast made on the way) makes the call
unplannable, and it keeps running the launcher. Later calls with the same key replay the plan: the
returned allocation is made anew, the other allocations (workspaces) are reused per CUDA stream
while small, and each compiled kernel is launched directly (``CompiledKernel.run``, the call
Triton itself makes after binding).

Replays are skipped (the launcher runs as usual) under CUDA-graph capture, under the Triton
interpreter (which returns no compiled kernel to replay), and while Triton's launch hooks call
anything (a profiler's). A launcher must only plan calls whose host decisions depend on the key
alone (no tensor value read back, e.g. a check of ``seq_lens``). Workspaces are reused in stream
order only: two calls of one shape running concurrently on one stream are impossible, on two
streams they get separate workspaces.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence

import torch

MAX_PLANS = 64
"""Keys kept per launcher, plans and shapes seen once (beyond it the least recently used is dropped: a plan
that replays stays while vLLM's mixed batches bring one-off shapes)."""
MAX_CACHED_WORKSPACE = 16 << 20
"""A plan reuses its workspaces per stream only while they hold at most this many bytes (else each call
allocates them, which costs little beside a launch that large)."""

_INPUT, _ALLOC, _PERSISTENT = range(3)
_UNSEEN, _SEEN_ONCE = object(), object()


class _Local(threading.local):
    recorder: Recorder | None = None


_local = _Local()

try:  # Triton's own hooks and stream lookup, as its launcher uses them (3.6 and 3.9 alike)
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - Triton without knobs: plans stay off
    _knobs = _driver = None


def recording() -> Recorder | None:
    """The recorder of the call being planned on this thread, or ``None``."""
    return _local.recorder


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, noted by the active :class:`Recorder` if any; returns what Triton does."""
    compiled = kernel[grid](*args, **kwargs)
    rec = recording()
    if rec is not None:
        rec.note_launch(kernel, compiled, grid, args, kwargs)
    return compiled


def persistent(t: torch.Tensor) -> torch.Tensor:
    """Declare ``t`` a buffer that outlives calls (a plan may hold it); returns ``t``."""
    rec = recording()
    if rec is not None:
        rec.persistent[id(t)] = t
    return t


class Recorder:
    """What one launcher call allocated and launched (see the module docstring)."""

    def __init__(self, inputs: Sequence[torch.Tensor | None]):
        self.inputs = {id(t): i for i, t in enumerate(inputs) if t is not None}
        self.n_inputs = sum(t is not None for t in inputs)
        self.allocs: list[tuple[tuple, torch.dtype, torch.device]] = []
        self.alloc_ids: dict[int, int] = {}
        self.keep: list[torch.Tensor] = []  # keeps the ids above unique while recording
        self.persistent: dict[int, torch.Tensor] = {}
        self.launches: list[tuple] = []

    def empty(self, *shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty(*shape, dtype=dtype, device=device)``, noted."""
        t = torch.empty(*shape, dtype=dtype, device=device)
        self.alloc_ids[id(t)] = len(self.allocs)
        self.allocs.append((tuple(shape), dtype, t.device))
        self.keep.append(t)
        return t

    def note_launch(self, kernel, compiled, grid: tuple, args: tuple, kwargs: dict) -> None:
        self.launches.append((kernel, compiled, tuple(grid), args, dict(kwargs)))

    def __enter__(self) -> Recorder:
        _local.recorder = self
        return self

    def __exit__(self, *exc) -> None:
        _local.recorder = None

    def plan(self, result: torch.Tensor | None) -> Plan | None:
        """The plan of this call, or ``None`` where it cannot be replayed (see the module docstring)."""
        if not self.launches or _driver is None or len(self.inputs) != self.n_inputs:
            return None  # nothing launched, or one tensor passed as two inputs
        launches = []
        for kernel, compiled, grid, args, kwargs in self.launches:
            if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                return None  # the interpreter, or a Triton whose compiled kernels launch otherwise
            params = kernel.params[len(args) :]
            bound = list(args) + [kwargs[p.name] if p.name in kwargs else p.default for p in params]
            holes = []
            for pos, a in enumerate(bound):
                if isinstance(a, torch.Tensor):
                    src = self._source(a)
                    if src is None:
                        return None
                    if src[0] == _PERSISTENT:  # its address from now on (the plan holds the tensor)
                        bound[pos] = a.data_ptr()
                    else:
                        holes.append((pos, *src))
                        bound[pos] = None
            grid3 = (*grid, 1, 1)[:3]
            launches.append((compiled, grid3, bound, holes))
        out = None if result is None else self._source(result)
        if result is not None and (out is None or out[0] == _PERSISTENT):
            return None
        return Plan(launches, self.allocs, out, list(self.persistent.values()))

    def _source(self, t: torch.Tensor) -> tuple[int, object] | None:
        i = self.inputs.get(id(t))
        if i is not None:
            return _INPUT, i
        i = self.alloc_ids.get(id(t))
        if i is not None:
            return _ALLOC, i
        if id(t) in self.persistent:
            return _PERSISTENT, t
        return None


class Plan:
    """A recorded call, replayed for new inputs of the same key (see the module docstring).

    Tensor arguments go to Triton's launcher as device addresses (``int``s): given a tensor, the
    launcher calls its ``data_ptr()`` and asks the driver whether that is a device address
    (``cuPointerGetAttribute``), for every tensor argument of every launch. A replay needs neither:
    its key holds every input's device, the inputs' addresses are read once with the key
    (:meth:`Planner.call`), and reused workspaces' addresses sit in per-stream argument lists.
    """

    def __init__(self, launches: list[tuple], allocs: list[tuple], out: tuple[int, object] | None, keep=()):
        self.allocs = allocs
        self.keep = keep  # the persistent buffers whose addresses the launches hold
        self.out = out  # None: the launcher returns nothing
        self.fresh = out[1] if out is not None and out[0] == _ALLOC else -1  # the returned allocation
        self.reuse = sum(math.prod(s) * dt.itemsize for s, dt, _ in allocs) <= MAX_CACHED_WORKSPACE
        # per launch: Triton's run, its arguments after the launch's own (grid, stream, function, metadata,
        # hooks), the input holes (position, input index), the allocation holes (position, allocation index)
        self.launches = []
        for compiled, grid, bound, holes in launches:
            head = (*grid, None, compiled.function, compiled.packed_metadata, None, None, None)
            args = [*head, *bound]
            inp = [(len(head) + pos, src) for pos, kind, src in holes if kind == _INPUT]
            alloc = [(len(head) + pos, src) for pos, kind, src in holes if kind == _ALLOC]
            self.launches.append((compiled.run, args, inp, alloc))
        self.workspaces: dict[int, tuple[list, list]] = {}  # stream -> (allocations, argument lists)

    def _bind(self, stream: int) -> tuple[list, list]:
        """The allocations (the returned one ``None``) and each launch's arguments with addresses, on ``stream``."""
        allocs = [None if i == self.fresh else _alloc(a) for i, a in enumerate(self.allocs)]
        bound = []
        for run, args, inp, alloc in self.launches:
            args = list(args)
            args[3] = stream
            fresh = []
            for pos, src in alloc:
                if src == self.fresh:
                    fresh.append(pos)
                else:
                    args[pos] = allocs[src].data_ptr()
            bound.append((run, args, inp, fresh))
        return allocs, bound

    def replay(self, inputs: Sequence[torch.Tensor | None], addrs: Sequence[int], stream: int) -> torch.Tensor | None:
        """Launch the recorded kernels on ``inputs`` (device addresses ``addrs``) on ``stream``; returns the result."""
        held = self.workspaces.get(stream) if self.reuse else None
        if held is None:
            held = self._bind(stream)
            if self.reuse:
                self.workspaces[stream] = held
        allocs, bound = held
        result = fresh_addr = None
        if self.fresh >= 0:
            result = _alloc(self.allocs[self.fresh])
            fresh_addr = result.data_ptr()
        for run, template, inp, fresh in bound:
            args = template.copy()
            for pos, src in inp:
                args[pos] = addrs[src]
            for pos in fresh:
                args[pos] = fresh_addr
            run(*args)
        if self.out is None or result is not None:
            return result
        kind, src = self.out
        return inputs[src] if kind == _INPUT else allocs[src]


def _alloc(spec: tuple) -> torch.Tensor:
    shape, dtype, device = spec
    return torch.empty(shape, dtype=dtype, device=device)


def _key(head: tuple, device_index: int, inputs: Sequence[torch.Tensor | None]) -> tuple[tuple, list[int]]:
    """A call's plan key, ``head`` (the launcher's part), the device, then each input's shape, strides, dtype,
    device index and 16-byte alignment; and the inputs' addresses (0 for ``None``)."""
    key, addrs = [*head, device_index], []
    for t in inputs:
        if t is None:
            key.append(None)
            addrs.append(0)
        else:
            p = t.data_ptr()
            key.append((t.shape, t.stride(), t.dtype, t.get_device(), p % 16))
            addrs.append(p)
    return tuple(key), addrs


class Planner:
    """A launcher's plans by key: :meth:`call` replays one where it can, else runs and records the launcher."""

    def __init__(self):
        self.plans: dict[tuple, Plan | None] = {}
        self.enabled = True
        self._newest: Plan | None = None  # the plan at the end of ``plans``, where known

    def clear(self) -> None:
        self.plans.clear()
        self._newest = None

    def call(self, key_of: Callable[[], tuple | None] | None, inputs: Sequence, run: Callable) -> torch.Tensor | None:
        """``run(empty)`` (the launcher, allocating through ``empty``), or a replay of this call's plan.

        Called while another launcher is being recorded (``paged_attention``'s ``write_tail``), it runs
        the launcher, allocating through that recording, so the outer plan holds these launches.

        ``key_of`` is ``None`` for a call that must not be planned, else it gives the launcher's part of
        the call's key (its config and other non-tensor arguments), or ``None``; the key adds the
        device and the layouts of ``inputs``, the call's tensors (:func:`_key`; a call that passes one
        tensor as two inputs is not planned).
        """
        outer = _local.recorder
        if outer is not None:  # inside another launcher's recording: its plan takes these launches in
            return run(outer.empty)
        if key_of is None or not self.enabled or not _replayable():
            return run(torch.empty)
        head = key_of()
        if head is None:
            return run(torch.empty)
        device_index = _driver.active.get_current_device()
        key, addrs = _key(head, device_index, inputs)
        plan = self.plans.get(key, _UNSEEN)
        if plan is None:
            return run(torch.empty)
        if plan is _UNSEEN:  # a shape seen once is not recorded yet (shapes that never repeat cost only the key)
            self._insert(key, _SEEN_ONCE)
            return run(torch.empty)
        if plan is not _SEEN_ONCE:
            if plan is not self._newest:  # to the recent end, so eviction (oldest first) spares it
                self.plans.pop(key, None)
                self.plans[key] = self._newest = plan
            return plan.replay(inputs, addrs, _driver.active.get_current_stream(device_index))
        with Recorder(inputs) as rec:
            result = run(rec.empty)
        try:
            self.plans[key] = rec.plan(result)  # in place: this key is not the newest as such
        except AttributeError:  # a kernel object without Triton's JIT parameters (e.g. an autotuner)
            self.plans[key] = None
        self._newest = None
        return result

    def _insert(self, key: tuple, value) -> None:
        if len(self.plans) >= MAX_PLANS:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = value
        self._newest = None


def _replayable() -> bool:
    """Whether replays may run now: CUDA, not capturing a graph, no Triton launch hooks that call anything.

    (Under the interpreter a launch returns no compiled kernel, so no plan is ever made.)"""
    if _driver is None or not _cuda():
        return False
    if not (_idle(_knobs.runtime.launch_enter_hook) and _idle(_knobs.runtime.launch_exit_hook)):
        return False
    return not torch.cuda.is_current_stream_capturing()


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def _idle(hook) -> bool:
    """Whether a Triton launch hook calls nothing: ``None``, or a ``HookChain`` (Triton 3.6+) with no calls
    (then the replay passes ``None``, which the launcher skips, as it skips the empty chain)."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)
