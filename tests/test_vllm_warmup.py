"""The steps :mod:`kvarn.integration.vllm.warmup` rehearses before serving (the engine run is in ``test_vllm_e2e``)."""

from __future__ import annotations

import pytest

from kvarn.integration.vllm.warmup import WARMUP_ENV, rehearsal_steps, warmup_wanted
from kvarn.paged import PREFILL_MIN_QUERIES


@pytest.mark.parametrize(("g", "max_seqs", "max_tokens"), [(128, 1024, 16384), (64, 16, 96), (128, 6, 8192)])
def test_rehearsed_steps_fit_the_engine_and_reach_every_kind_of_step(g, max_seqs, max_tokens):
    max_len = 8 * g
    steps = rehearsal_steps(g, max_len, max_seqs, max_tokens)
    for queries, lens in steps:
        assert len(queries) == len(lens) <= max_seqs
        assert sum(queries) <= max_tokens
        assert all(0 < q <= n <= max_len for q, n in zip(queries, lens, strict=True))
    decodes = {len(q) for q, _ in steps if set(q) == {1}}
    assert decodes == {*(2**i for i in range(max_seqs.bit_length()) if 2**i < max_seqs), max_seqs}
    # a decode token that completes a tile (the commit), prompt chunks long enough for the page path, one
    # of them beside decode rows, one starting inside a tile, and multi-token queries too short for it
    assert any(n % g == 0 for q, lens in steps if set(q) == {1} for n in lens)
    prompts = [(q, lens) for q, lens in steps if max(q) >= PREFILL_MIN_QUERIES]
    assert any(1 in q for q, _ in prompts)
    inside = any((n - m) % g and m >= PREFILL_MIN_QUERIES for q, lens in prompts for m, n in zip(q, lens, strict=True))
    assert inside or max_tokens < g + 1  # such a chunk and a decode row take g + 1 tokens
    assert any(1 < max(q) < PREFILL_MIN_QUERIES for q, _ in steps)


def test_no_steps_where_the_block_table_reaches_too_few_tiles():
    assert rehearsal_steps(128, 2 * 128, 8, 8192) == []


def test_the_switch(monkeypatch):
    monkeypatch.delenv(WARMUP_ENV, raising=False)
    assert warmup_wanted("cuda") and not warmup_wanted("cpu")
    monkeypatch.setenv(WARMUP_ENV, "1")
    assert warmup_wanted("cpu")
    monkeypatch.setenv(WARMUP_ENV, "0")
    assert not warmup_wanted("cuda")
    monkeypatch.setenv(WARMUP_ENV, "yes")
    with pytest.raises(ValueError, match=WARMUP_ENV):
        warmup_wanted("cuda")
