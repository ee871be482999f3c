"""The pairing of a fused dense gate/up projection (``[gate; up]`` concatenated or
``g0, u0, ...`` interleaved), found by running the MLP block: the pairing whose neuron
permutation leaves the block's output unchanged is the block's own symmetry."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .context import _ContextBase

#: ``rules=`` values for a fused gate/up projection, and when each is right.
_PAIRINGS = [
    ("('mlp_in', 'gate_up:concat')", "for [gate; up] halves"),
    ("('mlp_in', 'gate_up:interleave')", "for gate and up rows interleaved"),
]


class _DownProjection(NamedTuple):
    """The output projection an MLP block's fused gate/up weight is probed against."""

    weight: torch.Tensor
    storage: str


class _GateUpProbe(_ContextBase):
    """Probes a fused gate/up weight; the pairings found are listed in ``self.probed``."""

    def _probe_pairing(self, name, block, module, attr, p, st) -> str:
        """Which gate/up pairing makes a neuron permutation leave the block's output unchanged."""
        if p.device.type == "meta":
            raise self._fail(
                name,
                p.shape,
                "fused gate/up pairing cannot be probed on the meta device",
                _PAIRINGS,
            )
        ff = p.shape[0 if st == "out_in" else 1] // 2
        down = None
        for q, oriented in self._matrices_in(block, p):
            if oriented.in_features == ff and oriented.out_features == self.dims.hidden:
                down = _DownProjection(q, oriented.storage)
        if down is None:
            raise self._fail(
                name, p.shape, "fused gate/up without a matching output projection to probe with", _PAIRINGS
            )
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(2, 3, self.dims.hidden, generator=g).to(device=p.device, dtype=p.dtype)
        perm = torch.randperm(ff, generator=g).to(p.device)
        results = {}
        bias = getattr(module, "bias", None) if attr == "weight" else None
        bias = bias if isinstance(bias, torch.Tensor) and bias.shape == (2 * ff,) else None
        with torch.no_grad():
            base = _first(block(x))
            saved_p, saved_q = p.detach().clone(), down.weight.detach().clone()
            saved_b = bias.detach().clone() if bias is not None else None
            for mode in ("concat", "interleave"):
                rows = (
                    torch.cat([perm, perm + ff])
                    if mode == "concat"
                    else torch.stack([2 * perm, 2 * perm + 1], 1).flatten()
                )
                if st == "out_in":
                    p.copy_(saved_p[rows])
                else:
                    p.copy_(saved_p[:, rows])
                if bias is not None:
                    bias.copy_(saved_b[rows])
                if down.storage == "out_in":
                    down.weight.copy_(saved_q[:, perm])
                else:
                    down.weight.copy_(saved_q[perm])
                moved = _first(block(x))
                results[mode] = torch.allclose(moved, base, rtol=1e-4, atol=1e-5 * float(base.abs().max()) + 1e-7)
                p.copy_(saved_p)
                down.weight.copy_(saved_q)
                if bias is not None:
                    bias.copy_(saved_b)
        good = [m for m, ok in results.items() if ok]
        if len(good) != 1:
            raise self._fail(name, p.shape, f"probing the gate/up pairing was inconclusive ({results})", _PAIRINGS)
        (pairing,) = good
        self.probed.append(f"{name}: {pairing}")
        return pairing


def _first(out):
    if isinstance(out, (tuple, list)):
        return out[0]
    return out
