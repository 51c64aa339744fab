"""The KVarN attention impl through the simulation (:mod:`vllm_sim`): values whose rotation leaves fp16's range,
and the layers it refuses to capture."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_sim import HKV, D, Sim

from kvarn import reference

pytestmark = pytest.mark.vllm


class WideSim(Sim):
    """fp16 K/V whose Hadamard rotation leaves fp16's range, also checked against fp32 storage."""

    def tokens(self, n):
        k = 20000 + 2000 * torch.randn(n, HKV, D, generator=self.gen)
        v = -20000 + 2000 * torch.randn(n, HKV, D, generator=self.gen)
        return k.to(self.dtype), v.to(self.dtype)

    def check(self, order, query, qsl, lens, table, output, replayed=False):
        super().check(order, query, qsl, lens, table, output, replayed)  # exact: the reference over the same fp16 pool
        cache = torch.zeros(self.kv_cache.shape[0], HKV, self.cfg.record_bytes, dtype=torch.uint8)
        tail_k = torch.zeros(len(order), self.g, HKV, D)
        tail_v = torch.zeros_like(tail_k)
        for i, rid in enumerate(order):
            req = self.reqs[rid]
            k, v = torch.stack(req["k"]).float(), torch.stack(req["v"]).float()
            full = req["len"] // self.g
            if full:
                tiles = (full, self.g, HKV, D)
                blocks = torch.tensor(req["blocks"][:full])
                src = blocks[:1].expand(full) if self.cfg.seq_smooth else None
                reference.store_tiles(
                    k[: full * self.g].view(tiles), v[: full * self.g].view(tiles), blocks, cache, self.cfg, src
                )
            hk, hv = self.held(i, order, qsl, torch.float32)
            tail_k[i, : hk.shape[0]], tail_v[i, : hv.shape[0]] = hk, hv
        slots = torch.arange(len(order))
        key, value = (x.float() for x in self.step_kv)
        want = reference.paged_attention(
            query.float(), cache, table, lens, tail_k, tail_v, slots, self.cfg, qsl, None, 0.125, key, value
        )
        rel = float((output.float() - want).norm() / want.norm())
        assert rel < 5e-3, f"the fp16 backend is {rel:.3g} away from storing the same values in fp32"
        held = reference.from_pool(self.layer._kvarn_tail[0])
        assert torch.isfinite(held).all() and float(held.abs().max()) > 65504


def test_fp16_values_whose_rotation_leaves_fp16_range_attend_as_in_fp32():
    """In the backend: the fp16 tail pool holds rotations past 65504 (the pool form), no inf."""
    sim = WideSim("kvarn_k4v2_g64", torch.float16, seed=11)
    sim.query_scale = 1e-3  # keeps softmax away from one-hot at |k| ~ 20000
    a, b = sim.add(200), sim.add(150)
    sim.step({a: 50, b: 70})  # both end inside a tile: b's first tile stored whole, a's in the pool
    sim.step({a: 30, b: 1})  # a completes its first tile from the pool (commit)
    for _ in range(3):
        sim.step({a: 1, b: 1})
    sim.step({a: 60})


def test_a_captured_layer_without_a_name_is_refused():
    """Tiles a replayed step filled are committed per layer name: a capture of a layer without one would leave
    them uncommitted, so it raises."""
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=19, max_num_seqs=4, request_slots=True)
    sim.pad, sim.replay = False, True
    a = sim.add(100)
    sim.step({a: 10})
    sim.layer.layer_name = None
    with pytest.raises(RuntimeError, match="layer_name"):
        sim.step({a: 1})


def test_a_window_layer_with_sinks_attends_through_the_paged_kernel_with_both(monkeypatch):
    """The impl passes the layer's window and its sink logits, read at forward time (vLLM loads them after building
    the layer) as float32, on every step, and never splits prompt chunks off to the full-attention varlen path."""
    from kvarn.paged import PagedKV

    attend, seen = PagedKV.attend, []

    def spy(self, *args, **kwargs):
        seen.append((kwargs["window"], kwargs["sink_logits"]))
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(PagedKV, "attend", spy)
    monkeypatch.setattr(PagedKV, "attend_split", lambda *a, **k: pytest.fail("a window layer took attend_split"))
    sinks = torch.nn.Parameter(torch.empty(4, dtype=torch.bfloat16), requires_grad=False)
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=5, window=90, sink_logits=sinks)
    sim.builder.prefill_split = True  # the CUDA path's split, which a window or sink layer must not take
    with torch.no_grad():
        sinks.copy_(torch.tensor([1.5, -0.5, 3.0, 0.0]))  # the weights, loaded after construction
    a, b = sim.add(260), sim.add(200)
    sim.step({a: 100, b: 70})
    assert sim.last_meta.prefill is not None
    sim.step({a: 100, b: 1})
    sim.step({a: 1, b: 1})
    assert len(seen) == 3 and all(w == 90 for w, _ in seen)
    assert all(s.dtype == torch.float32 and torch.equal(s, sinks.float()) for _, s in seen)
