import math
import sys

import numpy as np
import pytest
import reference as ref
import torch

from equiopt import linalg
from equiopt.linalg.coefficients import QUINTIC_LIMIT, greedy_schedule, minimax_quintic, schedule_bounds


def spd(n, cond, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=dtype))
    lam = torch.logspace(0, -math.log10(cond), n, dtype=dtype)
    return (q * lam) @ q.T


def tall(m, n, cond, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    d = (u * torch.logspace(0, -math.log10(cond), n, dtype=torch.float64)) @ v.T
    return d * (scale / d.pow(2).mean().sqrt())


@pytest.mark.parametrize("lo,hi", [(1e-3, 1.0), (0.05, 1.3), (0.5, 1.5)])
def test_minimax_quintic_equioscillates(lo, hi):
    a, b, c, err = minimax_quintic(lo, hi)
    p = lambda x: a * x + b * x**3 + c * x**5
    xs = np.linspace(lo, hi, 200001)
    dev = 1 - p(xs)
    assert abs(np.abs(dev).max() - err) < 1e-9
    # four alternation points: the ends and two interior extrema of equal size
    assert dev[0] == pytest.approx(err, abs=1e-9) and dev[-1] == pytest.approx(-err, abs=1e-9)
    assert dev.min() == pytest.approx(-err, abs=1e-9) and dev.max() == pytest.approx(err, abs=1e-9)


def test_greedy_schedule_bounds_match_known_behaviour():
    # five greedy steps from 1e-3 leave [0.886, 1.114]; six reach [0.999, 1.001]
    lo5, hi5 = schedule_bounds(1e-3, greedy_schedule(1e-3, 5))
    lo6, hi6 = schedule_bounds(1e-3, greedy_schedule(1e-3, 6))
    assert 0.88 < lo5 < 0.89 and 1.11 < hi5 < 1.12
    assert 0.998 < lo6 and hi6 < 1.002
    assert greedy_schedule(1e-3, 9)[-1] == QUINTIC_LIMIT


@pytest.mark.parametrize("method", ["exact", "polar_express", "newton_schulz"])
def test_inv_sqrt_matches_eigh(method):
    A = torch.stack([spd(24, 10.0, s) for s in range(3)])
    want = torch.stack([ref.inv_sqrt(a, 1e-8) for a in A])
    steps = 12 if method == "newton_schulz" else 5
    got = linalg.inv_sqrt(A if method == "exact" else A.float(), 1e-8, method, steps).double()
    tol = 1e-12 if method == "exact" else 1e-3
    assert (got - want).norm() / want.norm() < tol


def test_inv_sqrt_exact_float64_agrees_with_reference_to_1e_10():
    A = spd(40, 1e4, 3)
    got = linalg.inv_sqrt(A, 1e-6, "exact")
    assert got.dtype == torch.float64
    assert (got - ref.inv_sqrt(A, 1e-6)).abs().max() < 1e-10 * ref.inv_sqrt(A, 1e-6).abs().max()


@pytest.mark.parametrize("cond", [1e1, 1e3])
@pytest.mark.parametrize("scale", [1e-4, 1e-3, 1.0])
def test_polar_express_right_spectral_accuracy_on_tall_matrices(cond, scale):
    """The accuracy goal: within 2 % of float64 (and nu within 2 %) for tall matrices."""
    D = tall(1024, 128, cond, scale)
    C = D.T @ D
    R = ref.inv_sqrt(C, 1e-8)
    U, nu = D @ R, torch.trace(C @ R)
    Cf = D.float().T @ D.float()
    Rf = linalg.inv_sqrt(Cf, 1e-8, "polar_express", 5)
    Uf, nuf = D.float() @ Rf, (Cf * Rf).sum()
    assert ((Uf.double() - U).norm() / U.norm()).item() < 0.02
    assert abs(nuf.item() / nu.item() - 1) < 0.02


def test_inv_sqrt_batched_equals_loop_and_zero_matrix_is_finite():
    A = torch.stack([spd(16, 100.0, s).float() for s in range(4)])
    batched = linalg.inv_sqrt(A)
    loop = torch.stack([linalg.inv_sqrt(a) for a in A])
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=1e-6)
    Z = linalg.inv_sqrt(torch.zeros(2, 8, 8), eps=1e-8)
    assert torch.isfinite(Z).all()
    torch.testing.assert_close(Z, torch.eye(8).expand(2, 8, 8) * 1e4, rtol=1e-3, atol=0)


@pytest.mark.parametrize("method", ["polar_express", "newton_schulz", "gram_newton_schulz"])
@pytest.mark.parametrize("shape", [(3, 32, 96), (2, 96, 32)])
def test_polar_iterations_approximate_exact(method, shape):
    X = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    exact = linalg.polar(X.double(), "exact")
    torch.testing.assert_close(exact, torch.stack([ref.polar(x) for x in X.double()]))
    got = linalg.polar(X, method, steps=8 if method != "newton_schulz" else 5, dtype=torch.float32).double()
    s = torch.linalg.svdvals(got)
    if method == "newton_schulz":  # Muon's quintic is tuned not to converge: values stay in ~[0.68, 1.2]
        assert s.min() > 0.6 and s.max() < 1.25
    else:
        assert (got - exact).norm() / exact.norm() < 1e-3
    assert got.shape == X.shape


def test_polar_default_returns_input_dtype():
    X = torch.randn(16, 48)
    out = linalg.polar(X)
    assert out.dtype == torch.float32
    s = torch.linalg.svdvals(out.double())
    assert 0.6 < s.min() and s.max() < 1.3


def _polar_express_transcribed(X, steps):
    """Polar Express in float64, as the paper's Muon writes it: X / (1.01 ||X||_F + 1e-7),
    then X <- a X + b (X X^T) X + c (X X^T)^2 X (on the wide side of a tall X)."""
    from equiopt.linalg.coefficients import schedule
    from equiopt.linalg.polar import NORM_FLOOR, NORM_MARGIN, POLAR_LOWER, POLAR_SAFETY

    tall = X.shape[-2] > X.shape[-1]
    x = X.mT if tall else X
    x = x / (NORM_MARGIN * torch.linalg.matrix_norm(x, keepdim=True) + NORM_FLOOR)
    for a, b, c in schedule(POLAR_LOWER, steps, 1.0, POLAR_SAFETY):
        g = x @ x.mT
        x = a * x + b * (g @ x) + c * (g @ (g @ x))
    return x.mT if tall else x


@pytest.mark.parametrize("shape", [(4, 24, 80), (3, 80, 24), (2, 2, 32, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_polar_express_equals_its_float64_transcription(shape, dtype, tol):
    # float32 and float64 iterations fold a X into the small factor: (a I + b G + c G^2) X
    X = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = _polar_express_transcribed(X, 5)
    got = linalg.polar(X.to(dtype), "polar_express", steps=5, dtype=dtype).double()
    assert ((got - want).norm() / want.norm()).item() < tol


def test_polar_default_precision_follows_the_device(monkeypatch):
    polar_module = sys.modules["equiopt.linalg.polar"]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    X = torch.randn(3, 16, 48, generator=torch.Generator().manual_seed(0))
    for native in (False, True):
        monkeypatch.setattr(polar_module, "CPU_BFLOAT16", native)
        # polar_express and Muon's quintic: bfloat16 where the device multiplies it natively
        for method in ("polar_express", "newton_schulz"):
            assert linalg.default_dtype(method, cpu) == (torch.bfloat16 if native else torch.float32)
            assert linalg.default_dtype(method, cuda) == torch.bfloat16
        # torch.optim.Muon's iteration keeps its own precision everywhere; the Gram form float32
        assert linalg.default_dtype("newton_schulz_torch", cpu) == torch.bfloat16
        assert linalg.default_dtype("gram_newton_schulz", cuda) == torch.float32
        # what polar runs when no dtype is given, bit for bit
        chosen = linalg.default_dtype("polar_express", cpu)
        assert torch.equal(linalg.polar(X), linalg.polar(X, dtype=chosen))


def _bfloat16_transcribed(X, method, steps):
    """The iteration in float64 with every product rounded to bfloat16, as bfloat16
    hardware (exact products, wide sums, one rounding) computes it."""
    from equiopt.linalg.coefficients import MUON_NS_COEFFICIENTS, schedule
    from equiopt.linalg.polar import NORM_FLOOR, NORM_MARGIN, POLAR_LOWER, POLAR_SAFETY, TORCH_NORM_EPS

    def r(t):
        return t.to(torch.bfloat16).double()

    x = X.double()
    if method == "newton_schulz_torch":
        x = r(x)
        x = r(x / r(torch.linalg.matrix_norm(x, keepdim=True)).clamp_min(TORCH_NORM_EPS))
        coeffs = (MUON_NS_COEFFICIENTS,) * steps
    else:
        x = r(x / (NORM_MARGIN * torch.linalg.matrix_norm(x, keepdim=True) + NORM_FLOOR))
        coeffs = schedule(POLAR_LOWER, steps, 1.0, POLAR_SAFETY)
    for a, b, c in coeffs:
        g = r(x @ x.mT)
        h = r(b * g + c * (g @ g))
        x = r(a * x + h @ x)
    return x


@pytest.mark.parametrize("method", ["polar_express", "newton_schulz_torch"])
def test_bfloat16_iteration_without_bfloat16_hardware_is_bfloat16_arithmetic(monkeypatch, method):
    """On a CPU without bfloat16 hardware the products run in float32 and are rounded to
    bfloat16. One step equals the float64 transcription with every product rounded to
    bfloat16 (to a rare tie broken the other way by the order of the sums), which the
    unrounded float32 step does not; five steps stay within bfloat16's rounding noise of
    the transcription and of torch's own bfloat16 kernels."""
    polar_module = sys.modules["equiopt.linalg.polar"]
    cpu = torch.device("cpu")
    X = torch.randn(6, 24, 64, generator=torch.Generator().manual_seed(0))

    def run(steps, dtype=torch.bfloat16):
        return linalg.polar(X, method, steps=steps, dtype=dtype).double()

    one, five = _bfloat16_transcribed(X, method, 1), _bfloat16_transcribed(X, method, 5)
    monkeypatch.setattr(polar_module, "CPU_BFLOAT16", False)
    assert linalg.emulates_bfloat16(torch.bfloat16, cpu) and not linalg.emulates_bfloat16(torch.float32, cpu)
    emulated_one, emulated = run(1), run(5)
    monkeypatch.setattr(polar_module, "CPU_BFLOAT16", True)
    assert not linalg.emulates_bfloat16(torch.bfloat16, cpu)
    native = run(5)
    assert torch.equal(emulated, emulated.bfloat16().double())
    assert (emulated_one == one).double().mean() > 0.99
    assert (run(1, torch.float32) == one).double().mean() < 0.01
    for got, want in ((emulated, five), (native, five), (emulated, native)):
        assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_bfloat16_iteration_without_bfloat16_hardware_compiles_to_the_same_values(monkeypatch):
    """Inductor drops a float32 -> bfloat16 -> float32 round trip inside a fused kernel; the
    compiled iteration rounds on the bits instead and equals the eager one bit for bit."""
    monkeypatch.setattr(sys.modules["equiopt.linalg.polar"], "CPU_BFLOAT16", False)
    X = torch.randn(3, 8, 24, generator=torch.Generator().manual_seed(1))

    def run(x):
        return linalg.polar(x, "newton_schulz_torch", steps=2), linalg.polar(x, steps=2, dtype=torch.bfloat16)

    torch._dynamo.reset()
    for eager, compiled in zip(run(X), torch.compile(run, fullgraph=True)(X)):
        assert torch.equal(eager, compiled)
        assert torch.equal(compiled, compiled.bfloat16().float())


def test_bfloat16_products_in_float32_round_once_and_leave_the_rest_alone():
    from equiopt.linalg.products import Bfloat16ProductsInFloat32

    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, 24, 24, generator=gen).bfloat16() for _ in range(3))
    small = torch.randint(-4, 5, (24, 24), generator=gen).bfloat16()  # every sum exact in bfloat16
    a32 = torch.randn(24, 24, generator=gen)
    with Bfloat16ProductsInFloat32():
        got = {
            "mm": a[0] @ b[0],
            "bmm": torch.bmm(a, b),
            "addmm": torch.addmm(c[0], a[0], b[0], beta=-0.5, alpha=2.0),
            "baddbmm": torch.baddbmm(c, a, b, beta=-0.5, alpha=2.0),
            "exact": small @ small,
            "float32": a32 @ a32,
            "add": a + b,
        }
    want = {
        "mm": (a[0].float() @ b[0].float()).bfloat16(),
        "bmm": torch.bmm(a.float(), b.float()).bfloat16(),
        "addmm": torch.addmm(c[0].float(), a[0].float(), b[0].float(), beta=-0.5, alpha=2.0).bfloat16(),
        "baddbmm": torch.baddbmm(c.float(), a.float(), b.float(), beta=-0.5, alpha=2.0).bfloat16(),
        "exact": small @ small,
        "float32": a32 @ a32,
        "add": a + b,
    }
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("bad", ["svd", "newton"])
def test_unknown_methods(bad):
    with pytest.raises(ValueError, match="valid"):
        linalg.polar(torch.randn(4, 4), bad)
    with pytest.raises(ValueError, match="valid"):
        linalg.inv_sqrt(torch.eye(4), method=bad)


def test_shape_errors():
    with pytest.raises(ValueError, match="square"):
        linalg.inv_sqrt(torch.randn(3, 4))
    with pytest.raises(ValueError, match="matrices"):
        linalg.polar(torch.randn(5))


def test_row_split_gram_polar_equals_whole_matrix():
    """The Gram Newton-Schulz polar factor of a tall matrix split by rows: each shard with
    a reducer that sums the shards' Grams (run in lockstep) gives its rows of the factor
    of the whole matrix (float64: agreement to rounding of the norm, taken in float32 by
    the whole-matrix path). Other methods refuse a reducer."""
    import threading

    X = torch.randn(300, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = linalg.polar(X, method="gram_newton_schulz", dtype=torch.float64)
    parts = list(torch.tensor_split(X, 3))
    barrier, sums, calls = threading.Barrier(3), {}, [0, 0, 0]
    lock = threading.Lock()

    class Shards:
        def __init__(self, i):
            self.i = i

        def sum(self, t):
            r = calls[self.i]
            calls[self.i] += 1
            with lock:
                sums[r] = sums.get(r, 0) + t
            barrier.wait()
            out = sums[r].clone()
            barrier.wait()
            return out

    got = [None] * 3

    def run(i):
        got[i] = linalg.polar(parts[i], method="gram_newton_schulz", dtype=torch.float64, reducer=Shards(i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [3, 3, 3]  # the Gram, then one per restart (steps 2 and 4 of 5)
    assert (torch.cat(got) - want).norm() / want.norm() < 1e-5
    with pytest.raises(ValueError, match="gram_newton_schulz"):
        linalg.polar(parts[0], method="polar_express", reducer=Shards(0))
