"""Check numerically that the symmetry each role claims really holds in a model.

An optimizer built from a role table relies on two kinds of claims: that the *rows* of
each work matrix (see :mod:`equiopt.layouts`) are the axis a symmetry acts on, and that
the symmetry acts the way the role says. :func:`verify_roles` tests exactly these
claims on the model itself: it moves the weights along a symmetry, in place, runs the
model on a fixed random input and compares the output distribution (log-softmax of the
logits) with the original one, then restores the weights bit for bit.

Checks (``kind``):

``neuron``
    For each MLP block (its ``mlp_in`` and ``mlp_out`` parameters, grouped as below), a
    random permutation of the intermediate neurons is applied to the rows of every work
    matrix of the block, and to the neuron-indexed biases. With an expert axis (an
    :class:`~equiopt.layouts.Experts` layout on every member) each expert gets its own
    permutation. Output must be unchanged (paper, SwiGLU neuron-permutation symmetry).
    A block of a single neuron cannot be verified (the permutation is trivial) and is
    reported as failed.
``expert``
    For each ``router``: one random permutation of the experts applied to the router's
    work rows (and its bias), to the leading axis of every expert tensor of the same
    MoE block and their biases (or, for experts kept as a module list, to the list).
    Output must be unchanged (router symmetry ``W -> P W``).
``shift``
    For each ``lm_head`` and ``router``: a random ``1 a^T`` is added to every work
    matrix (the same row vector on every row). Softmax and top-k are invariant to a
    shared logit shift, so the output must be unchanged (the quotient by ``1 a^T`` that
    centred updates use). Final-logit soft-capping breaks this symmetry, and the
    check reports it.
``vocab``
    The rows of the ``embedding`` and ``lm_head`` work matrices are the vocabulary:
    permuting them (and relabelling the input ids for the embedding) must permute
    the output distribution over the vocabulary accordingly. Run when the table has an
    embedding or an LM head.
``conv``
    For each convolution weight (``nn.Conv*d``, ``nn.ConvTranspose*d``; ``Flatten``
    layouts, see :func:`~equiopt.roles.assign_roles`), whatever its layout: the work
    rows must be the weight's channels one for one (an index tensor pushed through the
    layout: every work row lies in one slice ``weight[c]`` and every ``c`` has exactly
    one row), and the module itself, run alone on the input it received in the model's
    forward pass, must agree: moving ``weight[c]`` for a few sampled ``c`` changes only
    output channel ``c`` (a transposed convolution: nothing when its input channel ``c``
    is zero). The change reported is the largest one outside the channel moved,
    against ``atol + rtol * max|output|``.

Attention parameters, other ``matrix`` parameters and ``vector`` roles are not checked.

Grouping of MLP blocks: every ``mlp_in`` parameter is joined to the ``mlp_out``
parameters with the same number of neurons (and experts) whose module paths share
the longest prefix with its own, provided that prefix contains at least the parent of
the module owning the parameter (``model.layers.0.mlp`` for
``model.layers.0.mlp.gate_proj.weight``, ``model.layers.0.mlp.experts`` for
``model.layers.0.mlp.experts.gate_up_proj``), and the other way round. Parameters
without a partner are checked alone (such a check fails unless the parameter really is
symmetric by itself) and the report says so.

Biases: the bias of a weight ``W`` is the parameter of the same module named ``bias``
(when ``W`` is ``weight``), ``<W>_bias`` or ``<stem>bias`` (for ``<stem>weight``); its
shape must be ``W``'s without one of the last two axes (a bias indexes ``W``'s output
axis; for a square ``W`` the module's storage convention decides: ``nn.Linear`` and
``is_transposed=False`` expert modules index rows, ``Conv1D`` and ``is_transposed=True``
columns). How the bias moves is read off the layout itself: the same permutation is
applied to a tensor of stored positions, which gives the permutation along the bias's
axis (identity for an output projection's bias, which indexes the hidden size). A
bias that cannot be mapped this way, and any other tensor of the block with the
neuron count in its shape, is left unchanged and named in the check's ``detail``.

Zero parameters: a check cannot see a parameter that is entirely zero (a zero-initialised
bias, output projection or head: permuting it, or anything feeding only it, changes
nothing). By default every all-zero floating-point parameter of the model is filled
with ``N(0, 0.02^2)`` values for the duration of the verification (the symmetries are
properties of the parameterisation, so they must hold at any point), the report's notes
name them, and they are restored bit for bit afterwards; ``fill_zeros=False`` checks
the weights exactly as they are.

Tolerances: the output compared is the log-softmax of the logits, computed in float32
(float64 for float64 models). A check passes when the largest absolute change of a
log-probability is at most ``atol + rtol * scale + 8 eps |log p|max``: ``scale`` is the
largest absolute centred logit of the unmodified model (the spread the model's own
rounding is proportional to) and the last term is the rounding of the log-probabilities
themselves. Defaults ``(rtol, atol)`` by model dtype: float64 ``(1e-9, 1e-12)``,
float32 ``(1e-4, 1e-6)``, float16 ``(5e-3, 1e-4)``, bfloat16 ``(3e-2, 1e-3)``. A
symmetry that holds changes the output by rounding only (permutations reorder sums; in
float32 a tiny model's log-probabilities move by about one ulp); a broken one moves
them by a fraction of the logit spread, orders of magnitude above the float32
tolerance. Float32 is the main case: in half precision rounding is large, a wrong
role on a model with very small weights may stay under the tolerance, and adding
``1 a^T`` to a router, rounded to the model dtype, can flip top-k choices between
near-tied experts and fail the shift check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .checks.conv import _ConvChecks
from .checks.expert import _ExpertChecks
from .checks.forward import _reference_param, _vocab_size
from .checks.neuron import _NeuronChecks
from .checks.report import CHECK_KINDS, DEFAULT_TOLERANCES, RoleCheck, RoleReport
from .checks.shift import _ShiftChecks
from .checks.vocab import _VocabCheck
from .checks.zeros import _FILL_STD, _fill_zero_parameters
from .infer import assign_roles
from .table import RoleTable

__all__ = ["verify_roles", "RoleReport", "RoleCheck", "CHECK_KINDS", "DEFAULT_TOLERANCES"]


def verify_roles(
    model: nn.Module,
    table: RoleTable | None = None,
    input_ids: Tensor | None = None,
    rules: Any = None,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    *,
    forward_fn: Callable[[nn.Module, Tensor], Any] | None = None,
    checks: Sequence[str] | None = None,
    fill_zeros: bool = True,
    raise_on_failure: bool = False,
    replicas: bool = False,
    **role_options: Any,
) -> RoleReport:
    """Check that the symmetry each role of ``table`` claims holds in ``model``.

    Args:
        model: the model, on any device and in its own dtype (float32 is the main
            case; see the module docstring for tolerances).
        table: the role table to verify; by default ``assign_roles(model, rules,
            **role_options)``.
        input_ids: token ids to run the model on; default random ids of shape
            ``(2, 16)`` below the vocabulary size, from a generator seeded with
            ``seed``, on the model's device.
        rules: passed to :func:`assign_roles` when ``table`` is None.
        seed: seeds the input and every random permutation and shift.
        rtol: relative part of the tolerance on the largest change of a
            log-probability, ``atol + rtol * scale + 8 eps |log p|max`` (``scale``: the
            largest absolute centred logit); defaults depend on the dtype
            (:data:`DEFAULT_TOLERANCES`).
        atol: absolute part of that tolerance; defaults depend on the dtype.
        forward_fn: ``forward_fn(model, input_ids) -> logits`` (or an output with
            ``.logits``, a ``{"logits": ...}`` mapping or a tuple led by the logits);
            by default ``model(input_ids=ids)`` when the forward takes ``input_ids``
            (Hugging Face models, with ``use_cache=False`` where accepted), else
            ``model(ids)``.
        checks: the kinds to run, a subset of :data:`CHECK_KINDS` (default all).
        fill_zeros: fill every all-zero parameter (zero-initialised biases, output
            projections, heads) with small random values while checking, so that the
            checks can see it; restored afterwards.
        raise_on_failure: raise a ValueError listing the failed checks.
        replicas: under ``torch.distributed``, also compare every parameter and gradient that
            should be equal on every rank (:func:`equiopt.diagnostics.check_replicas`; a
            collective, so every rank calls it): one ``"replica"`` check naming what differs.
        **role_options: passed to :func:`assign_roles` when ``table`` is None.

    Weights are changed in place under ``torch.no_grad()`` with the model in eval
    mode; every parameter is restored bit for bit and every module's training flag
    is restored, also when a forward raises.

    Returns:
        a :class:`RoleReport`.
    """
    if table is None:
        table = assign_roles(model, rules=rules, **role_options)
    elif rules is not None or role_options:
        raise ValueError("pass either a role table or rules/role options for assign_roles, not both")
    kinds = tuple(CHECK_KINDS if checks is None else checks)
    unknown = [k for k in kinds if k not in CHECK_KINDS]
    if unknown:
        raise ValueError(f"unknown check kind(s) {unknown}; valid: {', '.join(CHECK_KINDS)}")
    ref = _reference_param(model, table)
    if ref.device.type == "meta":
        raise ValueError("verify_roles needs real weights; the model is on the meta device")
    dtype = ref.dtype
    default = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    rtol = default[0] if rtol is None else float(rtol)
    atol = default[1] if atol is None else float(atol)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    if input_ids is None:
        vocab = _vocab_size(model, table)
        input_ids = torch.randint(0, vocab, (2, 16), generator=gen)
    input_ids = torch.as_tensor(input_ids).to(device=ref.device)

    modes = [(m, m.training) for m in model.modules()]
    runner = _Runner(model, table, input_ids, forward_fn, gen, rtol, atol)
    filled: list[tuple[nn.Parameter, Tensor]] = []
    try:
        model.eval()
        with torch.no_grad():
            if fill_zeros:
                filled = _fill_zero_parameters(model, gen)
            runner.start()
            for kind, run in runner.checks().items():
                if kind in kinds:
                    run()
    finally:
        with torch.no_grad():
            for p, old in reversed(filled):
                p.copy_(old)
        for m, flag in modes:
            m.training = flag
    if filled:
        names = [runner.names_of.get(id(p), "?") for p, _ in filled]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        runner.notes.insert(
            0,
            f"{len(names)} all-zero parameter(s) filled with N(0, {_FILL_STD}^2) during the "
            f"checks (so that the checks can see them): {shown}",
        )
    if replicas:
        from ..diagnostics.replicas import check_replicas

        differ = check_replicas(model)
        runner.results.append(
            RoleCheck(
                kind="replica",
                names=tuple(differ) or ("every replicated parameter",),
                max_change=float(len(differ)),
                tolerance=0.0,
                passed=not differ,
                detail=("differ across ranks: " + ", ".join(differ))
                if differ
                else "parameters and gradients equal on every rank",
            )
        )
    report = RoleReport(
        runner.results,
        dtype=dtype,
        input_shape=tuple(input_ids.shape),
        scale=runner.scale,
        notes=runner.notes + _unchecked_notes(table, runner.conv_checked),
    )
    if raise_on_failure and not report.ok:
        lines = [
            f"{c.kind} check failed on {c.where}: max change {c.max_change:.3g} > tolerance "
            f"{c.tolerance:.3g}" + (f" ({c.detail})" if c.detail else "")
            for c in report.failures
        ]
        raise ValueError("role symmetry checks failed:\n" + "\n".join(lines))
    return report


class _Runner(_NeuronChecks, _ExpertChecks, _ShiftChecks, _VocabCheck, _ConvChecks):
    """Runs the checks of :data:`CHECK_KINDS` on one model, one method a kind."""

    def checks(self) -> dict[str, Callable[[], None]]:
        """The method that runs each kind of check, in the order of :data:`CHECK_KINDS`."""
        return {
            "neuron": self.neuron_checks,
            "expert": self.expert_checks,
            "shift": self.shift_checks,
            "vocab": self.vocab_check,
            "conv": self.conv_checks,
        }


def _unchecked_notes(table: RoleTable, checked: set[str] = frozenset()) -> list[str]:
    counts: dict[str, int] = {}
    for r in table:
        if r.role in ("attention", "matrix") and r.name not in checked:
            counts[r.role] = counts.get(r.role, 0) + 1
    return [f"{n} {role} parameter(s) not checked (no permutation check for this role)" for role, n in counts.items()]
