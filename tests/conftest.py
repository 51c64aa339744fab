import os

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
