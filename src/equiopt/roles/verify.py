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

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..layouts import Experts, Layout
from .infer import _CONVS, _input_embedding, assign_roles
from .table import RoleRow, RoleTable

__all__ = ["verify_roles", "RoleReport", "RoleCheck", "CHECK_KINDS", "DEFAULT_TOLERANCES"]

CHECK_KINDS = ("neuron", "expert", "shift", "vocab", "conv")

#: default ``(rtol, atol)`` per model dtype (see the module docstring)
DEFAULT_TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-4, 1e-6),
    torch.float16: (5e-3, 1e-4),
    torch.bfloat16: (3e-2, 1e-3),
}


@dataclass(frozen=True)
class RoleCheck:
    """One symmetry check: which parameters were moved and how much the output changed.

    ``max_change`` is the largest absolute change of a log-probability (for ``vocab``
    after undoing the output permutation); ``detail`` says what was moved and notes
    anything left unchanged.

    Args:
        kind: the check (one of :data:`CHECK_KINDS`).
        names: the parameters moved together.
        max_change: the largest absolute change of a log-probability.
        tolerance: the largest change that passes.
        passed: ``max_change <= tolerance``.
        detail: what was moved, and anything left unchanged.
    """

    kind: str
    names: tuple[str, ...]
    max_change: float
    tolerance: float
    passed: bool
    detail: str = ""

    @property
    def where(self) -> str:
        """The parameter names with their common module prefix factored out."""
        return _compress(self.names)


class RoleReport(list):
    """A list of :class:`RoleCheck` with ``.ok``, ``.failures`` and a text table.

    Also ``dtype`` (the model's), ``input_shape``, ``scale`` (largest absolute centred
    logit of the model, the spread tolerances are relative to) and ``notes`` (filled
    zero parameters, roles without a check).

    Args:
        checks: the checks run.
        dtype: the model's dtype.
        input_shape: the shape of the token ids the model ran on.
        scale: the largest absolute centred logit of the model.
        notes: remarks printed under the table.
    """

    def __init__(
        self,
        checks: Sequence[RoleCheck] = (),
        dtype: torch.dtype | None = None,
        input_shape: tuple[int, ...] | None = None,
        scale: float | None = None,
        notes: Sequence[str] = (),
    ):
        super().__init__(checks)
        self.dtype = dtype
        self.input_shape = input_shape
        self.scale = scale
        self.notes = list(notes)

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self)

    @property
    def failures(self) -> list[RoleCheck]:
        return [c for c in self if not c.passed]

    def kinds(self) -> set[str]:
        """The kinds of check the report holds.

        Returns:
            A set of :data:`CHECK_KINDS` entries.
        """
        return {c.kind for c in self}

    def format(self, details: bool = True) -> str:
        """The report as a text table: kind, result, largest change, tolerance, parameters.

        Args:
            details: add each failed (or compound) check's detail line.

        Returns:
            The table, with a summary line first and the notes last.
        """
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        shape = "x".join(map(str, self.input_shape)) if self.input_shape else "?"
        n_fail = len(self.failures)
        head = f"role symmetry checks ({dtype}, input {shape}): {len(self)} checks, "
        head += "all passed" if n_fail == 0 else f"{n_fail} FAILED"
        header = ["kind", "result", "max change", "tolerance", "parameters"]
        lines = [
            [c.kind, "ok" if c.passed else "FAIL", f"{c.max_change:.2e}", f"{c.tolerance:.2e}", c.where] for c in self
        ]
        widths = [max(len(x) for x in col) for col in zip(header, *lines)]
        fmt = lambda cells: "  ".join(x.ljust(w) for x, w in zip(cells, widths)).rstrip()
        out = [head, fmt(header), fmt(["-" * w for w in widths])]
        for c, cells in zip(self, lines):
            out.append(fmt(cells))
            if details and c.detail and (not c.passed or ";" in c.detail):
                out.append("    " + c.detail)
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()

    __repr__ = list.__repr__


# ----------------------------------------------------------------------------- API


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
            if "neuron" in kinds:
                runner.neuron_checks()
            if "expert" in kinds:
                runner.expert_checks()
            if "shift" in kinds:
                runner.shift_checks()
            if "vocab" in kinds:
                runner.vocab_check()
            if "conv" in kinds:
                runner.conv_checks()
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


# ------------------------------------------------------------------------- runner


class _Runner:
    def __init__(self, model, table, input_ids, forward_fn, gen, rtol, atol):
        self.model, self.table, self.ids, self.gen = model, table, input_ids, gen
        self.forward_fn = forward_fn or _default_forward(model)
        self.rtol, self.atol = rtol, atol
        self.results: list[RoleCheck] = []
        self.notes: list[str] = []
        self.modules = dict(model.named_modules())
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.names_of: dict[int, str] = {}
        self.roles = {id(row.param): row.role for row in table}
        for row in table:
            self.names_of.setdefault(id(row.param), row.name)
        for name, p in self.params.items():
            self.names_of.setdefault(id(p), name)
        self.conv_checked: set[str] = set()

    # -- model evaluation ---------------------------------------------------------
    def start(self):
        self.base = self._logprobs(self.ids)
        centred = self.base - self.base.mean(-1, keepdim=True)
        self.scale = float(centred.abs().max())
        floor = 8 * torch.finfo(self.base.dtype).eps * float(self.base.abs().max())
        self.tolerance = self.atol + self.rtol * self.scale + floor

    def _logprobs(self, ids: Tensor) -> Tensor:
        logits = _logits(self.forward_fn(self.model, ids))
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return logits.detach().to(work).log_softmax(-1)

    def _run(
        self,
        kind: str,
        plan: list[tuple[nn.Parameter, Callable[[], Tensor]]],
        detail: str,
        ids: Tensor | None = None,
        out_perm: Tensor | None = None,
    ):
        """Move the weights as ``plan`` says, compare outputs, restore bit for bit, record.

        ``plan``: ``(param, new)`` where ``new()`` computes the moved value from the
        current values. All new values are computed before any is written.
        """
        params, seen = [], set()
        for q, _ in plan:
            if id(q) not in seen:
                seen.add(id(q))
                params.append(q)
        saved = [(q, q.detach().clone()) for q in params]
        try:
            news = [(q, new()) for q, new in plan]
            for q, value in news:
                q.copy_(value)
            out = self._logprobs(self.ids if ids is None else ids)
        finally:
            for q, old in reversed(saved):
                q.copy_(old)
        base = self.base
        if out_perm is not None:
            base = base.index_select(-1, out_perm.to(base.device))
        if out.shape != base.shape:
            change = math.inf
        else:
            change = float((out - base).abs().max())
            if math.isnan(change):
                change = math.inf
        names = tuple(self.names_of.get(id(q), "?") for q in params)
        self.results.append(RoleCheck(kind, names, change, self.tolerance, change <= self.tolerance, detail))

    def _fail(self, kind: str, names: Sequence[str], detail: str):
        """Record a failed check that could not be run or could not confirm anything."""
        self.results.append(RoleCheck(kind, tuple(names), math.inf, self.tolerance, False, detail))

    # -- random draws (CPU generator, moved to the parameter's device) -------------
    def _perm(self, n: int) -> Tensor:
        perm = torch.randperm(n, generator=self.gen)
        if n > 1 and bool((perm == torch.arange(n)).all()):
            perm = perm.roll(1)
        return perm

    def _perms(self, batch: int, n: int) -> Tensor:
        return torch.stack([self._perm(n) for _ in range(batch)])

    # -- neuron permutation ---------------------------------------------------------
    def neuron_checks(self):
        rows = [r for r in self.table if r.role in ("mlp_in", "mlp_out") and r.layout is not None]
        info = {r.name: _neuron_info(r) for r in rows}
        parent = {r.name: r.name for r in rows}

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for r in rows:
            if info[r.name] is None:
                continue
            others = [o for o in rows if o.role != r.role and info[o.name] == info[r.name]]
            if not others:
                continue
            path = _module_path(r.name)
            scores = [_common(path, _module_path(o.name)) for o in others]
            best = max(scores)
            if best >= len(path) - 1:
                for o, score in zip(others, scores):
                    if score == best:
                        parent[find(o.name)] = find(r.name)
        groups: dict[str, list[RoleRow]] = {}
        for r in rows:
            groups.setdefault(find(r.name), []).append(r)
        for members in groups.values():
            self._neuron_check(members, info[members[0].name])

    def _neuron_check(self, members: list[RoleRow], info: tuple[int | None, int] | None):
        # grouping requires equal (experts, neurons); info is None only for a lone
        # member whose work matrices disagree on their row count
        notes = []
        if info is None:
            notes.append("work matrices disagree on the neuron count: each permuted on its own")
            neurons, perm = None, None
        elif info[0] is not None:
            neurons, perm = info[1], self._perms(info[0], info[1])
        else:
            neurons, perm = info[1], self._perm(info[1])
        roles = {m.role for m in members}
        if neurons == 1:
            why = "1 neuron: the permutation is trivial, so nothing confirms the role"
            if len(roles) == 1:
                why += (
                    f" (no {'mlp_out' if roles == {'mlp_in'} else 'mlp_in'} partner either; a (1, d) "
                    "projection is usually a scalar gate, not an MLP projection)"
                )
            self._fail("neuron", [m.name for m in members], why)
            return
        if roles == {"mlp_in"}:
            notes.append("no mlp_out partner found: mlp_in permuted alone")
        elif roles == {"mlp_out"}:
            notes.append("no mlp_in partner found: mlp_out permuted alone")
        plan: list = []
        handled = {id(m.param) for m in members}
        for m in members:
            perms = perm if perm is not None else [self._perm(s[-2]) for s in m.work_shapes]
            new, src = _work_rows_plan(m.layout, m.param, perms, m.name)
            plan.append((m.param, new))
            handled |= self._plan_bias(m, src, plan, notes)
        if neurons is not None:  # anything else in the block that carries the neuron count
            paths = [_module_path(m.name) for m in members]
            if len(paths) == 1:
                block = paths[0][:-1]
            else:
                block = paths[0][: min(_common(paths[0], q) for q in paths[1:])]
            prefix = ".".join(block)
            for name, q in self.params.items():
                if id(q) in handled or not (prefix == "" or name.startswith(prefix + ".")):
                    continue
                if any(n in (neurons, 2 * neurons) for n in q.shape):
                    handled.add(id(q))
                    notes.append(
                        f"{name} {tuple(q.shape)} ({self._role_of(q)}) has the neuron count but is not permuted"
                    )
        per = "per-expert " if info is not None and info[0] is not None else ""
        detail = f"{per}permutation of {neurons if neurons is not None else 'the'} neurons on work rows"
        self._run("neuron", plan, "; ".join([detail] + notes))

    def _plan_bias(self, row: RoleRow, src: Tensor, plan: list, notes: list[str]) -> set[int]:
        """Add the bias of ``row`` (moved like its weight, per ``src``) to ``plan``."""
        found = self._bias_of(row.name, row.param)
        if found is None:
            return set()
        bname, b = found
        index, why = _bias_index(tuple(b.shape), tuple(row.param.shape), src, self._bias_axis(row.name, row.param, b))
        if why:
            notes.append(f"bias {bname} not permuted: {why}")
        elif index is not None:
            index = index.to(b.device)
            plan.append((b, lambda: torch.gather(b, -1, index)))
        return {id(b)}

    # -- expert permutation ---------------------------------------------------------
    def expert_checks(self):
        for r in self.table:
            if r.role == "router" and r.layout is not None:
                self._expert_check(r)

    def _expert_check(self, router: RoleRow):
        counts = sorted({s[-2] for s in router.work_shapes})
        if len(counts) != 1:
            self._fail("expert", [router.name], f"router work matrices disagree on the expert count {counts}")
            return
        E = counts[0]
        perm = self._perm(E)
        notes: list[str] = []
        new, src = _work_rows_plan(router.layout, router.param, perm, router.name)
        plan: list = [(router.param, new)]
        handled = {id(router.param)} | self._plan_bias(router, src, plan, notes)
        router_module = _module_name(router.name)
        prefix = ".".join(_module_path(router.name)[:-1])

        def in_block(name: str) -> bool:
            if router_module and name.startswith(router_module + "."):
                return False
            return prefix == "" or name.startswith(prefix + ".")

        found = 0
        # expert tensors with a leading expert axis, and their biases
        for row in self.table:
            q = row.param
            if id(q) in handled or not in_block(row.name):
                continue
            if row.role in ("mlp_in", "mlp_out") and isinstance(row.layout, Experts) and q.shape[0] == E:
                plan.append((q, _leading_plan(q, perm)))
                handled.add(id(q))
                found += 1
                bias = self._bias_of(row.name, q)
                if bias is not None and id(bias[1]) not in handled:
                    handled.add(id(bias[1]))
                    if bias[1].ndim >= 1 and bias[1].shape[0] == E:
                        plan.append((bias[1], _leading_plan(bias[1], perm)))
                    else:
                        notes.append(f"bias {bias[0]} {tuple(bias[1].shape)} not permuted: no leading expert axis")
        # experts kept as a list of modules: <block>.<list>.<i>.<rest>
        lists: dict[tuple[str, str], dict[int, nn.Parameter]] = {}
        for name, q in self.params.items():
            if id(q) in handled or not in_block(name):
                continue
            comps = (name[len(prefix) + 1 :] if prefix else name).split(".")
            j = next((k for k, c in enumerate(comps[:-1]) if c.isdigit()), None)
            if j is not None:
                lists.setdefault((".".join(comps[:j]), ".".join(comps[j + 1 :])), {})[int(comps[j])] = q
        for _, items in sorted(lists.items()):
            if sorted(items) != list(range(E)) or len({tuple(q.shape) for q in items.values()}) != 1:
                continue
            for i in range(E):
                source = items[int(perm[i])]
                plan.append((items[i], lambda source=source: source.detach().clone()))
                handled.add(id(items[i]))
            found += 1
        if not found:
            notes.append(f"no expert tensors found in {prefix or 'the model'}: router permuted alone")
        for name, q in self.params.items():  # anything else in the block with a leading axis of E
            if (
                id(q) not in handled
                and (prefix == "" or name.startswith(prefix + "."))
                and q.ndim >= 1
                and q.shape[0] == E
            ):
                handled.add(id(q))
                notes.append(f"{name} {tuple(q.shape)} ({self._role_of(q)}) has the expert count but is not permuted")
        self._run("expert", plan, "; ".join([f"permutation of {E} experts"] + notes))

    # -- shared shift -----------------------------------------------------------------
    def shift_checks(self):
        for r in self.table:
            if r.role not in ("lm_head", "router") or r.layout is None:
                continue
            shifts = [torch.randn(*s[:-2], 1, s[-1], generator=self.gen) for s in r.work_shapes]
            what = "vocabulary" if r.role == "lm_head" else "expert"
            detail = f"{r.role}: 1 a^T added to each work matrix (a shared {what}-logit shift)"
            if r.role == "router" and r.param.dtype in (torch.float16, torch.bfloat16):
                detail += (
                    "; in half precision the rounded shift can flip top-k choices between near-tied "
                    "experts: confirm a failure in float32"
                )
            self._run("shift", [(r.param, _shift_plan(r.layout, r.param, shifts, r.name))], detail)

    # -- vocabulary -------------------------------------------------------------------
    def vocab_check(self):
        V = self.base.shape[-1]
        emb, head = [], []
        for r in self.table:
            if r.role not in ("embedding", "lm_head") or r.layout is None:
                continue
            rows = sorted({s[-2] for s in r.work_shapes})
            if rows != [V]:
                self._fail("vocab", [r.name], f"{r.role} work rows {rows} are not the vocabulary ({V} logits)")
            else:
                (emb if r.role == "embedding" else head).append(r)
        if not emb and not head:
            return
        output_side = bool(head) or bool(getattr(self.table, "tied_embeddings", False))
        perm = self._perm(V)
        plan: list = []
        notes: list[str] = []
        for r in emb + head:
            new, src = _work_rows_plan(r.layout, r.param, perm, r.name)
            plan.append((r.param, new))
            if r.role == "lm_head":
                self._plan_bias(r, src, plan, notes)
        ids, sides = self.ids, []
        if emb:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(V)
            ids = inverse.to(self.ids.device)[self.ids]
            sides.append("input ids relabelled")
        else:
            notes.append("no embedding in the table: only the output side checked")
        if output_side:
            sides.append("output permuted")
        else:
            notes.append("no lm_head in the table: only the input side checked")
        detail = f"permutation of {V} vocabulary rows ({', '.join(sides)})"
        self._run("vocab", plan, "; ".join([detail] + notes), ids=ids, out_perm=perm if output_side else None)

    # -- convolution weights -------------------------------------------------------------
    def conv_checks(self):
        targets = []
        for r in self.table:
            mod = self.modules.get(_module_name(r.name))
            if r.layout is not None and isinstance(mod, _CONVS) and getattr(mod, "weight", None) is r.param:
                targets.append((r, mod))
        if not targets:
            return
        captured: dict[str, tuple] = {}

        def keep(key):
            def hook(module, args, kwargs, output):
                if key not in captured:
                    captured[key] = (tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args), dict(kwargs))

            return hook

        handles = [mod.register_forward_hook(keep(r.name), with_kwargs=True) for r, mod in targets]
        try:
            self.forward_fn(self.model, self.ids)
        finally:
            for h in handles:
                h.remove()
        for r, mod in targets:
            self.conv_checked.add(r.name)
            self._conv_check(r, mod, captured.get(r.name))

    def _conv_check(self, row: RoleRow, mod: nn.Module, inputs):
        p, name = row.param, row.name
        transposed = bool(getattr(mod, "transposed", False))
        side = "input" if transposed else "output"
        channels = p.shape[0]
        where = f"{type(mod).__name__} weight {tuple(p.shape)}, layout {row.layout.spec}"
        # the layout: one work row per channel (dim 0 of the weight), one channel per row
        index = torch.arange(channels).view(-1, *([1] * (p.ndim - 1))).expand(p.shape).contiguous()
        works = row.layout.to_work_list(index, name=name)
        rows = torch.cat([w.reshape(-1, w.shape[-1]) for w in works])
        first = rows[:, 0]
        if (
            rows.shape[0] != channels
            or not bool((rows == first[:, None]).all())
            or not torch.equal(first.sort().values, torch.arange(channels))
        ):
            self._fail(
                "conv",
                [name],
                f"{where}: the work rows are not the {channels} {side} channels one for one "
                f"({rows.shape[0]} work rows; a convolution weight takes a flatten layout, "
                f"rows = its first axis)",
            )
            return
        if inputs is None:
            self._fail(
                "conv",
                [name],
                f"{where}: layout fits, but the module did not run in the model's forward, "
                f"so its channels could not be checked",
            )
            return
        args, kwargs = inputs
        spatial = len(getattr(mod, "kernel_size", p.shape[2:]))
        scale = float(p.detach().float().pow(2).mean().sqrt()) or 1.0
        picks = sorted({0, channels - 1, *torch.randint(0, channels, (2,), generator=self.gen).tolist()})
        base = mod(*args, **kwargs)
        tolerance = self.atol + self.rtol * float(base.detach().abs().max())
        saved = p.detach().clone()
        off, silent = 0.0, []
        try:
            for c in picks:
                delta = torch.randn(p.shape[1:], generator=self.gen).to(p) * scale
                x = args[0]
                if transposed:  # the change must vanish when input channel c is zero
                    cdim = x.ndim - spatial - 1
                    quiet = x.clone()
                    quiet.select(cdim, c).zero_()
                    before = mod(quiet, *args[1:], **kwargs)
                p[c].add_(delta)
                out = mod(*args, **kwargs)
                diff = (out - base).abs()
                cdim = diff.ndim - spatial - 1
                per_channel = diff.movedim(cdim, 0).reshape(diff.shape[cdim], -1).amax(1)
                if transposed:
                    off = max(off, float((mod(quiet, *args[1:], **kwargs) - before).abs().max()))
                    moved = float(per_channel.max())
                else:
                    others = torch.cat([per_channel[:c], per_channel[c + 1 :]])
                    off = max(off, float(others.max()) if others.numel() else 0.0)
                    moved = float(per_channel[c])
                if not moved > tolerance:
                    silent.append(c)
                p.copy_(saved)
        finally:
            p.copy_(saved)
        detail = f"{where}: {side} channels {picks} moved one at a time; " + (
            "each changed only its own output channel"
            if not transposed
            else "each changed nothing while its input channel was zero"
        )
        if silent:
            self._fail(
                "conv",
                [name],
                f"{where}: moving {side} channel(s) {silent} changed nothing in the module's "
                f"output (is their input zero in this forward?)",
            )
            return
        self.results.append(RoleCheck("conv", (name,), off, tolerance, off <= tolerance, detail))

    def _role_of(self, q: Tensor) -> str:
        role = self.roles.get(id(q))
        return f"role {role}" if role is not None else "not in the role table"

    # -- biases ------------------------------------------------------------------------
    def _bias_of(self, name: str, p: Tensor) -> tuple[str, nn.Parameter] | None:
        """The bias of weight ``name``: ``bias``, ``<attr>_bias`` or ``<stem>bias`` of its module."""
        mod_name = _module_name(name)
        attr = name.rsplit(".", 1)[-1]
        mod = self.modules.get(mod_name)
        if mod is None:
            return None
        candidates = ["bias"] if attr == "weight" else []
        candidates.append(attr + "_bias")
        if attr.endswith("weight") and attr != "weight":
            candidates.append(attr[: -len("weight")] + "bias")
        for c in candidates:
            q = mod._parameters.get(c)
            if q is not None and q is not p:
                return _join(mod_name, c), q
        return None

    def _bias_axis(self, name: str, p: Tensor, b: Tensor) -> int | None:
        """The stored axis of ``p`` (-2 or -1) that its bias ``b`` indexes, or None."""
        lead = tuple(p.shape[:-2])
        rows_fit = tuple(b.shape) == lead + (p.shape[-2],)
        cols_fit = tuple(b.shape) == lead + (p.shape[-1],)
        if rows_fit != cols_fit:
            return -2 if rows_fit else -1
        if not rows_fit:
            return None
        mod = self.modules.get(_module_name(name))  # square weight: the storage convention decides
        if isinstance(mod, nn.Linear):
            return -2
        if type(mod).__name__ == "Conv1D":
            return -1
        transposed = getattr(mod, "is_transposed", None)
        if isinstance(transposed, bool):
            return -1 if transposed else -2
        return None


_FILL_STD = 0.02


def _fill_zero_parameters(model: nn.Module, gen: torch.Generator) -> list[tuple[nn.Parameter, Tensor]]:
    """Fill every all-zero floating-point parameter with N(0, _FILL_STD^2); return the originals."""
    saved, seen = [], set()
    for p in model.parameters():
        if id(p) in seen or not p.is_floating_point() or p.numel() == 0 or bool(p.detach().any()):
            continue
        seen.add(id(p))
        saved.append((p, p.detach().clone()))
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * _FILL_STD
        p.copy_(noise.to(device=p.device, dtype=p.dtype))
    return saved


# --------------------------------------------------------------------- tensor helpers


def _neuron_info(row: RoleRow) -> tuple[int | None, int] | None:
    """(experts or None, neurons) of an MLP row, or None when its work matrices disagree."""
    counts = {s[-2] for s in row.work_shapes}
    if len(counts) != 1:
        return None
    return (row.shape[0] if isinstance(row.layout, Experts) else None), counts.pop()


def _permute_rows(w: Tensor, perm: Tensor) -> Tensor:
    """Rows (dim -2) of ``w`` reordered: ``out[..., i, :] = w[..., perm[i], :]``.

    ``perm`` of shape ``(n,)`` applies to every matrix; ``(E, n)`` gives each index of
    the leading (expert) axis of ``w`` its own permutation.
    """
    perm = perm.to(w.device)
    if perm.ndim == 1:
        return w.index_select(-2, perm)
    E, n = perm.shape
    index = perm.view(E, *([1] * (w.ndim - 3)), n, 1).expand(w.shape)
    return torch.gather(w, -2, index)


def _work_rows_plan(layout: Layout, p: Tensor, perms, name: str) -> tuple[Callable[[], Tensor], Tensor]:
    """``(new, source map)`` for ``p`` with the rows of its work matrices permuted.

    ``perms``: one permutation for every work tensor, or a list with one per work
    tensor. ``new()`` computes the moved value (to_work_list -> rows -> from_work_list)
    from ``p``'s current value. The source map has ``p``'s shape and holds, for each
    stored position, the flat index of the position its new value comes from (the
    same moves applied to a tensor of positions).
    """
    count = layout.num_blocks
    perm_list = list(perms) if isinstance(perms, (list, tuple)) else [perms] * count

    def move(t: Tensor) -> Tensor:
        works = layout.to_work_list(t, name=name)
        return layout.from_work_list([_permute_rows(w, q) for w, q in zip(works, perm_list)])

    src = move(torch.arange(p.numel()).view(p.shape))
    return (lambda: move(p.detach()).clone()), src


def _shift_plan(layout: Layout, p: Tensor, shifts: list[Tensor], name: str) -> Callable[[], Tensor]:
    """``new()`` adding ``1 a^T`` to each work matrix, ``a`` scaled to the matrix's rms."""

    def new() -> Tensor:
        moved = []
        for w, a in zip(layout.to_work_list(p.detach(), name=name), shifts):
            rms = float(w.float().pow(2).mean().sqrt()) or 1.0
            moved.append(w + (a * rms).to(device=w.device, dtype=w.dtype))
        return layout.from_work_list(moved).clone()

    return new


def _leading_plan(q: Tensor, perm: Tensor) -> Callable[[], Tensor]:
    index = perm.to(q.device)
    return lambda: q.detach().index_select(0, index)


def _bias_index(
    b_shape: tuple[int, ...], p_shape: tuple[int, ...], src: Tensor, axis: int | None
) -> tuple[Tensor | None, str]:
    """How a bias of ``p`` moves when ``p`` moves by the source map ``src``.

    Returns ``(index, "")``: gather the bias along its last axis with ``index``;
    ``(None, "")``: the move leaves the axis the bias indexes alone (e.g. the hidden
    axis of an output projection); ``(None, why)``: it cannot be followed.
    """
    if axis is None:
        return None, f"shape {b_shape} does not index one output axis of the weight {p_shape}"
    coords = torch.unravel_index(src.reshape(-1), p_shape)
    grid = torch.unravel_index(torch.arange(src.numel()), p_shape)
    if not all(bool((c == g).all()) for c, g in zip(coords[:-2], grid[:-2])):
        return None, "the move mixes the leading axes of the weight"
    other = -1 if axis == -2 else -2
    axis_fixed = bool((coords[axis] == grid[axis]).all())
    other_fixed = bool((coords[other] == grid[other]).all())
    if axis_fixed:
        return None, ""
    if not other_fixed:
        return None, "the layout moves both axes of the weight, so the bias's positions cannot be followed"
    source = coords[axis].view(p_shape)
    index = source.select(other, 0)
    if not bool((source == index.unsqueeze(other)).all()):
        return None, "the move along the bias's axis differs between columns of the weight"
    return index, ""


def _module_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_path(name: str) -> list[str]:
    return name.split(".")[:-1]


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _compress(names: Sequence[str]) -> str:
    if not names:
        return ""
    if len(names) == 1:
        return names[0]
    paths = [n.split(".") for n in names]
    k = min(len(p) for p in paths) - 1
    n = 0
    while n < k and all(p[n] == paths[0][n] for p in paths):
        n += 1
    if n == 0:
        return ", ".join(names)
    return ".".join(paths[0][:n]) + ".{" + ", ".join(".".join(p[n:]) for p in paths) + "}"


def _unchecked_notes(table: RoleTable, checked: set[str] = frozenset()) -> list[str]:
    counts: dict[str, int] = {}
    for r in table:
        if r.role in ("attention", "matrix") and r.name not in checked:
            counts[r.role] = counts.get(r.role, 0) + 1
    return [f"{n} {role} parameter(s) not checked (no permutation check for this role)" for role, n in counts.items()]


def _reference_param(model: nn.Module, table: RoleTable) -> Tensor:
    for r in table:
        if r.param.is_floating_point():
            return r.param
    for p in model.parameters():
        if p.is_floating_point():
            return p
    raise ValueError("the model has no floating-point parameters")


def _vocab_size(model: nn.Module, table: RoleTable) -> int:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    for c in (config, text):
        v = getattr(c, "vocab_size", None) if c is not None else None
        if isinstance(v, int) and v > 0:
            return v
    for r in table:
        if r.role == "embedding" and r.layout is not None:
            return r.layout.work_shapes(r.shape, r.name)[0][-2]
    emb = _input_embedding(model)
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    raise ValueError("cannot tell the vocabulary size: pass input_ids")


def _default_forward(model: nn.Module) -> Callable[[nn.Module, Tensor], Any]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "input_ids" in params:
        if "use_cache" in params:
            return lambda m, ids: m(input_ids=ids, use_cache=False)
        return lambda m, ids: m(input_ids=ids)
    return lambda m, ids: m(ids)


def _logits(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, Mapping) and isinstance(out.get("logits"), Tensor):
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"cannot find logits in the model output of type {type(out).__name__}; pass forward_fn")
