"""The entry point as vLLM loads it, without running a model: registration (idempotent, every name a valid
dtype), a failing install, the import cost, the backend name."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm.config.cache as cache_mod
from vllm.config.cache import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

import kvarn.integration.vllm as kv
from kvarn.config import CACHE_DTYPES, PRESETS
from kvarn.integration.vllm import hooks, plugin
from kvarn.integration.vllm.registry import BACKENDS, backend_path

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def registered():
    kv.register()
    assert kv.is_enabled(), kv.status()


def test_register_is_idempotent_and_every_preset_is_a_valid_cache_dtype():
    hooked = type(current_platform).get_attn_backend_cls
    kv.register()
    kv.register()
    assert type(current_platform).get_attn_backend_cls == hooked
    assert not hooks.install_selection_hook(current_platform, backend_path), "a second hook must not wrap the first"
    assert not hooks.install_config_hook(current_platform), "a second hook must not wrap the first"
    expected_mode = "registry" if hasattr(cache_mod, "register_kv_cache_dtype") else "literal"
    assert kv.status()["mode"] == expected_mode
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert set(CACHE_DTYPES) == {p + ks + sink for p in PRESETS for ks in ("", "_ks") for sink in ("", "_sink")}
    for preset in CACHE_DTYPES:
        assert CacheConfig(cache_dtype=preset).cache_dtype == preset
        assert STR_DTYPE_TO_TORCH_DTYPE[preset] is torch.uint8
        assert parser.parse_args(["--kv-cache-dtype", preset]).kv_cache_dtype == preset
    with pytest.raises(ValueError):
        CacheConfig(cache_dtype="kvarn_k3v3_g128")
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "kvarn_k3v3_g128"])


_ERROR_PATH = r"""
import json, logging, sys
import torch
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("vllm.kvarn").addHandler(Keep())
from kvarn.integration.vllm import hooks
def boom():
    raise RuntimeError("simulated failure while adding the dtype names")
hooks.install_dtypes = boom
import kvarn.integration.vllm as kv
kv.register()
kv.register()
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.cache import CacheConfig
from vllm.platforms import current_platform
from vllm.v1.attention.selector import get_attn_backend
out = {"status": kv.status(), "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}
out["hook_left"] = any(
    getattr(getattr(type(current_platform), name), "_kvarn_wrapped", False)
    for name in ("get_attn_backend_cls", "check_and_update_config")
)
try:
    CacheConfig(cache_dtype="kvarn_k4v2_g128")
    out["kvarn_dtype"] = "accepted"
except Exception as exc:
    out["kvarn_dtype"] = type(exc).__name__
with set_current_vllm_config(VllmConfig()):
    out["auto_backend"] = get_attn_backend(64, torch.bfloat16, "auto").get_name()
out["auto_config"] = CacheConfig(cache_dtype="auto").cache_dtype
print("RESULT" + json.dumps(out))
"""


def test_a_failing_plugin_warns_once_and_leaves_vllm_working_without_kvarn():
    proc = subprocess.run([sys.executable, "-c", _ERROR_PATH], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line.removeprefix("RESULT"))
    assert out["status"]["enabled"] is False
    assert "simulated failure" in out["status"]["error"]
    assert len(out["warnings"]) == 1 and "unavailable" in out["warnings"][0]
    assert out["hook_left"] is False
    assert out["kvarn_dtype"] == "ValidationError"
    assert out["auto_backend"] == "CPU_ATTN"
    assert out["auto_config"] == "auto"


def test_importing_the_integration_imports_neither_vllm_nor_transformers():
    code = (
        "import sys, kvarn.integration, kvarn.integration.vllm, kvarn.paged\n"
        "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_where_the_backend_enum_takes_no_new_names_kvarn_registers_as_custom(monkeypatch):
    from vllm.v1.attention.backends import registry

    from kvarn.integration.vllm.backend import KVarNBackend

    calls = []

    def closed_register_backend(backend, class_path=None, is_mamba=False):
        calls.append(backend)
        if isinstance(backend, str):
            return lambda x: x  # 0.26 stores the string and never adds an enum member
        return lambda x: x

    enum = registry.AttentionBackendEnum
    members = {k: v for k, v in enum.__members__.items() if k != "KVARN"}
    closed = SimpleNamespace(__members__=members, CUSTOM=enum.CUSTOM)
    monkeypatch.setattr(registry, "register_backend", closed_register_backend)
    monkeypatch.setattr(registry, "AttentionBackendEnum", closed)
    monkeypatch.setattr(KVarNBackend, "registered_name", "KVARN")
    assert plugin.install_backend_name() == "CUSTOM"
    assert registry.AttentionBackendEnum.CUSTOM in calls
    assert BACKENDS["kvarn_k4v2_g128"].get_name() == "CUSTOM"
