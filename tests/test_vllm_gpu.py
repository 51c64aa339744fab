"""The vLLM backend's CUDA path without vLLM's engine (``pytest -m gpu``): its own store and attention calls.

This drives what the backend runs on CUDA, :class:`~kvarn.paged.TilePlanner` plus :meth:`~kvarn.paged.PagedKV.store` and
:meth:`~kvarn.paged.PagedKV.attend` with ``impl="triton"``, through a schedule like vLLM's (chunks ending inside
tiles, mixed decode and prefill, permuted blocks, skipped steps, a prefix hit, preemption). Every
step checks the records of every full tile against the reference encoding of its tokens (equal up
to rounding ties, as in ``kernel_oracle``) and the attention output against
``kvarn.reference.paged_attention`` over the same state, and so does the prompt-chunk path
(:meth:`~kvarn.paged.PagedKV.attend_split`) through SDPA and, where vLLM imports, through vLLM's
flash attention.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

pytest.importorskip("triton")

from kernel_oracle import check_attention, check_records  # noqa: E402

from kvarn import reference as R  # noqa: E402
from kvarn.config import KVarNConfig  # noqa: E402
from kvarn.paged import PagedKV, TilePlanner, sdpa_varlen, split_prefill  # noqa: E402


def _varlens() -> list:
    """The prompt-chunk attentions to check: SDPA always, vLLM's flash attention where vLLM imports."""
    try:
        from kvarn.integration.vllm.impl import flash_varlen
    except ImportError:
        return [sdpa_varlen]
    flash = flash_varlen()
    assert flash is not None, "vLLM imports on this CUDA machine but its flash attention does not"
    return [sdpa_varlen, flash]


DEV = "cuda"
IMPL = "triton"
HQ, HKV = 16, 4


def _tokens(gen, n, d, dtype):
    k = torch.randn(n, HKV, d, generator=gen) * 2
    k[:, :, 5] += 10
    return k.to(dtype), torch.randn(n, HKV, d, generator=gen).to(dtype)


@pytest.mark.parametrize(
    ("preset", "d", "dtype"),
    [
        ("kvarn_k4v2_g128", 128, torch.float16),
        ("kvarn_k4v2_g64", 64, torch.bfloat16),
        ("kvarn_k2v2_g128", 256, torch.bfloat16),
    ],
)
def test_backend_steps_on_cuda_match_the_reference(preset, d, dtype):
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    g = cfg.group_size
    rng = random.Random(d)
    gen = torch.Generator().manual_seed(d)
    num_blocks, num_slots = 128, 16
    cache = torch.zeros(num_blocks, HKV, cfg.record_bytes, dtype=torch.uint8, device=DEV)
    tail_k = torch.zeros(num_slots, g, HKV, d, dtype=dtype, device=DEV)
    tail_v = torch.zeros_like(tail_k)
    planner = TilePlanner(num_slots, g)
    paged = PagedKV(cfg, cache, tail_k, tail_v, impl=IMPL)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    reqs: dict[int, dict] = {}

    def add(rid, target, share=None):
        req = {"k": [], "v": [], "len": 0, "target": target, "blocks": []}
        if share is not None:
            hit = reqs[share]["len"] // g
            req.update(
                k=reqs[share]["k"][: hit * g],
                v=reqs[share]["v"][: hit * g],
                len=hit * g,
                shared=hit,
                blocks=reqs[share]["blocks"][:hit],
            )
        reqs[rid] = req

    for rid in range(6):
        add(rid, rng.randrange(g // 2, 4 * g))
    next_id, steps, checked, prefill_checks = 6, 0, 0, 0
    varlens = _varlens()
    while steps < 30:
        steps += 1
        live = [r for r, q in reqs.items() if q["len"] < q["target"]]
        if steps == 12:
            add(next_id, reqs[0]["len"] + g, share=0)
            next_id += 1
            continue
        if steps == 20 and len(live) > 2:
            victim = live[-1]
            free.extend(reqs[victim]["blocks"][reqs[victim].get("shared", 0) :])
            target = reqs.pop(victim)["target"]
            add(next_id, target)
            next_id += 1
            continue
        chunks = {}
        for rid in live:
            if rng.random() < 0.75:
                req = reqs[rid]
                n = 1 if req["len"] and rng.random() < 0.5 else rng.randrange(1, 2 * g + 9)
                chunks[rid] = min(n, req["target"] - req["len"])
        if not chunks:
            continue
        order = list(chunks)
        rng.shuffle(order)
        qsl, ks, vs = [0], [], []
        for rid in order:
            req, n = reqs[rid], chunks[rid]
            k, v = _tokens(gen, n, d, dtype)
            req["k"] += list(k)
            req["v"] += list(v)
            req["len"] += n
            while len(req["blocks"]) * g < req["len"]:
                req["blocks"].append(free.pop())
            ks.append(k)
            vs.append(v)
            qsl.append(qsl[-1] + n)
        width = max(len(reqs[r]["blocks"]) for r in order)
        table = torch.tensor([reqs[r]["blocks"] + [0] * (width - len(reqs[r]["blocks"])) for r in order])
        lens = torch.tensor([reqs[r]["len"] for r in order])
        qsl_t = torch.tensor(qsl)
        plan = planner.plan(qsl_t, lens, table, qsl[-1], DEV)
        k_all, v_all = torch.cat(ks).to(DEV), torch.cat(vs).to(DEV)
        paged.store(plan, k_all, v_all)
        query = (torch.randn(qsl[-1], HQ, d, generator=gen) * 2).to(dtype).to(DEV)
        table, lens, qsl_t = table.to(DEV, torch.int32), lens.to(DEV, torch.int32), qsl_t.to(DEV, torch.int32)
        scale = d**-0.5
        out = paged.attend(plan, query, table, lens, qsl_t, scale, key=k_all, value=v_all)
        # the oracle's slots from the requests' tokens (not the implementation's pool): each holds the
        # tile its request's step starts in, up to the step's end
        held = [torch.zeros(len(order), g, HKV, d, dtype=dtype, device=DEV) for _ in range(2)]
        for i, rid in enumerate(order):
            req = reqs[rid]
            head = (req["len"] - chunks[rid]) // g * g
            for pool, name in zip(held, ("k", "v"), strict=True):
                toks = torch.stack(req[name][head : min(req["len"], head + g)]).to(DEV)
                pool[i, : toks.shape[0]] = R.prepare(toks, dtype)
        slots = torch.arange(len(order), device=DEV)
        args = (query, cache, table, lens, *held, slots, cfg, qsl_t, None, scale, k_all, v_all)
        check_attention(out, args)
        split = split_prefill(qsl, lens.cpu().numpy(), DEV, min_queries=g // 2)
        for varlen in varlens if split is not None else ():
            got = paged.attend_split(plan, query, table, lens, split, scale, varlen, k_all, v_all)
            check_attention(got, args)
            prefill_checks += 1
        paged.write_late_tail(plan, k_all, v_all)
        for rid in order:
            req = reqs[rid]
            full = req["len"] // g
            if not full:
                continue
            kt = R.prepare(torch.stack(req["k"][: full * g]).to(DEV), dtype).view(full, g, HKV, d).transpose(1, 2)
            vt = R.prepare(torch.stack(req["v"][: full * g]).to(DEV), dtype).view(full, g, HKV, d).transpose(1, 2)
            want = R.encode_records(kt, vt, cfg)
            check_records(cache[torch.tensor(req["blocks"][:full], device=DEV)], want, kt, vt, cfg)
            checked += full
    assert checked > 0 and planner.stats["committed_tiles"] > 0 and planner.stats["stored_tiles"] > 0
    assert prefill_checks >= 2 * len(varlens)
    assert planner.stats["chunks_starting_inside_a_tile"] > 0
