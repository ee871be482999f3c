"""The ``expert`` check: for each router, one permutation of the experts applied to the
router's work rows and bias and to every expert tensor of its MoE block (a leading
expert axis, or a list of expert modules); the output must not change."""

from __future__ import annotations

from torch import nn

from ...layouts import Experts
from ..table import RoleRow
from .biases import _BiasMoves
from .moves import _leading_plan, _work_rows_plan
from .paths import _module_name, _module_path, _under


class _ExpertChecks(_BiasMoves):
    """The ``expert`` checks, one per router."""

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
            return _under(name, prefix)

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
            if id(q) not in handled and _under(name, prefix) and q.ndim >= 1 and q.shape[0] == E:
                handled.add(id(q))
                notes.append(f"{name} {tuple(q.shape)} ({self._role_of(q)}) has the expert count but is not permuted")
        self._run("expert", plan, "; ".join([f"permutation of {E} experts"] + notes))
