import os
import sys
import threading
import time

import torch
from hypothesis import HealthCheck, settings

# Without a CUDA device Triton can only interpret kernels, and it must see TRITON_INTERPRET before its first
# import (its own @jit helpers, tl.sum's combine function among them, are defined then): set it here, before any
# test file imports Triton, so files run in any order and any mix. On a GPU machine it stays unset (compiled).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HEARTBEAT_S = float(os.environ.get("KVARN_TEST_HEARTBEAT", "60"))
"""Seconds between the lines naming a test that is still running (0: none)."""


class _Heartbeat:
    """Every ``HEARTBEAT_S`` seconds that one test runs (its fixtures' setup included), a line naming it.

    pytest prints a test's result only when it ends, so a module fixture that runs for minutes (the vLLM
    engines of ``test_vllm_e2e.py``) otherwise leaves the console silent. The lines go to a duplicate of
    the terminal's file descriptor, which pytest's output capture does not redirect.
    """

    def __init__(self, fd: int):
        self.out = os.fdopen(fd, "w", buffering=1)
        self.lock = threading.Lock()
        self.nodeid: str | None = None
        self.started = 0.0
        self.mid_line = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="kvarn-test-heartbeat", daemon=True)
        self.thread.start()

    def begin(self, nodeid: str) -> None:
        with self.lock:
            self.nodeid, self.started = nodeid, time.monotonic()
            self.mid_line = True  # pytest has written the file name or a result since our last line

    def end(self) -> None:
        with self.lock:
            self.nodeid = None

    def _beat(self) -> None:
        said = None
        while not self.done.wait(1.0):
            with self.lock:
                nodeid, elapsed = self.nodeid, time.monotonic() - self.started
                step = int(elapsed // HEARTBEAT_S) if nodeid is not None else 0
                if step < 1 or said == (nodeid, step):
                    continue
                said, newline, self.mid_line = (nodeid, step), self.mid_line, False
            prefix = "\n" if newline else ""
            self.out.write(f"{prefix}    ... {nodeid} still running ({step * HEARTBEAT_S:.0f} s)\n")

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self.out.close()


_BEAT: _Heartbeat | None = None


def pytest_configure(config):
    global _BEAT
    if HEARTBEAT_S <= 0 or config.option.collectonly:
        return
    try:
        fd = os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout (pytest run in-process by a tool)
        return
    _BEAT = _Heartbeat(fd)


def pytest_runtest_logstart(nodeid, location):
    if _BEAT is not None:
        _BEAT.begin(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    if _BEAT is not None:
        _BEAT.end()


def pytest_unconfigure(config):
    global _BEAT
    if _BEAT is not None:
        _BEAT.close()
        _BEAT = None
