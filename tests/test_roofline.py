"""The roofline counter (equiopt.roofline, ``bench --roofline``): FLOPs, bytes and peak
memory of operators on the meta device against counts by hand, the device-choice switch,
and the command."""

import json

import pytest
import torch

from equiopt import bench
from equiopt.linalg.device_choices import decide_as, decides_like
from equiopt.optim import EquivariantOptimizer
from equiopt.roofline import H100, RooflineCounter, count_step, fused_adamw_step


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _only(counter, name):
    (op,) = [o for o in counter.ops if o.name == name]
    return op


def test_elementwise_and_product_counts_by_hand():
    n, (m, k, p) = 1000, (64, 32, 48)
    x, y = _meta(n), _meta(n)
    a, b = _meta(m, k, dtype=torch.bfloat16), _meta(k, p, dtype=torch.bfloat16)
    row = _meta(1, n)
    with RooflineCounter() as c:
        x.add_(y)  # reads x and y, writes x
        x.copy_(y)  # reads y only
        x.lerp_(y, 0.5)
        _meta(8, n).mul(row.expand(8, n))  # the broadcast row is read once
        torch.mm(a, b)
        torch.mm(a, b, out_dtype=torch.float32)
        x.view(10, 100)
    add, copy, lerp, mul = (_only(c, s) for s in ("add_", "copy_", "lerp_", "mul"))
    assert (add.read, add.written) == (8 * n, 4 * n)
    assert (copy.read, copy.written) == (4 * n, 4 * n)
    assert (lerp.read, lerp.written) == (8 * n, 4 * n)
    assert (mul.read, mul.written) == (4 * 9 * n, 4 * 8 * n)
    mm, wide = [o for o in c.ops if o.name == "mm"]
    assert mm.flops == wide.flops == 2 * m * k * p and mm.dtype == wide.dtype == torch.bfloat16
    assert (mm.read, mm.written, wide.written) == (2 * (m * k + k * p), 2 * m * p, 4 * m * p)
    assert mm.seconds == pytest.approx(max(2 * m * k * p / 700e12, mm.bytes / 2.8e12) + 5e-6)
    assert add.seconds == pytest.approx(12 * n / H100.bandwidth + H100.launch_s)
    assert c.kernels == 6 and len(c.ops) == 9  # an empty, an expand and a view: no kernel, no cost
    assert c.flops_by_dtype() == {"bfloat16": 4 * m * k * p}


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
def test_polar_express_products_of_one_matrix_by_formula(nesterov):
    """A spectral step of one m x n matrix (m <= n): five Polar Express steps, each
    ``A = X X^T`` (2 m^2 n), ``B = b A + c A^2`` (2 m^3) and ``a X + B X`` (2 m^2 n), all
    bfloat16 on CUDA; the fused momentum stage reads momentum and gradient and writes the
    momentum, and with Nesterov the map's input (without, the map reads the momentum), and
    the matrix's sum of squares, so the normalisation before the iterations reads the
    matrix only to divide it."""
    m, n = 64, 256
    w = torch.nn.Parameter(_meta(m, n))
    w.grad = torch.empty_like(w)
    with decide_as("cuda"):
        opt = EquivariantOptimizer(
            [w], lr=1e-3, rule="spectral", method="polar_express", steps=5, nesterov=nesterov, compile=False
        )
        c = count_step(opt.step)
    assert c.flops_by_dtype() == {"bfloat16": 5 * (4 * m * m * n + 2 * m**3)}
    stage = _only(c, "momentum_stage")
    assert stage.written == (8 if nesterov else 4) * m * n + 4  # (and the matrix's sum of squares)
    assert stage.read - 8 * m * n == 1  # (and its one finite flag)
    norms = [o for o in c.ops if o.name in ("linalg_vector_norm", "norm") and o.read >= 4 * m * n]
    assert not norms, norms
    flags = _only(c, "grad_flags")
    assert flags.read == 4 * m * n + 4 and flags.written == 4  # the gradient; the skip counter


@pytest.mark.parametrize("layout", ["row", "col"])
def test_a_hybrid_on_the_direct_route_reads_its_rows_norms_once(layout):
    """HybridPolarGradM (``row_then_right``) on CUDA's direct route: the rows' norms serve the
    row stage and the polar iteration's normalisation of ``Diag(r) D``, summed by the
    momentum stage where the work rows are the stored rows (``row``), else one pass over
    ``D``; and one ``tr(U^T Diag(r) D)`` that widens and scales ``U`` in one product."""
    m, n = 64, 256
    w = torch.nn.Parameter(_meta(m, n))
    w.grad = torch.empty_like(w)
    with decide_as("cuda"):
        opt = EquivariantOptimizer(
            [w], lr=1e-3, rule="hybrid", order="row_then_right", route="direct", layout=layout, compile=False
        )
        c = count_step(opt.step)
    norms = [o for o in c.ops if o.name == "linalg_vector_norm" and o.read >= 4 * m * n]
    assert len(norms) == (0 if layout == "row" else 1), [(o.name, o.stage) for o in norms]
    rows = m if layout == "row" else 0  # (the momentum stage's sums, 4 bytes a row)
    assert _only(c, "momentum_stage").written == 4 * m * n + 4 * rows
    dots = [o for o in c.ops if o.stage == "maps.one_sided._dots" and o.kernel]
    assert sorted(o.name for o in dots) == ["bmm", "mul"], [(o.name, o.read, o.written) for o in dots]


@pytest.mark.parametrize("nesterov", [False, True], ids=["ema", "nesterov"])
def test_row_norm_on_a_vocabulary_moves_what_fused_adamw_moves_beside_its_row_scalars(nesterov):
    """RowNormM on a 32768 x 1024 embedding, counted as CUDA runs it: one read of the gradient
    for its flags, one momentum stage that also sums the direction's rows, one update add;
    beyond fused AdamW's bytes on the same matrix only its per-row scalars (a few dozen
    bytes a row); with Nesterov the direction is written too, and the add reads it instead
    of the momentum."""
    m, n = 32768, 1024
    w, a = torch.nn.Parameter(_meta(m, n)), torch.nn.Parameter(_meta(m, n))
    w.grad, a.grad = torch.empty_like(w), torch.empty_like(a)
    with decide_as("cuda"):
        opt = EquivariantOptimizer([w], lr=1e-3, rule="row", nesterov=nesterov, compile=False)
        c = count_step(opt.step)
    adamw = count_step(fused_adamw_step([a])).bytes
    assert adamw == 28 * m * n + 12  # (and its step counter)
    extra = 4 * m * n if nesterov else 0  # the direction, written by the stage (the add reads it, not the momentum)
    assert 0 < c.bytes - adamw - extra <= 96 * m, (c.bytes - adamw - extra) / m
    assert _only(c, "momentum_stage").written == (8 if nesterov else 4) * m * n + 4 * m


def test_a_centred_row_map_adds_its_update_in_one_pass_over_the_weights():
    """Centred RowNormM (an LM head) on a 32768 x 1024 matrix: its update, rows scaled and
    column shift subtracted, is one read of the weights and the momentum and one write of
    the weights (``equiopt::row_add_``), no second pass for the shift; the gradient enters
    the momentum centred (its column sums taken with the flags), with the rows' norms summed
    by the momentum stage: beside fused AdamW's bytes only the shift's read of the direction
    (``s^T D``) and the row and column scalars."""
    m, n = 32768, 1024
    w, a = torch.nn.Parameter(_meta(m, n)), torch.nn.Parameter(_meta(m, n))
    w.grad, a.grad = torch.empty_like(w), torch.empty_like(a)
    with decide_as("cuda"):
        opt = EquivariantOptimizer([w], lr=1e-3, rule="row", center=True, nesterov=False, compile=False)
        c = count_step(opt.step)
    add = _only(c, "row_add_")
    assert add.written == 4 * m * n and 8 * m * n < add.read <= 8 * m * n + 8 * (m + n)
    adds = [o.name for o in c.ops if o.stage == "optim.apply._add_" and o.written >= 4 * m * n]
    assert adds == ["row_add_"], adds
    adamw = count_step(fused_adamw_step([a])).bytes
    assert 0 < c.bytes - adamw - 4 * m * n <= 96 * m + 32 * n, (c.bytes - adamw) / (m * n)
    assert _only(c, "momentum_stage").written == 4 * m * n + 4 * m  # the momentum and its rows' sums


def test_fused_adamw_reads_four_and_writes_three_tensors():
    params = [_meta(100, 10), _meta(300)]
    c = count_step(fused_adamw_step(params))
    fused = _only(c, "_fused_adamw_")
    assert fused.written == 3 * 4 * 1300 and fused.read == 4 * 4 * 1300 + 4 * 2  # and two step counters
    assert c.kernels == 2


def test_cuda_choices_make_split_products_bfloat16_products():
    """``gram_dtype="auto"`` on a matrix of 512 and more, on the Gram route: six (four for a
    Gram) bfloat16 products per float32 one on CUDA, strict float32 products on a CPU. On
    ``route="auto"`` CUDA takes the direct route (Polar Express on the matrix, bfloat16)."""
    w = torch.nn.Parameter(_meta(1024, 512))
    w.grad = torch.empty_like(w)
    found = {}
    for route in ("cuda", "cpu"):
        with decide_as(route):
            opt = EquivariantOptimizer([w], lr=1e-3, rule="right", compile=False, route="gram")
            found[route] = count_step(opt.step).flops_by_dtype()
    assert set(found["cuda"]) == {"bfloat16"} and set(found["cpu"]) == {"float32"}
    assert 4 * found["cpu"]["float32"] < found["cuda"]["bfloat16"] <= 6 * found["cpu"]["float32"]
    with decide_as("cuda"):
        auto = count_step(EquivariantOptimizer([w], lr=1e-3, rule="right", compile=False).step).flops_by_dtype()
    assert auto == {"bfloat16": 5 * (4 * 1024 * 512 * 512 + 2 * 512**3)}


def test_decide_as_applies_to_meta_tensors_only_and_restores():
    assert decides_like(_meta(1)) == "meta"
    with decide_as("cuda"):
        assert decides_like(_meta(1)) == "cuda" and decides_like(torch.zeros(1)) == "cpu"
        with decide_as("cpu"):
            assert decides_like(torch.device("meta")) == "cpu"
        assert decides_like(_meta(1)) == "cuda"
    assert decides_like(_meta(1)) == "meta"


def test_peak_counts_storages_alive_at_once_not_views():
    a = _meta(1000)  # before: not counted
    with RooflineCounter() as c:
        b = a * 2  # 4,000 bytes
        v = b.view(10, 100)  # a view: nothing new
        d = v + 1  # 8,000 alive
        del b  # v keeps b's storage
        e = d * 3  # 12,000
        del v  # b's storage goes
        f = torch.cat([d, e])  # 4,000 + 4,000 + 8,000
        del d, e, f
        torch.empty(1000, device="meta")  # dies at once
    assert c.peak_bytes == 16000


def test_the_command_prints_and_writes_each_route(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    bench.main(
        ["--roofline", "--model", "512x64", "--recipes", "paper:qwen3:a-i", "--routes", "cuda,cpu", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert "cuda's choices" in text and "cpu's choices" in text and "paper:qwen3:a-i" in text
    tables = json.loads(out.read_text())["tables"]
    assert [t["route"] for t in tables] == ["cuda", "cpu"]
    row = tables[0]["recipes"]["paper:qwen3:a-i"]
    assert row["ms"] > tables[0]["adamw"]["ms"] > 0 and row["kernels"] > 0 and len(row["top"]) == 10
    assert row["flops"]["bfloat16"] > 0 and row["peak_extra_mib"] > 0 and row["state_mib"] > 0


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3:paper"])
def test_a_step_holds_at_most_half_its_state_beyond_it(model):
    """Qwen3-0.6B at its real widths on the meta device, with CUDA's choices: a-i, b-ii
    and the default recipe each hold at most half their state beyond it at their peak
    (the polar iterations a chunk at a time, the direct route's factor narrow, a hybrid's
    row stage never formed)."""
    from equiopt.roofline import roofline

    table = roofline(["paper:qwen3:a-i", "paper:qwen3:b-ii", "equiopt:default"], model, route="cuda", top=1)
    for name, row in table["recipes"].items():
        assert row["peak_extra_mib"] <= 0.5 * row["state_mib"], (model, name, row["peak_extra_mib"], row["state_mib"])


def test_collectives_count_what_a_rank_sends_apart_from_its_kernels():
    """On a fake process group: an all-reduce hands over its tensor, an all-to-all its input
    (not its output), a broadcast its tensor; none is a kernel, and the link time is the
    bytes over the link's rate."""
    import torch.distributed as dist

    from equiopt.planning import fake_world

    fake_world(4)
    try:
        a, out, inp, b = _meta(1000), _meta(64), _meta(64 + 32), _meta(10, dtype=torch.bfloat16)
        with RooflineCounter() as c:
            dist.all_reduce(a)
            dist.all_to_all_single(out, inp, [16] * 4, [24] * 4)
            dist.broadcast(b, src=0)
            a.mul_(2.0)
    finally:
        dist.destroy_process_group()
    assert c.collectives == 3
    assert c.sent == 4000 + 96 * 4 + 20
    assert c.kernels == 1 and c.bytes == 8000  # the multiply alone
    assert c.link_seconds == pytest.approx(c.sent / H100.link_bandwidth)


def test_a_sharded_step_is_counted_on_rank_0_of_a_fake_mesh():
    """``shards=2``: the model fully sharded by FSDP2 over a fake group of 2 ranks; rank 0's
    fused AdamW moves half the single process's bytes (its shards), its step sends bytes to
    collectives, and no process group is left behind."""
    import torch.distributed as dist

    from equiopt.roofline import roofline

    one = roofline(["paper:qwen3:a-i"], "512x64", "cuda", top=3)
    two = roofline(["paper:qwen3:a-i"], "512x64", "cuda", top=3, shards=2)
    assert not dist.is_initialized()
    assert two["placement"] == "FSDP2 over 2 ranks, rank 0" and one["placement"] == "one process"
    assert two["params"] == one["params"]
    assert two["adamw"]["gb"] == pytest.approx(one["adamw"]["gb"] / 2, rel=1e-3)
    step = two["recipes"]["paper:qwen3:a-i"]
    assert step["sent_gb"] > 0 and step["collectives"] > 0 and step["link_ms"] > 0
    assert one["recipes"]["paper:qwen3:a-i"]["sent_gb"] == 0
    assert step["state_mib"] == pytest.approx(one["recipes"]["paper:qwen3:a-i"]["state_mib"] / 2, rel=0.05)
