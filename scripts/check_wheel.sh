#!/usr/bin/env bash
# Build kvarn's sdist and wheel, install the wheel (with the hf extra) into a fresh venv outside the checkout
# and run `kvarn demo` from it: what a user of the package gets, apart from the editable .venv the tests use.
# Fails on any build warning and on a wheel without kvarn/data or py.typed. Used by `make check-wheel` and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
DEMO_ARGS=${DEMO_ARGS:-}
say() { echo "check_wheel [$((SECONDS - start)) s]: $*"; }

start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/kvarn-wheel.XXXXXX")
trap 'say "removing $work"; rm -rf "$work"' EXIT

say "building the sdist and the wheel (python -m build) into $work/dist"
# PYTHONDONTWRITEBYTECODE makes setuptools warn that it skips byte-compiling: not a warning about kvarn
if ! env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1; then
  cat "$work/build.log"
  say "the build failed (log above)"
  exit 1
fi
if grep -n -i -E "warning|deprecat" "$work/build.log"; then
  say "the build printed the warnings above (full log follows)"
  cat "$work/build.log"
  exit 1
fi
tail -n 1 "$work/build.log"
wheel=$(ls "$work"/dist/kvarn-*.whl)
listing=$("$VENV/bin/python" -m zipfile -l "$wheel")
for file in kvarn/py.typed kvarn/data/pride_and_prejudice.txt kvarn/data/SOURCES.md; do
  if ! grep -q "^$file " <<<"$listing"; then
    say "$(basename "$wheel") lacks $file"
    exit 1
  fi
done
say "$(basename "$wheel") holds kvarn/py.typed and kvarn/data/"

say "installing it with the hf extra into a fresh venv at $work/venv (torch 2.13.0 first, as scripts/setup.sh)"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "torch==2.13.0"
"$work/venv/bin/python" -m pip install -q "${wheel}[hf]"

say "running: kvarn demo${DEMO_ARGS:+ $DEMO_ARGS} (from $work, so the checkout is not on the path)"
(cd "$work" && "$work/venv/bin/kvarn" demo $DEMO_ARGS)
imported=$(cd "$work" && "$work/venv/bin/python" -c "import kvarn; print(kvarn.__file__)")
case "$imported" in
  "$work"/venv/*) ;;
  *) say "the demo imported kvarn from $imported, not from the installed wheel"; exit 1 ;;
esac
say "ok: the wheel installs and its kvarn demo runs"
