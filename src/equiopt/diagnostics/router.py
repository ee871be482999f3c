"""Mixture-of-experts router diagnostics and auxiliary router losses.

Definitions follow the paper's appendix, subsection "Load-Balancing Loss and Router z-Loss
Diagnostics" (downsized gpt-oss experiments), which follows the OLMoE protocol. For one
MoE layer with router logits ``z_t`` in ``R^E`` for tokens ``t = 1..N``, probabilities
``p_t = softmax(z_t)`` and top-``k`` routing:

- ``f_i``: fraction of routed top-``k`` assignments sent to expert ``i``,
  ``f_i = (1 / (k N)) sum_t 1[i in topk(p_t)]``, so ``sum_i f_i = 1``.
- ``P_i``: mean router probability of expert ``i``, ``P_i = (1/N) sum_t p_ti``.
- load-balancing loss ``L_LB = E sum_i f_i P_i`` (Shazeer et al. 2017 / Switch
  Transformer form); a perfectly balanced router has ``L_LB = 1``.
- router z-loss ``L_z = (1/N) sum_t (log sum_i exp z_ti)^2`` (Zoph et al. 2022).
- load entropy ``H(f) = -sum_i f_i log f_i`` (natural log, ``0 log 0 = 0``) and
  ``H(f) / log E`` (1 for a uniform load).
- load coefficient of variation ``std(f) / mean(f)`` with the population standard
  deviation over the ``E`` experts (divide by ``E``; the experts are the whole
  population, not a sample). Since ``mean(f) = 1/E`` it equals ``E std(f)``; it is 0
  for a uniform load and ``sqrt(E - 1)`` when one expert takes everything (``k = 1``).
- dead-expert fraction: share of experts with no routed assignment in the batch.
- maximum expert load ``max_i f_i`` and its ratio to uniform ``E max_i f_i``.
- router-logit scale: RMS of the logits ``sqrt(mean_{t,i} z_ti^2)`` and centred RMS
  after removing each token's mean logit (the softmax-invariant shared shift).

The paper logs these per MoE layer; :func:`router_metrics` returns each layer's values
and their mean over layers. The paper's training runs with auxiliary losses use the
coefficients 0.01 (``L_LB``) and 0.001 (``L_z``); :func:`load_balancing_loss` and
:func:`z_loss` return the unscaled terms.

Relation to Hugging Face ``load_balancing_loss_func`` (OLMoE, gpt-oss, Mixtral,
Qwen-MoE in transformers 5.x): it divides the assignment counts by the number of tokens,
not by ``k`` times the number of tokens, so its ``f`` sums to ``k`` and a balanced router
scores ``k``; and it pools all layers (sums counts and probabilities over layers, then
forms one product) instead of averaging per-layer losses. Hence, with the same logits
and mask, ``hf == top_k * load_balancing_loss(logits, top_k, layer_reduction="pooled")``,
and for a single layer ``hf == top_k * load_balancing_loss(logits, top_k)``. Hugging Face's
OLMoE and gpt-oss models compute no router z-loss.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ROUTER_METRIC_KEYS",
    "expert_load",
    "load_balancing_loss",
    "z_loss",
    "router_metrics",
    "collect_router_logits",
    "RouterLogitsRecorder",
]

#: Scalar keys of each per-layer dict of :func:`router_metrics` (and of its layer means).
ROUTER_METRIC_KEYS = (
    "lb_loss",
    "z_loss",
    "load_entropy",
    "load_entropy_norm",
    "load_cv",
    "dead_fraction",
    "max_load",
    "max_load_ratio",
    "logit_rms",
    "logit_rms_centered",
    "num_tokens",
)


def _as_layers(router_logits) -> list[torch.Tensor]:
    """A bare tensor is one layer; a list or tuple holds one tensor per layer."""
    if isinstance(router_logits, torch.Tensor):
        return [router_logits]
    layers = list(router_logits)
    if not layers:
        raise ValueError("router_logits is empty")
    for t in layers:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"router logits must be tensors, got {type(t).__name__}")
    return layers


def _flatten(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(tokens, E)`` or ``(B, T, E)`` logits to float32 ``(N, E)``, and float weights ``(N,)`` or None."""
    if logits.dim() < 2:
        raise ValueError(f"router logits must have shape (tokens, E) or (B, T, E), got {tuple(logits.shape)}")
    x = logits.reshape(-1, logits.shape[-1]).float()
    if attention_mask is None:
        return x, None
    w = attention_mask.reshape(-1)
    if w.numel() != x.shape[0]:
        raise ValueError(f"attention_mask has {w.numel()} entries but the router logits have {x.shape[0]} tokens")
    return x, (w.to(device=x.device) != 0).float()


def _check_top_k(top_k: int, num_experts: int) -> int:
    top_k = int(top_k)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    return top_k


def _layer_sums(x: torch.Tensor, w: torch.Tensor | None, top_k: int):
    """Per-expert assignment counts, probability sums and the (weighted) token count."""
    E = x.shape[-1]
    p = torch.softmax(x, dim=-1)
    idx = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
    if w is None:
        ones = torch.ones(idx.shape, dtype=p.dtype, device=p.device)
        counts = torch.zeros(E, dtype=p.dtype, device=p.device).scatter_add_(0, idx, ones)
        prob_sum = p.sum(dim=0)
        ntok = torch.tensor(float(x.shape[0]), dtype=p.dtype, device=p.device)
    else:
        counts = torch.zeros(E, dtype=p.dtype, device=p.device).scatter_add_(
            0, idx, w.unsqueeze(-1).expand(-1, top_k).reshape(-1)
        )
        prob_sum = (p * w.unsqueeze(-1)).sum(dim=0)
        ntok = w.sum()
    return counts, prob_sum, ntok


def expert_load(
    router_logits: torch.Tensor,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, P)`` of one MoE layer, float32 tensors of shape ``(E,)``.

    ``f_i`` is the fraction of routed top-``k`` assignments sent to expert ``i``
    (``sum_i f_i = 1``; not differentiable) and ``P_i`` the mean router probability
    (differentiable). ``router_logits`` is ``(tokens, E)`` or ``(B, T, E)``;
    ``attention_mask`` (``B*T`` entries, nonzero = real token) drops padding. Top-``k``
    is taken on the softmax probabilities, as in OLMoE and Hugging Face's loss.

    Args:
        router_logits: ``(tokens, E)`` or ``(B, T, E)``.
        top_k: experts per token.
        attention_mask: ``B*T`` entries, nonzero for real tokens.

    Returns:
        ``(f, P)``, each ``(E,)`` float32.
    """
    x, w = _flatten(router_logits, attention_mask)
    k = _check_top_k(top_k, x.shape[-1])
    counts, prob_sum, ntok = _layer_sums(x, w, k)
    return counts / (k * ntok), prob_sum / ntok


def _reduce_layers(values: list[torch.Tensor], layer_reduction: str) -> torch.Tensor:
    stacked = torch.stack(values)
    if layer_reduction == "mean":
        return stacked.mean()
    if layer_reduction == "sum":
        return stacked.sum()
    raise ValueError(f"layer_reduction must be 'mean', 'sum' or 'pooled', got {layer_reduction!r}")


def load_balancing_loss(
    router_logits,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    layer_reduction: str = "mean",
) -> torch.Tensor:
    """Auxiliary load-balancing loss ``L_LB = E sum_i f_i P_i``, a differentiable scalar tensor.

    The paper's definition (appendix, "Load-Balancing Loss and Router z-Loss
    Diagnostics"; Shazeer et al. 2017, Switch Transformer eqs. 4-6): ``f_i`` is the
    fraction of routed top-``k`` assignments sent to expert ``i`` (sums to 1) and
    ``P_i`` the mean router probability; a balanced router gives 1. Gradients flow
    through ``P`` only. The caller multiplies by the coefficient (0.01 in the paper).

    ``router_logits``: one tensor (one layer) or a sequence with one ``(tokens, E)`` or
    ``(B, T, E)`` tensor per MoE layer (e.g. Hugging Face's ``outputs.router_logits``).
    ``attention_mask``: ``B*T`` entries, nonzero = real token, shared by all layers.
    ``layer_reduction``: ``"mean"`` (default) averages the per-layer losses, so the
    balanced value stays 1 at any depth; ``"sum"`` adds them; ``"pooled"`` sums ``f`` and
    ``P`` statistics over layers first and forms a single product, the Hugging Face
    convention (which additionally scales by ``top_k``; see the module docstring).

    Args:
        router_logits (torch.Tensor | Sequence[torch.Tensor]): one layer's logits, or one
            tensor per MoE layer.
        top_k: experts per token.
        attention_mask: ``B*T`` entries, nonzero for real tokens.
        layer_reduction: ``"mean"``, ``"sum"`` or ``"pooled"``.

    Returns:
        The loss, a scalar tensor (differentiable through ``P``).
    """
    layers = _as_layers(router_logits)
    if layer_reduction == "pooled":
        counts = prob_sum = ntok = None
        k = E = None
        for t in layers:
            x, w = _flatten(t, attention_mask)
            if E is None:
                E = x.shape[-1]
                k = _check_top_k(top_k, E)
            elif x.shape[-1] != E:
                raise ValueError("layer_reduction='pooled' needs the same number of experts in every layer")
            c, ps, n = _layer_sums(x, w, k)
            counts = c if counts is None else counts + c.to(counts.device)
            prob_sum = ps if prob_sum is None else prob_sum + ps.to(prob_sum.device)
            ntok = n if ntok is None else ntok + n.to(ntok.device)
        return E * torch.sum((counts / (k * ntok)) * (prob_sum / ntok))
    losses = []
    for t in layers:
        f, P = expert_load(t, top_k, attention_mask)
        losses.append(f.shape[0] * torch.sum(f * P))
    dev = losses[0].device
    return _reduce_layers([v.to(dev) for v in losses], layer_reduction)


def z_loss(
    router_logits,
    attention_mask: torch.Tensor | None = None,
    layer_reduction: str = "mean",
) -> torch.Tensor:
    """Router z-loss ``L_z = (1/N) sum_t (logsumexp_i z_ti)^2``, a differentiable scalar tensor.

    The paper's definition (appendix, "Load-Balancing Loss and Router z-Loss
    Diagnostics"; Zoph et al. 2022, ST-MoE eq. 5), ``N`` the number of (unmasked)
    tokens. Zero logits give ``(log E)^2``. Computed in float32. The caller multiplies by
    the coefficient (0.001 in the paper). ``layer_reduction`` is ``"mean"`` (default) or
    ``"sum"`` over layers; inputs as in :func:`load_balancing_loss`.

    Args:
        router_logits (torch.Tensor | Sequence[torch.Tensor]): one layer's logits, or one
            tensor per MoE layer.
        attention_mask: ``B*T`` entries, nonzero for real tokens.
        layer_reduction: ``"mean"`` or ``"sum"``.

    Returns:
        The loss, a differentiable scalar tensor.
    """
    values = []
    for t in _as_layers(router_logits):
        x, w = _flatten(t, attention_mask)
        lse2 = torch.logsumexp(x, dim=-1).square()
        values.append(lse2.mean() if w is None else (lse2 * w).sum() / w.sum())
    dev = values[0].device
    return _reduce_layers([v.to(dev) for v in values], layer_reduction)


@torch.no_grad()
def router_metrics(
    router_logits,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    *,
    all_reduce: bool = False,
    group=None,
) -> dict:
    """The paper's router diagnostics per MoE layer and averaged over layers.

    Inputs as in :func:`load_balancing_loss`. Returns a dict whose scalar entries (keys
    :data:`ROUTER_METRIC_KEYS`, floats) are means over layers, plus ``"num_layers"`` and
    ``"per_layer"``: one dict per layer with the same scalar keys and ``"load"`` (``f``)
    and ``"prob"`` (``P``) as lists of ``E`` floats. Definitions (paper appendix, "Load-
    Balancing Loss and Router z-Loss Diagnostics"; details in the module docstring):

    - ``lb_loss``: ``E sum_i f_i P_i`` (1 when balanced).
    - ``z_loss``: ``mean_t (logsumexp_i z_ti)^2``.
    - ``load_entropy``: ``-sum_i f_i log f_i`` in nats; ``load_entropy_norm``: divided by
      ``log E`` (1 when balanced; 1 by convention if ``E = 1``).
    - ``load_cv``: population std of ``f`` over experts divided by its mean.
    - ``dead_fraction``: share of experts with zero routed assignments in the batch.
    - ``max_load``: ``max_i f_i``; ``max_load_ratio``: ``E max_i f_i`` (1 when balanced).
    - ``logit_rms``: ``sqrt(mean_{t,i} z_ti^2)``; ``logit_rms_centered``: the same after
      subtracting each token's mean logit.
    - ``num_tokens``: tokens counted in the layer.

    With ``all_reduce=True`` under an initialised ``torch.distributed`` process group,
    the per-layer counts and sums are all-reduced over ``group`` first, so the metrics
    describe the union of all ranks' tokens (dead experts are then dead on every rank).

    Args:
        router_logits (torch.Tensor | Sequence[torch.Tensor]): one layer's logits, or one
            tensor per MoE layer.
        top_k: experts per token.
        attention_mask: ``B*T`` entries, nonzero for real tokens.
        all_reduce: reduce over the ranks of ``group``.
        group (ProcessGroup | None): the process group (default: the world).

    Returns:
        The means over layers (keys :data:`ROUTER_METRIC_KEYS`), ``"num_layers"`` and
        ``"per_layer"``.
    """
    layers = _as_layers(router_logits)
    packed, sizes = [], []
    for t in layers:
        x, w = _flatten(t, attention_mask)
        k = _check_top_k(top_k, x.shape[-1])
        counts, prob_sum, ntok = _layer_sums(x, w, k)
        lse2 = torch.logsumexp(x, dim=-1).square()
        z2 = x.square().mean(dim=-1)
        zc2 = (x - x.mean(dim=-1, keepdim=True)).square().mean(dim=-1)
        if w is not None:
            lse2, z2, zc2 = lse2 * w, z2 * w, zc2 * w
        extras = torch.stack([ntok, lse2.sum(), z2.sum(), zc2.sum()])
        vec = torch.cat([counts, prob_sum, extras]).double()
        packed.append(vec)
        sizes.append(x.shape[-1])
    dev = packed[0].device
    flat = torch.cat([v.to(dev) for v in packed])
    if all_reduce and dist.is_available() and dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat = flat.cpu()

    per_layer = []
    offset = 0
    for E in sizes:
        vec = flat[offset : offset + 2 * E + 4]
        offset += 2 * E + 4
        counts, prob_sum, (ntok, lse2, z2, zc2) = vec[:E], vec[E : 2 * E], vec[2 * E :].tolist()
        per_layer.append(_layer_metrics(counts, prob_sum, ntok, lse2, z2, zc2, top_k))
    out: dict = {key: float(sum(d[key] for d in per_layer) / len(per_layer)) for key in ROUTER_METRIC_KEYS}
    out["num_layers"] = len(per_layer)
    out["per_layer"] = per_layer
    return out


def _layer_metrics(counts, prob_sum, ntok, lse2, z2, zc2, top_k) -> dict:
    E = counts.numel()
    if ntok <= 0:
        nan = float("nan")
        d = {key: nan for key in ROUTER_METRIC_KEYS}
        d.update(num_tokens=0.0, load=[nan] * E, prob=[nan] * E)
        return d
    f = counts / (top_k * ntok)
    P = prob_sum / ntok
    fpos = f[f > 0]
    entropy = float(-(fpos * fpos.log()).sum())
    mean = float(f.mean())
    std = float(f.std(unbiased=False))
    return {
        "lb_loss": float(E * (f * P).sum()),
        "z_loss": lse2 / ntok,
        "load_entropy": entropy,
        "load_entropy_norm": entropy / math.log(E) if E > 1 else 1.0,
        "load_cv": std / mean,
        "dead_fraction": float((counts == 0).double().mean()),
        "max_load": float(f.max()),
        "max_load_ratio": float(E * f.max()),
        "logit_rms": math.sqrt(z2 / ntok),
        "logit_rms_centered": math.sqrt(zc2 / ntok),
        "num_tokens": float(ntok),
        "load": f.tolist(),
        "prob": P.tolist(),
    }


def collect_router_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    no_grad: bool = True,
    **forward_kwargs,
) -> list[torch.Tensor]:
    """Run a Hugging Face MoE model with ``output_router_logits=True``; one logits tensor per MoE layer.

    Each tensor is what the model's router returns, ``(B*T, E)`` for OLMoE, gpt-oss,
    Mixtral and Qwen-MoE in transformers 5.x (gpt-oss logits include the router bias).
    Padding is not removed: pass the same ``attention_mask`` to :func:`router_metrics`.
    Runs under ``torch.no_grad()`` unless ``no_grad=False``; the model's train/eval mode
    is left as it is. ``use_cache=False`` and, where the forward accepts it,
    ``logits_to_keep=1`` (so no full ``B x T x V`` vocabulary logits are formed) are
    passed unless given in ``forward_kwargs``.

    Args:
        model: a Hugging Face MoE causal LM.
        input_ids: token ids ``(B, T)``.
        attention_mask: passed to the model.
        no_grad: run under ``torch.no_grad()``.
        **forward_kwargs (Any): further arguments of the model's forward.

    Returns:
        One logits tensor per MoE layer.

    Raises:
        ValueError: when the model returns no router logits.
    """
    forward_kwargs.setdefault("use_cache", False)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "logits_to_keep" in params:
        forward_kwargs.setdefault("logits_to_keep", 1)
    if attention_mask is not None:
        forward_kwargs["attention_mask"] = attention_mask
    ctx = torch.no_grad() if no_grad else contextlib.nullcontext()
    with ctx:
        out = model(input_ids=input_ids, output_router_logits=True, **forward_kwargs)
    logits = getattr(out, "router_logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("router_logits")
    if logits is None:
        raise ValueError(
            f"{type(model).__name__} returned no router logits; it is not a Hugging Face MoE model, "
            "use RouterLogitsRecorder on its router modules instead"
        )
    return [t for t in logits]


class RouterLogitsRecorder:
    """Record router logits with forward hooks, for models without ``output_router_logits``.

    ``modules``: router modules (an ``nn.Module``, an iterable of them, or a mapping
    name -> module), usually the ``nn.Linear(d, E)`` gates. Every forward call of module
    ``j`` appends its output, reshaped to ``(-1, E)``; tuple or list outputs (e.g. Hugging
    Face routers returning ``(logits, scores, indices)``) contribute element ``index``.
    ``router_logits`` concatenates the calls per module (one tensor per module, in the
    given order), ready for :func:`router_metrics`. Outputs are detached unless
    ``detach=False`` (then they keep the graph and can feed :func:`load_balancing_loss`).

    Use as a context manager (hooks are removed on exit)::

        with RouterLogitsRecorder(routers) as rec:
            model(x)
        stats = router_metrics(rec.router_logits, top_k=2)

    Args:
        modules (nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module]): the router
            modules.
        index: the element of a tuple or list output that holds the logits.
        detach: detach the recorded outputs.
    """

    def __init__(self, modules, *, index: int = 0, detach: bool = True):
        if isinstance(modules, nn.Module):
            modules = [modules]
        if isinstance(modules, Mapping):
            self.names = [str(n) for n in modules.keys()]
            self.modules = list(modules.values())
        else:
            self.modules = list(modules)
            self.names = [str(i) for i in range(len(self.modules))]
        if not self.modules:
            raise ValueError("no router modules given")
        self.index = index
        self.detach = detach
        self._captured: list[list[torch.Tensor]] = [[] for _ in self.modules]
        self._handles: list = []

    def _hook(self, j: int):
        def hook(module, inputs, output):
            t = output[self.index] if isinstance(output, (tuple, list)) else output
            if self.detach:
                t = t.detach()
            self._captured[j].append(t.reshape(-1, t.shape[-1]))

        return hook

    def attach(self) -> RouterLogitsRecorder:
        """Register the forward hooks (entering the context does this).

        Returns:
            The recorder itself.
        """
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(j)) for j, m in enumerate(self.modules)]
        return self

    def remove(self) -> None:
        """Remove the forward hooks (leaving the context does this); the records stay."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def clear(self) -> None:
        """Forget the recorded outputs (the hooks stay attached)."""
        self._captured = [[] for _ in self.modules]

    def __enter__(self) -> RouterLogitsRecorder:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.remove()

    @property
    def router_logits(self) -> list[torch.Tensor]:
        """One ``(tokens, E)`` tensor per module, all recorded calls concatenated."""
        out = []
        for name, calls in zip(self.names, self._captured):
            if not calls:
                raise RuntimeError(f"router module {name} has not run since the recorder was attached or cleared")
            out.append(calls[0] if len(calls) == 1 else torch.cat(calls, dim=0))
        return out
