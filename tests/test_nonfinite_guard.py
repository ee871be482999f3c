"""Nothing non-finite reaches the weights or the optimizer state, at any gradient scale."""

import pytest
import torch

from equiopt import maps
from equiopt.optim import EquivariantOptimizer, NonFiniteGradientError
from equiopt.optim import distribute as engine_module
from equiopt.optim.apply import GRAD_LIMIT, add_factored_

RULES = [
    {"rule": "adamw"},
    {"rule": "sgd", "beta": 0.9},
    {"rule": "spectral"},
    {"rule": "right"},
    {"rule": "left", "center": True},
    {"rule": "row", "center": True},
    {"rule": "hybrid"},
    {"rule": "hybrid", "order": "right_then_row", "scale": "rms"},
    {"rule": "right", "gram_dtype": "bfloat16"},
    {"rule": "hybrid", "gram_dtype": "bfloat16"},
    {"rule": "hybrid", "gram_dtype": "bfloat16x6"},
    {"rule": "left", "center": True, "gram_dtype": "bfloat16x6"},
]


def _opt(settings, shape=(64, 16), **extra):
    p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    opt = EquivariantOptimizer(
        [{"params": [p], "lr": 0.01, "weight_decay": 0.1, **settings, **extra}], eager_state=True
    )
    return p, opt


def _state(opt):
    return {k: v.clone() for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "nonfinite"}


@pytest.mark.parametrize("settings", RULES, ids=[str(r) for r in RULES])
@pytest.mark.parametrize("scale", [1e16, 1e30, float("inf"), float("nan")])
def test_unusable_gradients_leave_weights_and_state_bit_for_bit(settings, scale):
    p, opt = _opt(settings)
    p.grad = torch.randn(p.shape)
    opt.step()  # some state to keep
    w0, s0 = p.detach().clone(), _state(opt)
    g = torch.randn(p.shape)
    g[3, 5] = scale
    p.grad = g
    opt.step()
    assert torch.equal(p.detach(), w0)
    for k, v in _state(opt).items():
        assert torch.equal(v, s0[k]), k
        assert torch.isfinite(v).all(), k
    assert opt.nonfinite_steps == 1 and opt.nonfinite_updates == 0


@pytest.mark.parametrize("settings", RULES, ids=[str(r) for r in RULES])
def test_gradients_up_to_the_limit_step_finitely(settings):
    p, opt = _opt(settings)
    for scale in (1e10, GRAD_LIMIT / 2):
        g = torch.randn(p.shape)
        p.grad = g / g.abs().amax() * scale
        opt.step()
        assert torch.isfinite(p).all()
        assert all(torch.isfinite(v).all() for v in _state(opt).values())
    assert opt.nonfinite_steps == 0 and opt.nonfinite_updates == 0


def test_raise_names_the_parameter_for_a_gradient_beyond_the_limit():
    p, opt = _opt({"rule": "right", "nonfinite": "raise", "names": ["lm_head.weight"]})
    p.grad = torch.full(p.shape, 1e20)
    with pytest.raises(NonFiniteGradientError, match="lm_head.weight"):
        opt.step()


@pytest.mark.parametrize(
    "settings",
    [
        {"rule": "right"},
        {"rule": "hybrid"},
        {"rule": "hybrid", "gram_dtype": "bfloat16"},
        {"rule": "hybrid", "gram_dtype": "bfloat16x6"},
        {"rule": "row"},
        {"rule": "spectral"},
    ],
    ids=["right", "hybrid", "hybrid-bf16", "hybrid-bf16x6", "row", "spectral"],
)
def test_a_non_finite_update_from_a_usable_gradient_is_not_added(settings, monkeypatch):
    """The last guard: a map that returns NaN (here forced) adds nothing to the weights,
    writes no NaN anywhere, and is counted; the next healthy step proceeds."""
    real = engine_module.factored_map

    def broken(key, eta, D, *args, **kwargs):
        f = real(key, eta, D, *args, **kwargs)
        if f.right is not None:
            return f._replace(right=torch.full_like(f.right, float("nan")))
        if f.row is not None:
            return f._replace(row=torch.full_like(f.row, float("inf")))
        return f._replace(x=torch.full_like(f.x, float("nan")))

    p, opt = _opt({**settings, "weight_decay": 0.0})
    p.grad = torch.randn(p.shape)
    monkeypatch.setattr(engine_module, "factored_map", broken)
    w0 = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), w0)
    assert opt.nonfinite_updates == 1
    restored = EquivariantOptimizer([{"params": [p], "lr": 0.01, **settings}])
    restored.load_state_dict(opt.state_dict())
    assert restored.nonfinite_updates == 1
    monkeypatch.setattr(engine_module, "factored_map", real)
    opt.step()
    assert not torch.equal(p.detach(), w0) and torch.isfinite(p).all()
    assert opt.nonfinite_updates == 1


def test_a_row_with_an_overflowing_norm_poisons_the_hybrid_factors_not_the_weights():
    """Row norms that overflow give NaN scales (not 0), so the check sees them; the
    materialised first stage is cleaned, so 0 * NaN never reaches the GEMM."""
    D = torch.randn(32, 8)
    D[4] = 3e38
    f = maps.hybrid_factored(D, order="row_then_right")
    assert not torch.isfinite(f.right).all()
    assert torch.isfinite(f.x).all()


def test_with_bfloat16_grams_the_low_precision_copy_is_what_the_guard_cleans():
    """With ``gram_dtype="bfloat16"`` the product reads only the bfloat16 copy of the first
    stage: the guard cleans that copy, and the poisoned update adds nothing."""
    D = torch.randn(32, 8)
    D[4] = 3e38
    f = maps.hybrid_factored(D, order="row_then_right", gram_dtype="bfloat16")
    assert f.low is not None and not torch.isfinite(f.low).all()
    w = torch.randn(32, 8)
    w0 = w.clone()
    ok = add_factored_(w, f, torch.tensor(-0.01))
    assert not ok and torch.equal(w, w0)
    assert torch.isfinite(f.low).all()
