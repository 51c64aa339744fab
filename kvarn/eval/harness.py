"""Fidelity measurements of a quantized KV cache on a real model and real text.

Protocol (one model, one text, per method and per full-precision region setting):

1. **Prefix, tile by tile (pseudo-decode).** The first ``prefix`` tokens are fed in chunks of one
   tile (``G`` tokens). Each chunk attends over the cache (earlier tiles stored by the method) and
   over its own tokens exactly; when the chunk's last token arrives its tile is stored. Errors so
   flow forward through later tiles and layers. The attention output of every layer at every
   prefix position is compared with the exact run: the **accumulated** error.
2. **Static error.** The exact run's own q, K, V of every layer are quantized tile by tile and
   attended over in the same pattern (earlier tiles quantized, own tile exact): the error of one
   layer with nothing carried over from the layers and tiles before it.
3. **Teacher-forced continuation.** The next ``continuation`` tokens of the text are fed in
   tile-aligned chunks, so every token sees each earlier tile quantized once that tile is full and
   the tail in full precision: what token-by-token decoding sees, with the tail exact instead of
   rounded to the store dtype. Next-token distributions are compared with the exact run: KL,
   perplexity of the text, top-1 agreement.
4. **Greedy generation.** From the cache after the prefix, ``greedy`` tokens are generated one by
   one; agreement with the exact run's greedy tokens (position by position, and the length of the
   common prefix).

The exact run ("reference") uses the model's own dtype (fp32 on the CPU) in a transformers
``DynamicCache``; every method rounds K/V to ``store_dtype`` (fp16) before storing, as an fp16
deployment would. Region settings: ``tail`` (only the incomplete last tile in full precision) and
``sink`` (the first tile as well).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources

import torch

from kvarn.eval.methods import Method, get_method

PROBE_NAME = "kvarn_probe"
REGIONS = ("tail", "sink")
BLOCK = 128
"""Positions are grouped in blocks of this many tokens for the per-tile-position error."""


def bundled_text() -> str:
    """The bundled public-domain prose (Jane Austen, *Pride and Prejudice*, chapters 1-4)."""
    return resources.files("kvarn.data").joinpath("pride_and_prejudice.txt").read_text(encoding="utf-8")


class _Probe:
    """Records attention outputs (and q, K, V) per layer while ``on``."""

    def __init__(self):
        self.on = False
        self.want_qkv = False
        self.out: dict[int, list[torch.Tensor]] = {}
        self.qkv: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def start(self, want_qkv: bool = False) -> None:
        self.on, self.want_qkv, self.out, self.qkv = True, want_qkv, {}, {}

    def stop(self) -> None:
        self.on = False

    def outputs(self) -> torch.Tensor:
        """``[L, T, Hq, D]`` attention outputs recorded since :meth:`start`."""
        return torch.stack([torch.cat(self.out[i]) for i in sorted(self.out)])

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer ``(q: [Hq, T, D], k: [Hkv, T, D], v: [Hkv, T, D])`` recorded since :meth:`start`."""
        out = []
        for i in sorted(self.qkv):
            parts = self.qkv[i]
            out.append(tuple(torch.cat([p[j] for p in parts], dim=1) for j in range(3)))
        return out


PROBE = _Probe()


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if PROBE.on:
        i = module.layer_idx
        PROBE.out.setdefault(i, []).append(out[0].detach().float().clone())  # [n, Hq, D]
        if PROBE.want_qkv:
            n = query.shape[2]
            qkv = (query[0].float().clone(), key[0, :, -n:].float().clone(), value[0, :, -n:].float().clone())
            PROBE.qkv.setdefault(i, []).append(qkv)
    return out, weights


def install_probe(model) -> None:
    """Route ``model``'s attention through SDPA with the recording probe."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
    model.set_attn_implementation(PROBE_NAME)


@dataclass
class Reference:
    """What the exact run produced: the yardstick of every method."""

    logprobs: torch.Tensor  # [C, V] next-token log-probabilities over the continuation
    attn: torch.Tensor  # [L, P, Hq, D] attention outputs over the prefix
    qkv: list  # per layer (q [Hq, P, D], k [Hkv, P, D], v [Hkv, P, D])
    scales: list  # per layer (K amax / 448, V amax / 448)
    greedy: list[int]
    ppl: float
    seconds: float


@dataclass
class Result:
    """One method in one region setting."""

    method: str
    family: str
    region: str
    bits_per_element: float
    capacity_vs_fp16: float
    kl: float
    ppl: float
    top1: float
    greedy_match: float | None
    greedy_prefix: int | None
    attn_static: list  # [L, n_blocks] mean relative error of the attention output
    attn_accum: list  # [L, n_blocks]
    cache_bytes: int
    fp16_bytes: int
    seconds: float
    extra: dict = field(default_factory=dict)


def attention_backends():
    """The SDPA backends the harness's forwards use: all but cuDNN's, which builds an execution plan on the host
    for each new key length, so a decode step (a new length every token) would pay for one at every layer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    with attention_backends():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits[0].float()


def _chunks(start: int, stop: int, group: int) -> Iterable[tuple[int, int]]:
    """Tile-aligned ``[a, b)`` chunks covering ``start .. stop``."""
    a = start
    while a < stop:
        b = min((a // group + 1) * group, stop)
        yield a, b
        a = b


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[..., T, Hq, D]`` -> ``[..., T]`` relative L2 error of each position's output."""
    num = (out - ref).flatten(-2).norm(dim=-1)
    return num / ref.flatten(-2).norm(dim=-1).clamp_min(1e-12)


def _blocks(err: torch.Tensor) -> list:
    """``[L, T]`` -> ``[L, ceil(T / BLOCK)]`` mean per block of positions."""
    n = math.ceil(err.shape[-1] / BLOCK)
    return [[float(row[i * BLOCK : (i + 1) * BLOCK].mean()) for i in range(n)] for row in err]


def _mixed_attention(q, k_hat, v_hat, k, v, group: int) -> torch.Tensor:
    """Queries ``[Hq, T, D]`` of tile ``t`` attend over ``k_hat, v_hat`` before the tile and ``k, v`` inside it.

    ``k, v, k_hat, v_hat: [Hkv, T, D]`` -> ``[T, Hq, D]``. Causal.
    """
    hq, t, d = q.shape
    rep = hq // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    k_hat, v_hat = k_hat.repeat_interleave(rep, 0), v_hat.repeat_interleave(rep, 0)
    pos = torch.arange(t)
    tile_start = (pos // group * group)[:, None]
    old = pos[None, :] < tile_start  # [T, T] key before the query's tile
    causal = pos[None, :] <= pos[:, None]
    s = torch.where(old, q @ k_hat.transpose(1, 2), q @ k.transpose(1, 2)) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    o = (p * old) @ v_hat + (p * ~old) @ v
    return o.transpose(0, 1)


def reference_run(model, ids: torch.Tensor, prefix: int, greedy: int, progress: Callable = lambda: None) -> Reference:
    """The exact run over ``ids: [1, prefix + C]``: continuation log-probs, prefix attention, greedy tokens."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    total = ids.shape[1]
    cache = DynamicCache()
    PROBE.start(want_qkv=True)
    for a, b in _chunks(0, prefix, BLOCK):
        logits = _forward(model, ids[:, a:b], cache)
        progress()
    PROBE.stop()
    attn, qkv = PROBE.outputs(), PROBE.tensors()
    greedy_cache = copy.deepcopy(cache)
    lp = [torch.log_softmax(logits[-1:], -1)]
    for a, b in _chunks(prefix, total - 1, BLOCK):
        lp.append(torch.log_softmax(_forward(model, ids[:, a:b], cache), -1))
        progress()
    logprobs = torch.cat(lp)
    amax = []
    for layer in cache.layers:
        amax.append((float(layer.keys.abs().max()) / 448.0, float(layer.values.abs().max()) / 448.0))
    target = ids[0, prefix:]
    ppl = math.exp(float(-logprobs.gather(1, target[:, None]).mean()))
    tokens = _greedy(model, greedy_cache, logits[-1], greedy, progress)
    return Reference(logprobs, attn, qkv, amax, tokens, ppl, time.perf_counter() - t0)


def _greedy(model, cache, last_logits: torch.Tensor, n: int, progress: Callable) -> list[int]:
    tokens: list[int] = []
    nxt = int(last_logits.argmax())
    for _ in range(n):
        tokens.append(nxt)
        if len(tokens) == n:
            break
        logits = _forward(model, torch.tensor([[nxt]]), cache)
        nxt = int(logits[-1].argmax())
        progress()
    return tokens


def static_errors(ref: Reference, method: Method, sink: bool, store_dtype: torch.dtype) -> torch.Tensor:
    """``[L, P]`` relative attention-output error with the exact q, K, V and only K/V quantized."""
    errs = []
    for layer, (q, k, v) in enumerate(ref.qkv):
        g = method.group_size
        k16, v16 = k.to(store_dtype), v.to(store_dtype)
        # [Hkv, T, D] -> [T, Hkv, D] for the quantizer, and back
        kt, vt = k16.transpose(0, 1).contiguous(), v16.transpose(0, 1).contiguous()
        kh, vh = method.roundtrip(kt, vt, layer, ref.scales, num_layers=len(ref.qkv))
        kh, vh = kh.transpose(0, 1).float(), vh.transpose(0, 1).float()
        if sink:
            kh[:, :g], vh[:, :g] = k16[:, :g].float(), v16[:, :g].float()
        exact = _mixed_attention(q, k, v, k, v, g)
        out = _mixed_attention(q, kh, vh, k16.float(), v16.float(), g)
        errs.append(_rel_error(out, exact))
    return torch.stack(errs)


def run_method(
    model,
    ids: torch.Tensor,
    prefix: int,
    method: Method,
    region: str,
    ref: Reference,
    greedy: int,
    store_dtype: torch.dtype = torch.float16,
    progress: Callable = lambda: None,
) -> Result:
    """Measure ``method`` with full-precision region ``region`` (``"tail"`` or ``"sink"``) against ``ref``."""
    if region not in REGIONS:
        raise ValueError(f"region must be one of {REGIONS}, got {region!r}")
    t0 = time.perf_counter()
    sink = region == "sink"
    total, g = ids.shape[1], method.group_size
    cfg = model.config
    cache = method.make_cache(sink=sink, dtype=store_dtype, scales=ref.scales, num_layers=cfg.num_hidden_layers)
    PROBE.start()
    for a, b in _chunks(0, prefix, g):
        logits = _forward(model, ids[:, a:b], cache)
        progress()
    PROBE.stop()
    accum = _rel_error(PROBE.outputs(), ref.attn)
    greedy_cache = copy.deepcopy(cache) if greedy else None
    lp = [torch.log_softmax(logits[-1:], -1)]
    for a, b in _chunks(prefix, total - 1, g):
        lp.append(torch.log_softmax(_forward(model, ids[:, a:b], cache), -1))
        progress()
    logprobs = torch.cat(lp)
    kl = float((ref.logprobs.exp() * (ref.logprobs - logprobs)).sum(-1).mean())
    target = ids[0, prefix:]
    ppl = math.exp(float(-logprobs.gather(1, target[:, None]).mean()))
    top1 = float((logprobs.argmax(-1) == ref.logprobs.argmax(-1)).float().mean())
    cache_bytes = int(cache.nbytes()["total"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    stored = total - 1
    fp16_bytes = 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * stored
    match = prefix_len = None
    if greedy:
        for layer in greedy_cache.layers:
            if hasattr(layer, "keep_decoded"):
                layer.keep_decoded = True
        tokens = _greedy(model, greedy_cache, logits[-1], greedy, progress)
        same = [a == b for a, b in zip(tokens, ref.greedy, strict=True)]
        match = sum(same) / len(same)
        prefix_len = same.index(False) if False in same else len(same)
    static = static_errors(ref, method, sink, store_dtype)
    return Result(
        method=method.name,
        family=method.family,
        region=region,
        bits_per_element=method.bits_per_element(head_dim, cfg.num_hidden_layers),
        capacity_vs_fp16=method.capacity_vs_fp16(head_dim, cfg.num_hidden_layers),
        kl=kl,
        ppl=ppl,
        top1=top1,
        greedy_match=match,
        greedy_prefix=prefix_len,
        attn_static=_blocks(static),
        attn_accum=_blocks(accum),
        cache_bytes=cache_bytes,
        fp16_bytes=fp16_bytes,
        seconds=time.perf_counter() - t0,
    )


def prepare_ids(tok, prefix: int, continuation: int, text: str | None = None, name: str | None = None) -> torch.Tensor:
    """``[1, prefix + continuation]`` token ids of ``text`` (default the bundled text, called ``name`` in errors)."""
    ids = tok(bundled_text() if text is None else text, return_tensors="pt").input_ids[:, : prefix + continuation]
    if ids.shape[1] < prefix + continuation:
        what = name or ("the bundled text" if text is None else "the text")
        raise ValueError(
            f"{what} has {ids.shape[1]} tokens for this tokenizer, too short for prefix + continuation "
            f"({prefix} + {continuation} = {prefix + continuation} tokens); give a longer text or a shorter "
            "--prefix / --continuation"
        )
    return ids


def evaluate(
    model,
    tok,
    methods: list[str],
    regions: list[str],
    prefix: int = 1024,
    continuation: int = 256,
    greedy: int = 256,
    progress_factory: Callable | None = None,
    text: str | None = None,
) -> dict:
    """Run the reference and every (method, region) over ``text`` (default the bundled text).

    Returns a JSON-ready dict of results.
    """
    if prefix % BLOCK or prefix <= 0:
        raise ValueError(f"prefix must be a positive multiple of {BLOCK} tokens, got {prefix}")
    if continuation < 2:
        raise ValueError(f"continuation must be at least 2 tokens, got {continuation}")
    if greedy < 0:
        raise ValueError(f"greedy must be 0 (no greedy generation) or a positive number of tokens, got {greedy}")
    resolved = [get_method(m) for m in methods]
    ids = prepare_ids(tok, prefix, continuation, text)
    install_probe(model)
    steps_ref = math.ceil(prefix / BLOCK) + len(list(_chunks(prefix, prefix + continuation - 1, BLOCK)))
    steps_ref += max(greedy - 1, 0)
    runs = [(m, r) for r in regions for m in resolved]
    bar = progress_factory(total=steps_ref + sum(_steps(m, prefix, continuation, greedy, r) for m, r in runs))
    with torch.inference_mode():
        ref = reference_run(model, ids, prefix, greedy, bar.tick)
        results = []
        for method, region in runs:
            bar.describe(f"{method.name} [{region}]")
            results.append(run_method(model, ids, prefix, method, region, ref, greedy, progress=bar.tick))
    bar.close()
    return {
        "prefix": prefix,
        "continuation": continuation,
        "greedy": greedy,
        "reference": {"ppl": ref.ppl, "seconds": ref.seconds},
        "results": [r.__dict__ for r in results],
    }


def _steps(method: Method, prefix: int, continuation: int, greedy: int, region: str) -> int:
    g = method.group_size
    return math.ceil(prefix / g) + len(list(_chunks(prefix, prefix + continuation - 1, g))) + max(greedy - 1, 0)
