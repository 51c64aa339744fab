"""One layer's KVarN storage: its records and its full-precision tail and sink pool.

:class:`PagedKV` carries out a :class:`~kvarn.paged.plan.TilePlan` through :mod:`kvarn.ops`: the
step's tail tokens into the pool, the tiles they complete into records, the step's whole tiles
straight into records, then attention under the own-tile rule (through the paged kernel, or for
prompt chunks through pages and one varlen call: :mod:`kvarn.paged.prefill`). It holds no
decision of its own: which tile goes where is the plan's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kvarn import ops
from kvarn.config import KVarNConfig
from kvarn.paged.plan import TilePlan
from kvarn.paged.prefill import PagedChunks, PageLayout, PrefillSplit, VarlenAttention, sdpa_varlen
from kvarn.paged.slots import BlockTails, TailRows


@dataclass
class PagedKV:
    """The KVarN storage of one attention layer, and the ops that carry a :class:`TilePlan` out.

    Attributes:
        cfg: the format (its ``head_dim`` is the layer's).
        cache: ``[num_blocks, Hkv, record_bytes]`` uint8, one record per (full tile, KV head).
        tail_k, tail_v: ``[slots, G, Hkv, D]`` in the store dtype, the full-precision pool in the
            rotated frame and the pool form (an fp16 pool holds the values times ``2^-POOL_EXP``,
            :func:`kvarn.reference.pool_exponent`; read it with :func:`kvarn.ops.from_pool`):
            ``num_sink_slots`` sink slots first, then the tail slots (the planner's numbering).
        num_sink_slots: how many slots at the start of the pool hold sinks.
        impl: ``"auto" | "reference" | "triton"``, passed to every :mod:`kvarn.ops` call.
    """

    cfg: KVarNConfig
    cache: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    num_sink_slots: int = 0
    impl: str = "auto"
    late_pending: TilePlan | None = field(default=None, repr=False)
    """A plan :meth:`store` carried out whose late tail tokens :meth:`write_late_tail` has not written yet."""

    @classmethod
    def allocate(
        cls,
        cfg: KVarNConfig,
        num_blocks: int,
        num_heads: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        num_sink_slots: int = 0,
        impl: str = "auto",
    ) -> PagedKV:
        """Zeroed storage: ``num_blocks`` records and ``num_slots + num_sink_slots`` pool tiles."""
        pool = (num_sink_slots + num_slots, cfg.group_size, num_heads, cfg.head_dim)
        cache = torch.zeros(num_blocks, num_heads, cfg.record_bytes, dtype=torch.uint8, device=device)
        tail_k = torch.zeros(pool, dtype=dtype, device=device)
        return cls(cfg, cache, tail_k, torch.zeros_like(tail_k), num_sink_slots, impl)

    @property
    def num_slots(self) -> int:
        """Tail slots (the pool less its sink slots)."""
        return self.tail_k.shape[0] - self.num_sink_slots

    def grow_pool(self, slots: int) -> None:
        """Make the pool at least ``slots`` rows long (new rows zeroed), keeping what it holds."""
        have = self.tail_k.shape[0]
        if slots > have:
            extra = self.tail_k.new_zeros(slots - have, *self.tail_k.shape[1:])
            self.tail_k = torch.cat([self.tail_k, extra])
            self.tail_v = torch.cat([self.tail_v, extra])

    def grow_blocks(self, num_blocks: int) -> None:
        """Make the cache at least ``num_blocks`` records long (new records zeroed); block ids stay."""
        have = self.cache.shape[0]
        if num_blocks > have:
            self.cache = torch.cat([self.cache, self.cache.new_zeros(num_blocks - have, *self.cache.shape[1:])])

    def overflows(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether storing ``k, v: [T, Hkv, D]`` (before any cast to the pool dtype) saturates the pool.

        An fp16 pool holds rotated values up to ``2^POOL_EXP`` (``>= sqrt(D)``) times 65504
        (:func:`kvarn.reference.pool_exponent`), and no rotated element exceeds its token's L2
        norm (the rotation is orthonormal): fp16 K/V never saturate it. Wider K/V (an fp32 or
        bf16 model storing in fp16) may, through a value past 65504 (the cast) or a token whose
        norm is past the pool form's range. bf16 and fp32 pools hold any finite input (``prepare``
        saturates at ``2^24`` first). One reduction and one host sync; for callers that can afford
        it (the transformers cache), not for a captured step.
        """
        pool = self.tail_k.dtype
        if not k.numel() or pool != torch.float16 or (k.dtype == pool and v.dtype == pool):
            return False
        finite = torch.finfo(pool).max
        amax = torch.maximum(k.abs().amax(), v.abs().amax()).float()
        if not self.cfg.rotate:
            return bool(amax > finite)
        limit = finite * 2.0 ** ops.pool_exponent(pool, self.cfg.head_dim)
        norm = torch.maximum(k.float().norm(dim=-1).amax(), v.float().norm(dim=-1).amax())
        return bool((amax > finite) | (norm > limit))

    def store(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one step's ``k, v: [T, Hkv, D]`` (model frame) as ``plan`` says, in place, before attention.

        Tail (and sink) tokens first, then the tiles they complete, then the step's whole tiles:
        :meth:`write_tail`, :meth:`commit`, :meth:`store_whole`. The tokens of a tile that the step
        starts in a slot it takes over (:meth:`write_late_tail`) go in after the step's attention;
        the next :meth:`store` raises if they were not written.
        """
        if self.late_pending is not None:
            raise RuntimeError(
                "PagedKV.store: the previous step's late tail tokens were never written; call "
                "write_late_tail(plan, k, v) after each step's attention"
            )
        self.write_tail(plan, k, v)
        self.commit(plan)
        self.store_whole(plan, k, v)
        if plan.late_tail_slot_mapping is not None:
            self.late_pending = plan

    def write_tail(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """The plan's tail (and sink) tokens of ``k, v: [T, Hkv, D]`` into the pool (negative entries skip)."""
        cfg, impl = self.cfg, self.impl
        if plan.slots_needed > self.tail_k.shape[0]:
            raise ValueError(f"the plan uses {plan.slots_needed} pool slots, this pool has {self.tail_k.shape[0]}")
        ops.write_tail(k, v, self.tail_k, self.tail_v, plan.tail_slot_mapping, cfg, impl=impl)
        if plan.sink_slot_mapping is not None:
            ops.write_tail(k, v, self.tail_k, self.tail_v, plan.sink_slot_mapping, cfg, impl=impl)

    def write_late_tail(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """The plan's tail tokens that go in after the step's attention (a slot handed to the next tile).

        Attention still reads the completed tile from the slot (:attr:`TilePlan.head_slots`);
        call this once the step's attention (every layer's own) has run, before the next step.
        """
        if plan.late_tail_slot_mapping is not None:
            ops.write_tail(k, v, self.tail_k, self.tail_v, plan.late_tail_slot_mapping, self.cfg, impl=self.impl)
        if self.late_pending is plan:
            self.late_pending = None

    def _first_blocks(self, first: torch.Tensor | None) -> torch.Tensor | None:
        """``smooth_src`` for the store ops: the plan's first blocks for per-sequence smoothing, else None."""
        if not self.cfg.seq_smooth:
            return None
        if first is None:
            raise ValueError(f"{self.cfg.name} with smooth_scope='sequence' needs a plan with commit_first/store_first")
        return first

    def commit(self, plan: TilePlan) -> None:
        """Quantize the pool tiles that are full after this step into their blocks."""
        src = self._first_blocks(plan.commit_first)
        ops.commit_tiles(
            self.tail_k, self.tail_v, plan.commit_slots, plan.commit_blocks, self.cache, self.cfg, src, impl=self.impl
        )

    def store_whole(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize the step's whole tiles straight from ``k, v: [T, Hkv, D]``."""
        cfg = self.cfg
        if plan.store_blocks.numel():
            idx = plan.store_token_idx.reshape(-1)
            shape = (plan.store_blocks.numel(), cfg.group_size, *k.shape[1:])
            src = self._first_blocks(plan.store_first)
            ops.store_tiles(
                k[idx].view(shape), v[idx].view(shape), plan.store_blocks, self.cache, cfg, src, impl=self.impl
            )

    def attend(
        self,
        plan: TilePlan,
        query: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        scale: float | None = None,
        out: torch.Tensor | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        tails: BlockTails | None = None,
        *,
        window: int | None = None,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one step's ``query: [T, Hq, D]`` after :meth:`store` -> ``[T, Hq, D]`` (``out`` if given).

        Each request's tokens attend causally over its first ``seq_lens`` tokens under the own-tile
        rule: the tiles before a query's own from the records (the first from its sink slot, with a
        sink), its own tile from the step's head slot and ``key, value: [T, Hkv, D]`` (the step's
        K/V as stored; needed where a request's queries span tiles, e.g. a prompt chunk). With
        ``tails`` (a decode step, tails in the cache's blocks: :func:`block_tails`) the own tiles are
        read from their blocks instead of the head slots. ``window``: the layer's sliding window (a
        query at ``p`` sees keys ``p - window + 1 .. p``; a request's block-table entries before its
        first query's window, and its sink slot once that window has left tile 0, are not read);
        ``sink_logits: [Hq]``: learned sink logits in the softmax denominator
        (:func:`kvarn.ops.paged_attention`).
        """
        pool_k, pool_v, own = self.tail_k, self.tail_v, plan.head_slots
        if tails is not None:
            (pool_k, pool_v), own = self.tail_block_view(tails.rows_per_block), tails.tables
        return ops.paged_attention(
            query,
            self.cache,
            block_table,
            seq_lens,
            pool_k,
            pool_v,
            own,
            self.cfg,
            query_start_loc,
            plan.sink_slots,
            scale,
            key,
            value,
            out=out,
            window=window,
            sink_logits=sink_logits,
            impl=self.impl,
        )

    def read_pages(
        self,
        plan: TilePlan,
        block_table: torch.Tensor,
        layout: PageLayout,
        key: torch.Tensor,
        value: torch.Tensor,
        dtype: torch.dtype,
    ) -> PagedChunks:
        """The K/V that the prompt chunks of ``layout`` attend over, as pages of ``G`` tokens, model frame, ``dtype``.

        Per request, the tiles before its last query's tile are dequantized into one page each (a
        sink tile read from its slot), and each tile holding queries gets a full-precision page:
        the tile's tokens before the step from the head slot, the step's from ``key, value:
        [T, Hkv, D]`` through the pool form (the values a tail slot would hold). Batched over all
        requests, three launches (:func:`kvarn.ops.write_record_pages`, then
        :func:`kvarn.ops.write_row_pages` for the head slots' tokens and for the step's), each
        writing its rows straight into the pages (:mod:`kvarn.reference.pages` states the values).

        Every page element is written once: the record pages whole, and of each query tile's page
        its rows before ``seqused_k`` (head slot and step tokens) and, as zeros, the rows past it
        (only the last query tile of a request has any; the attention never reads them, and zeros
        keep a ``0 * garbage`` product of a masked key finite). Those padding rows are found on the
        host once per layout and kept with its device index arrays.
        """
        cfg, g = self.cfg, self.cfg.group_size
        heads, d = self.cache.shape[1], cfg.head_dim
        dev = self.cache.device
        ix = layout.on(dev)
        pages = [torch.empty(layout.num_pages, g, heads, d, dtype=dtype, device=dev) for _ in range(2)]
        if ix["rec_row"].shape[0]:
            ops.write_record_pages(
                self.cache,
                block_table,
                ix["rec_row"],
                ix["rec_tile"],
                *pages,
                cfg,
                self.tail_k,
                self.tail_v,
                plan.sink_slots,
                impl=self.impl,
            )
        if ix["held_dst"].shape[0]:
            slots = plan.head_slots[ix["held_rows"]]
            ops.write_row_pages(
                self.tail_k, self.tail_v, ix["held_src"], ix["held_dst"], *pages, cfg, False, slots, impl=self.impl
            )
        ops.write_row_pages(
            key, value, ix["step_rows"], ix["step_dst"], *pages, cfg, True, None, self.tail_k.dtype, impl=self.impl
        )
        table, cu_q, used = ix["block_table"], ix["cu_q"], ix["seqused_k"]
        return PagedChunks(pages[0], pages[1], layout.cu_q, layout.seqused_k, table, cu_q, used)

    def attend_split(
        self,
        plan: TilePlan,
        query: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        split: PrefillSplit,
        scale: float | None = None,
        varlen: VarlenAttention | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`attend` for a step that :func:`split_prefill` split. ``query: [T, Hq, D]`` -> ``[T, Hq, D]``.

        The prefill requests attend over :meth:`read_pages` in one ``varlen`` call per group of
        at most :data:`~kvarn.paged.prefill.PREFILL_READ_TOKENS` tokens (default :func:`sdpa_varlen`; the vLLM backend
        passes flash attention); the other requests go through the paged kernel.
        ``key, value: [T, Hkv, D]``: the step's K/V, as for :meth:`attend`. Full attention only: a layer with a
        sliding window or sink logits attends through :meth:`attend` (the pages hold every tile before a query's).
        """
        if key is None or value is None:
            raise ValueError("attend_split needs the step's key and value (the prompt chunks' own tiles)")
        out = torch.empty_like(query)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if split.rest_rows is not None:
            rows, tokens = split.rest_rows, split.rest_tokens
            sinks = None if plan.sink_slots is None else plan.sink_slots[rows]
            out[tokens] = ops.paged_attention(
                query[tokens],
                self.cache,
                block_table[rows],
                seq_lens[rows],
                self.tail_k,
                self.tail_v,
                plan.head_slots[rows],
                self.cfg,
                split.rest_query_start_loc,
                sinks,
                scale,
                key[tokens],
                value[tokens],
                impl=self.impl,
            ).to(out.dtype)
        for group in split.read_groups():
            layout = split.layout(group, self.cfg.group_size)
            chunks = self.read_pages(plan, block_table, layout, key, value, query.dtype)
            spans = [(first, end) for _, first, end, _ in group]
            contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            q = query[spans[0][0] : spans[-1][1]] if contiguous else torch.cat([query[a:b] for a, b in spans])
            att = (varlen or sdpa_varlen)(q, chunks, scale)
            if contiguous:
                out[spans[0][0] : spans[-1][1]] = att
            else:
                done = 0
                for a, b in spans:
                    out[a:b] = att[done : done + b - a]
                    done += b - a
        return out

    def read_tiles(self, blocks: torch.Tensor, sink_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Full tiles read back in the model frame: ``blocks: [B, n]`` -> ``k, v: [B, n * G, Hkv, D]`` fp32.

        With ``sink_slots: [B]`` (pool indices, ``-1`` for none), tile 0 of each row with a sink
        comes from its sink slot in full precision instead of its record.
        """
        batch, n = blocks.shape
        cfg = self.cfg
        k, v = ops.decode_records(self.cache[blocks.reshape(-1).long()], cfg, impl=self.impl)  # [B*n, Hkv, G, D]
        heads = self.cache.shape[1]
        k = k.view(batch, n, *k.shape[1:]).transpose(2, 3).reshape(batch, n * cfg.group_size, heads, cfg.head_dim)
        v = v.view(batch, n, *v.shape[1:]).transpose(2, 3).reshape(batch, n * cfg.group_size, heads, cfg.head_dim)
        if sink_slots is not None and n > 0:
            rows = (sink_slots >= 0).nonzero().flatten()
            if rows.numel():
                slots = sink_slots[rows].long()
                k[rows, : cfg.group_size] = ops.from_pool(self.tail_k[slots])
                v[rows, : cfg.group_size] = ops.from_pool(self.tail_v[slots])
        return self.to_model_frame(k), self.to_model_frame(v)

    def read_tail(self, slots: torch.Tensor, count: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``start .. start + count`` of pool slots ``slots: [B]`` in the model frame: ``[B, count, Hkv, D]``
        fp32."""
        idx = slots.long()
        kv = ops.from_pool(
            torch.stack([self.tail_k[idx, start : start + count], self.tail_v[idx, start : start + count]])
        )
        k, v = self.to_model_frame(kv).unbind(0)  # one rotation for both: a reader's launches are per call
        return k, v

    def tail_block_view(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The records' bytes as tail rows (``docs/internals/vllm_backend.md``): ``k, v: [num_blocks, rows, Hkv, D]``.

        Strided views of :attr:`cache` in the pool dtype: row ``r`` of block ``b`` and KV head ``h``
        holds one tail token's K then V (pool form) at bytes ``r * 2 D e ..`` of that head's record
        (``rows`` from :func:`tail_geometry`). Writing them writes the cache.
        """
        d, dtype = self.cfg.head_dim, self.tail_k.dtype
        num_blocks, heads, record = self.cache.shape
        width = rows * 2 * d * dtype.itemsize
        if width > record or record % dtype.itemsize:
            raise ValueError(f"{rows} tail rows of head_dim {d} in {dtype} do not fit a {record}-byte record")
        x = self.cache[:, :, :width].view(dtype).view(num_blocks, heads, rows, 2, d).permute(0, 2, 1, 3, 4)
        return x[..., 0, :], x[..., 1, :]

    def gather_tails(self, where: TailRows) -> None:
        """Before a step: each sequence's partial-tile tokens from its tail blocks into its pool slot at their
        offsets (``where``: :func:`tail_rows` of the lengths before the step; see :meth:`tail_block_view`)."""
        view_k, view_v = self.tail_block_view(where.rows_per_block)
        self.tail_k[where.slot, where.offset] = view_k[where.block, where.row]
        self.tail_v[where.slot, where.offset] = view_v[where.block, where.row]

    def scatter_tails(self, where: TailRows) -> None:
        """After a step (its late tail written): :meth:`gather_tails` backwards (``where`` for the lengths
        after the step). Writes only rows of the blocks after each sequence's partial tile: never a record."""
        view_k, view_v = self.tail_block_view(where.rows_per_block)
        view_k[where.block, where.row] = self.tail_k[where.slot, where.offset]
        view_v[where.block, where.row] = self.tail_v[where.slot, where.offset]

    def write_block_tails(self, tails: BlockTails, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode step's tokens ``k, v: [B, Hkv, D]`` straight into their rows of the cache's blocks
        (:func:`block_tails`; no step pool)."""
        view_k, view_v = self.tail_block_view(tails.rows_per_block)
        ops.write_tail(k, v, view_k, view_v, tails.mapping, self.cfg, impl=self.impl)

    def commit_block_tails(self, plan: TilePlan, tails: BlockTails) -> None:
        """Commit the tiles a decode step filled when they are kept in the cache's blocks: each committing
        row's tile is copied from its blocks into its step-pool slot, then committed from there.

        ``plan.commit_slots`` index ``tails.tables`` as well as the pool: the plan must be
        :func:`plan_request_slots`' with slot ``b`` for row ``b`` (``arange`` slots, no sink slots), as the
        vLLM builder makes it; other slot lists would copy another row's tile.
        """
        view_k, view_v = self.tail_block_view(tails.rows_per_block)
        ops.gather_tail_tiles(view_k, view_v, tails.tables, self.tail_k, self.tail_v, plan.commit_slots, impl=self.impl)
        self.commit(plan)

    def to_model_frame(self, x: torch.Tensor) -> torch.Tensor:
        """Rotated-frame ``x: [..., D]`` back to the model frame (the rotation is its own inverse)."""
        return ops.rotate(x, impl=self.impl) if self.cfg.rotate else x

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``records``, ``tail`` (tail slots) and ``sink`` (sink slots)."""
        per_slot = 2 * self.tail_k[:1].numel() * self.tail_k.element_size()
        return {
            "records": self.cache.numel(),
            "tail": per_slot * self.num_slots,
            "sink": per_slot * self.num_sink_slots,
        }
