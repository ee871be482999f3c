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
        if kwargs.get("finite") is not None:  # a map that checks its factors reports it (Rule.checks)
            kwargs["finite"].fill_(False)
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


def test_finite_flags_of_many_tensors_match_a_float64_check():
    """One foreach infinity norm decides every tensor's flag: NaN, +-Inf and entries past the
    limit fail, the limit itself and large finite float16 entries pass, empty tensors pass,
    whatever the mix of dtypes; the infinity-norm guard (limit Inf) fails only non-finite."""
    from equiopt.optim.apply import INF_NORM, finite_flags

    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    for trial in range(40):
        grads = []
        for k in range(6):
            dtype = dtypes[int(torch.randint(len(dtypes), (1,), generator=gen))]
            g = torch.randn(int(torch.randint(0, 30, (1,), generator=gen)), generator=gen).to(dtype)
            if g.numel():
                at = int(torch.randint(g.numel(), (1,), generator=gen))
                bad = [float("nan"), float("inf"), -float("inf"), 2.0**51, GRAD_LIMIT, 6e4, 1.0][(trial + k) % 7]
                if dtype == torch.float16 and abs(bad) > 6e4:
                    bad = float("inf")  # beyond float16's range a value is Inf
                g[at] = bad
            grads.append(g)
        wide = [g.double() for g in grads]
        want = [bool(torch.isfinite(w).all() and (w.abs() <= GRAD_LIMIT).all()) for w in wide]
        assert finite_flags(grads).tolist() == want, trial
        assert finite_flags(grads, INF_NORM).tolist() == [bool(torch.isfinite(w).all()) for w in wide], trial


def test_whole_updates_added_together_match_one_by_one():
    """add_updates_ (the batched guard and add) against add_factored_ per update: the same
    weights within rounding, a non-finite update not added, its flag False; a skipped
    update (coef 0) reported finite even when it is not."""
    from equiopt.optim.apply import add_updates_

    gen = torch.Generator().manual_seed(5)
    shapes = [(4, 3), (5, 2), (4, 3), (1, 7)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    updates = [torch.randn(s, generator=gen) for s in shapes]
    updates[1][2, 1] = float("nan")
    updates[3][0, 0] = float("inf")
    coefs = [torch.tensor(-0.1, dtype=torch.float64), torch.tensor(-0.2, dtype=torch.float64)] * 2
    coefs[3] = torch.tensor(0.0, dtype=torch.float64)
    mine = [w.clone() for w in weights]
    flags = add_updates_(mine, [u.clone() for u in updates], coefs)
    theirs = [w.clone() for w in weights]
    one_by_one = [bool(add_factored_(w, maps.Factored(u.clone()), c)) for w, u, c in zip(theirs, updates, coefs)]
    assert flags.tolist() == one_by_one == [True, False, True, True]
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert torch.isfinite(a).all()
    assert torch.equal(mine[1], weights[1]) and torch.equal(mine[3], weights[3])


def test_gradients_sanitised_as_stacks_equal_one_by_one():
    """sanitize_all stacks gradients of one shape and dtype: bit for bit sanitize of each,
    in the state dtype asked for, the gradients themselves untouched."""
    from equiopt.optim.apply import sanitize, sanitize_all

    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(s, generator=gen) for s in [(3, 4), (3, 4), (2, 5), (3, 4)]]
    grads.append(torch.randn(3, 4, generator=gen).to(torch.bfloat16))
    grads[1][0, 0], grads[3][2, 3] = float("nan"), -float("inf")
    before = [g.clone() for g in grads]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.float64, torch.float32]
    out = sanitize_all(grads, dtypes)
    for g, b, o, dtype in zip(grads, before, out, dtypes):
        assert o.dtype == dtype and torch.equal(o, sanitize(b, dtype))
        assert torch.equal(g.nan_to_num(0.0), b.nan_to_num(0.0)) and torch.isnan(g).sum() == torch.isnan(b).sum()


def test_updates_that_tile_one_buffer_are_cleaned_through_it():
    """Updates that are views filling one buffer (a batched map's output, an owner exchange's
    receive buffer) are guarded as the same updates given apart: a non-finite one adds
    nothing, the others add in full; views that do not tile their buffer are cleaned one by one
    and leave the rest of it as it was."""
    from equiopt.optim.apply import add_updates_

    gen = torch.Generator().manual_seed(11)
    flat = torch.randn(4 * 3 + 2 * 5, generator=gen)
    flat[13] = float("nan")  # in the second update
    apart = [t.clone() for t in torch.split(flat, [12, 10])]
    parts = [t.view(s) for t, s in zip(torch.split(flat, [12, 10]), [(4, 3), (2, 5)])]
    weights = [torch.randn(4, 3, generator=gen), torch.randn(2, 5, generator=gen)]
    coefs = [torch.tensor(-0.5)] * 2
    mine = [w.clone() for w in weights]
    flags = add_updates_(mine, parts, coefs)
    theirs = [w.clone() for w in weights]
    add_updates_(theirs, [a.view(w.shape) for a, w in zip(apart, weights)], coefs)
    assert flags.tolist() == [True, False]
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], weights[1]) and torch.equal(theirs[1], weights[1])
    # a view of part of a buffer: the buffer's other entries keep their NaN
    buffer = torch.full((3, 4), float("nan"))
    buffer[0] = 1.0
    add_updates_([torch.zeros(4), torch.zeros(4)], [buffer[0], buffer[1]], coefs)
    assert torch.isnan(buffer[2]).all() and (buffer[1] == 0).all()
