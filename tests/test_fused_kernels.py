"""The fused stages' Triton kernels (equiopt.optim.fused.kernels), run on the CPU by Triton's
interpreter (``TRITON_INTERPRET=1``) in float32, against the eager stages that are the
operators' CPU implementations: the finite flags, the momentum stage (sanitising, EMA,
Nesterov or not, one gradient of its own or a stack in the buffer) and the decay with the
update add; then whole steps of a bucket of several parts, with NaN and Inf gradients,
decay and Nesterov on and off, through the kernels and through the eager stages."""

import os
import sys
import types

import pytest
import torch

# Triton's interpreter must be chosen before triton is first imported (its own library
# functions are compiled then); on a CUDA machine the kernels run on the device instead
INTERPRET = not torch.cuda.is_available() and ("triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the fused stages' kernels are Triton kernels: pip install triton to run them")

import equiopt.optim.buckets as buckets  # noqa: E402
import equiopt.optim.stages as stages  # noqa: E402
from equiopt.optim import EquivariantOptimizer  # noqa: E402
from equiopt.optim.apply import GRAD_LIMIT  # noqa: E402
from equiopt.optim.fused import kernels, ops  # noqa: E402

# the interpreter computes in NumPy, which warns where a kernel takes inf - inf (to find the infinities)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
interpreted = pytest.mark.skipif(
    not INTERPRET, reason="Triton's interpreter runs where no CUDA device is (and before triton is imported)"
)
N = 2 * kernels.BLOCK + 77  # three blocks per member, the last one partial


def _gradients(members=5, n=N, seed=0):
    """A stack of gradients: member 0 healthy, then NaN, +Inf, -Inf and an entry beyond
    ``GRAD_LIMIT``, each in a late block."""
    g = torch.randn(members, n, generator=torch.Generator().manual_seed(seed))
    bad = [float("nan"), float("inf"), float("-inf"), 2 * GRAD_LIMIT]
    for k, value in enumerate(bad[: members - 1]):
        g[k + 1, n - 1 - 13 * k] = value
    return g


def _given(g: torch.Tensor, how: str) -> list[torch.Tensor]:
    """The gradients as an operator takes them: their stack, or each member's own tensor
    (separate allocations, at offsets of either sign from the first)."""
    if how == "stack":
        return [g]
    return [t.clone() for t in reversed(g.unbind(0))][::-1]  # (the first one made last)


@interpreted
@pytest.mark.parametrize("how", ["stack", "members"])
@pytest.mark.parametrize("present", [None, [True, False, True, True, False]], ids=["all", "missing"])
def test_finite_flags_kernel_equals_eager(present, how):
    g = _gradients()
    mask = None if present is None else torch.tensor(present)
    eager_counters, counters = torch.zeros(5), torch.zeros(5)
    ok, reported = ops.grad_flags(_given(g, how), eager_counters, mask, 5)
    flags = ops._combine(kernels.finite_flags(_given(g, how), 5), counters, mask)
    assert kernels.finite_flags(_given(g, how), 5).tolist() == [True, False, False, False, False]
    assert ok.tolist() == [True, False, False, False, False]
    assert torch.equal(flags[0], ok) and torch.equal(flags[1], reported)
    assert torch.equal(counters, eager_counters)


@interpreted
@pytest.mark.parametrize("how", ["stack", "members"])
@pytest.mark.parametrize("cols", [300, 1024], ids=["partial-tiles", "whole-tiles"])
def test_finite_flags_kernel_sums_the_columns_it_reads(cols, how):
    """``equiopt::grad_flags`` given ``col_sums``: the same flags, and each finite gradient's
    column sums (tiles of whole rows, the last one partial; the kernel reads NaN and Inf as
    0); the kernel against the operator's CPU implementation and a float64 sum."""
    rows = 3 * kernels.TILE_ROWS + 5
    g = _gradients(5, rows * cols)
    found = []
    for flags in (
        lambda src, c: ops.grad_flags(src, torch.zeros(5), None, 5, c)[0],
        lambda src, c: kernels.finite_flags(src, 5, c),
    ):
        sums = torch.full((5, cols), 3.0)
        found.append((flags(_given(g, how), sums), sums))
    (ok_eager, sums_eager), (ok_kernel, sums_kernel) = found
    assert ok_eager.tolist() == ok_kernel.tolist() == [True, False, False, False, False]
    clean = torch.nan_to_num(g.double(), nan=0.0, posinf=0.0, neginf=0.0).view(5, rows, cols)
    torch.testing.assert_close(sums_eager[:1].double(), clean[:1].sum(dim=1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums_kernel.double(), clean.sum(dim=1), rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
def test_momentum_stage_takes_the_gradient_in_less_its_column_shift(nesterov):
    """``equiopt::momentum_stage`` given ``shift``: each gradient row less the shift, NaN and
    Inf read as 0 (also where the shift is not finite), before the EMA and the direction; a
    skipped member's momentum stays bit for bit; kernel against the CPU implementation and
    both against the unshifted stage on shifted gradients."""
    rows, cols = 7, 300
    g = _gradients(5, rows * cols)
    ok = torch.tensor([True, False, True, False, True])
    shift = torch.randn(5, cols, generator=torch.Generator().manual_seed(8))
    shift[3, 5] = float("inf")  # (a skipped member's column sums may overflow)
    momentum = torch.randn(5, rows * cols, generator=torch.Generator().manual_seed(2))
    found = []
    for stage in (ops.momentum_stage, kernels.momentum_stage):
        m, scratch = momentum.clone(), torch.full_like(g, 7.0)
        stage(_given(g, "members"), scratch, m, ok, 0.9, nesterov, True, None, 0, shift)
        found.append((m, scratch))
    (m_eager, s_eager), (m_kernel, s_kernel) = found
    clean = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0).view(5, rows, cols) - shift.unsqueeze(1)
    clean = torch.nan_to_num(clean, nan=0.0, posinf=0.0, neginf=0.0).view(5, -1)
    plain_m, plain_s = momentum.clone(), torch.full_like(g, 7.0)
    ops.momentum_stage([t.clone() for t in clean.unbind(0)], plain_s, plain_m, ok, 0.9, nesterov, True)
    assert torch.equal(m_eager, plain_m) and torch.equal(s_eager, plain_s)
    assert torch.equal(m_eager[~ok], momentum[~ok])
    torch.testing.assert_close(m_kernel, m_eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s_kernel, s_eager, rtol=1e-6, atol=1e-7)
    assert torch.equal(m_kernel[~ok], momentum[~ok])


@interpreted
@pytest.mark.parametrize("direction", [True, False], ids=["direction", "momentum-only"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
@pytest.mark.parametrize("given", ["in-buffer", "own-gradient", "members", "members-into-transposed"])
def test_momentum_stage_kernel_equals_eager(nesterov, given, direction):
    """``members-into-transposed``: each member's own gradient in, the direction written into
    a strided place (a transposed part's place in the map's input, seen in stored layout)."""
    own = given == "own-gradient"
    members = 1 if own else 5
    g = _gradients(members)
    ok = torch.tensor([True, False, True, False, True][:members]) if not own else torch.tensor([True])
    momentum = torch.randn(members, N, generator=torch.Generator().manual_seed(2))
    results = []
    for run in (ops.momentum_stage, kernels.momentum_stage):
        m = momentum.clone()
        scratch = g.clone() if given == "in-buffer" else torch.full_like(g, 7.0)
        sources = [] if given == "in-buffer" else [g] if own else _given(g, "members")
        if given == "members-into-transposed":  # N = 2125 = 17 x 125, stored transposed
            scratch = torch.full((members, 125, 17), 7.0).mT
            assert not scratch.is_contiguous()
        # (the momentum stack has the stored shape the scratch is seen in)
        run(sources, scratch, m.view(scratch.shape), ok, 0.9, nesterov, direction)
        results.append((scratch.reshape(members, N), m))
    (s_eager, m_eager), (s_kernel, m_kernel) = results
    assert torch.isfinite(m_kernel).all()
    torch.testing.assert_close(m_kernel, m_eager, rtol=1e-6, atol=1e-7)
    if direction:
        assert torch.isfinite(s_kernel).all()
        torch.testing.assert_close(s_kernel, s_eager, rtol=1e-6, atol=1e-7)
    else:  # the kernel leaves the buffer as it was (its gradients, or what it held)
        kept = g if given == "in-buffer" else torch.full_like(g, 7.0)
        s_kernel = s_kernel.reshape(kept.shape)
        torch.testing.assert_close(s_kernel, kept, rtol=0, atol=0, equal_nan=True)
    skipped = ~ok
    assert torch.equal(m_kernel[skipped], momentum[skipped])  # bit for bit


def _summed_both_ways(n, k, nesterov, direction, run=0):
    """Five members of ``n`` entries (NaN and Inf gradients among them) through
    ``equiopt::momentum_stage`` with ``k`` sums each, by the CPU implementation and by the
    kernel: ``(g, ok, momentum, [(momentum, scratch, sums) eager, the same by the kernel])``."""
    g = _gradients(5, n)
    ok = torch.tensor([True, False, True, False, True])
    momentum = torch.randn(5, n, generator=torch.Generator().manual_seed(2))
    found = []
    for stage in (ops.momentum_stage, kernels.momentum_stage):
        m, scratch, sums = momentum.clone(), torch.full_like(g, 7.0), torch.full((5, k), 3.0)
        stage(_given(g, "members"), scratch, m, ok, 0.9, nesterov, direction, sums, run)
        found.append((m, scratch, sums))
    return g, ok, momentum, found


@interpreted
@pytest.mark.parametrize("direction", [True, False], ids=["direction", "momentum-only"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
@pytest.mark.parametrize("row_len", [kernels.BLOCK, 125], ids=["rows-of-a-block", "rows-across-blocks"])
def test_momentum_stage_sums_the_rows_of_the_direction_it_writes(row_len, nesterov, direction):
    """``equiopt::momentum_stage`` given ``sums``: the stage as without them, and each
    row's sum of squares of the direction (the momentum where none is written), rows of a
    whole block (one atomic add per block) or straddling blocks, NaN and Inf gradients among
    them; the kernel against the operator's CPU implementation and a float64 sum."""
    rows = 3
    n = rows * row_len
    g, ok, momentum, found = _summed_both_ways(n, rows, nesterov, direction)
    (m_eager, s_eager, sums_eager), (m_kernel, s_kernel, sums_kernel) = found
    plain_m, plain_s = momentum.clone(), torch.full_like(g, 7.0)
    ops.momentum_stage(_given(g, "members"), plain_s, plain_m, ok, 0.9, nesterov, direction)
    assert torch.equal(m_eager, plain_m) and torch.equal(s_eager, plain_s)  # the sums change nothing else
    torch.testing.assert_close(m_kernel, m_eager, rtol=1e-6, atol=1e-7)
    written = (s_eager if direction else m_eager).double().view(5, rows, row_len)
    torch.testing.assert_close(sums_eager.double(), written.square().sum(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(sums_kernel, sums_eager, rtol=1e-5, atol=0)


@interpreted
@pytest.mark.parametrize(
    "run", [kernels.BLOCK, 128, 125], ids=["runs-of-a-block", "runs-within-a-block", "runs-across"]
)
def test_momentum_stage_sums_runs_in_turn(run):
    """``sums`` with ``run``: entry ``e`` of a member counts in sum ``(e // run) % k`` (the
    heads of a weight split along its columns, each row a run per head, in turn); the
    kernel against the operator's CPU implementation and a float64 sum, NaN and Inf among
    the gradients."""
    k, cycles = 4, 3
    n = run * k * cycles
    *_, found = _summed_both_ways(n, k, True, True, run)
    (_, s_eager, sums_eager), (_, _, sums_kernel) = found
    expected = s_eager.double().view(5, cycles, k, run).square().sum(dim=(1, 3))
    torch.testing.assert_close(sums_eager.double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(sums_kernel, sums_eager, rtol=1e-5, atol=0)


@interpreted
@pytest.mark.parametrize("decay", [True, False], ids=["decay", "no-decay"])
def test_decay_add_kernel_equals_eager(decay):
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(40, 51, generator=gen) for _ in range(4)]  # separate tensors
    update = torch.randn(4, 40, 51, generator=gen)
    factors = torch.tensor([1.0, 1.0 - 0.02 * 0.1, 1.0, 0.5]) if decay else None
    eager = [p.clone() for p in params]
    ops.decay_add_(eager, update, factors)
    kernels.decay_add_(params, update, factors)
    for a, b in zip(params, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@interpreted
@pytest.mark.parametrize("shift", [True, False], ids=["shift", "no-shift"])
@pytest.mark.parametrize("form", ["matrix", "transposed", "stack"])
def test_row_add_kernel_equals_eager(form, shift):
    """``W <- W + Diag(k) X - 1 t^T`` (a centred row map's update) in one pass, rounded as the
    two eager operators round it: a matrix, a transposed view of the weight (work matrices
    that are not its storage order) and a stack of matrices, from a bfloat16 ``X``."""
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(3, 40, 1100, generator=gen)  # several blocks per matrix, the last partial
    weight = {"matrix": base[0], "transposed": base[0].mT, "stack": base}[form]
    x = torch.randn(weight.shape, generator=gen).bfloat16()
    row = torch.randn(*weight.shape[:-1], 1, generator=gen) * 1e-2
    t = torch.randn(*weight.shape[:-2], 1, weight.shape[-1], generator=gen) * 1e-3 if shift else None
    eager = weight.clone()
    ops.row_add_(eager, x, row, t)
    expected = weight.double() + row.double() * x.double() - (0 if t is None else t.double())
    torch.testing.assert_close(eager.double(), expected, rtol=0, atol=1e-5)
    kernels.row_add_(weight, x, row, t)
    torch.testing.assert_close(weight, eager, rtol=1e-6, atol=1e-7)


@interpreted
@pytest.mark.parametrize("decay", [True, False], ids=["decay", "no-decay"])
@pytest.mark.parametrize("form", ["rows", "transposed", "heads"])
def test_factor_add_kernel_equals_eager(form, decay):
    """``W <- f W + k X`` from a bfloat16 factor in work layout: work matrices stored as the
    weight (``rows``), the weight's transpose (a ``col`` part, the factor a transposed
    iterate) or the weight split in heads (several matrices, and scales, per member)."""
    gen = torch.Generator().manual_seed(4)
    members, shape = 3, (48, 40)
    params = [torch.randn(shape, generator=gen) for _ in range(members)]
    if form == "rows":
        work = [p.view(1, 48, 40) for p in params]
        factor = torch.randn(members, 48, 40, generator=gen).bfloat16()
    elif form == "transposed":
        work = [p.mT.unsqueeze(0) for p in params]  # (1, 40, 48) work matrices, strided
        factor = torch.randn(members, 48, 40, generator=gen).bfloat16().mT  # a tall iterate's layout
    else:
        work = [p.view(4, 12, 40) for p in params]
        factor = torch.randn(members * 4, 12, 40, generator=gen).bfloat16()
    factor = factor.reshape(-1, *factor.shape[-2:]) if form != "transposed" else factor
    scales = torch.rand(factor.shape[0], 1, 1, generator=gen) + 0.5
    # a refused matrix (scale 0) holds NaN and Inf, which read as 0: its member only decays
    factor[1, 2, 3], factor[1, 5, 7], scales[1] = float("nan"), float("-inf"), 0.0
    factors = torch.tensor([1.0, 1.0 - 0.02 * 0.1, 0.5]) if decay else None
    strides = list(work[0].stride())
    eager = [p.clone() for p in params]
    place = torch.empty(factor.shape)
    ops.factor_add_(eager, factor, scales, factors, place, strides)
    kernels.factor_add_(params, factor, scales, factors, strides)
    for a, b in zip(params, eager):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and what it adds is the scaled factor, in the weight's own order
    again = torch.Generator().manual_seed(4)
    start = [torch.randn(shape, generator=again) for _ in range(members)]
    for k, (a, w0) in enumerate(zip(params, start)):
        per = factor.shape[0] // members
        u = factor[k * per : (k + 1) * per].float().nan_to_num(0.0, 0.0, 0.0) * scales[k * per : (k + 1) * per]
        expect = (w0 * (factors[k] if decay else 1.0)).as_strided(u.shape, strides) + u
        torch.testing.assert_close(a.as_strided(u.shape, strides), expect, rtol=1e-6, atol=1e-6)


# a bucket of several parts with work matrices of 48 x 40 (1,920 entries, two blocks): stored
# as is, split in heads, a one-member part (read from its own gradient), and transposed (its
# direction copied into its place after the kernels)
PARTS = [("row", [(48, 40)] * 2), ("heads:48", [(96, 40)] * 2), ("row", [(48, 40)]), ("col", [(40, 48)] * 2)]


def _steps(settings, through_kernels, steps=4):
    groups = [
        {
            "params": [
                torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(10 * k + j)))
                for j, s in enumerate(shapes)
            ],
            "layout": layout,
            **settings,
        }
        for k, (layout, shapes) in enumerate(PARTS)
    ]
    opt = EquivariantOptimizer(groups, lr=0.02, beta=0.9, method="exact", compile=False)
    params = [p for g in groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)
    calls = []
    if through_kernels:

        def flags(sources, counters, present, members, col_sums=None):
            calls.append("grad_flags")
            return ops._combine(kernels.finite_flags(sources, members, col_sums), counters, present)

        def momentum(*args):
            calls.append("momentum_stage")
            kernels.momentum_stage(*args)

        def decay_add(*args):
            calls.append("decay_add_")
            kernels.decay_add_(*args)

        def factor_add(params, factor, scales, factors, place, strides):
            calls.append("factor_add_")
            kernels.factor_add_(params, factor, scales, factors, strides)

        fused = types.SimpleNamespace(
            grad_flags=flags, momentum_stage=momentum, decay_add_=decay_add, factor_add_=factor_add
        )
    else:
        fused = ops
    saved = buckets.fused, stages.fused
    buckets.fused = stages.fused = fused
    try:
        for step in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if step == 1:
                params[1].grad[47, 39] = float("nan")  # stored as is
                params[2].grad[0, 0] = float("inf")  # heads
                params[4].grad[3, 5] = float("-inf")  # the one-member part
            if step == 2:
                params[0].grad[20, 1] = 4 * GRAD_LIMIT
            opt.step()
    finally:
        buckets.fused, stages.fused = saved
    return params, opt, calls


@interpreted
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0], ids=["decay", "no-decay"])
def test_a_bucket_steps_through_the_kernels_as_through_the_eager_stages(nesterov, weight_decay):
    settings = {"rule": "spectral", "nesterov": nesterov, "weight_decay": weight_decay}
    eager, eager_opt, _ = _steps(settings, False)
    fused, opt, calls = _steps(settings, True)
    assert [len(b.parts) for b in opt._buckets.matrix] == [4]
    # every part takes the kernels, each step (the transposed one copies its direction after)
    assert calls.count("grad_flags") == calls.count("momentum_stage") == 4 * 4
    # the one-member part adds its own update; the others (the transposed one too) add
    # their polar factors as they form the updates
    assert calls.count("factor_add_") == 3 * 4 and "decay_add_" not in calls
    assert opt.nonfinite_steps == eager_opt.nonfinite_steps == 4
    for a, b in zip(fused, eager):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key in ("momentum_buffer", "nonfinite"):
            torch.testing.assert_close(opt.state[a][key], eager_opt.state[b][key], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the operators' CUDA implementations need a CUDA device")
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
def test_cuda_operators_equal_their_cpu_implementations(nesterov):
    g = _gradients()
    ok = torch.tensor([True, False, True, False, True])
    momentum = torch.randn(5, N, generator=torch.Generator().manual_seed(2))
    found = {}
    for device in ("cpu", "cuda"):
        counters = torch.zeros(5, device=device)
        flags = ops.grad_flags(list(g.to(device).clone().unbind(0)), counters, None, 5)
        m, scratch = momentum.to(device), torch.empty_like(g, device=device)
        ops.momentum_stage([t.clone() for t in g.to(device)], scratch, m, ok.to(device), 0.9, nesterov)
        params = [t.clone() for t in momentum[:, :1000].to(device)]
        ops.decay_add_(params, scratch[:, :1000].contiguous(), torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0], device=device))
        found[device] = [t.cpu() for t in (*flags, counters, m, scratch, *params)]
    for a, b in zip(found["cuda"], found["cpu"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
