"""What KVarN refuses inside vLLM (start-up validation), the run-wide numbers the hooks and the backend
need (slots per pool, the format a dtype is served in), and the once-only warnings.

The hooks (:mod:`kvarn.integration.vllm.hooks`) and the backend both import this module. It imports
nothing from vLLM: every argument is read by attribute. The cache-dtype name rules (``_ks``, ``_sink``)
are :mod:`kvarn.config`'s.
"""

from __future__ import annotations

import logging
import os

import torch

from kvarn.config import (
    SINK_SUFFIX,
    SUPPORTED_HEAD_DIMS,
    cache_dtype_config,
    has_key_smoothing,
    has_sink,
    is_cache_dtype,
    key_bias_reason,
    with_key_smoothing,
    without_sink,
)
from kvarn.integration.vllm.state import serving


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process meets it (vLLM builds configs, backends and
    runners more than once)."""
    if message not in serving.warned:
        serving.warned.add(message)
        logging.getLogger("vllm.kvarn").warning(message)


KEY_SMOOTHING_ENV = "KVARN_KEY_SMOOTHING"
KEY_SMOOTHING_MODES = ("auto", "off")
TAIL_SLOTS_ENV = "KVARN_TAIL_SLOTS"
SINK_SLOTS_ENV = "KVARN_SINK_SLOTS"
TAIL_BLOCKS_ENV = "KVARN_TAIL_BLOCKS"
"""Where running requests keep their tails: ``1`` in vLLM's own blocks, ``0`` in a pool, unset as the engine
suits (:func:`kvarn.integration.vllm.backend.tail_blocks_enabled`, ``docs/internals/vllm_backend.md``)."""
SUPPORTED_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def group_size(preset: str) -> int:
    """The tile length ``G`` of cache dtype ``preset`` (one vLLM block per tile)."""
    return cache_dtype_config(preset).group_size


def sink_slot_count(vllm_config) -> int:
    """Full-precision sink slots per layer for a ``_sink`` cache dtype.

    One per request the scheduler may run (``max_num_seqs``) is always enough: a sink is evicted
    only when no request holds its block, and the requests that hold blocks are the running ones.
    ``$KVARN_SINK_SLOTS`` above that keeps the sinks of more prefix-cached first tiles (a cached
    first tile whose sink is evicted is dropped from the prefix cache); below it is refused.
    """
    max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    return _slots_from_env(SINK_SLOTS_ENV, max_seqs, max_seqs, "every running request holds the sink of its first tile")


def tail_slot_count(vllm_config, per_request: bool = False, departures_reported: bool = False) -> int:
    """Full-precision tail slots per layer for this run.

    With ``per_request`` (the GPU model runner hands each live request a stable index) the pool
    has exactly one slot per request the scheduler may run, ``max_num_seqs``: a tail can then
    never be lost, and ``$KVARN_TAIL_SLOTS`` is ignored. Otherwise slots are keyed by block id
    (:class:`kvarn.paged.TilePlanner`), a request holds at most one (two with speculative
    decoding: a tile filled with a draft keeps its slot until the draft is verified, and the next
    tile takes another), and a value of ``$KVARN_TAIL_SLOTS`` below that many per ``max_num_seqs``
    is refused. The default is that minimum when the runner reports finished and preempted requests
    (``departures_reported``: the CPU runner, through
    :func:`~kvarn.integration.vllm.hooks.install_release_hook`; the live slots then never outnumber
    what the running requests hold) and twice it otherwise (room for the tails of departed requests
    until their blocks are reused).
    """
    max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    if per_request:
        return max_seqs
    per_seq = 2 if getattr(vllm_config, "speculative_config", None) is not None else 1
    need = per_seq * max_seqs
    default = need if departures_reported else 2 * need
    if per_seq == 1:
        why = f"every running request can hold one incomplete tile, so the scheduler could need {need} tail slots"
        return _slots_from_env(TAIL_SLOTS_ENV, default, need, why)
    why = (
        "with speculative decoding every running request can hold two full-precision tiles (one filled with an "
        f"unverified draft, and the next), so the scheduler could need {need} tail slots"
    )
    return _slots_from_env(TAIL_SLOTS_ENV, default, need, why, "twice --max-num-seqs,")


def _slots_from_env(name: str, default: int, least: int, why: str, floor: str | None = None) -> int:
    """Slots per layer from environment variable ``name`` (``default`` when unset); below ``least`` (``floor``
    names it; ``--max-num-seqs`` by default) is refused."""
    env = os.environ.get(name)
    if not env:
        return default
    try:
        value = int(env)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {env!r}") from None
    if value < least:
        raise ValueError(
            f"{name}={value} is below {floor or '--max-num-seqs'} {least}: {why}; set {name} to at least {least} "
            "(or unset it), or lower --max-num-seqs"
        )
    return value


def check_layer(selector_config, vllm_config=None) -> None:
    """Refuse, with what to change, a layer or a run that KVarN cannot serve correctly."""
    preset = selector_config.kv_cache_dtype
    flag = f"--kv-cache-dtype {preset}"
    fix = "use --kv-cache-dtype auto (or fp8) for this model"
    problems = []
    if selector_config.use_mla:
        problems.append(f"this model uses MLA (a latent KV cache KVarN does not quantize); {fix}")
    if selector_config.attn_type != "decoder":
        problems.append(f"this is an {selector_config.attn_type} attention layer; KVarN serves decoder layers; {fix}")
    if selector_config.head_size not in SUPPORTED_HEAD_DIMS:
        problems.append(
            f"head size {selector_config.head_size} is not supported (KVarN serves head sizes "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}); {fix}"
        )
    if selector_config.dtype not in SUPPORTED_MODEL_DTYPES:
        problems.append(f"model dtype {selector_config.dtype} is not supported; use --dtype float16 or bfloat16")
    for attr, what in (
        ("use_sparse", "sparse attention"),
        ("use_mm_prefix", "bidirectional multimodal prefixes"),
        ("use_non_causal", "non-causal attention"),
        ("use_per_head_quant_scales", "a checkpoint KV-cache quantization scheme"),
        ("use_kv_connector", "a KV connector (KV transfer)"),
        ("use_pcp", "prefill context parallelism"),
        ("use_dcp", "decode context parallelism"),
        ("use_rswa", "reference sliding-window attention"),
    ):
        if getattr(selector_config, attr, False):
            problems.append(f"{what} is not supported with KVarN; {fix}")
    if getattr(selector_config, "use_adaptive_verification", False):
        problems.append(ADAPTIVE_VERIFICATION)
    if vllm_config is not None:
        problems.extend(run_problems(vllm_config, preset))
    if problems:
        raise ValueError(f"{flag}: " + "; ".join(dict.fromkeys(problems)))


def freed_window_problems(preset: str, vllm_config=None) -> list[str]:
    """What keeps this run's sliding-window layers from vLLM's window spec, whose blocks vLLM frees as the window
    moves: they then get full-attention pages, blocks for every token, the window applied by attention alone
    (:meth:`~kvarn.integration.vllm.backend.KVarNBackend.customize_spec`), and nothing is refused.

    Nothing may live by a block before the window: not the ``_sink`` dtypes' first tile (kept by its block), not
    on a GPU the ``_ks`` formats' per-sequence smoothing vector (its request-index planner reads it from the first
    tile's record; the CPU engine's planner reads the tile before the step's, which a spec window one tile wider
    than the layer's keeps), and not a tile filled with a speculative draft (kept by its block until a later step
    starts past it, which the window may pass first). Tails in blocks are fine: a request's tail blocks follow
    its last tile, which no window has left. Each reason says what would let vLLM free the blocks.
    """
    problems = []
    cfg = cache_dtype_config(preset)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if has_sink(preset):
        problems.append(f"the full-precision sink is kept by the first tile's block ({without_sink(preset)} has none)")
    if cfg.seq_smooth and device in (None, "cuda"):
        problems.append(
            "the GPU planner reads the per-sequence key smoothing vector from the first tile's record "
            f"({KEY_SMOOTHING_ENV}=off, or a dtype without _ks, has none)"
        )
    if vllm_config is not None and getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("a tile filled with an unverified draft keeps its tail by its block (speculative decoding)")
    return problems


def full_pages_reason(preset: str, vllm_config) -> bool:
    """Whether this run's sliding-window layers take full-attention pages instead of vLLM's window spec (something
    lives by a block the window leaves: :func:`~kvarn.integration.vllm.checks.freed_window_problems`), saying why
    once."""
    problems = freed_window_problems(preset, vllm_config)
    if problems:
        warn_once(
            "KVarN: sliding-window layers get full-attention pages in this run (blocks for every token, the window "
            "applied in attention), because " + "; ".join(problems)
        )
    return bool(problems)


def has_window_layers(vllm_config) -> bool:
    """Whether the model has sliding-window attention layers, by its text config as vLLM builds the layers from
    it: ``layer_types`` naming a sliding layer (Gemma 2/3, GPT-OSS), or a ``sliding_window`` without them
    (Mistral-style; transformers sets it to None or 0 where ``use_sliding_window`` is off)."""
    text = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    types = getattr(text, "layer_types", None)
    if types:
        return any("sliding" in str(t) for t in types)
    return bool(getattr(text, "sliding_window", None))


SPECULATIVE_METHODS = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")
"""Speculative methods whose drafts come without attention layers of their own: only the target's
verification steps reach the KVarN cache (:class:`kvarn.paged.TilePlanner`, ``num_drafts``)."""
DRAFT_LAYER_METHODS = ("eagle", "eagle3", "mtp", "draft_model")
"""Speculative methods with draft attention layers, served in the same KVarN cache: vLLM builds those
layers with the target's cache dtype, and their builder plans every token a draft step writes as an
unverified draft (:meth:`~kvarn.integration.vllm.builder.KVarNMetadataBuilder.build_for_drafting`)."""
ADAPTIVE_VERIFICATION = (
    "adaptive verification of speculative drafts lets the device shorten a step's query lengths after KVarN "
    "planned the step on the host; drop enable_adaptive_verification from --speculative-config"
)


def speculative_problems(vllm_config, preset: str) -> list[str]:
    """What in a run's ``--speculative-config`` KVarN cannot serve (nothing without one).

    Served: the methods of :data:`SPECULATIVE_METHODS` with fewer draft tokens than the tile length (a
    request then keeps at most two full-precision tiles: one filled with a draft, kept until the
    draft is verified, and the next), and those of :data:`DRAFT_LAYER_METHODS` with fewer than half
    of it (a draft layer's steps of one engine step write up to ``2k + 1`` positions), on a runner that
    plans from block ids (vLLM's V1 runner, the CPU engine's) with synchronous scheduling
    (:func:`serve_speculative` turns asynchronous scheduling off and picks the V1 runner on a GPU).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return []
    problems = []
    method = getattr(spec, "method", None)
    served = ", ".join(SPECULATIVE_METHODS + DRAFT_LAYER_METHODS)
    if method not in SPECULATIVE_METHODS + DRAFT_LAYER_METHODS:
        problems.append(
            f"speculative method {method!r} is not one KVarN serves (its draft layers attend outside the "
            f"causal, one-token-a-position order KVarN plans tiles in); use one of {served}, or "
            "--kv-cache-dtype auto"
        )
    group = group_size(preset)
    drafts = getattr(spec, "num_speculative_tokens", None) or 0
    if method in DRAFT_LAYER_METHODS:
        draft_dtype = getattr(spec, "kv_cache_dtype", None)
        if draft_dtype not in (None, preset):
            problems.append(
                f"a draft kv_cache_dtype of {draft_dtype!r} in --speculative-config gives the draft layers pages "
                "of another size, which vLLM pads every KVarN page to (one page size for all layers); leave it "
                "unset: the draft layers then use the KVarN cache too"
            )
        if has_sink(preset):
            problems.append(
                f"the full-precision sink of {method!r} draft layers is not built (a draft step clamped at "
                f"--max-model-len writes position 0, which would overwrite a shared first tile's sink); use "
                f"{without_sink(preset)}"
            )
        if getattr(spec, "parallel_drafting", False):
            problems.append("parallel drafting is not served; drop parallel_drafting from --speculative-config")
        if 2 * drafts >= group:
            problems.append(
                f"num_speculative_tokens {drafts} with {method!r} drafts is not below half the tile length "
                f"{group} (a draft layer's steps of one engine step write up to 2k + 1 positions, which must span at "
                f"most two tiles); use fewer than {(group + 1) // 2}"
            )
    elif drafts >= group:
        problems.append(
            f"num_speculative_tokens {drafts} in --speculative-config is not below the tile length {group} (a "
            f"request may then hold more than two full-precision tiles); use fewer than {group}"
        )
    if getattr(spec, "enable_adaptive_verification", False):
        problems.append(ADAPTIVE_VERIFICATION)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device in (None, "cuda") and getattr(vllm_config, "use_v2_model_runner", False):
        problems.append(
            "speculative decoding on vLLM's V2 GPU model runner keeps tails by request index or in vLLM's blocks, "
            "which cannot yet hold a tile filled with an unverified draft next to the following one; unset "
            "VLLM_USE_V2_MODEL_RUNNER (KVarN then picks the V1 runner) or set it to 0"
        )
    if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
        problems.append(
            "asynchronous scheduling with speculative decoding gives the backend sequence lengths that assume "
            "every draft of the previous step was accepted; add --no-async-scheduling"
        )
    return problems


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's choice of GPU model runner, which its config reads whenever it is asked (``use_v2_model_runner``)."""


def serve_speculative(vllm_config) -> list[str]:
    """Fit a KVarN run with speculative decoding to what KVarN plans drafts on; returns the lines to log.

    Asynchronous scheduling goes off: with it vLLM schedules a step before the previous step's drafts
    are verified, and the host lengths a step is planned from assume every draft was accepted, while
    KVarN plans each step's tiles on the host from exact lengths. On a GPU the V1 model runner is chosen
    where vLLM would pick its V2 runner by default (``VLLM_USE_V2_MODEL_RUNNER`` unset): KVarN keeps a
    tile filled with an unverified draft in its tail pool keyed by block id, which only the V1 runner
    serves. A run that asked for the V2 runner keeps it (and is refused, saying why). Called once as vLLM
    builds the run's config, before it reads the runner choice; a run without KVarN or without drafts is
    left alone.
    """
    if not is_cache_dtype(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)):
        return []
    if getattr(vllm_config, "speculative_config", None) is None:
        return []
    lines = []
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler, "async_scheduling", False):
        scheduler.async_scheduling = False
        lines.append(
            "KVarN: asynchronous scheduling turned off for speculative decoding (KVarN plans each step from the "
            "sequence lengths after the previous step's drafts were verified)"
        )
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    v2 = getattr(vllm_config, "use_v2_model_runner", False)
    if device in (None, "cuda") and v2 and V2_RUNNER_ENV not in os.environ:
        os.environ[V2_RUNNER_ENV] = "0"
        if getattr(vllm_config, "use_v2_model_runner", False):  # a vLLM that read the choice once already
            del os.environ[V2_RUNNER_ENV]
        else:
            lines.append(
                f"KVarN: vLLM's V1 GPU model runner chosen for speculative decoding ({V2_RUNNER_ENV}=0 for this "
                "process and its workers: KVarN keeps a tile filled with an unverified draft in a tail pool keyed "
                "by block id, which the V1 runner serves)"
            )
    return lines


def key_smoothing_mode() -> str:
    """``$KVARN_KEY_SMOOTHING``: ``"auto"`` (the default) or ``"off"``; anything else is refused."""
    mode = os.environ.get(KEY_SMOOTHING_ENV, "").strip().lower() or "auto"
    if mode not in KEY_SMOOTHING_MODES:
        raise ValueError(f"{KEY_SMOOTHING_ENV} must be one of {', '.join(KEY_SMOOTHING_MODES)}, got {mode!r}")
    return mode


def _key_bias(vllm_config) -> str | None:
    return key_bias_reason(getattr(getattr(vllm_config, "model_config", None), "hf_config", None))


def served_dtype(cache_dtype: str, vllm_config) -> str:
    """The format a layer asking for ``cache_dtype`` (a :data:`kvarn.config.CACHE_DTYPES` name) is served in.

    ``cache_dtype`` itself, except on a model whose keys likely carry large per-channel biases
    (:func:`kvarn.config.key_bias_reason`: Qwen1.5/2/2.5, ``attention_bias``): there rotated keys lose
    to plain RTN at 4 bits and collapse at 2 (``docs/guide/fidelity.md``), so the layer is served in the
    ``_ks`` form (:func:`kvarn.config.with_key_smoothing`), unless ``$KVARN_KEY_SMOOTHING`` is ``off``.
    """
    if has_key_smoothing(cache_dtype) or key_smoothing_mode() == "off" or _key_bias(vllm_config) is None:
        return cache_dtype
    return with_key_smoothing(cache_dtype)


def serve_key_smoothing(vllm_config) -> str | None:
    """Set the run's cache dtype to the format it is served in (:func:`served_dtype`); returns the line to log.

    Called once as vLLM builds the run's config, before any layer reads the dtype; a dtype that is
    not KVarN's is left alone (and ``$KVARN_KEY_SMOOTHING`` is not read).
    """
    cache = getattr(vllm_config, "cache_config", None)
    asked = getattr(cache, "cache_dtype", None)
    if not is_cache_dtype(asked):
        return None
    served = served_dtype(asked, vllm_config)
    note = key_smoothing_note(asked, vllm_config)
    if served != asked:
        cache.cache_dtype = served
    return note


def key_smoothing_note(cache_dtype: str, vllm_config) -> str | None:
    """The start-up line for a layer served in another format than asked (:func:`served_dtype`), or
    the warning for a biased model served without smoothing because ``$KVARN_KEY_SMOOTHING=off``;
    ``None`` otherwise."""
    reason = None if has_key_smoothing(cache_dtype) else _key_bias(vllm_config)
    if reason is None:
        return None
    smoothed = with_key_smoothing(cache_dtype)
    if served_dtype(cache_dtype, vllm_config) == smoothed:
        return (
            f"--kv-cache-dtype {cache_dtype}: {reason}; serving it as {smoothed} (keys smoothed with one vector "
            f"per sequence: rotated keys with large per-channel offsets lose to plain RTN at 4 bits and "
            f"collapse at 2, Qwen2.5 in kvarn's docs/guide/fidelity.md). {KEY_SMOOTHING_ENV}=off serves it as named"
        )
    return (
        f"--kv-cache-dtype {cache_dtype} with {KEY_SMOOTHING_ENV}=off: {reason}; rotated keys with large "
        f"per-channel offsets lose to plain RTN at 4 bits and collapse at 2 (Qwen2.5 in kvarn's "
        f"docs/guide/fidelity.md). Unset {KEY_SMOOTHING_ENV} or use --kv-cache-dtype {smoothed} to smooth them"
    )


def sink_process_problem(vllm_config, preset: str) -> str | None:
    """Why a ``_sink`` dtype cannot run with this run's workers, or ``None``.

    The sink evicts a first tile's sink only when vLLM's block pool says no request holds its block, and then
    drops that block from the prefix cache; the pool lives with vLLM's scheduler, so the worker must run in the
    scheduler's process (the ``uni`` executor, one worker). The config hook asks too, so the refusal comes before
    vLLM starts the workers of a parallel run.
    """
    if not has_sink(preset):
        return None
    parallel = getattr(vllm_config, "parallel_config", None)
    world = getattr(parallel, "world_size", 1) or 1
    executor = getattr(parallel, "distributed_executor_backend", "uni")
    if world == 1 and executor in ("uni", None):
        return None
    why = (
        "the full-precision sink needs vLLM's scheduler and its one worker in one process: it evicts a first "
        "tile's sink only when the scheduler's block pool says no request holds its block, and then drops that "
        "block from the prefix cache"
    )
    plain = f"drop the {SINK_SUFFIX} suffix (--kv-cache-dtype {without_sink(preset)})"
    if world > 1:
        return (
            f"{why}, but this run's {world} workers (tensor or pipeline parallelism) each run in a process of "
            f"their own, with no block pool to ask; serve it on one device, or {plain}"
        )
    return (
        f"{why}, but this run's worker runs in a process of its own (the {executor!r} executor, vLLM's CPU "
        "default): set VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM's CPU platform then keeps the 'uni' executor), "
        f"or {plain}"
    )


def check_run(vllm_config, preset: str) -> None:
    """Refuse a run KVarN cannot serve, and set the cache block size to the tile length.

    Called for every KVarN layer as it is built (selection results are cached by vLLM, layer
    construction is not), so a second engine in the same process gets its block size too.
    """
    problems = run_problems(vllm_config, preset)
    if problems:
        raise ValueError(f"--kv-cache-dtype {preset}: " + "; ".join(problems))


def run_problems(vllm_config, preset: str) -> list[str]:
    """What in the run (not the layer) KVarN cannot serve; sets the block size to ``G`` when none is."""
    group = group_size(preset)
    problems = []
    cache = vllm_config.cache_config
    if cache.user_specified_block_size and cache.block_size % group:
        problems.append(
            f"--block-size {cache.block_size} is not a multiple of the tile length {group}: "
            f"drop --block-size or set it to {group}"
        )
    unit = getattr(cache, "prefix_match_unit", None)
    if unit is not None and unit % group:
        problems.append(
            f"--prefix-match-unit {unit} would let a prefix-cache hit end inside a {group}-token tile; "
            f"drop it or set it to a multiple of {group}"
        )
    problems.extend(speculative_problems(vllm_config, preset))
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "is_hybrid", False) is True and not serving.hybrid_pages_sized:
        problems.append(
            "this vLLM pads a hybrid (Mamba/conv + attention) model's Mamba pages to an attention page of one "
            "byte per K and V element (2 * KV heads * head size bytes a token), not to KVarN's smaller page, "
            "and the plugin found no Platform._align_hybrid_block_size to correct that; serve this model with "
            "--kv-cache-dtype auto, or with vLLM 0.32 or later"
        )
    if getattr(vllm_config.parallel_config, "enable_dbo", False):
        problems.append("dual-batch overlap splits one step over two metadata builders; drop --enable-dbo")
    dp = getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1
    if dp > 1:
        problems.append(
            f"data parallelism (--data-parallel-size {dp}) runs dummy batches on idle ranks over the block tables "
            "of earlier steps, and KVarN places a step's tokens by the sequence lengths and block tables, not by "
            "vLLM's padding slot mapping, so it would write into blocks of the prefix cache; drop "
            "--data-parallel-size (one server a device)"
        )
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is not None and getattr(scheduler, "max_num_seqs", None) is not None:
        try:
            tail_slot_count(vllm_config)
            if has_sink(preset):
                sink_slot_count(vllm_config)
        except ValueError as exc:
            problems.append(str(exc))
    if has_sink(preset) and unit is not None and cache.user_specified_block_size and unit < cache.block_size:
        problems.append(
            f"--prefix-match-unit {unit} below --block-size {cache.block_size} lets a prefix hit end inside a "
            "block, which vLLM then copies (copy-on-write) without the first tile's full-precision sink; set "
            f"--prefix-match-unit to the block size, or drop the {SINK_SUFFIX} suffix"
        )
    if (problem := sink_process_problem(vllm_config, preset)) is not None:
        problems.append(problem)
    if not problems and not cache.user_specified_block_size:
        cache.block_size = group
        if getattr(cache, "kv_cache_dtype_skip_layers", None):
            # vLLM re-picks a block size it thinks unset from the first layer's backend, with skipped layers
            # perhaps its own (16 tokens): marked as chosen, the tile length stands
            cache.user_specified_block_size = True
    return problems
