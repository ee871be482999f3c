"""Muon's polar factor kept in its iteration's dtype (``polar(narrow=True)``): a bucket's
step reads it once, widening it as it scales it, and adds the update the per-parameter
path adds, which casts it back first. Run with CUDA's choices (bfloat16 iterations on
bfloat16 kernels), where the narrow factor is a bfloat16 tensor."""

from functools import partial

import pytest
import torch

from equiopt.linalg import polar
from equiopt.linalg.device_choices import decide_as
from equiopt.linalg.polar import _scaled_cast
from equiopt.optim import EquivariantOptimizer
from equiopt.optim import distribute as engine_module
from equiopt.roofline import count_step


@pytest.mark.parametrize("shape", [(3, 16, 40), (2, 40, 16)], ids=["wide", "tall"])
def test_narrow_polar_is_the_factor_before_its_cast_back(shape):
    X = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with decide_as("cuda"):
        wide = polar(X, dtype=torch.bfloat16)
        narrow = polar(X, dtype=torch.bfloat16, narrow=True)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert narrow.shape == X.shape
    assert torch.equal(narrow.float(), wide)
    # an iteration as wide as the input is returned as it is
    assert torch.equal(polar(X, dtype=torch.float32, narrow=True), polar(X, dtype=torch.float32))


@pytest.mark.parametrize("transposed", [False, True])
def test_scaled_cast_rounds_as_a_division_then_a_cast(transposed):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 24, 40, generator=g) * 30
    wide = wide.mT if transposed else wide
    scale = torch.rand(4, 1, 1, generator=g) + 0.1
    got = _scaled_cast(wide, scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got, (wide / scale).to(torch.bfloat16))


# a (16, 40) stack (its own work matrices), a (40, 16) stack (work: their transposes) and one
# (24, 56) parameter (its update added straight into its weights): three buckets
SHAPES = [(16, 40), (16, 40), (40, 16), (40, 16), (40, 16), (24, 56)]


def _run(nonfinite: str, steps: int = 3, weight_decay: float = 0.1):
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = EquivariantOptimizer(
        [{"params": params, "rule": "spectral", "weight_decay": weight_decay, "nonfinite": nonfinite}],
        lr=0.02,
        polar_dtype=torch.bfloat16,
    )
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def test_a_bucket_adds_the_per_parameter_update_from_the_narrow_factor():
    with decide_as("cuda"):
        bucketed, opt = _run("skip")
        single, ref = _run("raise")  # the per-parameter path: the factor cast back to float32
    assert opt._buckets is not None and opt._buckets.covered == {id(p) for p in bucketed}
    assert ref._buckets is None or not ref._buckets.covered
    for a, b in zip(bucketed, single):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_a_bucket_does_not_cast_the_factor_back():
    """On the meta device with CUDA's choices: the polar stage converts no tensor's dtype with
    a copy of its own (the input's cast is the normalising division's output)."""
    with torch.device("meta"), decide_as("cuda"):
        params = [torch.nn.Parameter(torch.empty(s)) for s in SHAPES]
        for p in params:
            p.grad = torch.empty_like(p)
        opt = EquivariantOptimizer([{"params": params, "rule": "spectral"}], lr=0.02, eager_state=True)
        counter = count_step(opt.step)
    polar_ops = [o.name for o in counter.ops if o.stage.startswith("linalg.polar")]
    assert "bmm" in polar_ops and "div" in polar_ops
    assert "_to_copy" not in polar_ops, polar_ops


def assert_a_bad_factor_adds_nothing(monkeypatch, run, value: float, expect) -> None:
    """One step of ``run(steps=1)``'s optimizer with CUDA's choices, ``value`` written into
    the first matrix of each bucket's factor (``expect(kwargs, f)`` checks the map's call and
    factor first): that matrix keeps its weights, every other one moves, and the three
    refusals are counted. ``run`` steps ``SHAPES``-like parameters in three buckets."""
    real = engine_module.factored_map

    def broken(key, eta, D, *args, **kwargs):
        f = real(key, eta, D, *args, **kwargs)
        expect(kwargs, f)
        x = f.x.clone()
        x[0, 0, 0] = value  # one matrix of the bucket
        if kwargs.get("finite") is not None:  # a map that checks its factors reports it (Rule.checks)
            kwargs["finite"][0] = bool(torch.isfinite(x[0]).all())
        return f._replace(x=x)

    with decide_as("cuda"):
        params, opt = run(steps=1, weight_decay=0.0)  # (a refused update still decays)
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape)
        monkeypatch.setattr(engine_module, "factored_map", broken)
        opt.step()
    changed = [not torch.equal(p, b) for p, b in zip(params, before)]
    # the first matrix of each bucket kept its weights, every other one moved
    assert changed == [False, True, False, True, True, False], changed
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.nonfinite_updates == 3


def test_a_non_finite_narrow_factor_adds_nothing(monkeypatch):
    def expect(kwargs, f):
        assert not kwargs.get("narrow") or f.x.dtype == torch.bfloat16

    assert_a_bad_factor_adds_nothing(monkeypatch, partial(_run, "skip"), float("nan"), expect)
