"""OLMo-core as a client: roles of its dense and MoE transformers from their forward, its
``OptimConfig``, its own FSDP and expert-parallel placements on 2 gloo processes, and the
example that trains with its own train loop."""

import copy
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

import equiopt as eo
from equiopt.layouts import Col, Compose, Heads, Row, Unflatten

olmo = pytest.importorskip("olmo_core.nn.transformer", reason="needs OLMo-core (pip install 'equiopt[olmo]')")
T = olmo.TransformerConfig

D, V, HEADS, KV = 64, 200, 4, 2
HD = D // HEADS


def _configs():
    moe = dict(d_model=D, vocab_size=V, n_layers=2, n_heads=HEADS, num_experts=4, top_k=2, expert_hidden_size=32)
    return {
        "llama_like": T.llama_like(d_model=D, vocab_size=V, n_layers=2, n_heads=HEADS, n_kv_heads=KV, qk_norm=True),
        "gemma3_like": T.gemma3_like(d_model=D, vocab_size=V, n_layers=2, n_heads=HEADS, n_kv_heads=KV, hidden_size=96),
        "qwen3_0_6B": T.qwen3_0_6B(vocab_size=1000),
        "llama_like_moe": T.llama_like_moe(**moe),
        "llama_like_moe_shared": T.llama_like_moe(**moe, shared_expert_hidden_size=48),
        "llama_like_moe_dropless": T.llama_like_moe(**moe, dropless=True),
    }


def _expected(name, cfg):
    d = cfg.d_model
    hd = 128 if name == "qwen3_0_6B" else HD
    rows = [
        (r"^embeddings\.weight$", "embedding", Row()),
        (r"^lm_head\.w_out\.weight$", "lm_head", Row()),
        (r"attention\.w_[qkv]\.weight$", "attention", Heads(hd)),
        (r"attention\.w_out\.weight$", "attention", Heads(hd, "cols")),
        (r"(feed_forward|shared_mlp)\.w[13]\.weight$", "mlp_in", Row()),
        (r"(feed_forward|shared_mlp)\.w2\.weight$", "mlp_out", Col()),
        (r"router\.weight$", "router", Unflatten(4)),
        (r"norm\.weight$", "vector", None),
    ]
    if name.endswith("dropless"):  # DroplessMoEMLP stores (experts * hidden, d_model) for all three
        rows += [(r"experts\.mlp\.w[13]$", "mlp_in", Heads(32)), (r"experts\.mlp\.w2$", "mlp_out", Heads(32))]
    else:  # MoEMLP: w1, w3 (experts * d_model, hidden), w2 (experts * hidden, d_model)
        rows += [
            (r"experts\.mlp\.w[13]$", "mlp_in", Compose(Heads(d), Col())),
            (r"experts\.mlp\.w2$", "mlp_out", Heads(32)),
        ]
    return rows


@pytest.mark.parametrize("name", list(_configs()))
def test_roles_of_olmo_core_models_from_their_forward(name):
    cfg = _configs()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cfg.build(init_device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a traced forward: no fallback warning
        table = eo.assign_roles(model)
    expected = _expected(name, cfg)
    for row in table:
        match = next(((role, lay) for pat, role, lay in expected if re.search(pat, row.name)), None)
        assert match is not None, f"{name}: unexpected parameter {row.name}"
        assert (row.role, row.layout) == match, (name, row.name, row.role, row.layout, row.reason)
        if row.role != "vector":
            assert row.source == "dataflow", (row.name, row.reason)
    by = table.by_role()
    if "moe" in name:
        experts = [r for r in by["mlp_in"] if "experts" in r.name]
        assert experts and all(r.work_shapes == [(4, 32, D)] for r in experts)  # one (hidden, d) matrix per expert
        assert all(r.work_shapes == [(4, D)] for r in by["router"])
        assert len(by["router"]) == 2


def test_equiopt_config_builds_and_trains_an_olmo_core_model():
    from olmo_core.optim.config import INITIAL_LR_FIELD, OptimConfig

    from equiopt.integrations.olmo_core import EquioptConfig

    assert OptimConfig.get_registered_class("equiopt") is EquioptConfig
    torch.manual_seed(0)
    model = _configs()["llama_like"].build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    config = EquioptConfig(recipe="paper:qwen3:b-ii", overrides={"lm_head": {"lr": 1e-3}})
    opt = config.build(model)
    roles = {g["role"]: g for g in opt.param_groups}
    assert roles["lm_head"]["lr"] == roles["lm_head"][INITIAL_LR_FIELD] == 1e-3
    assert roles["mlp_in"]["rule"] == "hybrid" and roles["attention"]["rule"] == "spectral"
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    state = opt.state_dict()
    opt.param_groups[0][INITIAL_LR_FIELD] = 123.0
    opt.load_state_dict(state)  # OLMo-core's fixed fields are restored after loading
    assert opt.param_groups[0][INITIAL_LR_FIELD] != 123.0
    with pytest.raises(ValueError, match="group_overrides"):
        from olmo_core.optim.config import OptimGroupOverride

        EquioptConfig(group_overrides=[OptimGroupOverride(params=["*"], opts={})]).build(model)


def _fsdp_equals_one_process(rank, world):
    from sharded_steps import give_grads, global_grads, rel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from equiopt.integrations.olmo_core import EquioptConfig

    errors = {}
    for name in ("llama_like", "llama_like_moe"):
        torch.manual_seed(0)
        ref = _configs()[name].build(init_device="cpu")
        ref.init_weights(device=torch.device("cpu"))
        sharded = copy.deepcopy(ref)
        sharded.apply_fsdp(dp_mesh=init_device_mesh("cpu", (world,)))  # OLMo-core's own FSDP2 placement
        config = EquioptConfig(recipe="paper:olmoe:ii", overrides={"*": {"method": "exact"}})
        opt_ref, opt = config.build(ref), config.build(sharded)
        for step in range(2):
            give_grads(global_grads(ref, step, seed=5), ref, sharded)
            opt_ref.step()
            opt.step()
        want = dict(ref.named_parameters())
        assert all(isinstance(p, DTensor) for p in sharded.parameters())
        errors[name] = max(rel(p.full_tensor(), want[n].detach()) for n, p in sharded.named_parameters())
    return errors


@pytest.mark.slow
def test_olmo_core_fsdp_step_equals_one_process(gloo):
    for errors in gloo(_fsdp_equals_one_process, 2):
        assert all(e <= 1e-5 for e in errors.values()), errors


def _ep_equals_one_process(rank, world):
    """OLMo-core's expert-parallel placement, as its train module makes it (EP over the HSDP
    shard dimension, the only data parallelism it allows EP with), for both expert MLPs."""
    from olmo_core.distributed.parallel import DataParallelType, build_world_mesh
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerExpertParallelConfig
    from olmo_core.train.train_module.transformer.common import parallelize_model
    from sharded_steps import give_grads, global_grads, rel
    from torch.distributed.tensor import DTensor

    from equiopt.integrations.olmo_core import EquioptConfig

    dp = TransformerDataParallelConfig(name=DataParallelType.hsdp)
    ep = TransformerExpertParallelConfig(degree=world)
    mesh = build_world_mesh(dp=dp, ep=ep, device_type="cpu")  # (dp_replicate=1, dp_shard=2)
    errors = {}
    for name in ("llama_like_moe", "llama_like_moe_dropless"):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DTensor random ops on a CPU mesh; no grouped_gemm
            placed = parallelize_model(
                _configs()[name].build(init_device="meta"),
                world_mesh=mesh,
                device=torch.device("cpu"),
                max_sequence_length=16,
                rank_microbatch_size=32,
                dp_config=dp,
                ep_config=ep,
            )
            ref = _configs()[name].build(init_device="cpu")
        experts = {n: p for n, p in placed.named_parameters() if ".experts." in n}
        assert experts and all(p.to_local().shape[0] == p.shape[0] // world for p in experts.values())  # 2 of 4 here
        want = dict(ref.named_parameters())
        with torch.no_grad():  # the reference holds the placed model's weights
            for n, p in placed.named_parameters():
                want[n].copy_(p.full_tensor() if isinstance(p, DTensor) else p)
        config = EquioptConfig(recipe="paper:olmoe:ii", overrides={"*": {"method": "exact"}})
        opt_ref, opt = config.build(ref), config.build(placed)
        roles = {r.name: (r.role, r.layout) for r in opt.role_table}
        assert roles == {r.name: (r.role, r.layout) for r in opt_ref.role_table}  # per-expert maps, as on one process
        for step in range(2):
            give_grads(global_grads(ref, step, seed=5), ref, placed)
            opt_ref.step()
            opt.step()
        errors[name] = max(rel(p.full_tensor(), want[n].detach()) for n, p in placed.named_parameters())
    return errors


@pytest.mark.slow
def test_olmo_core_expert_parallel_step_equals_one_process(gloo):
    for errors in gloo(_ep_equals_one_process, 2):
        assert all(e <= 1e-5 for e in errors.values()), errors


@pytest.mark.slow
def test_olmo_core_train_example(monkeypatch, tmp_path, one_thread):
    """The example trains with OLMo-core's own trainer, data loader and scheduler (dense on a CPU)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    import olmo_core_train

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result, train_module = olmo_core_train.main(["--steps", "3", "--out", str(tmp_path), "--no-moe"])
    assert result["steps"] == 3 and len(result["losses"]) == 3
    assert all(math.isfinite(loss) for loss in result["losses"]), result
    opt = train_module.optim
    assert isinstance(opt, eo.EquivariantOptimizer)
    recipe = eo.recipes.get_recipe("paper:olmoe:ii")
    by_role = {g["role"]: g for g in opt.param_groups}
    assert set(by_role) == {"embedding", "lm_head", "attention", "mlp_in", "mlp_out", "vector"}
    for role, group in by_role.items():
        assert group["rule"] == recipe.settings(role)["rule"], role
    assert by_role["attention"]["rule"] == "spectral" and by_role["lm_head"]["rule"] == "row"
    grouped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert grouped == {id(p) for p in train_module.model.parameters()}
    # OLMo-core's scheduler scaled each group's initial_lr (CosWithWarmup ends at 0.1 of it)
    for group in opt.param_groups:
        assert group["lr"] < group["initial_lr"]
