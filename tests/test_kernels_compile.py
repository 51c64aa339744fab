"""The Triton kernels compile for the H100/H200 (sm_90) here, with Triton's bundled ptxas and no GPU.

The interpreter tests run the kernels' arithmetic on the CPU but never compile them, so what only a
compile finds (a module global read in a kernel that is not a ``tl.constexpr``, a variable whose
type differs between the branches of a runtime ``if``, a layout the backend rejects) would otherwise
surface only on the GPU machine. One launch of each kernel family, with the constexpr switches the
launchers set for it; the compile must produce a cubin.
"""

import pytest

pytest.importorskip("triton")

from benchmarks.sass_decode import compile_decode
from benchmarks.sass_store import compile_encode
from kvarn.config import KVarNConfig

pytestmark = pytest.mark.slow  # ~45 s on 2 cores: each compile runs ptxas

SEQ = {"smooth_keys": True, "smooth_scope": "sequence"}

DECODE = [
    # id, preset config, D, tokens_m, fold, fused_q, extra constexprs
    ("default", "kvarn_k4v2_g128", 128, True, True, True, {"HAS_SINK": True}),
    ("prologue", "kvarn_k2v2_g128", 64, False, False, False, {}),
    ("multi_query", "kvarn_k4v2_g64", 64, False, False, True, {"MULTI_Q": True, "BLOCK_Q": 4}),
    ("seq_smooth_prologue", ("kvarn_k4v2_g128", SEQ), 64, True, True, False, {"SMOOTH_Q": True, "LATE_Q": True}),
    ("seq_smooth_fused", ("kvarn_k2v2_g128", SEQ), 64, False, False, True, {"LATE_Q": True, "HAS_SINK": True}),
    ("per_tile_smooth", ("kvarn_k4v2_g64", {"smooth_keys": True}), 64, False, False, True, {}),
]


def _cfg(preset, d: int) -> KVarNConfig:
    name, over = (preset, {}) if isinstance(preset, str) else preset
    return KVarNConfig.from_preset(name, head_dim=d, **over)


@pytest.mark.parametrize("preset,d,tokens_m,fold,fused_q,extra", [c[1:] for c in DECODE], ids=[c[0] for c in DECODE])
def test_decode_attention_compiles_for_sm90(preset, d, tokens_m, fold, fused_q, extra):
    kernel = compile_decode(_cfg(preset, d), d, tokens_m, fold, fused_q, pair=False, extra=extra)
    assert len(kernel.asm["cubin"]) > 0


@pytest.mark.parametrize(
    "preset,phase",
    [("kvarn_k4v2_g64", None), (("kvarn_k4v2_g64", SEQ), 0), (("kvarn_k2v2_g128", SEQ), 1)],
    ids=["plain", "seq_smooth_phase0", "seq_smooth_phase1"],
)
def test_store_encoder_compiles_for_sm90(preset, phase):
    cfg = _cfg(preset, 64)
    extra = {} if phase is None else {"HAS_SMOOTH_SRC": True, "SMOOTH_PHASE": phase}
    kernel = compile_encode(cfg, 8 if cfg.smooth_keys else 4, extra=extra)
    assert len(kernel.asm["cubin"]) > 0
