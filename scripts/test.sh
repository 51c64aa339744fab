#!/usr/bin/env bash
# The test command: lint, the Triton kernels under the interpreter, then the CPU test suite.
# Extra arguments go to both pytest runs (e.g. `scripts/test.sh -k attention`).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

"$PY" -m ruff check .
"$PY" -m ruff format --check .

# Progress: each file's line ends with its time, tests/conftest.py names a test every 60 s it runs (a module
# fixture may take minutes before the first result), and the slowest tests are listed at the end.
PROGRESS=(-o console_output_style=times --durations=15)

# Triton kernels on tiny shapes through TRITON_INTERPRET=1 (it must be set before triton imports,
# hence a separate process), spread over pytest-xdist workers: each interpreted kernel runs on one core.
# KVARN_TEST_WORKERS overrides the count (default: the usable cores, at most 4; 1 runs them in this process).
# Exit code 5 means no such test was collected.
WORKERS=${KVARN_TEST_WORKERS:-$("$PY" -c "import os; a = getattr(os, 'sched_getaffinity', None); print(min(len(a(0)) if a else os.cpu_count() or 1, 4))")}
SPREAD=()
if [ "$WORKERS" -gt 1 ]; then
  SPREAD=(-n "$WORKERS")
fi
set +e
TRITON_INTERPRET=1 "$PY" -m pytest -m "interpreter and not gpu" "${SPREAD[@]}" "${PROGRESS[@]}" "$@"
rc=$?
set -e
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
  exit "$rc"
fi

# Everything that runs on the CPU as it is; GPU tests run on a CUDA machine with `pytest -m gpu`.
"$PY" -m pytest -m "not gpu and not interpreter" "${PROGRESS[@]}" "$@"
