"""The ``neuron`` check: the MLP parameters grouped into blocks, and one permutation of a
block's neurons (one per expert with an expert axis) applied to the rows of every work
matrix and to the neuron-indexed biases; the output must not change."""

from __future__ import annotations

from ...layouts import Experts
from ..table import RoleRow
from .biases import _BiasMoves
from .moves import _work_rows_plan
from .paths import _common, _module_path, _under


class _NeuronChecks(_BiasMoves):
    """The ``neuron`` checks, one per MLP block."""

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
                if id(q) in handled or not _under(name, prefix):
                    continue
                if any(n in (neurons, 2 * neurons) for n in q.shape):
                    handled.add(id(q))
                    notes.append(
                        f"{name} {tuple(q.shape)} ({self._role_of(q)}) has the neuron count but is not permuted"
                    )
        per = "per-expert " if info is not None and info[0] is not None else ""
        detail = f"{per}permutation of {neurons if neurons is not None else 'the'} neurons on work rows"
        self._run("neuron", plan, "; ".join([detail] + notes))


def _neuron_info(row: RoleRow) -> tuple[int | None, int] | None:
    """(experts or None, neurons) of an MLP row, or None when its work matrices disagree."""
    counts = {s[-2] for s in row.work_shapes}
    if len(counts) != 1:
        return None
    return (row.shape[0] if isinstance(row.layout, Experts) else None), counts.pop()
