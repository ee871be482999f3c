"""``lazy=True``: only the rows with a nonzero gradient in this step are updated."""

import pytest
import reference as ref
import torch

import equiopt as eo
from equiopt.optim import EquivariantOptimizer
from equiopt.recipes import get_recipe

VOCAB, D = 40, 6


def _sparse_grads(steps, seed=0, vocab=VOCAB, d=D):
    """Embedding-like gradients: each step touches a random subset of the rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        grad = torch.randn(vocab, d, generator=g, dtype=torch.float64)
        seen = torch.rand(vocab, generator=g) < 0.3
        out.append(grad * seen[:, None])
    return out


def _run(grads, w0, **kw):
    w = torch.nn.Parameter(w0.clone())
    opt = EquivariantOptimizer([w], **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach(), opt.state[w]["momentum_buffer"]


@pytest.mark.parametrize(
    "rule,extra",
    [
        ("row", {}),
        ("hybrid", {"scale": "rms"}),
        ("hybrid", {"scale": "nu"}),
        ("hybrid", {"order": "right_then_row"}),
        ("right", {"alpha": 1.0}),
    ],
)
def test_lazy_step_equals_the_float64_algorithm(rule, extra):
    """Weights: W <- W - lr U(mask * M) with M the (dense) EMA momentum and mask the rows
    with a nonzero gradient this step, written out with the float64 reference maps."""
    lr, beta, eps = 0.05, 0.9, 1e-8
    grads = _sparse_grads(5)
    w0 = torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got, mom = _run(grads, w0, lr=lr, rule=rule, beta=beta, eps=eps, method="exact", lazy=True, **extra)
    W, M = w0.clone(), torch.zeros_like(w0)
    alpha = extra.get("alpha", 1.0 if rule == "hybrid" else 0.0)
    for G in grads:
        M = beta * M + (1 - beta) * G
        masked = M * (G.abs().sum(dim=1, keepdim=True) > 0)
        if rule == "row":
            U = ref.row(masked, eps)
        elif rule == "right":
            U = ref.right(masked, eps, alpha)
        elif extra.get("scale") == "rms":
            U = eo.maps.hybrid(masked, eps=eps, alpha=alpha, method="exact", scale="rms")
        else:
            U = ref.hybrid(masked, extra.get("order", "row_then_right"), eps, alpha)
        W = W - lr * U
    torch.testing.assert_close(mom, M, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got, W, rtol=1e-10, atol=1e-12)


def test_unseen_rows_stay_put_and_seen_rows_move_as_if_alone():
    """A lazy step on the whole matrix is the plain step on the submatrix of the rows the
    gradient touched: the other rows neither move nor enter the Gram or the row count."""
    grads = _sparse_grads(1)
    w0 = torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    kw = dict(lr=0.1, rule="hybrid", scale="rms", method="exact")
    lazy, _ = _run(grads, w0, lazy=True, **kw)
    seen = grads[0].abs().sum(dim=1) > 0
    sub, _ = _run([grads[0][seen]], w0[seen], **kw)
    torch.testing.assert_close(lazy[~seen], w0[~seen], rtol=0, atol=0)
    torch.testing.assert_close(lazy[seen], sub, rtol=1e-12, atol=1e-14)


def test_without_lazy_a_row_seen_once_keeps_moving_at_full_step():
    """What the option is for: a row-normalised momentum moves a row seen once by the same
    step on every later step (normalisation undoes its decay); lazy stops it after one."""
    w0 = torch.zeros(4, 3, dtype=torch.float64)
    first = torch.zeros(4, 3, dtype=torch.float64)
    first[0] = torch.tensor([1e-3, 0, 0])
    later = torch.zeros(4, 3, dtype=torch.float64)
    later[1:] = 1.0  # the other rows are seen on every step
    grads = [first] + [later] * 9
    plain, mom = _run(grads, w0, lr=0.1, rule="row", beta=0.9)
    lazy, lazy_mom = _run(grads, w0, lr=0.1, rule="row", beta=0.9, lazy=True)
    assert plain[0, 0].item() == pytest.approx(-1.0, rel=1e-3)  # ten full steps of 0.1 (up to eps)
    assert lazy[0, 0].item() == pytest.approx(-0.1, rel=1e-3)  # one
    torch.testing.assert_close(lazy_mom, mom, rtol=0, atol=0)  # the momentum itself is the same
    torch.testing.assert_close(lazy[1:], plain[1:], rtol=0, atol=0)


@pytest.mark.parametrize("rule,extra", [("row", {}), ("hybrid", {"scale": "rms"}), ("right", {"alpha": 1.0})])
def test_lazy_keeps_left_permutation_right_orthogonal_equivariance(rule, extra):
    """Steps on (P W Q, P G Q) are P (steps on (W, G)) Q for a random permutation P of the
    rows and a random orthogonal Q of the columns."""
    g = torch.Generator().manual_seed(5)
    P = torch.eye(VOCAB, dtype=torch.float64)[torch.randperm(VOCAB, generator=g)]
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    grads = _sparse_grads(4, seed=3)
    w0 = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    kw = dict(lr=0.07, rule=rule, method="exact", lazy=True, **extra)
    base, _ = _run(grads, w0, **kw)
    moved, _ = _run([P @ G @ Q for G in grads], P @ w0 @ Q, **kw)
    torch.testing.assert_close(moved, P @ base @ Q, rtol=1e-9, atol=1e-11)


def test_lazy_on_work_matrices_masks_their_rows():
    """With a layout, the rows are those of the work matrices: a column-layout parameter
    (work matrix = W^T) is masked by the gradient's nonzero columns."""
    grads = [g.mT.contiguous() for g in _sparse_grads(3, seed=4)]
    w0 = torch.randn(D, VOCAB, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got, _ = _run(grads, w0, lr=0.1, rule="row", layout="col", lazy=True)
    want, _ = _run([g.mT for g in grads], w0.mT, lr=0.1, rule="row", lazy=True)
    torch.testing.assert_close(got, want.mT, rtol=1e-12, atol=1e-14)


def test_bad_lazy_settings_fail_by_name():
    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match="field 'lazy': expected true or false"):
        EquivariantOptimizer([p], rule="row", lazy="yes")
    with pytest.raises(ValueError, match="momentum rule.*adamw"):
        EquivariantOptimizer([p], rule="adamw", lazy=True)
    with pytest.raises(ValueError, match="center=True"):
        EquivariantOptimizer([p], rule="hybrid", center=True, lazy=True)
    recipe = get_recipe("paper:qwen3:a-ii")
    with pytest.raises(ValueError, match="role 'lm_head', field 'lazy'.*center=True"):
        recipe.with_overrides({"lm_head": {"lazy": True}})
    with pytest.raises(ValueError, match="role 'embedding', field 'lazy'.*true or false"):
        recipe.with_overrides({"embedding": {"lazy": 1}})
    with pytest.raises(ValueError, match="field 'lazy'.*does not apply to rule 'adamw'"):
        get_recipe("paper:qwen3:a-iii").with_overrides({"embedding": {"lazy": True}})
    settings = recipe.with_overrides({"embedding": {"lazy": True, "scale": "rms"}}).settings("embedding")
    assert settings["lazy"] is True and settings["scale"] == "rms"
