"""Every numeric tolerance the tests assert, in one place, with what it is derived from."""

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
