"""The plan of a step before launch: per-parameter decisions from placements alone, the cost
model's choice between reduce and owner, and ``equiopt plan`` on a fake 512-rank mesh."""

import json
import math

import pytest
import torch
import torch.distributed as dist

from equiopt.distributed.placements import Sharding, Split, row_range
from equiopt.layouts import parse_layout
from equiopt.optim.costs import COST_MODELS, CostModel, resolve_cost_model
from equiopt.optim.rules import MapKey
from equiopt.optim.sharded import Plan, plan

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

HYBRID = MapKey("hybrid", "row_then_right", False, 1e-8, 1.0, "polar_express", 5, "inverse", None, "nu", "relative")
MUON = MapKey("spectral", None, False, 1e-8, 0.0, "polar_express", 5, "inverse", None, "nu", "relative")
ROW = HYBRID._replace(rule="row")


def _rows_split(shape, n, dim=0, mesh=None):
    """A Sharding whose dimension ``dim`` is split like torch.chunk over one mesh axis of ``n``."""
    ranges = {(i,): row_range(shape[dim], n, i) for i in range(n)}
    block = tuple(ranges[(0,)] if d == dim else (0, s) for d, s in enumerate(shape))
    return Sharding(
        "w",
        "sharded",
        tuple(shape),
        block,
        mesh,
        (n,),
        ("dp_shard",),
        (0,),
        (dim,),
        {dim: Split((0,), ranges)},
        f"(Shard(dim={dim}),)",
    )


def test_placements_decide_the_plan():
    row, col = parse_layout("row"), parse_layout("col")
    # rows split: Grams reduce, row-norm reduces, Muon needs owners
    assert plan(HYBRID, row, _rows_split((512, 64), 4)) == Plan("reduce", rows=(0,))
    assert plan(ROW, row, _rows_split((512, 64), 4)).how == "reduce"
    assert plan(MUON, row, _rows_split((512, 64), 4)) == Plan("owner", rows=(0,))
    # Muon in Gram form: a tall matrix's c x c Gram is a sum over its rows; a wide one's is not
    gram_muon = MUON._replace(method="gram_newton_schulz")
    assert plan(gram_muon, row, _rows_split((512, 64), 4)) == Plan("reduce", rows=(0,))
    assert plan(gram_muon, row, _rows_split((64, 512), 4)) == Plan("owner", rows=(0,))
    # columns split (Megatron's vocabulary Shard(1); FSDP on a down projection's work columns)
    assert plan(ROW, row, _rows_split((512, 64), 4, dim=1)) == Plan("reduce", cols=(0,))
    assert plan(HYBRID, row, _rows_split((512, 64), 4, dim=1)) == Plan("owner", cols=(0,))
    assert plan(HYBRID, col, _rows_split((64, 512), 4, dim=1)).how == "reduce"  # Rowwise TP: neurons split
    # HSDP: the replica axis divides the Gram (each replica sums a slice of its shard's rows)
    hsdp = Sharding(
        "w",
        "sharded",
        (512, 64),
        ((0, 256), (0, 64)),
        None,
        (2, 2),
        ("dp_replicate", "dp_shard"),
        (0, 0),
        (None, 0),
        {0: Split((1,), {(i,): row_range(512, 2, i) for i in range(2)})},
        "",
    )
    assert plan(HYBRID, row, hsdp) == Plan("reduce", rows=(1,), replicas=(0,))
    assert plan(ROW, row, hsdp) == Plan("reduce", rows=(1,))  # nothing to divide
    # heads the split keeps whole need nothing; heads it cuts go to owners
    assert plan(MUON, parse_layout("heads:16"), _rows_split((128, 64), 4)).how == "local"
    assert plan(MUON, parse_layout("heads:16"), _rows_split((48, 64), 4)).how == "owner"
    # expert stacks split by whole experts are local; inside experts, as their inner layout
    assert plan(MUON, parse_layout("experts:row"), _rows_split((8, 96, 64), 4)).how == "local"
    assert plan(HYBRID, parse_layout("experts:row"), _rows_split((8, 96, 64), 2, dim=1)).how == "reduce"
    assert (
        plan(HYBRID, parse_layout("experts:gate_up:interleave:cols"), _rows_split((8, 64, 192), 2, dim=2)).how
        == "owner"
    )


def test_cost_model_chooses_gram_while_c_below_r_over_n():
    """A c x c Gram all-reduce against an owner round trip (about 8c^2 vs 8rc/N bytes per
    rank, plus the maps): the Gram while the rows per rank exceed c, owners beyond."""
    costs = CostModel(bandwidth=1e9, flops=1e30)  # bytes alone decide
    c = 256
    for n in (2, 8, 64, 128):  # (not at c == r / N, where the ring factor (N - 1) / N decides)
        r = 8192
        want = "reduce" if c < r / n else "owner"
        assert plan(HYBRID, parse_layout("row"), _rows_split((r, c), n), costs).how == want, (n, want)
    # with the maps' FLOPs counted, every rank inverting the same Gram loses at scale too
    h100 = COST_MODELS["nccl-h100"]
    assert plan(HYBRID, parse_layout("row"), _rows_split((3072, 1024), 512), h100).how == "owner"
    assert plan(HYBRID, parse_layout("row"), _rows_split((3072, 1024), 2), h100).how == "reduce"
    # a vocabulary matrix is never sent whole to an owner, whatever the mesh
    assert plan(HYBRID, parse_layout("row"), _rows_split((151936, 1024), 512), h100).how == "reduce"
    # uncentred row-norm on split rows sends nothing: always reduce
    assert plan(ROW, parse_layout("row"), _rows_split((3072, 1024), 512), h100).how == "reduce"
    assert (
        plan(HYBRID, parse_layout("row"), _rows_split((3072, 1024), 512), resolve_cost_model("reduce")).how == "reduce"
    )
    with pytest.raises(ValueError, match="unknown cost_model 'fast'"):
        resolve_cost_model("fast")


def test_replica_division_weighs_dividing_the_inverse_and_hiding_broadcasts():
    """DDP replicas and a SwiGLU-shaped Gram map: the gram division sends d x d sums and
    divides the Gram and its inverse square root; an owner sends the m x d update, of
    which an overlapped step hides the fraction ``hidden``, and divides everything."""
    from equiopt.optim.costs import replica_division

    m, d, n, flops = 768, 256, 2, 1e11
    sums = 2 * (n - 1) / n * 4 * d * d
    update = 4 * m * d * (n - 1) / n
    work = 4 * m * d * d + HYBRID.steps * 6 * d**3 + 4 * m * d
    gram_share = work - (2 * m * d * d + HYBRID.steps * 6 * d**3) * (1 - 1 / n)
    # the bandwidth at which the gram division and a waited owner cost the same
    even = (update - sums) / (gram_share - work / n) * flops
    for factor, want in ((0.5, "gram"), (2.0, "owner")):
        costs = CostModel(bandwidth=even * factor, flops=flops)
        assert replica_division(costs, HYBRID, (m, d), n) == want, (factor, want)
    # hiding half of the broadcast turns a gram case into an owner case, and only with overlap
    costs = CostModel(bandwidth=even * 0.9, flops=flops, hidden=0.5)
    assert replica_division(costs, HYBRID, (m, d), n, overlap=False) == "gram"
    assert replica_division(costs, HYBRID, (m, d), n, overlap=True) == "owner"
    with pytest.raises(ValueError, match="hidden must be in"):
        CostModel(bandwidth=1.0, flops=1.0, hidden=1.5)


def test_equiopt_plan_on_a_fake_512_rank_mesh(tmp_path, capsys):
    from equiopt.cli import main

    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "qwen3:tiny",
                "--recipe",
                "paper:qwen3:b-ii",
                "--mesh",
                "dp_shard=64,tp=8",
                "--json",
                str(out),
                "--ranks",
                "0,1,511",
                "--cost-model",
                "reduce",
            ]
        )
        == 0
    )
    assert not dist.is_initialized()
    doc = json.loads(out.read_text())
    assert doc["world"] == 512 and doc["mesh"] == {"dp_shard": 64, "tp": 8} and doc["totals"]["ranks_planned"] == 3
    assert set(doc["totals"]) >= {"bytes_sent_per_rank_max", "flops_per_rank_max", "state_bytes_per_rank_max"}
    by_name = {p["name"]: p for p in doc["parameters"]}
    for p in doc["parameters"]:
        assert set(p) >= {
            "name",
            "shape",
            "placements",
            "role",
            "rule",
            "plan",
            "bytes_sent_per_rank",
            "flops_per_rank",
        }
    emb = by_name["model.embed_tokens.weight"]
    assert (
        emb["placements"].startswith("(_StridedShard(dim=0") and emb["role"] == "embedding" and emb["plan"] == "reduce"
    )
    assert by_name["model.layers.0.mlp.down_proj.weight"]["placements"] == "(Shard(dim=0), Shard(dim=1))"
    assert by_name["model.layers.0.input_layernorm.weight"]["plan"] == "local"
    # a Gram all-reduce of the embedding's d x d (and d-vectors): at least d^2 float32 bytes
    assert emb["bytes_sent_per_rank"] >= 64 * 64 * 4
    # the step's own buckets: 512 ranks split no matrix of the tiny model evenly, so every
    # parameter takes the per-parameter path (tests/test_fsdp2_step.py plans buckets)
    assert {p["step"] for p in doc["parameters"]} == {"per-parameter"}
    text = capsys.readouterr().out
    assert "busiest rank" in text and "512 ranks" in text and "matrix buckets" in text


def test_normuon_plans_its_row_stage_on_a_fake_mesh():
    """NorMuon on FSDP x TP over 64 fake ranks: the owner round trip plus the row stage's
    sums. down_proj (rows = its stored columns, cut by tp; its stored rows cut by dp_shard)
    all-reduces its row sums over dp_shard and its per-matrix totals over tp; its row
    moments are split like its stored columns and counted in its state."""
    from equiopt.planning import plan_model

    def down(recipe):
        doc = plan_model("qwen3:tiny", recipe, {"dp_shard": 8, "tp": 8}, ranks=[0, 9])
        return next(p for p in doc["parameters"] if p["name"] == "model.layers.0.mlp.down_proj.weight")

    normuon, muon = down("normuon"), down("equiopt:default")
    assert normuon["rule"] == "normuon" and normuon["plan"] == muon["plan"] == "owner"
    d, f = normuon["shape"]  # stored (d, f): the work rows are the f columns
    assert normuon["state_bytes_per_rank"] == muon["state_bytes_per_rank"] + 4 * (f // 8)
    # the row sums of its f / 8 rows over dp_shard, its two totals over tp
    assert normuon["bytes_sent_per_rank"] == muon["bytes_sent_per_rank"] + 4 * (f // 8 + 2)


def test_equiopt_plan_reads_a_transformers_config_path(tmp_path):
    from transformers import Qwen3Config

    from equiopt.models import config
    from equiopt.planning import plan_model

    config("qwen3", "tiny").save_pretrained(tmp_path)
    assert isinstance(config("qwen3", "tiny"), Qwen3Config)
    doc = plan_model(str(tmp_path), "paper:qwen3:a-i", {"dp_shard": 4, "tp": 2}, ranks=[0, 7])
    assert doc["world"] == 8 and not dist.is_initialized()
    plans = {p["name"]: p for p in doc["parameters"]}
    assert plans["lm_head.weight"]["role"] == "lm_head" and plans["lm_head.weight"]["plan"] == "reduce"
    assert {p["plan"] for p in doc["parameters"]} >= {"local", "owner"}


def test_equiopt_plan_rejects_bad_meshes():
    from equiopt.planning import parse_mesh, world_size

    assert list(parse_mesh("tp=8,dp_shard=64")) == ["dp_shard", "tp"]
    for bad in ("dp=2", "tp=0", "tp", "", "dp_shard=4,ep=3"):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)
    # ep is carved out of dp_shard x tp (torchtitan): it adds no ranks
    assert world_size(parse_mesh("dp_replicate=2,dp_shard=4,ep=2,tp=2")) == 16
    assert world_size(parse_mesh("dp_shard=4,tp=2,ep=8")) == 8


def test_meta_blocks_of_a_fake_mesh_match_torch():
    """On a fake 512-rank group, every rank's block of a strided (FSDP over TP) placement is
    the one torch's compute_local_shape_and_global_offset gives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from equiopt.distributed import describe_sharding

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=512)
    try:
        mesh = init_device_mesh("cpu", (64, 8), mesh_dim_names=("dp_shard", "tp"))
        placements = [_StridedShard(0, split_factor=8), Shard(0)]
        w = distribute_tensor(torch.empty(1000, 24, device="meta"), mesh, placements, src_data_rank=None)
        s = describe_sharding(w, "w")
        for coord in [(0, 0), (1, 0), (0, 1), (63, 7), (17, 3)]:
            shape, offset = _compute_local_shape_and_global_offset((1000, 24), (64, 8), list(coord), placements)
            assert s.block_at(coord)[0] == ((offset[0], offset[0] + shape[0]) if shape[0] else s.block_at(coord)[0])
            assert s.block_at(coord)[0][1] - s.block_at(coord)[0][0] == shape[0]
    finally:
        dist.destroy_process_group()


def test_a_split_that_is_not_one_block_fails_by_name():
    """``Shard(0)`` then ``_StridedShard(0, sf=2)`` leaves rank (0, 0) rows {0, 2} of 8 x 4 (torch's
    own example): not a block, so the optimizer refuses it when built, naming the parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from equiopt.distributed import UnsupportedShardingError
    from equiopt.optim import EquivariantOptimizer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        w = torch.nn.Parameter(
            distribute_tensor(
                torch.empty(8, 4, device="meta"), mesh, [Shard(0), _StridedShard(0, split_factor=2)], src_data_rank=None
            )
        )
        with pytest.raises(UnsupportedShardingError, match=r"'mlp\.up_proj\.weight'.*_StridedShard.*not contiguous"):
            EquivariantOptimizer([{"params": [w], "names": ["mlp.up_proj.weight"]}], rule="hybrid")
    finally:
        dist.destroy_process_group()


class _Mesh:
    """The part of a DeviceMesh the owner batching reads: the rank grid."""

    def __init__(self, *shape):
        self.mesh = torch.arange(math.prod(shape)).view(shape)


def _hsdp(shape, replicas, shards, at, mesh):
    """A (dp_replicate, dp_shard) HSDP Sharding of a ``shape`` matrix at coordinate ``at``."""
    ranges = {(i,): row_range(shape[0], shards, i) for i in range(shards)}
    return Sharding(
        "w",
        "sharded",
        tuple(shape),
        (ranges[(at[1],)], (0, shape[1])),
        mesh,
        (replicas, shards),
        ("dp_replicate", "dp_shard"),
        at,
        (None, 0),
        {0: Split((1,), ranges)},
        "(Replicate(), Shard(dim=0))",
    )


@pytest.mark.parametrize(
    ("replicas", "shards", "tasks", "bandwidth", "divided"),
    [
        (2, 2, 32, 1e12, True),  # many maps, bandwidth to spare: the replicas share the maps
        (8, 8, 2, 1e9, False),  # two maps over 64 ranks: an owner would return 8 copies; repeat
    ],
)
def test_replicas_divide_owner_work_where_cheaper(replicas, shards, tasks, bandwidth, divided):
    """HSDP owner work (Muon on row-split matrices): over every replica where the busiest
    rank's time falls, each map then run once in the mesh, each distinct block sent by one
    holder and the update returned to all; within each replica otherwise."""
    from equiopt.optim.sharded import owner_batches

    costs = CostModel(bandwidth=bandwidth, flops=1e11)
    mesh, layout, how = _Mesh(replicas, shards), parse_layout("row"), Plan("owner", rows=(1,), replicas=(0,))
    owned = 0
    for r in range(replicas):
        for s in range(shards):
            sharding = _hsdp((256, 256), replicas, shards, (r, s), mesh)
            batches = owner_batches(
                [(sharding, how, layout, torch.float32, None, MUON)] * tasks,
                costs=costs,
                coordinate_of=lambda x: x.coordinate,
            )
            assert {p.axes for b in batches for p in b.plans} == {(0, 1) if divided else (1,)}
            for b in batches:
                owned += sum(o == b.me for o in b.owners)
                size = replicas * shards if divided else shards
                assert all(len(bl) == size for bl in b.blocks)
                for k, src in enumerate(b.sources):
                    # one holder per distinct block; the owner's own block from itself
                    assert sorted(b.blocks[k][q] for q in src) == sorted(set(b.blocks[k]))
                    if b.owners[k] in [q for q in range(size) if b.blocks[k][q] == b.blocks[k][b.owners[k]]]:
                        assert b.owners[k] in src
    assert owned == tasks * (1 if divided else replicas)
