"""The KVarN metadata builder: one step of one KV-cache group planned for the backend's impl.

Tails in blocks (:func:`~kvarn.integration.vllm.backend.tail_blocks_enabled`). A decode batch writes
each token straight into its block row, commits a filled tile through the row's slot of one step pool
shared by all layers, and attends reading the own tiles from the blocks (:func:`kvarn.paged.block_tails`);
other steps gather the partial tiles into that step pool and scatter them back
(:func:`kvarn.paged.tail_rows`).

Tail slots (a pool). On vLLM's GPU model runner (V2) every live request has a stable index below
``max_num_seqs``; the runner hook hands the builder each step's indices
(:meth:`~kvarn.integration.vllm.state.ServingState.set_step_rows`) and the request's incomplete tile
lives in the pool slot of that index (:func:`kvarn.paged.plan_request_slots`): no block id is read on
the host. Elsewhere (the CPU runner) slots are keyed by block id (:class:`kvarn.paged.TilePlanner`) and
the block table is on the host anyway.

CUDA graphs (GPU runner): the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE``. For a decode
batch it writes the plan into persistent device tensors of fixed size: the tail mapping and each
row's slot (with tails in blocks: each row's tail blocks and its token's block row). The captured
forward writes the tail and attends; nothing in it reads a value on the host, and it commits
nothing. A decode step fills a tile in one step of ``G``, and the builder knows which on the host:
when vLLM replays such a step from its graph (the forward did not run in Python), those tiles are
committed for every layer of the builder's group (:meth:`KVarNMetadataBuilder.commit_replayed`) by
the next step, first thing: the plugin's wrapper of the GPU runner's ``execute_model``
(:func:`~kvarn.integration.vllm.scheduler.commit_replayed_steps`, before vLLM applies the step's
copy-on-write block copies, which may copy such a block; without that wrapper the builder declares no
graphs), and again, a fallback, the builder's next :meth:`~KVarNMetadataBuilder.build`. On the stream
this is after the replayed step and before anything of the next step reads the records. The step's own
attention did not need them (it reads its own tile from the slot or the blocks), and nothing else reads
or overwrites them in between, but for one case: a request admitted through a prefix hit in that very
step may hit the tile being filled, so such a step is not replayed
(:func:`~kvarn.integration.vllm.scheduler.graph_unsafe_step`). A commit captured in the graph would
launch on every replay: torch has no conditional graph nodes to skip it.

Speculative decoding (vLLM's V1 runner, slots keyed by block id). A request with ``k`` drafts is
scheduled ``1 + k`` tokens, its last ``k`` unverified; the plugin's hook of the runner's
``_update_states`` notes each row's count from the scheduler output
(:func:`~kvarn.integration.vllm.scheduler.note_drafts`) and the planner keeps the slot of a tile filled
with a draft until a later step starts past it, so a step that rewinds into it (a rejected draft)
overwrites its rows and quantizes it again (:mod:`kvarn.paged.plan`). A draft model's attention layers
(EAGLE, MTP, a draft model) have builders of their own, which vLLM's drafter calls through
:meth:`KVarNMetadataBuilder.build_for_drafting` several times an engine step: a first pass over the
step's rows, whose tokens past the target's verified ones are drafts
(:func:`~kvarn.integration.vllm.scheduler.draft_pass_drafts`), then one token a row at a time, all drafts,
each planned from the device's lengths (the drafter lowers them by the rejected tokens there). Other tail
modes are refused with speculative decoding at start-up
(:func:`~kvarn.integration.vllm.checks.speculative_problems`).

Sink (``--kv-cache-dtype kvarn_..._sink``). The first tile of every sequence is also kept in full
precision in a sink slot keyed by the block id of that first tile (:class:`kvarn.paged.SinkSlots`),
so requests sharing a first tile through the prefix cache share its sink. A sink is freed when its
block is written as another tile (CPU runner: the planner sees it in the block table) or handed out
fresh by the scheduler (GPU runner: :func:`~kvarn.integration.vllm.scheduler.note_schedule` reads each
real step's scheduler output, which also gives each request's first block; rows find theirs by request
id), and evicted (least recently used) only when vLLM's block pool says no request holds its block; the
evicted block is dropped from vLLM's prefix cache in the same step
(:func:`~kvarn.integration.vllm.scheduler.forget_cached_block`), so no later request can hit a first
tile whose sink is gone. That needs the scheduler's block pool in the worker's process (vLLM's ``uni``
executor with one worker, which the checks require). On the GPU runner the sink slots and sink writes of
a decode step go into the persistent buffers its CUDA graphs read; rows of dummy and capture batches get
slot ``-1``. See ``docs/internals/vllm_backend.md``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from kvarn.integration.vllm.backend import (
    KVarNBackend,
    check_sink,
    departures_reported,
    freed_window,
    page_slot_bytes,
    per_request_slots,
    pool_itemsize,
    tail_blocks_enabled,
)
from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV, sink_slot_count, tail_slot_count, warn_once
from kvarn.integration.vllm.hooks import install_zeroing_hook
from kvarn.integration.vllm.scheduler import block_held, draft_pass_drafts, forget_cached_block, step_drafts
from kvarn.integration.vllm.state import serving
from kvarn.integration.vllm.warmup import rehearse, warmup_wanted
from kvarn.paged import (
    PREFILL_MIN_QUERIES,
    BlockTails,
    PrefillSplit,
    SinkSlots,
    TailRows,
    TilePlan,
    TilePlanner,
    block_tails,
    plan_request_slots,
    split_prefill,
    tail_geometry,
    tail_rows,
)

logger = logging.getLogger("vllm.kvarn")


@dataclass
class KVarNMetadata(AttentionMetadata):
    """One step of one KV-cache group: the tile plan plus what attention reads.

    ``query_start_loc: [B + 1]``, ``seq_lens: [B]``, ``block_table: [B, max_blocks]`` as vLLM
    gives them; ``plan`` from the planner; ``num_slots`` slots in each layer's pool. For a
    decode batch on the GPU runner also ``graph_ready`` (``plan`` holds the persistent tensors a
    captured graph reads) and ``decode`` (one query per row). ``prefill``: on CUDA, the requests of
    a step with prompt chunks that attend through pages and one varlen call
    (:func:`kvarn.paged.split_prefill`).
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: TilePlan
    num_slots: int
    graph_ready: bool = False
    decode: bool = False
    prefill: PrefillSplit | None = None
    tails: tuple[TailRows, TailRows] | None = None
    """Tails in blocks: where the partial tiles are before the step and after it (:func:`kvarn.paged.tail_rows`)."""
    block_tails: BlockTails | None = None
    """Tails in blocks, a decode step: the own tiles' blocks and the tokens' rows (:func:`kvarn.paged.block_tails`)."""
    decode_layers: dict | None = None
    """The builder's :attr:`KVarNMetadataBuilder.decode_layers`, which a decode step's forward fills."""
    forward_ran: bool = False
    """Set by the forward when it runs in Python (an eager step, which commits its own tiles, or a graph
    capture); a step vLLM replays from a CUDA graph leaves it ``False`` (see the module docstring)."""


def _layer_counts(vllm_config, preset: str, group_layers: int) -> tuple[int, int, int]:
    """The layers of this process that ``preset``'s backend serves, its Mamba/conv layers (their state shares
    vLLM's block pool) and how many of the first are sliding-window layers, from the model's layers as vLLM
    registered them; ``(group_layers, 0, 0)`` where there are none.
    """
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    kvarn = state = window = 0
    for layer in context.values():
        backend = getattr(layer, "attn_backend", None)
        if isinstance(backend, type) and issubclass(backend, KVarNBackend) and backend.preset == preset:
            kvarn += 1
            window += getattr(layer, "sliding_window", None) is not None
        elif callable(getattr(layer, "get_state_shape", None)):  # vLLM's MambaBase: a Mamba, conv or linear layer
            state += 1
    return (kvarn, state, window) if kvarn >= group_layers else (group_layers, state, 0)


class _DecodeBuffers:
    """Persistent device tensors a captured decode step reads; :meth:`KVarNMetadataBuilder.build` refills them."""

    def __init__(self, max_tokens: int, max_reqs: int, device, sink: bool = False, tail_blocks: int = 0):
        self.mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # tails in blocks: each row's own-tile blocks and its token's block row (kvarn.paged.block_tails)
        self.tables = torch.zeros(max_reqs, tail_blocks, dtype=torch.int32, device=device) if tail_blocks else None
        self.block_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device) if tail_blocks else None
        self.sink_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device) if sink else None
        self.sink_slots = torch.full((max_reqs,), -1, dtype=torch.int32, device=device) if sink else None
        # int32: the attention kernel's type, so no cast launch per layer
        self.tail_slots = torch.zeros(max_reqs, dtype=torch.int32, device=device)


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    """Builds :class:`KVarNMetadata` for its backend's preset; owns its group's tail-slot state."""

    backend: ClassVar[type[KVarNBackend]] = KVarNBackend
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """Single-token decode graphs where the builder plans them (request-index slots, or tails in blocks on
        the GPU runner) and the plugin wraps the runner's ``execute_model``: that wrapper commits replayed
        steps before vLLM's copy-on-write block copies and keeps a step that admits a prefix hit out of the
        full graph (:mod:`kvarn.integration.vllm.scheduler`). Without it, none: attention runs in Python every
        step, which commits before it attends (slower, logged)."""
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
        in_blocks = device == "cuda" and tail_blocks_enabled(vllm_config, cls.backend.preset)
        if not (per_request_slots(vllm_config) or in_blocks):
            return AttentionCGSupport.NEVER
        if not serving.scheduler_hooked:
            warn_once(
                "KVarN: vLLM's GPU model runner has no execute_model the plugin could wrap; decode steps run "
                "without full CUDA graphs"
            )
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.cfg = self.backend.config(kv_cache_spec.head_size)
        preset = self.cfg.name
        if kv_cache_spec.block_size != self.cfg.group_size:
            raise ValueError(
                f"{preset} needs kernel blocks of {self.cfg.group_size} tokens, vLLM gave {kv_cache_spec.block_size}"
            )
        cuda = torch.device(device).type == "cuda"
        warm = warmup_wanted(device)  # first: an unknown $KVARN_WARMUP is refused on every engine, rehearsing or not
        check_sink(vllm_config, self.backend.preset)
        install_zeroing_hook()  # vLLM's CPU runner is imported by now; new blocks of several tiles zeroed whole
        self.tail_rows = self.tail_blocks = 0  # tails in blocks: rows of a block, blocks a tail (else a pool)
        if tail_blocks_enabled(vllm_config, self.backend.preset):
            self.tail_rows, tail_blocks = tail_geometry(self.cfg, pool_itemsize(vllm_config))
            self.tail_blocks = tail_blocks
            if getattr(kv_cache_spec, "tail_blocks", None) != tail_blocks:
                raise RuntimeError(
                    f"KVarN tails in vLLM's blocks: vLLM's KV cache spec for these layers gives each request "
                    f"{getattr(kv_cache_spec, 'tail_blocks', 0)} tail blocks, the backend needs {tail_blocks} "
                    f"(the spec was built without this run's config); set {TAIL_BLOCKS_ENV}=0 to keep a tail pool"
                )
            self.num_slots = int(vllm_config.scheduler_config.max_num_seqs)
        self.per_request = not self.tail_rows and per_request_slots(vllm_config) and cuda
        if not self.tail_rows:
            released = departures_reported(self.per_request)
            self.num_slots = tail_slot_count(vllm_config, per_request=self.per_request, departures_reported=released)
            if getattr(vllm_config, "speculative_config", None) is not None and not (released or self.per_request):
                raise ValueError(
                    f"--kv-cache-dtype {preset} with --speculative-config: KVarN learns each step's drafts through "
                    "vLLM's V1 model runner (its _update_states), which this vLLM does not have; drop "
                    "--speculative-config or use --kv-cache-dtype auto"
                )
        self.num_sink_slots = sink_slot_count(vllm_config) if self.backend.sink else 0
        self.scratch_slot = self.num_sink_slots + self.num_slots
        self.sinks = None  # request-index mode: the sink slots (the planner keeps them otherwise)
        self._first_cache = None  # (book version, request ids, their first blocks) of the last step
        self.layer_name = layer_names[0] if layer_names else ""
        self.window = freed_window(kv_cache_spec)
        if self.window is not None and (self.num_sink_slots or (self.cfg.seq_smooth and cuda)):
            raise ValueError(  # such runs get full-attention pages (checks.freed_window_problems): never planned
                f"--kv-cache-dtype {preset}: sliding-window layers whose blocks vLLM frees keep no sink, and on a GPU "
                "no per-sequence smoothing vector; add --kv-cache-dtype-skip-layers sliding_window"
            )
        self.planner = None
        if not self.per_request and not self.tail_rows:
            self.planner = TilePlanner(
                self.num_slots,
                self.cfg.group_size,
                num_sink_slots=self.num_sink_slots,
                sink_pinned=block_held,
                on_sink_evicted=forget_cached_block,
                window=self.window,
            )
        elif self.num_sink_slots:
            self.sinks = SinkSlots(self.num_sink_slots, self.cfg.group_size, block_held, forget_cached_block)
            serving.sink_book.pools.add(self.sinks)
        if self.planner is not None:
            serving.planners.add(self.planner)
        self.buffers = None
        self.replay_commits: list[KVarNMetadata] = []  # decode steps that fill tiles (commit_replayed)
        self.decode_layers: dict[str, tuple] = {}
        """Layer name -> (impl, layer, vLLM's KV cache tensor, query dtype) of every layer of this group whose
        forward ran a decode step in Python (a CUDA-graph capture among them): what :meth:`commit_replayed`
        commits. Held here, so an engine's caches go with its builders."""
        # prompt chunks through pages and flash attention (PagedKV.attend_split) on CUDA; on the CPU the paged
        # reference attention is as fast (tests switch it on to cover the wiring)
        self.prefill_split = torch.device(device).type == "cuda"
        if cuda and (self.per_request or self.tail_rows):  # CUDA-graph decode steps
            sched = vllm_config.scheduler_config
            size = max(int(sched.max_num_batched_tokens), int(sched.max_num_seqs))
            sink = self.sinks is not None
            self.buffers = _DecodeBuffers(size, size, device, sink=sink, tail_blocks=self.tail_blocks)
            serving.graph_builders.add(self)
        self._warm_pending = bool(self.tail_rows) and warm  # warmup.rehearse before a first step
        self._log_capacity(vllm_config, kv_cache_spec, len(layer_names))

    def _log_capacity(self, vllm_config, spec, num_layers: int) -> None:
        """Log the run's KVarN capacity once per process and cache configuration.

        Counted over every KVarN layer of the run, not only this builder's group: a hybrid model's
        attention layers may form several KV-cache groups, each taking a block of vLLM's one pool for the
        same tokens. A block holds ``cache_config.block_size`` tokens (one tile or several)."""
        num_blocks = vllm_config.cache_config.num_gpu_blocks
        cfg = self.cfg
        block_tokens = int(getattr(vllm_config.cache_config, "block_size", None) or cfg.group_size)
        kvarn_layers, state_layers, window_layers = _layer_counts(vllm_config, self.backend.preset, num_layers)
        key = (num_blocks, block_tokens, spec.num_kv_heads, spec.head_size, kvarn_layers, self.backend.preset)
        key += (self.tail_rows,)
        if not num_blocks or key in serving.logged_capacity:
            return
        serving.logged_capacity.add(key)
        groups = -(-kvarn_layers // num_layers)  # vLLM gives every group of a hybrid model as many layers
        tokens = num_blocks * block_tokens // groups
        cache_bytes = tokens * kvarn_layers * spec.num_kv_heads * page_slot_bytes(cfg)
        dtype_bytes = torch.tensor([], dtype=vllm_config.model_config.dtype).element_size()
        pool = self.num_slots + int(self.per_request)
        slot_bytes = cfg.group_size * spec.num_kv_heads * cfg.head_dim * 2 * dtype_bytes * kvarn_layers
        tail_bytes = pool * slot_bytes // (kvarn_layers if self.tail_rows else 1)  # tails in blocks: one step pool
        sink_bytes = self.num_sink_slots * slot_bytes
        fp16_tokens = cache_bytes // (kvarn_layers * spec.num_kv_heads * 4 * cfg.head_dim)
        fp16_all = (cache_bytes + tail_bytes + sink_bytes) // (kvarn_layers * spec.num_kv_heads * 4 * cfg.head_dim)
        # vLLM measures the memory its profiling (GPU) or warm-up run (CPU) leaves and sizes the KV
        # cache from it, pool included; an explicit --kv-cache-memory-bytes is taken as given
        where = (
            "inside vLLM's KV budget (allocated in its profiling run)"
            if getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None) is None
            else "on top of --kv-cache-memory-bytes"
        )
        shared = []
        if groups > 1:
            shared.append(f"a token takes a block in each of the {groups} KV-cache groups of KVarN layers")
        if state_layers:
            shared.append(
                f"the blocks also hold the state of {state_layers} Mamba/conv layer{'s' * (state_layers > 1)}, a "
                "few blocks per running request (vLLM's concurrency line counts them)"
            )
        shared = f" Hybrid model: {'; '.join(shared)}." if shared else ""
        if window_layers:
            shared += (
                f" {window_layers} of the {kvarn_layers} layers have a sliding window: where vLLM frees a request's "
                "blocks before its window, long sequences fit more tokens than this."
            )
        logger.info(
            "KVarN %s KV cache: %d blocks of %d tokens = %d tokens in %.1f MiB of records (%d layers, %d KV "
            "heads, %d B per record); an fp16 cache of the same size holds %d tokens: %.2fx the capacity.%s "
            "Full-precision tail pool: %d slots (%s), %.1f MiB, %s;%s records and pool together hold %.2fx the "
            "tokens of an fp16 cache of their size.",
            self.backend.preset,
            num_blocks,
            block_tokens,
            tokens,
            cache_bytes / 2**20,
            kvarn_layers,
            spec.num_kv_heads,
            cfg.record_bytes,
            fp16_tokens,
            tokens / max(fp16_tokens, 1),
            shared,
            pool,
            (
                f"a step pool shared by the layers; each running request keeps its tail in "
                f"{getattr(spec, 'tail_blocks', 0)} more blocks of the cache above"
                if self.tail_rows
                else "one per request index + 1 scratch"
                if self.per_request
                else "keyed by block id"
            ),
            tail_bytes / 2**20,
            where,
            (
                f" full-precision sink pool: {self.num_sink_slots} slots (first tiles keyed by block id), "
                f"{sink_bytes / 2**20:.1f} MiB, allocated with the tail pool;"
                if self.num_sink_slots
                else ""
            ),
            tokens / max(fp16_all, 1),
        )

    def _request_slots(self, cam: CommonAttentionMetadata, batch: int) -> np.ndarray:
        rows, qsl = serving.step_rows, serving.step_qsl
        if rows is None or qsl is None or not np.shares_memory(cam.query_start_loc_cpu.numpy(), qsl):
            raise RuntimeError(
                "the KVarN backend did not receive this step's request indices from vLLM's GPU model runner; "
                "run with VLLM_USE_V2_MODEL_RUNNER=0 (tail slots then follow block ids) or report this"
            )
        slots = np.full(batch, self.scratch_slot, dtype=np.int64)
        slots[: min(len(rows), batch)] = rows[:batch] + self.num_sink_slots
        return slots

    def _sink_slots(self, qsl: np.ndarray, lens: np.ndarray, batch: int) -> np.ndarray:
        """Each row's sink slot in request-index mode (``-1`` for rows of no live request: dummy and
        CUDA-graph capture batches), from the first blocks
        :func:`~kvarn.integration.vllm.scheduler.note_schedule` recorded."""
        req_ids = serving.step_req_ids
        if req_ids is None:
            raise RuntimeError("the KVarN sink did not receive this step's request ids from vLLM's GPU model runner")
        req_ids = req_ids[:batch]
        book = serving.sink_book
        key = (book.version, id(book.first))
        if self._first_cache is None or self._first_cache[0] != key or self._first_cache[1] != req_ids:
            group = book.group_of.get(self.layer_name, 0)
            first = np.full(batch, -1, dtype=np.int64)
            for r, req_id in enumerate(req_ids):
                blocks = book.first.get(req_id)
                if blocks is None:
                    if req_id in book.scheduled:
                        raise RuntimeError(f"the KVarN sink has no first block for request {req_id!r} of this step")
                    continue
                first[r] = blocks[group]
            self._first_cache = (key, list(req_ids), first)
        first = self._first_cache[2]
        n = qsl[1 : batch + 1] - qsl[:batch]
        start = lens[:batch] - n
        live = (first >= 0) & (n > 0)
        slots = np.full(batch, -1, dtype=np.int64)
        if (start[live] >= self.cfg.group_size).all():  # only reads of complete first tiles (decoding)
            got = self.sinks.read(first[live])
            if got is not None:
                slots[live] = got
                return slots
        rows = [(int(r), int(first[r]), int(start[r])) for r in np.flatnonzero(live)]
        return np.asarray(self.sinks.assign(rows, batch), dtype=np.int64)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KVarNMetadata:
        return self._build(common_attn_metadata)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int) -> KVarNMetadata:
        """A draft model's step (``draft_index`` 0: its pass over the engine step's rows; then one token a row).

        Planned from the device's lengths, which the drafter lowers by each row's rejected tokens after its first
        pass (the host's upper bound assumes every draft accepted), with every token past the verified ones a
        draft, so the next engine step can rewind into the tiles they fill."""
        return self._build(common_attn_metadata, drafting=draft_index)

    def _build(self, cam: CommonAttentionMetadata, drafting: int | None = None) -> KVarNMetadata:
        self.commit_replayed()
        if self._warm_pending:  # the serving kernels compiled before the first step over the bound cache
            self._warm_pending = False  # first: the rehearsal's own steps come back through this build
            self._warm_pending = not rehearse(self, cam, serving.bookkeeping_paused)
            self.replay_commits.clear()  # the rehearsal's (its forwards ran; a failed one's are of its scratch cache)
        batch = cam.num_reqs
        serving.probe.note_build(self.layer_names)
        lens_cpu = None if drafting is not None else cam.seq_lens_cpu_upper_bound
        lens_cpu = cam.seq_lens[:batch].cpu() if lens_cpu is None else lens_cpu[:batch]
        qsl_cpu = cam.query_start_loc_cpu[: batch + 1]
        block_table = cam.block_table_tensor[:batch]
        meta = KVarNMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=cam.query_start_loc[: batch + 1],
            seq_lens=cam.seq_lens[:batch],
            block_table=block_table,
            plan=None,
            num_slots=self.num_sink_slots + self.num_slots + int(self.per_request),
            decode_layers=self.decode_layers,
        )
        if drafting is None:
            drafts = step_drafts(qsl_cpu.numpy(), batch)
        elif drafting == 0:
            drafts = draft_pass_drafts(qsl_cpu.numpy(), batch)
        else:
            drafts = np.diff(qsl_cpu.numpy().astype(np.int64))
        if drafts is not None and drafts.any() and self.planner is None:
            raise RuntimeError(
                "the KVarN backend plans speculative drafts with tail slots keyed by block id only; this run keeps "
                "tails by request index or in blocks (refused at start-up: report this)"
            )
        if self.prefill_split and cam.max_query_len >= PREFILL_MIN_QUERIES:
            # eager prompt chunks: exact lengths (one host sync per such step)
            exact = cam.seq_lens[:batch].cpu().numpy()
            if exact.size and int(exact.max()) <= block_table.shape[1] * self.cfg.group_size:  # not a dummy run's
                meta.prefill = split_prefill(qsl_cpu.numpy(), exact, self.device)
        if self.tail_rows:
            qsl_np, lens_np = qsl_cpu.numpy(), np.asarray(lens_cpu, dtype=np.int64)
            slots = np.arange(batch)  # the step pool: a slot per row, refilled from the blocks every step
            meta.plan = plan_request_slots(
                qsl_np, lens_np, block_table, cam.num_actual_tokens, slots, self.cfg.group_size
            )
            if cam.max_query_len == 1 and cam.num_actual_tokens == batch and meta.plan.late_tail_slot_mapping is None:
                self._decode_in_blocks(meta, cam, batch, lens_np)
                return meta
            serving.tail_block_steps["gathered"] += 1
            starts = lens_np - (qsl_np[1:] - qsl_np[:-1])
            g, slots_t = self.cfg.group_size, torch.from_numpy(slots)
            starts_t = torch.from_numpy(starts)
            before = tail_rows(block_table, starts_t, slots_t, g, self.tail_rows)
            # written back after the step: its new tokens only (the older rows are in their blocks)
            after = tail_rows(block_table, torch.from_numpy(lens_np), slots_t, g, self.tail_rows, since=starts_t)
            meta.tails = (before, after)
            return meta
        if not self.per_request:
            meta.plan = self.planner.plan(
                qsl_cpu, lens_cpu, block_table.cpu(), cam.num_actual_tokens, self.device, num_drafts=drafts
            )
            return meta
        slots = self._request_slots(cam, batch)
        qsl_np, lens_np = qsl_cpu.numpy(), np.asarray(lens_cpu)
        sinks = None if self.sinks is None else self._sink_slots(qsl_np, lens_np, batch)
        g = self.cfg.group_size
        plan = plan_request_slots(qsl_np, lens_np, block_table, cam.num_actual_tokens, slots, g, sinks)
        meta.plan = plan
        if cam.max_query_len == 1 and cam.num_actual_tokens == batch and plan.late_tail_slot_mapping is None:
            self._decode_shape(meta, plan, batch)
        return meta

    def _decode_in_blocks(self, meta: KVarNMetadata, cam: CommonAttentionMetadata, batch: int, lens) -> None:
        """A decode step with tails in the blocks: each row's token goes straight to its block row and attention
        reads the own tiles there (:func:`kvarn.paged.block_tails`, on the device: no host sync); a tile the
        step fills is copied into the row's step-pool slot and committed from it. On CUDA through the
        persistent buffers a captured graph reads."""
        g, width = self.cfg.group_size, meta.block_table.shape[1]
        last = (int(np.max(lens)) - 1) // g + self.tail_blocks if batch else 0
        if last >= width:
            raise ValueError(
                f"a sequence of {int(np.max(lens))} tokens keeps its tail in blocks up to column {last}, but the "
                f"block table has {width} columns (vLLM must give it the tail blocks)"
            )
        tails = block_tails(meta.block_table, cam.seq_lens[:batch], g, self.tail_rows, self.tail_blocks)
        serving.tail_block_steps["decode"] += 1
        serving.probe.note_build(self.layer_names, batch, lens)
        serving.tail_block_steps["commits"] += bool(meta.plan.commit_slots.numel())
        if self.buffers is None:
            meta.block_tails, meta.decode = tails, True
            return
        self._decode_shape(meta, meta.plan, batch)
        buf = self.buffers
        buf.tables[:batch].copy_(tails.tables)
        buf.block_mapping[:batch].copy_(tails.mapping)
        meta.block_tails = BlockTails(buf.tables[:batch], buf.block_mapping[:batch], self.tail_rows)

    def commit_replayed(self) -> int:
        """Commit the tiles that the pending decode steps filled, those vLLM replayed from a CUDA graph; the
        number of layer commits (see the module docstring).

        :func:`~kvarn.integration.vllm.scheduler.commit_replayed_steps` (the ``execute_model`` hook) and
        :meth:`build` call it
        first, so the commit launches follow the replayed step on the stream and precede the next
        step's work, and read the step's plan and block tails (with tails in blocks, the tables are the
        persistent buffer ``tables`` the graph read) before the step being built refills any persistent
        buffer. Only layers whose forward ran in Python (a capture) can have been replayed; each
        commits with the plan and block tails of that step."""
        if not self.replay_commits or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return 0  # nothing pending, or a build inside a capture: not into the graph; a later call commits
        pending = [m for m in self.replay_commits if not m.forward_ran]
        self.replay_commits.clear()
        done = 0
        for meta in pending:
            for name in self.layer_names:
                target = self.decode_layers.get(name)
                if target is not None:
                    impl, layer, kv_cache, dtype = target
                    impl.commit_step(layer, kv_cache, dtype, meta)
                    done += 1
            serving.tail_block_steps["replay_commits"] += 1
        return done

    def _decode_shape(self, meta: KVarNMetadata, plan: TilePlan, batch: int) -> None:
        """Copy a decode step's plan into the persistent buffers a captured graph reads."""
        buf = self.buffers
        buf.mapping[:batch].copy_(plan.tail_slot_mapping)
        buf.tail_slots[:batch].copy_(plan.tail_slots)
        if plan.commit_slots.numel():  # committed by the forward, or after a replay (commit_replayed)
            self.replay_commits.append(meta)
        sink = {}
        if buf.sink_slots is not None:
            buf.sink_mapping[:batch].copy_(plan.sink_slot_mapping)
            buf.sink_slots[:batch].copy_(plan.sink_slots)
            sink = {"sink_slot_mapping": buf.sink_mapping[:batch], "sink_slots": buf.sink_slots[:batch]}
        # the commit lists stay the plan's own tensors: a graph does not read them, and a commit after a
        # replay runs before the next step's plan exists
        exact = dataclasses.replace(
            plan,
            **sink,
            tail_slot_mapping=buf.mapping[:batch],
            tail_slots=buf.tail_slots[:batch],
            head_slots=buf.tail_slots[:batch],  # one slot per request: the step's tile is in it
        )
        meta.plan, meta.graph_ready = exact, True
        meta.decode = True
