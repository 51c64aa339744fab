"""Steps through TilePlanner and PagedKV shared by the tests of kvarn.paged.storage and kvarn.paged.prefill."""

import torch

from kvarn.paged import TilePlanner


def run_chunks(chunks, k, v, q, sink=False, split=False, impl="reference"):
    """One sequence fed in ``chunks`` (token counts) through TilePlanner + PagedKV: each position's attention output."""
    from kvarn.config import KVarNConfig
    from kvarn.paged import PagedKV, split_prefill

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv = cfg.group_size, k.shape[1]
    planner = TilePlanner(2, g, num_sink_slots=1 if sink else 0)
    kv = PagedKV.allocate(cfg, 8, hkv, 2, k.dtype, "cpu", num_sink_slots=1 if sink else 0, impl=impl)
    table = torch.arange(1, 9)[None]  # block 0 unused
    outs, done = [], 0
    for n in chunks:
        qsl, lens = torch.tensor([0, n]), torch.tensor([done + n])
        step = planner.plan(qsl, lens, table, n)
        kn, vn = k[done : done + n], v[done : done + n]
        kv.store(step, kn, vn)
        parts = split_prefill(qsl.numpy(), lens.numpy(), "cpu", min_queries=2) if split else None
        if parts is not None:
            outs.append(kv.attend_split(step, q[done : done + n], table, lens, parts, key=kn, value=vn))
        else:
            outs.append(kv.attend(step, q[done : done + n], table, lens, qsl, key=kn, value=vn))
        kv.write_late_tail(step, kn, vn)
        done += n
    return torch.cat(outs), kv.cache
