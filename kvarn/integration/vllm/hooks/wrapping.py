"""How every kvarn hook wraps a vLLM function: marked, so it is never installed twice, and undoable."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.kvarn")


HOOK_MARK = "_kvarn_wrapped"
"""The attribute every wrapper carries (``True``): a hook found in place is not installed twice."""


def _mark(wrapper, original) -> None:
    setattr(wrapper, HOOK_MARK, True)
    wrapper.__wrapped__ = original


def _wrap(platform_cls, name: str, wrapper, original) -> None:
    """Install ``wrapper`` as classmethod ``name`` of ``platform_cls``, remembering what :func:`_unwrap` restores."""
    _mark(wrapper, original)
    wrapper._kvarn_own = name in vars(platform_cls)  # else inherited: removing the wrapper restores it
    setattr(platform_cls, name, classmethod(wrapper))


def _unwrap(platform, name: str) -> bool:
    """Undo :func:`_wrap` on ``type(platform)``; returns ``False`` if ``name`` is not wrapped."""
    platform_cls = type(platform)
    hooked = getattr(platform_cls, name)
    if not getattr(hooked, HOOK_MARK, False):
        return False
    if hooked._kvarn_own:
        setattr(platform_cls, name, classmethod(hooked.__wrapped__.__func__))
    else:
        delattr(platform_cls, name)
    return True
