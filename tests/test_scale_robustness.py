"""Every rule at every gradient scale: finite, nonzero steps, and the same step size for
the rules meant to be scale-free (Grams normalised before the inverse square root,
damping relative to the Gram's own scale)."""

import pytest
import torch

from equiopt.optim import EquivariantOptimizer

# name, group settings, scale-free
CONFIGS = [
    ("spectral", {"rule": "spectral"}, True),
    ("right", {"rule": "right"}, True),  # alpha = 0: the damped polar factor
    ("right nu alpha=1", {"rule": "right", "alpha": 1.0}, False),
    ("right rms", {"rule": "right", "scale": "rms", "alpha": 1.0}, True),
    ("right centred rms", {"rule": "right", "scale": "rms", "center": True}, True),
    ("left centred", {"rule": "left", "center": True}, True),
    ("left rms", {"rule": "left", "scale": "rms", "alpha": 0.5}, True),
    ("row", {"rule": "row"}, True),
    ("row centred", {"rule": "row", "center": True}, True),
    ("hybrid row->right", {"rule": "hybrid", "order": "row_then_right"}, True),
    ("hybrid row->right centred rms", {"rule": "hybrid", "center": True, "scale": "rms"}, True),
    ("hybrid right->row", {"rule": "hybrid", "order": "right_then_row"}, True),
    ("hybrid right->row rms", {"rule": "hybrid", "order": "right_then_row", "scale": "rms"}, True),
    ("hybrid left->row centred", {"rule": "hybrid", "order": "left_then_row", "center": True}, True),
    ("spectral_row", {"rule": "spectral_row"}, True),
    ("normuon", {"rule": "normuon"}, True),
    ("adamw", {"rule": "adamw"}, True),
    ("sgd", {"rule": "sgd", "beta": 0.9}, False),
]

# work-matrix shapes: vocabulary-like (tall), MLP-like, router-like (wide)
SHAPES = {"vocabulary": (2048, 64), "mlp": (96, 64), "router": (8, 64)}
SCALES = [10.0**k for k in range(-8, 9, 2)]
SCALE_FREE = [s for s in SCALES if s >= 1e-6]


def _step(settings, shape, batched, dtype, scale, seed=0):
    """The update ``U`` (``W_1 = -lr U`` from zero weights) of one step at gradient entries ~ ``scale``."""
    full = ((3,) + shape) if batched else shape
    p = torch.nn.Parameter(torch.zeros(full, dtype=dtype))
    g = torch.Generator().manual_seed(seed)
    # a gradient with a spread of row norms and a decaying spectrum, like a real one
    base = torch.randn(full, generator=g) * torch.logspace(0, -2, shape[-1])
    base = base * torch.rand(full[:-1] + (1,), generator=g).add(0.1)
    p.grad = (base / base.abs().amax() * scale).to(dtype)
    lr = 0.01
    layout = "experts:row" if batched else "row"
    opt = EquivariantOptimizer([{"params": [p], **settings, "lr": lr, "layout": layout}])
    opt.step()
    assert opt.nonfinite_steps == 0, "a finite gradient was skipped"
    return -p.detach().double() / lr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("name,settings,scale_free", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_every_gradient_scale_gives_a_finite_nonzero_step(name, settings, scale_free, shape, batched, dtype):
    rms = {}
    for scale in SCALES:
        u = _step(settings, SHAPES[shape], batched, dtype, scale)
        assert torch.isfinite(u).all(), f"{name}: non-finite update at gradient scale {scale:g}"
        per_matrix = u.reshape(-1, *SHAPES[shape]).pow(2).mean(dim=(-2, -1)).sqrt()
        assert (per_matrix > 0).all(), f"{name}: zero update at gradient scale {scale:g}"
        rms[scale] = per_matrix
    if scale_free:
        ref = rms[1.0]
        for scale in SCALE_FREE:
            ratio = rms[scale] / ref
            assert ((ratio > 0.5) & (ratio < 2.0)).all(), (
                f"{name}: update RMS at gradient scale {scale:g} is {ratio.tolist()} x the one at scale 1"
            )


@pytest.mark.parametrize("name,settings,scale_free", CONFIGS[:14], ids=[c[0] for c in CONFIGS[:14]])
def test_batched_and_single_matrix_paths_agree(name, settings, scale_free):
    """Each matrix of an expert stack steps as it would alone, at tiny and huge scales alike."""
    for scale in (1e-7, 1.0, 1e7):
        stacked = _step(settings, SHAPES["mlp"], True, torch.float32, scale)
        g = torch.Generator().manual_seed(0)
        base = torch.randn((3, 96, 64), generator=g) * torch.logspace(0, -2, 64)
        base = base * torch.rand((3, 96, 1), generator=g).add(0.1)
        grad = base / base.abs().amax() * scale
        for e in range(3):
            p = torch.nn.Parameter(torch.zeros(96, 64))
            p.grad = grad[e].clone()
            opt = EquivariantOptimizer([{"params": [p], **settings, "lr": 0.01}])
            opt.step()
            alone = -p.detach().double() / 0.01
            err = (alone - stacked[e]).norm() / stacked[e].norm()
            assert err < 1e-5, f"{name} at scale {scale:g}: expert {e} differs by {err:.1e}"


def test_absolute_damping_is_the_papers_and_shrinks_tiny_gradients():
    """``damping="absolute"`` keeps the paper's ``C + eps I``: at gradient entries of 1e-6 on
    a vocabulary matrix its step shrinks, where the default relative damping does not."""
    settings = {"rule": "right", "scale": "rms", "alpha": 1.0}
    big = _step(settings, SHAPES["vocabulary"], False, torch.float32, 1.0).norm()
    tiny_rel = _step(settings, SHAPES["vocabulary"], False, torch.float32, 1e-6).norm()
    tiny_abs = _step(
        {**settings, "damping": "absolute", "eps": 1e-6}, SHAPES["vocabulary"], False, torch.float32, 1e-6
    ).norm()
    assert abs(tiny_rel / big - 1) < 0.05
    assert tiny_abs / big < 0.5


def test_unknown_damping_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match="damping"):
        EquivariantOptimizer([{"params": [p], "rule": "right", "damping": "sometimes"}])
