"""Every numeric tolerance the tests (and the benchmarks' correctness gates) assert, with its derivation."""

import torch

FP32_ATOL = 1e-5
"""Two fp32 computations of the same formula in a different order."""

ROTATE_ROUNDTRIP = 1e-5
"""H @ H in fp32: relative error of rotating twice."""

ATTENTION_VS_SDPA = 2e-3
"""Reference paged attention vs SDPA over the same dequantized K/V: fp32 vs fp32, then the output
is rounded to fp16 (half an fp16 ulp is 2^-11 ~ 4.9e-4 relative; outputs are O(1))."""

ROW_PARAM_REL = 2.0**-11
"""Relative rounding of an fp16 row parameter (unit roundoff of fp16)."""

# Relative Frobenius round-trip error bounds of one tile half, per bit width. Uniform rounding of a
# row with range R has error R / (2^b - 1) / sqrt(12); a Gaussian row of 64-256 samples has range
# about 5-6 std, so the expected relative error is ~0.45 (2 bits) and ~0.10 (4 bits). Bounds leave
# headroom for small tiles.
ROUNDTRIP_REL = {2: 0.62, 4: 0.14}

# The Triton kernels against the reference (asserted by tests/kernel_oracle.py).

CODE_MISMATCH_MAX = 0.03
"""Largest fraction of codes allowed to differ from the reference (each by one step, each at a
rounding tie: see ``TIE_WINDOW``). fp32 ``exp``/``log``/summation differences move ``B`` by a few
ulps; bf16 inputs make exact ties common. Most differences on the GPU come from the Sinkhorn
gauge (see ``kernel_oracle.check_records``): when the kernel keeps another iterate of the same imbalance,
every column scale is re-rounded to bf16, which moves ``B`` by up to 2^-9 per column. Measured on
the H200: 0.1-1% (``STATS`` lines of ``test_kernels_gpu.py``)."""

TIE_WINDOW = 0.12
"""Every differing code must sit within this distance of a half-integer in the reference's
pre-rounding value ``(B - lo) / step``. A one-bf16-ulp column-scale change moves that value by
at most ``(2^b - 1) * 2^-8 < 0.06``; the window doubles that."""

COL_REL = 2.0**-6
"""Column scales (bf16), after dividing out the tile half's gauge factor (see
``kernel_oracle.check_records``), may differ by one bf16 ulp each side of the ratio (2^-8 relative spacing,
2^-7 just above a power of two)."""

ROW_REL = 2.0**-6
"""Row parameters (fp16), gauge factor divided out, relative to the half's largest: a one-ulp
column-scale change moves ``lo``/``step`` of the rows that touch it by up to ~2^-7."""

CLIP_PICK_MISMATCH_MAX = 0.02
"""Clipped ranges (2-bit halves, ``KVarNConfig.clip``): largest fraction of rows allowed to pick
another shrink than the reference. Two shrinks of near-equal squared error (fp32 sums in another
order, or B moved by a Sinkhorn gauge re-rounding) are both right; those rows are then held only to
the reconstruction check (``QUALITY_REL``), every other row to the code and parameter checks."""

QUALITY_REL = 0.01
"""The kernel's reconstruction error (Frobenius, against the prepared tiles) may exceed the
reference's by at most 1%: a code that moves at a rounding tie is as far from the value as the
reference's code (equal at an exact tie), so the two errors agree closely."""

QUALITY_ABS = 2.0**-8
"""Plus this fraction of the tile's norm: where several iterates tie exactly (degenerate tiles,
e.g. constant ones, score the same imbalance at every iterate), kernel and reference may store
different but equivalent scales whose fp16/bf16 rounding (2^-11 / 2^-8) differs."""

PREPARE_ULP_FRACTION = 0.02
"""Fraction of prepared (rotated, rounded) values allowed to differ by one ulp of the model dtype:
the rotation's fp32 sums run in a different order than the reference matmul, which moves a value
across a rounding boundary with probability ~(a few fp32 ulps) / (one fp16 ulp) ~ 1e-3."""

ATTN_REL = {torch.float16: 1e-2, torch.bfloat16: 1.6e-2}
"""Attention output vs the reference computed in fp32, relative to max |ref|. The kernel rounds
``q * k_scale`` and ``p * v_scale`` to fp16 for the tensor-core dots (unit roundoff 2^-11); a torch
emulation of exactly that arithmetic puts the score side at up to 2e-3 and the value side at 3e-4
(CPU, 10 x 48 query rows), and the kernel measured up to 3.6e-3 over 40 random queries. 1e-2 leaves
~3x headroom; a wrong tile, scale, mask or softmax step costs 1e-1..1. bf16 outputs add their own
rounding (half an ulp is 2^-9 relative), hence 1.6e-2."""

ATTN_COND_FACTOR = 2.5
"""Ill-conditioned attention (sharp softmax, large query channels): the output tolerance becomes
``max(ATTN_REL, ATTN_COND_FACTOR * sensitivity)``, where the sensitivity is the largest change of
the fp32 reference output (relative to max |ref|) when every query element is perturbed by up to
one unit roundoff of the query dtype (:func:`kernel_oracle.query_sensitivity`). The kernel rounds
the rotated query, the dequantized scales and the probabilities to fp16 at least once each, so its
error is a few such perturbations. Used by the smoothed-key cases, whose queries have a 10x channel
on the keys' outlier channel: there the reference alone moves by 0.2-0.8% under a one-ulp query
perturbation (CPU, fp16, D 64/128). On an H200 (23 cases) the kernels' error was at
most 1.25x that sensitivity (1.2e-2 at 1.55e-2 in the worst case), so 2.5 leaves 2x headroom."""
