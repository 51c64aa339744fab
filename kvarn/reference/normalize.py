"""Variance normalization: Sinkhorn-like dual scaling of a tile in the log domain.

For a tile ``M: [..., R, C]`` find row scales ``r: [..., R]`` and column scales ``c: [..., C]``
such that the balanced tile ``B = M / (r c^T)`` has rows of similar spread and columns of similar
spread, so no token and no channel dominates its neighbours' range when the rows are rounded.

Algorithm (all in fp32, batched over the leading dims, one independent problem per tile)::

    lc = 0 (C), lr = 0 (R), X = M
    imb(X) = max(colstd) / max(min(colstd), 1e-8) + max(rowstd) / max(min(rowstd), 1e-8)
    best = (lr = 0, lc = 0, imb(M))                     # doing nothing is a candidate
    repeat iters times:
        lc = clamp(lc + log(clamp(colstd(X), 1e-3, 1e3)), -0.3, 10);  X = M / (exp(lr) exp(lc)^T)
        lr = clamp(lr + log(clamp(rowstd(X), 1e-3, 1e3)), -0.3, 10);  X = M / (exp(lr) exp(lc)^T)
        if imb(X) <= best.imb: best = (lr, lc, imb(X))  # keep the best iterate

``std`` is the unbiased sample standard deviation (divisor ``n - 1``). A balanced tile scores 2.
``X`` is always recomputed from the original ``M``. Keeping the best iterate is load-bearing:
without it accuracy collapses on some tiles. The clamps below are part of the method and make it
deliberately not scale-invariant; they live here, in one place, so they can be studied.
"""

from __future__ import annotations

import torch

STD_MIN = 1e-3
"""Lower clamp of a row or column std before its log is taken."""
STD_MAX = 1e3
"""Upper clamp of a row or column std before its log is taken."""
LOG_SCALE_MIN = -0.3
"""Lower clamp of an accumulated log-scale: a row or column is never scaled up by more than e^0.3."""
LOG_SCALE_MAX = 10.0
"""Upper clamp of an accumulated log-scale: scaled down by at most e^10."""
IMBALANCE_EPS = 1e-8
"""Floor of the smallest std in the imbalance measure."""


def imbalance(x: torch.Tensor) -> torch.Tensor:
    """Imbalance of tiles ``x: [..., R, C]`` -> ``[...]``: max/min column std plus max/min row std."""
    return _imbalance(x.std(dim=-2), x.std(dim=-1))


def _imbalance(col: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """:func:`imbalance` from the column and row stds."""
    col_term = col.amax(-1) / col.amin(-1).clamp_min(IMBALANCE_EPS)
    row_term = row.amax(-1) / row.amin(-1).clamp_min(IMBALANCE_EPS)
    return col_term + row_term


def _log_std_step(log_scale: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    step = torch.log(std.clamp(STD_MIN, STD_MAX))
    return (log_scale + step).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)


def _divide(m: torch.Tensor, lr: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
    return m / (torch.exp(lr)[..., :, None] * torch.exp(lc)[..., None, :])


def sinkhorn(m: torch.Tensor, iters: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column scales of the best iterate for tiles ``m: [..., R, C]``.

    Returns ``(r: [..., R], c: [..., C])`` in fp32, both positive, with ``m / (r c^T)`` the
    balanced tile. ``iters = 0`` returns all-ones scales.
    """
    m = m.to(torch.float32)
    lr = m.new_zeros(m.shape[:-1])
    lc = m.new_zeros(m.shape[:-2] + m.shape[-1:])
    best_lr, best_lc = lr, lc
    col = m.std(dim=-2)  # of the current iterate, shared by its imbalance and the next column step
    best_imb = _imbalance(col, m.std(dim=-1))
    for _ in range(iters):
        lc = _log_std_step(lc, col)
        x = _divide(m, lr, lc)
        lr = _log_std_step(lr, x.std(dim=-1))
        x = _divide(m, lr, lc)
        col = x.std(dim=-2)
        imb = _imbalance(col, x.std(dim=-1))
        take = imb <= best_imb
        best_imb = torch.where(take, imb, best_imb)
        best_lr = torch.where(take[..., None], lr, best_lr)
        best_lc = torch.where(take[..., None], lc, best_lc)
    return torch.exp(best_lr), torch.exp(best_lc)
