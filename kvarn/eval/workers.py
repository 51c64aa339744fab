"""Samples of a long-context task spread over worker processes, each holding its own copy of the model.

A sample runs its methods one token or one tile chunk at a time, so on a GPU a single process spends
most of its time in Python and kernel launches while the device idles; a few processes, each
answering whole samples, use it better (not many: processes share a GPU in time slices). Each
worker loads the model once (``spawn``: no CUDA state is inherited) and answers the samples it is
handed with the same functions a single process calls, so a record does not depend on which worker
made it (on a CPU, bit for bit at the same thread count).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

_MODEL: dict = {}
"""A worker's ``model`` and ``tok``, loaded by :func:`_load` when the worker starts."""


class _Silent:
    """A progress bar that shows nothing: a worker's progress is counted by its parent, a sample at a time."""

    def tick(self) -> None:
        pass

    def describe(self, label: str) -> None:
        pass


def _exit_with(parent: int, stop, period: float = 0.5) -> None:
    """End this process once ``parent`` is gone (reparented) or ``stop`` is set, even mid-sample: a killed or
    interrupted report must not leave workers on the GPU."""
    while os.getppid() == parent and not stop.wait(period):
        pass
    os._exit(1)


def _load(model: str, device: str, threads: int, stop) -> None:
    import torch
    import transformers

    from kvarn.eval.models import load_model

    transformers.utils.logging.disable_progress_bar()  # one loading bar per worker would bury the parent's progress
    threading.Thread(target=_exit_with, args=(os.getppid(), stop), daemon=True).start()
    torch.set_num_threads(threads)
    _MODEL["model"], _MODEL["tok"] = load_model(model, device=device)


def _call(fn: Callable, args: tuple):
    return fn(_MODEL["model"], _MODEL["tok"], *args, _Silent())


class Workers:
    """``count`` processes with ``model`` loaded on ``device``; :meth:`run` answers samples on them.

    ``config`` is the model's configuration, read in this process without loading the weights.

    ``fn(model, tok, *args, bar)`` must be a module-level function (it is pickled by name) returning a
    picklable record.
    """

    def __init__(self, model: str, device: str, count: int, threads: int = 1):
        if count < 2:
            raise ValueError(f"Workers needs 2 or more processes, got {count}")
        from transformers import AutoConfig

        from kvarn.eval.models import model_dir

        self.count = count
        self.config = AutoConfig.from_pretrained(model_dir(model))  # the workers' model.config
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self.pool = ProcessPoolExecutor(
            count, mp_context=context, initializer=_load, initargs=(model, device, threads, self._stop)
        )

    def run(self, fn: Callable, jobs: Iterable[tuple]) -> Iterator[tuple[int, object]]:
        """``(position in jobs, record)`` of each ``fn(model, tok, *job, bar)`` as it completes."""
        pending: dict[Future, int] = {self.pool.submit(_call, fn, job): i for i, job in enumerate(jobs)}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield pending.pop(fut), fut.result()
        finally:
            for fut in pending:
                fut.cancel()

    def close(self, wait: bool = True) -> None:
        """Stop the workers: after their samples, or (``wait=False``) at once, dropping the samples they hold."""
        if not wait:
            self._stop.set()
        self.pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(wait=kind is None)
