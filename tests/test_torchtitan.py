"""equiopt as the optimizer of torchtitan (``equiopt.integrations.torchtitan``).

Opt-in: skipped unless torchtitan is installed (``pip install 'equiopt[titan]'``, see the
README). torchtitan's ``Trainer`` needs CUDA, but its models and ``parallelize_*``
functions run on CPU with gloo once its mesh device type is ``cpu``; torchtitan's triton
kernels are replaced by stand-ins when triton is absent (importing the integration does it).
FlexAttention has no CPU backward, so the multi-process tests give every parameter a
known global gradient instead of running the model.

Fast tests (one process): the roles of torchtitan's own models, the factory's groups,
state dicts through torchtitan's helpers, clear errors, the example config. Then 4 gloo
processes: a tiny Llama 3 on FSDP x TP (2 x 2) and a tiny Qwen3 MoE on FSDP x TP with
expert parallelism (EP 2 x FSDP 2 on the experts), parallelised by torchtitan itself,
stepped through the container with torchtitan's LR schedule, saved and restored by
torchtitan's ``CheckpointManager`` into other weights, stepped again: every parameter and
state equals one process to 1e-5.
"""

import copy
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'equiopt[titan]')")

import torch.distributed as dist
from sharded_steps import give_grads, global_grads, in_quotient, rel
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig

import equiopt
from equiopt.integrations import torchtitan as tt
from equiopt.layouts import Col, Experts, GateUp, Heads, Row
from equiopt.optim import EquivariantOptimizer

pytestmark = pytest.mark.torchtitan

FLOAT32 = {"*": {"polar_dtype": "float32"}}
WORLD = 4
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_config.py"


# ------------------------------------------------------------------ tiny models


def _tiny(kind: str, vocab: int = 128, dim: int = 32):
    """A small config of torchtitan's own Llama 3 / Qwen3 MoE, built by its own layer builders."""
    if kind == "llama3":
        from torchtitan.models import llama3 as L

        return L.Llama3Model.Config(
            dim=dim,
            vocab_size=vocab,
            tok_embeddings=L.Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
            norm=L.RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
            lm_head=L.Linear.Config(in_features=dim, out_features=vocab, param_init=L._LINEAR_INIT),
            layers=L._build_llama3_layers(
                n_layers=2,
                dim=dim,
                n_heads=4,
                n_kv_heads=2,
                hidden_dim=64,
                rope=L.ComplexRoPE.Config(dim=dim // 4, max_seq_len=64, theta=1e4),
                attn_backend="flex",
            ),
        )
    from torchtitan.models import qwen3 as Q

    return Q.Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=Q._qwen3_norm(dim),
        tok_embeddings=Q.Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=Q._EMBEDDING_INIT),
        lm_head=Q.Linear.Config(in_features=dim, out_features=vocab, param_init=Q._LINEAR_INIT),
        layers=Q._build_qwen3_moe_layers(
            n_layers=2,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=8,
            moe_hidden_dim=24,
            num_experts=4,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=Q.CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1e4),
        ),
    )


def _plain(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = _tiny(kind).build()
    with torch.no_grad():
        model.init_states()
    return model


def _names(container):
    return {
        n: (g["role"], g["rule"], layout)
        for o in container.optimizers
        if isinstance(o, EquivariantOptimizer)
        for g in o.param_groups
        for n, layout in zip(g["param_names"], g["layouts"])
    }


# ------------------------------------------------------------ roles of models

# (name pattern, role, layout) of the flavor named, as torchtitan builds it
EXPECTED = {
    "llama3:debugmodel": [
        (r"^tok_embeddings\.weight$", "embedding", Row()),
        (r"qkv_linear\.wqkv\.weight$", "attention", Heads(16)),
        (r"attention\.wo\.weight$", "attention", Heads(16, "cols")),
        (r"feed_forward\.w[13]\.weight$", "mlp_in", Row()),
        (r"feed_forward\.w2\.weight$", "mlp_out", Col()),
        (r"norm\.weight$", "vector", None),
        (r"^lm_head\.weight$", "lm_head", Row()),
    ],
    "qwen3:debugmodel_moe": [
        (r"^tok_embeddings\.weight$", "embedding", Row()),
        (r"qkv_linear\.wqkv\.weight$", "attention", Heads(128)),
        (r"attention\.wo\.weight$", "attention", Heads(128, "cols")),
        (r"[qk]_norm\.weight$", "vector", None),
        (r"inner_experts\.w[13]_EFD$", "mlp_in", Experts(Row())),
        (r"inner_experts\.w2_EDF$", "mlp_out", Experts(Col())),
        (r"moe\.router\.gate\.weight$", "router", Row()),
        (r"norm\.weight$", "vector", None),
        (r"^lm_head\.weight$", "lm_head", Row()),
    ],
    "deepseek_v3:debugmodel": [
        (r"^tok_embeddings\.weight$", "embedding", Row()),
        (r"attention\.wq\.weight$", "attention", Heads(192)),
        (r"attention\.wkv_a\.weight$", "attention", Row()),
        (r"attention\.wkv_b\.weight$", "attention", Heads(128)),
        (r"attention\.wo\.weight$", "attention", Heads(128, "cols")),
        (r"(feed_forward|shared_experts)\.w[13]\.weight$", "mlp_in", Row()),
        (r"(feed_forward|shared_experts)\.w2\.weight$", "mlp_out", Col()),
        (r"inner_experts\.w[13]_EFD$", "mlp_in", Experts(Row())),  # square (256 x 256): the axis names decide
        (r"inner_experts\.w2_EDF$", "mlp_out", Experts(Col())),
        (r"moe\.router\.gate\.weight$", "router", Row()),
        (r"norm\.weight$", "vector", None),
        (r"^lm_head\.weight$", "lm_head", Row()),
    ],
    "gpt_oss:debugmodel": [
        (r"^tok_embeddings\.weight$", "embedding", Row()),
        (r"norm\.weight$", "vector", None),
        (r"qkv_linear\.wqkv\.weight$", "attention", Heads(64)),
        (r"attention\.wo\.weight$", "attention", Heads(64, "cols")),
        (r"sinks$|bias$|_bias_E[GD]$", "vector", None),
        (r"mlp1_weight_EGD$", "mlp_in", Experts(GateUp("interleave"))),
        (r"mlp2_weight_EDF$", "mlp_out", Experts(Col())),
        (r"moe\.router\.gate\.weight$", "router", Row()),
        (r"^lm_head\.weight$", "lm_head", Row()),
    ],
}


@pytest.mark.parametrize("spec", list(EXPECTED))
def test_roles_of_torchtitan_models(spec):
    model = tt.build_model(spec)  # on the meta device
    table = tt.role_table(model)
    assert len(table) == sum(1 for _ in model.parameters())
    for row in table:
        matches = [(role, layout) for pattern, role, layout in EXPECTED[spec] if re.search(pattern, row.name)]
        assert matches, f"{spec}: no expectation for {row.name}"
        role, layout = matches[0]
        assert row.role == role, (spec, row.name, row.role, row.reason)
        assert row.layout == layout, (spec, row.name, row.layout, row.reason)


@pytest.mark.parametrize("spec", list(EXPECTED))
def test_roles_of_torchtitan_models_from_the_dataflow_alone(spec):
    """No torchtitan rules: the forward (flex / varlen attention traced as SDPA) decides."""
    model = tt.build_model(spec)
    table = equiopt.assign_roles(model)
    for row in table:
        role, layout = next((r, lay) for pattern, r, lay in EXPECTED[spec] if re.search(pattern, row.name))
        assert (row.role, row.layout) == (role, layout), (spec, row.name, row.role, row.layout, row.reason)
        if role != "vector":
            assert row.source == "dataflow", (spec, row.name, row.reason)
    assert not table.notes, table.notes  # the names agree with the dataflow everywhere


def test_equiopt_roles_prints_torchtitan_models(capsys):
    from equiopt.cli import main

    assert main(["roles", "torchtitan:deepseek_v3", "--recipe", "paper:olmoe:ii"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("layers.1.moe.routed_experts.inner_experts.w2_EDF"))
    assert "mlp_out" in line and "8x256x256" in line
    assert re.search(r"layers\.1\.moe\.router\.gate\.weight .* router .* left centred", out)
    with pytest.raises(SystemExit, match="no flavor 'huge'.*debugmodel"):
        main(["roles", "torchtitan:llama3:huge"])
    with pytest.raises(SystemExit, match="unknown torchtitan model 'llama9'"):
        main(["roles", "torchtitan:llama9"])


# ---------------------------------------------------------- factory and groups


def test_container_groups_one_per_role_with_canonical_names():
    model = _plain("moe")
    cfg = tt.equiopt_config(recipe="paper:olmoe:ii", lr_multiplier=2.0, overrides={"router": {"lr": 1e-3}})
    container = cfg.build(model_parts=[model])
    assert isinstance(container, tt.EquioptOptimizersContainer) and len(container.optimizers) == 1
    opt = container.optimizers[0]
    assert isinstance(opt, EquivariantOptimizer)
    recipe = equiopt.recipes.get_recipe("paper:olmoe:ii")
    roles = [g["role"] for g in opt.param_groups]
    assert roles == [r for r in equiopt.recipes.ROLES if r in roles] and len(set(roles)) == len(roles)
    for g in opt.param_groups:
        assert "fused" not in g and "foreach" not in g
        assert g["param_names"] == g["names"]
        want = 2 * (1e-3 if g["role"] == "router" else recipe.settings(g["role"])["lr"])
        assert g["lr"] == pytest.approx(want), g["role"]
        assert g["rule"] == recipe.settings(g["role"])["rule"]
    names = _names(container)
    assert set(names) == {n for n, _ in model.named_parameters()}  # every parameter once, by its own name
    assert names["layers.0.moe.routed_experts.inner_experts.w2_EDF"][:2] == ("mlp_out", "spectral")
    assert names["layers.1.moe.router.gate.weight"] == ("router", "left", Row())


def test_pattern_groups_mix_with_torchtitans_own_optimizers():
    model = _plain("llama3")
    cfg = tt.equiopt_config(
        param_groups=[
            ParamGroupConfig(pattern=r"norm\.weight$", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(
                pattern=r"^layers\.0\.",
                optimizer_name=tt.OPTIMIZER_NAME,
                optimizer_kwargs={"weight_decay": 0.25, "attention": {"lr": 0.5}},
            ),
            ParamGroupConfig(pattern=r".*", optimizer_name=tt.OPTIMIZER_NAME),
        ],
        recipe="equiopt:default",
    )
    container = cfg.build(model_parts=[model])
    adamw = [o for o in container.optimizers if isinstance(o, torch.optim.AdamW)]
    assert len(adamw) == 1 and all(n.endswith("norm.weight") for n in adamw[0].param_groups[0]["param_names"])
    opt = next(o for o in container.optimizers if isinstance(o, EquivariantOptimizer))
    for g in opt.param_groups:
        first = all(n.startswith("layers.0.") for n in g["param_names"])
        assert first or not any(n.startswith("layers.0.") for n in g["param_names"])  # groups never mix patterns
        assert g["weight_decay"] == (0.25 if first else 0.0)
        if g["role"] == "attention":
            assert g["lr"] == (0.5 if first else 0.02)
    assert not any(n.endswith("norm.weight") for n in _names(container))


def test_pipeline_stages_get_an_optimizer_each_with_their_own_roles():
    """Model parts as pipeline parallelism cuts them (torchtitan sets the modules a stage
    does not run to None): each part's factory call finds the roles in its own part."""
    first, last = _plain("llama3"), _plain("llama3")
    first.norm = first.lm_head = None
    del first.layers["1"]
    last.tok_embeddings = None
    del last.layers["0"]
    container = tt.equiopt_config().build(model_parts=[first, last])
    assert len(container.optimizers) == 2
    stage = [{n: g["role"] for g in o.param_groups for n in g["param_names"]} for o in container.optimizers]
    assert stage[0]["tok_embeddings.weight"] == "embedding" and "lm_head.weight" not in stage[0]
    assert stage[1]["lm_head.weight"] == "lm_head" and "tok_embeddings.weight" not in stage[1]
    assert stage[1]["layers.1.feed_forward.w2.weight"] == "mlp_out"
    assert set(stage[0]) | set(stage[1]) == {n for m in (first, last) for n, _ in m.named_parameters()}


def test_steps_equal_build_optimizer_and_state_dict_round_trips():
    """The container steps exactly as equiopt.build_optimizer; its flat state dict (torchtitan's
    helpers) holds no per-parameter lists and loads into a fresh container, whose state is
    created by torchtitan's zero-gradient step at lr 0."""
    model = _plain("moe")
    twin, other = copy.deepcopy(model), _plain("moe", seed=1)
    container = tt.equiopt_config(recipe="paper:olmoe:ii", overrides=FLOAT32).build(model_parts=[model])
    ref, schedule = equiopt.build_optimizer(twin, "paper:olmoe:ii", overrides=FLOAT32)
    for group, base in zip(ref.param_groups, schedule.base_lrs):  # the base rates, as torchtitan's schedule at 1
        group["lr"] = base
    for step in range(2):
        give_grads(global_grads(model, step, seed=7), model, twin)
        container.step()
        ref.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    flat = container.state_dict()
    assert "state.layers.0.moe.router.gate.weight.momentum_buffer" in flat
    assert "param_groups.layers.0.moe.router.gate.weight.rule" in flat
    assert not [k for k in flat if k.endswith((".names", ".layouts"))]
    fresh = tt.equiopt_config(recipe="paper:olmoe:ii", overrides=FLOAT32, eager_state=False).build(model_parts=[other])
    before = [p.detach().clone() for p in other.parameters()]
    fresh.load_state_dict(flat)
    assert all(torch.equal(p, b) for p, b in zip(other.parameters(), before))  # the zero step moved nothing
    with torch.no_grad():
        for p, q in zip(other.parameters(), model.parameters()):
            p.copy_(q)
    give_grads(global_grads(model, 2, seed=7), model, other)
    container.step()
    fresh.step()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name


def test_clear_errors():
    with pytest.raises(ValueError, match="paper:nope"):
        tt.equiopt_config(recipe="paper:nope")
    with pytest.raises(TypeError, match="'foo'"):
        tt.equiopt_config(foo=1)
    with pytest.raises(ValueError, match="'bogus'"):
        tt.equiopt_config(overrides={"attention": {"bogus": 1}})
    with pytest.raises(ValueError, match="unknown role 'mlp'"):
        tt.equiopt_config(rules={r"w1": "mlp"})
    with pytest.raises(ValueError, match="names the optimizer 'equiopt'"):
        tt.equiopt_config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")])
    model = _plain("llama3")
    bad = tt.equiopt_config(
        param_groups=[
            ParamGroupConfig(
                pattern=r"^layers\.1\.", optimizer_name=tt.OPTIMIZER_NAME, optimizer_kwargs={"betaz": 0.9}
            ),
            ParamGroupConfig(pattern=".*", optimizer_name=tt.OPTIMIZER_NAME),
        ]
    )
    with pytest.raises(ValueError, match=r"equiopt param group 0 \(parameters 'layers\.1\..*'betaz'"):
        bad.build(model_parts=[model])
    with pytest.raises(NotImplementedError, match="Lion.*'equiopt'"):
        tt.equiopt_config(
            param_groups=[
                ParamGroupConfig(pattern="norm", optimizer_name="Lion"),
                ParamGroupConfig(pattern=".*", optimizer_name="equiopt"),
            ]
        ).build(model_parts=[model])
    stranger = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="'x.weight' is in none of the model parts"):
        tt.build_optimizer_from_groups([{"params": [stranger], "param_names": ["x.weight"]}], model=model)
    with pytest.raises(ValueError, match="lr_multiplier"):
        tt.build_optimizer_from_groups([], model=model, lr_multiplier=0)


def test_example_config():
    spec = importlib.util.spec_from_file_location("torchtitan_config_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = example.llama3_debugmodel_equiopt()
    assert isinstance(config.optimizer, tt.EquioptOptimizersContainer.Config)
    container = config.optimizer.build(model_parts=[_plain("llama3")])
    assert {g["role"] for g in container.optimizers[0].param_groups} >= {"embedding", "lm_head", "attention"}


# ----------------------------------------------------------- 4 gloo processes


def _parallelised(kind, seed, par, dims):
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3 import parallelize_qwen3

    config = _tiny(kind)
    config.update_from_config(config=SimpleNamespace(parallelism=par))  # the sharding plans of each module
    with torch.device("meta"):
        model = config.build()
    parallelize = parallelize_llama if kind == "llama3" else parallelize_qwen3
    model = parallelize(
        model,
        parallel_dims=dims,
        training=TrainingConfig(),
        parallelism=par,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states()
    return model


def _placements(model):
    return {
        n: (tuple(p.device_mesh.mesh_dim_names), tuple(repr(q) for q in p.placements))
        for n, p in model.named_parameters()
    }


def _check_placements(kind, model):
    """The meshes torchtitan made: FSDP x TP on the dense parameters, EFSDP x EP on the experts."""
    seen = _placements(model)
    assert seen["layers.0.attention.wo.weight"] == (("fsdp", "tp"), ("Shard(dim=0)", "Shard(dim=1)"))
    assert seen["lm_head.weight"][1][1] == "Shard(dim=0)" and "_StridedShard" in seen["lm_head.weight"][1][0]
    if kind == "moe":
        mesh, placements = seen["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
        assert mesh == ("efsdp", "ep") and placements[1] == "Shard(dim=0)", (mesh, placements)
    else:
        assert seen["layers.1.feed_forward.w2.weight"] == (("fsdp", "tp"), ("Shard(dim=0)", "Shard(dim=1)"))


def _compare(where, sharded, opt, ref, opt_ref):
    from torch.distributed.tensor import DTensor

    want = dict(ref.named_parameters())
    for name, p in sharded.named_parameters():
        err = rel(p.full_tensor().detach(), want[name].detach())
        assert err <= 1e-5, f"{where}: {name} {p.placements} differs by {err:.2e}"
        for key, value in opt.state[p].items():
            if not value.ndim:
                continue
            mine = value.full_tensor() if isinstance(value, DTensor) else value
            theirs = opt_ref.state[want[name]][key]
            if key == "momentum_buffer":
                mine, theirs = in_quotient(mine, opt_ref, want[name]), in_quotient(theirs, opt_ref, want[name])
            assert rel(mine, theirs) <= 1e-5, f"{where}: state {key} of {name} differs"


def _check_mesh(kind, recipe, rank, world, directory):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from equiopt.distributed import record_collectives
    from equiopt.optim.planner import plan_step

    par = ParallelismConfig(
        spmd_backend="partial_dtensor",
        data_parallel_shard_degree=2,
        tensor_parallel_degree=2,
        expert_parallel_degree=2 if kind == "moe" else 1,
    )
    with mock.patch("torchtitan.distributed.parallel_dims.device_type", "cpu"):
        dims = ParallelDims.from_config(par, world)
        dims.build_mesh()
    sharded = _parallelised(kind, 0, par, dims)
    _check_placements(kind, sharded)
    ref = _tiny(kind).build()
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            ref.get_parameter(name).copy_(p.full_tensor())

    def optimizers(model, **options):
        container = tt.equiopt_config(recipe=recipe, overrides=FLOAT32, **options).build(model_parts=[model])
        schedule = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
            optimizers=container, training_steps=6
        )
        return container, schedule

    def checkpointer(model, container, schedule):
        config = CheckpointManager.Config(
            enable=True, folder=f"{kind}-checkpoint", interval=1, keep_latest_k=0, exclude_from_loading=["dataloader"]
        )
        return config.build(
            dataloader=None,
            model_parts=[model],
            optimizers=container,
            lr_schedulers=schedule,
            states={},
            sd_adapter=None,
            base_folder=directory,
        )

    container, schedule = optimizers(sharded)
    container_ref, schedule_ref = optimizers(ref)
    opt, opt_ref = container.optimizers[0], container_ref.optimizers[0]
    plans = {
        opt.plan_of(g, lay, opt._sharding(p)).how
        for g in opt.param_groups
        if g["rule"] not in ("adamw",)
        for p, lay in zip(g["params"], g["layouts"])
    }
    assert "local" in plans and plans & {"reduce", "owner"}, plans  # some maps send, some do not
    give_grads(global_grads(ref, 0, seed=3000), ref, sharded)
    for c, s in ((container, schedule), (container_ref, schedule_ref)):
        c.step()
        s.step()
        c.zero_grad()
    _compare(f"{kind} step 1", sharded, opt, ref, opt_ref)
    saver = checkpointer(sharded, container, schedule)
    assert saver.save(curr_step=1)
    saver.close()
    dist.barrier()

    # other weights, state created by torchtitan's zero-gradient step, then everything restored
    restored = _parallelised(kind, 1, par, dims)
    container2, schedule2 = optimizers(restored, eager_state=False)
    loader = checkpointer(restored, container2, schedule2)
    assert loader.load(step=1)
    loader.close()
    opt2 = container2.optimizers[0]
    assert schedule2.schedulers[0].last_epoch == schedule_ref.schedulers[0].last_epoch == 1
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt_ref.param_groups]
    _compare(f"{kind} restored", restored, opt2, ref, opt_ref)
    give_grads(global_grads(ref, 1, seed=3000), ref, restored)
    planned = plan_step(opt2, ranks=[rank]).per_rank[rank][0]
    with record_collectives() as log:
        container2.step()
    # the plan of torchtitan's own layout (EP on its (efsdp, ep) mesh) is what the step sends
    assert planned > 0 and log.total_bytes() == planned, (kind, log.summary(), planned)
    schedule2.step()
    container_ref.step()
    schedule_ref.step()
    _compare(f"{kind} step 2 after restoring", restored, opt2, ref, opt_ref)


def _worker(rank, world, cases, directory):
    for kind, recipe in cases:
        _check_mesh(kind, recipe, rank, world, directory)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("kind,recipe", [("llama3", "paper:qwen3:b-ii"), ("moe", "paper:olmoe:ii")])
def test_parallelised_by_torchtitan_equals_one_process(kind, recipe, gloo, tmp_path):
    gloo(_worker, WORLD, [(kind, recipe)], str(tmp_path / "checkpoint"))
