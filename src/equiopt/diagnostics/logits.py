"""Final vocabulary-logit diagnostics and final-logit soft-capping.

The paper (appendix "Experimental Details", subsection "Vocabulary-Logit Growth and Final
Logit Soft-Capping") logs, on a set ``S`` of sampled validation positions with final
logits ``z_t = W_out h_t`` in ``R^v``, per-position mean ``zbar_t = (1/v) sum_i z_ti`` and
centred logits ``ztilde_t = z_t - zbar_t 1``:

- raw RMS        ``( (1/|S|) sum_t ||z_t||^2 / v )^(1/2)``
- centred RMS    ``( (1/|S|) sum_t ||ztilde_t||^2 / v )^(1/2)``
- max log-sum-exp ``max_t log sum_i exp(z_ti)``

The raw RMS includes the shared-logit-shift component that softmax ignores; the centred
RMS measures growth on the LM head's quotient space. Since ``||z_t||^2 / v =
||ztilde_t||^2 / v + zbar_t^2``, :func:`logit_metrics` also reports the shift part
``shift_rms = ((1/|S|) sum_t zbar_t^2)^(1/2)``, so ``raw_rms^2 = centered_rms^2 +
shift_rms^2``.

Pass the logits the softmax actually sees: after :func:`softcap` when final-logit
soft-capping is on (Gemma 2/3: ``c = 30``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["LOGIT_METRIC_KEYS", "logit_metrics", "softcap", "sample_positions"]

#: Keys of the dict returned by :func:`logit_metrics`.
LOGIT_METRIC_KEYS = (
    "raw_rms",
    "centered_rms",
    "shift_rms",
    "max_lse",
    "mean_lse",
    "max_abs",
    "num_positions",
)

# Elements of float32 work per chunk (64 MiB); a chunk is at least one position.
_CHUNK_ELEMS = 1 << 24


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final-logit soft-capping ``cap * tanh(logits / cap)``; ``logits`` itself when ``cap`` is None.

    Gemma 2 uses ``cap = 30`` for the final vocabulary logits (and ``50`` for attention
    logits). The result lies in ``(-cap, cap)``, is odd, monotone, and close to the
    identity for ``|logits| << cap``. Computed in the dtype of ``logits``.

    Args:
        logits: any shape.
        cap: the cap ``c``; None for no capping.

    Returns:
        The capped logits (``logits`` itself when ``cap`` is None).
    """
    if cap is None:
        return logits
    cap = float(cap)
    if not cap > 0.0 or not math.isfinite(cap):
        raise ValueError(f"soft-cap must be a positive finite number or None, got {cap}")
    return torch.tanh(logits / cap) * cap


def sample_positions(
    batch_shape: Sequence[int] | torch.Size,
    n: int,
    generator: torch.Generator | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Pick ``n`` distinct positions of a ``batch_shape`` grid (e.g. ``(B, T)``), reproducibly.

    Returns a tuple of index tensors, one per dimension of ``batch_shape``, sorted in
    row-major order, so ``hidden[idx]`` (``(B, T, d) -> (n, d)``) or ``logits[idx]``
    (``(B, T, V) -> (n, V)``) selects the sample. Selecting hidden states before the LM
    head avoids materialising ``B * T * V`` logits. Positions are drawn uniformly without
    replacement with ``generator`` (a CPU generator; the indices live on the CPU, move
    them with ``.to(device)`` if needed). If ``mask`` (``batch_shape``, nonzero = valid) is
    given, only valid positions are drawn. If fewer than ``n`` positions are available,
    all of them are returned.

    Args:
        batch_shape: the grid of positions, e.g. ``(B, T)``.
        n: how many positions to draw.
        generator: a CPU generator; None uses torch's global one.
        mask: ``batch_shape`` entries, nonzero where a position may be drawn.

    Returns:
        One index tensor per dimension of ``batch_shape`` (on the CPU).
    """
    shape = tuple(int(s) for s in batch_shape)
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    total = math.prod(shape)
    if mask is None:
        candidates = torch.arange(total)
    else:
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match batch_shape {shape}")
        candidates = torch.nonzero(mask.detach().reshape(-1).cpu() != 0).reshape(-1)
    k = min(int(n), candidates.numel())
    pick = torch.randperm(candidates.numel(), generator=generator)[:k]
    flat = candidates[pick].sort().values
    return tuple(torch.unravel_index(flat, shape))


def _reduce(values: torch.Tensor, op: str, all_reduce: bool, group) -> torch.Tensor:
    """All-reduce ``values`` in place (``op`` is ``"sum"`` or ``"max"``) when asked and possible."""
    if all_reduce and dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return values


@torch.no_grad()
def logit_metrics(
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    chunk_elements: int = _CHUNK_ELEMS,
    all_reduce: bool = False,
    group=None,
) -> dict[str, float]:
    """Final-logit diagnostics of the paper for logits of shape ``(..., V)``; floats.

    Every leading index is one position ``t`` (usually ``(n, V)`` from
    :func:`sample_positions`). ``mask`` (shape ``logits.shape[:-1]``, nonzero = keep)
    drops positions such as padding. Work is done in float32 (bf16/fp16 inputs are
    upcast chunk by chunk, at most ``chunk_elements`` elements at a time); sums are
    accumulated in float64.

    Keys (see :data:`LOGIT_METRIC_KEYS`):

    - ``raw_rms``: ``sqrt(mean_t ||z_t||^2 / V)``.
    - ``centered_rms``: the same for ``z_t - mean_i(z_ti)``, the softmax-relevant part.
    - ``shift_rms``: ``sqrt(mean_t mean_i(z_ti)^2)``, the shared-shift part;
      ``raw_rms^2 = centered_rms^2 + shift_rms^2``.
    - ``max_lse`` / ``mean_lse``: max / mean over positions of ``logsumexp_i z_ti``.
    - ``max_abs``: ``max_{t,i} |z_ti|``.
    - ``num_positions``: number of positions measured (a float, for logging).

    With ``all_reduce=True`` under an initialised ``torch.distributed`` process group,
    sums are all-reduced and maxima max-reduced over ``group``, so every rank gets the
    metrics of the union of all ranks' positions (the paper's convention for the max).
    With no positions the metrics are NaN.

    Args:
        logits: ``(..., V)``, one position per leading index.
        mask: ``logits.shape[:-1]`` entries, nonzero for positions to keep.
        chunk_elements: the most elements upcast at a time.
        all_reduce: reduce over the ranks of ``group``.
        group (ProcessGroup | None): the process group (default: the world).

    Returns:
        ``{key: value}`` for the keys of :data:`LOGIT_METRIC_KEYS`, Python floats.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have shape (..., V)")
    V = logits.shape[-1]
    x = logits.detach().reshape(-1, V)
    if mask is not None:
        if tuple(mask.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"mask shape {tuple(mask.shape)} does not match logits.shape[:-1] {tuple(logits.shape[:-1])}"
            )
        x = x[mask.detach().reshape(-1).to(x.device) != 0]
    device = x.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # ||z||^2/V, ||zc||^2/V, zbar^2, lse
    maxes = torch.full((2,), -math.inf, dtype=torch.float64, device=device)  # lse, |z|
    rows = max(1, int(chunk_elements) // max(V, 1))
    for start in range(0, x.shape[0], rows):
        c = x[start : start + rows].float()
        mean = c.mean(dim=-1, keepdim=True)
        ms = c.square().mean(dim=-1)
        cms = (c - mean).square().mean(dim=-1)
        lse = torch.logsumexp(c, dim=-1)
        sums += torch.stack([ms.sum(), cms.sum(), mean.square().sum(), lse.sum()]).double()
        maxes = torch.maximum(maxes, torch.stack([lse.max(), c.abs().max()]).double())
    count = torch.tensor([float(x.shape[0])], dtype=torch.float64, device=device)
    sums = _reduce(torch.cat([sums, count]), "sum", all_reduce, group)
    maxes = _reduce(maxes, "max", all_reduce, group)
    s = sums.tolist()
    m = maxes.tolist()
    n = s[4]
    if n == 0:
        nan = float("nan")
        return {
            "raw_rms": nan,
            "centered_rms": nan,
            "shift_rms": nan,
            "max_lse": nan,
            "mean_lse": nan,
            "max_abs": nan,
            "num_positions": 0.0,
        }
    return {
        "raw_rms": math.sqrt(s[0] / n),
        "centered_rms": math.sqrt(s[1] / n),
        "shift_rms": math.sqrt(s[2] / n),
        "max_lse": m[0],
        "mean_lse": s[3] / n,
        "max_abs": m[1],
        "num_positions": n,
    }
