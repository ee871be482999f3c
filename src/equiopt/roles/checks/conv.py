"""The ``conv`` check: a convolution weight's work rows must be its channels one for one,
and the module, run alone on the input it received in the model's forward, must agree
(moving ``weight[c]`` changes only output channel ``c``)."""

from __future__ import annotations

import torch
from torch import nn

from ..inference.storage import CONVS
from ..table import RoleRow
from .paths import _module_name
from .report import RoleCheck
from .runner import _RunnerBase


class _ConvChecks(_RunnerBase):
    """The ``conv`` checks, one per convolution weight."""

    def conv_checks(self):
        targets = []
        for r in self.table:
            mod = self.modules.get(_module_name(r.name))
            if r.layout is not None and isinstance(mod, CONVS) and getattr(mod, "weight", None) is r.param:
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
