"""A check for the GPU engine: one layer's last decode step through the blocks, held to the reference."""

from __future__ import annotations

import numpy as np
import torch

from kvarn import ops

PROBE_ENV = "KVARN_PROBE_LAYER"


class DecodeProbe:
    """What one layer's last decode step through the blocks attended with.

    With ``KVARN_PROBE_LAYER=<layer name>`` (e.g. ``model.layers.0.self_attn.attn``) that layer's forward of
    a decode step with tails in blocks copies its query, its output and the step's sequence lengths, block
    table and tail tables into persistent buffers (copies a CUDA graph captures, so a replay refills them),
    and keeps its cache view. After a run whose last step was such a decode, the buffers and the cache
    are that step's inputs and output, which ``benchmarks/bench_vllm.py check`` holds to
    :func:`kvarn.reference.paged_attention`. Host bookkeeping: ``builds`` counts the layer group's
    builds, ``decode_build`` is the last decode build's number and ``rows`` its batch, ``eager_build`` the
    build whose forward last ran on the host (a replayed step's forward does not).
    """

    def __init__(self, layer: str | None):
        self.layer = layer
        self.reset()

    def reset(self) -> None:
        """Forget the last engine's step (its cache and buffers), for the next engine of the process."""
        self.buffers: dict[str, torch.Tensor] = {}
        self.paged = None
        self.scale = 1.0
        self.builds = self.decode_build = self.eager_build = 0
        self.rows = self.tail_rows = 0
        self.lens = None

    def note_build(self, layer_names, decode_rows: int | None = None, lens=None) -> None:
        if self.layer is None or self.layer not in layer_names:
            return
        if decode_rows is None:
            self.builds += 1
            return
        self.decode_build, self.rows, self.lens = self.builds, decode_rows, np.array(lens[:decode_rows])

    def record(self, layer, paged, scale: float, tail_rows: int, max_rows: int, **tensors: torch.Tensor) -> None:
        if self.layer is None or getattr(layer, "layer_name", None) != self.layer:
            return
        self.eager_build, self.paged, self.scale, self.tail_rows = self.builds, paged, scale, tail_rows
        for name, t in tensors.items():
            buf = self.buffers.get(name)
            if buf is None or buf.shape[0] < t.shape[0]:  # sized for the largest batch, before capture (warm-up)
                rows = max(max_rows, t.shape[0])
                buf = self.buffers[name] = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            buf[: t.shape[0]].copy_(t)

    def check(self) -> dict:
        """The recorded step against :func:`kvarn.ops.paged_attention` with ``impl="reference"`` over the cache
        as it is now: ``rel_err`` = max |recorded - reference| / max |reference| over the live rows (those
        of positive length), with ``replayed``, ``last_step_was_decode`` and ``seq_lens_match_build`` (the
        buffers hold the step the builder planned). The caller applies its tolerance."""
        res = {"rows": self.rows, "probed": bool(self.decode_build and self.paged is not None)}
        if not res["probed"]:
            return res
        b = {k: v[: self.rows] for k, v in self.buffers.items()}
        lens = b["seq_lens"].cpu().numpy()
        res["last_step_was_decode"] = self.decode_build == self.builds
        res["replayed"] = self.eager_build != self.decode_build  # its forward did not run on the host
        res["seq_lens_match_build"] = bool(np.array_equal(lens, self.lens))
        live = torch.from_numpy(lens > 0).to(b["query"].device)
        tk, tv = self.paged.tail_block_view(self.tail_rows)
        q = b["query"][live]
        args = (b["block_table"][live], b["seq_lens"][live], tk, tv, b["tables"][live], self.paged.cfg)
        ref = ops.paged_attention(q.float(), self.paged.cache, *args, scale=self.scale, impl="reference")
        out = b["output"][live].float()
        res["live_rows"] = int(live.sum())
        res["rel_err"] = float((out - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
        res["dtype"] = str(q.dtype).removeprefix("torch.")
        return res
