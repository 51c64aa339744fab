"""``benchmarks/bench_vllm.py``'s record of Triton compiles: it chains the hooks it finds and counts each compile once.

Triton calls ``knobs.runtime.jit_cache_hook`` before a compile (a true return skips it) and
``jit_post_compile_hook`` after, with the kernel as ``fn`` and its specialization as ``key``; the
calls below are the ones triton 3.9's ``JITFunction._do_compile`` makes (vLLM 0.26's JIT monitor uses the
second on triton 3.6; where either hook is missing ``JitLog.install`` records nothing).
"""

import types

import pytest

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")

from benchmarks.bench_vllm import JitLog  # noqa: E402


@pytest.fixture
def hooks():
    rt = knobs.runtime
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    yield rt
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def _compile(rt, name: str, key: str) -> bool:
    fn = types.SimpleNamespace(name=name)
    skipped = rt.jit_cache_hook(key=key, fn=fn, compile={}, is_manual_warmup=False, already_compiled=False)
    if not skipped:
        rt.jit_post_compile_hook(key=key, fn=fn, compile={}, is_manual_warmup=False, already_compiled=False)
    return bool(skipped)


def test_jit_log_counts_compiles_and_chains_the_hooks_it_found(hooks):
    seen = []
    hooks.jit_cache_hook = lambda **kw: seen.append(("pre", kw["key"])) or None
    hooks.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    log = JitLog.install()
    assert log is not None
    assert not _compile(hooks, "_attn_kernel", "(i32, i32D)")
    mark = len(log.events)
    assert not _compile(hooks, "_attn_kernel", "(i32, i32)")  # another specialization: a second compile
    assert not _compile(hooks, "_encode_kernel", "(i32,)")
    got = log.since(mark)
    assert got["compiles"] == 2 and got["kernels"] == {"_attn_kernel": 1, "_encode_kernel": 1}
    assert got["seconds"] >= 0.0
    assert log.since(0)["kernels"] == {"_attn_kernel": 2, "_encode_kernel": 1}
    assert [k for k, _ in seen] == ["pre", "post"] * 3, "the hooks installed before were not called"


def test_jit_log_keeps_a_skipping_cache_hook_in_charge(hooks):
    hooks.jit_cache_hook = lambda **kw: True  # e.g. a tool that serves kernels from elsewhere
    hooks.jit_post_compile_hook = None
    log = JitLog.install()
    assert _compile(hooks, "_attn_kernel", "(i32,)")
    assert log.since(0)["compiles"] == 0 and not log._started, "a skipped compile was timed"
