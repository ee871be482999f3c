"""The optimizer step on 2-D meshes (4 gloo processes): FSDP + tensor parallel, TP alone,
HSDP, and expert parallel x FSDP, each equal to one process on the same weights and global
gradients (float32 polar, <= 1e-5 relative on every parameter and its state).

The dense model is a tiny Qwen3 from transformers, parallelised as torchtitan does Llama:
``ColwiseParallel`` on q/k/v/gate/up and the LM head, ``RowwiseParallel`` on o/down and
the embedding, ``SequenceParallel`` norms, then ``fully_shard`` on the ``dp`` axis, which
gives the embedding, LM head, q/k/v, gate and up ``(_StridedShard(0), Shard(0))``, o and
down ``(Shard(0), Shard(1))`` and norms ``(Shard(0), Replicate())``. The MoE models'
expert stacks are laid out by hand with ``distribute_tensor`` as torchtitan's expert
parallelism lays them: ``Shard(0)`` (experts) on ``ep`` and FSDP on ``efsdp`` (whole
experts, or ``Shard(1)`` inside them).
"""

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
from map_work import check_work_divided, counting_map_work
from sharded_steps import give_grads, global_grads, in_quotient, rel

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.slow,
]

FLOAT32 = {"*": {"polar_dtype": "float32"}}
STEPS = 2
WORLD = 4


def _tensor_parallel(model, tp_mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(),
        "model.norm": SequenceParallel(),
    }
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[pre + n] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[pre + n] = RowwiseParallel()
        for n in ("input_layernorm", "post_attention_layernorm"):
            plan[pre + n] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    return model


def _fully_shard(model, mesh):
    from equiopt.train.parallel import fsdp2_api, transformer_blocks

    fully_shard = fsdp2_api()[0]
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _by_hand(model, mesh, placements_of):
    """Every parameter replaced by ``distribute_tensor(p, mesh, placements_of(name, p))``."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in list(model.named_parameters()):
        *path, leaf = name.split(".")
        owner = model.get_submodule(".".join(path))
        setattr(owner, leaf, torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements_of(name, p))))
    return model


def _layouts(case, ref):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    if case == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return _fully_shard(_tensor_parallel(copy.deepcopy(ref), mesh["tp"]), mesh["dp"])
    if case == "tp":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        return _tensor_parallel(copy.deepcopy(ref), mesh)
    if case == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        return _fully_shard(copy.deepcopy(ref), mesh)
    # expert parallel on "ep" x FSDP on "efsdp": whole experts (ep-ws) or Shard(1) inside them (ep-s1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    inner = Shard(0) if case == "ep-whole" else Shard(1)

    def placements_of(name, p):
        if "experts" in name and p.ndim == 3:
            return [Shard(0), inner]
        return [Replicate(), Shard(0)] if p.ndim >= 2 else [Replicate(), Replicate()]

    return _by_hand(copy.deepcopy(ref), mesh, placements_of)


# (recipe, cost model): "reduce" runs every map that can on the shards; "auto" lets the
# cost model send the tiny test matrices to owners where that is cheaper
CASES = [
    (
        "fsdp+tp",
        "qwen3",
        (
            ("paper:qwen3:a-i", "auto"),
            ("paper:qwen3:b-ii", "reduce"),
            ("paper:qwen3:b-ii", "auto"),
            ("paper:qwen3:b-iii", "reduce"),
            ("normuon", "auto"),
        ),
    ),
    ("tp", "qwen3", (("paper:qwen3:a-i", "auto"), ("paper:qwen3:b-ii", "reduce"))),
    ("hsdp", "qwen3", (("paper:qwen3:a-i", "auto"), ("paper:qwen3:b-ii", "auto"), ("normuon", "auto"))),
    (
        "ep-whole",
        "gpt_oss",
        (
            ("paper:gpt_oss:i", "auto"),
            ("paper:gpt_oss:router-hybrid", "reduce"),
            ("paper:gpt_oss:router-left-centered", "auto"),
        ),
    ),
    (
        "ep-s1",
        "olmoe",
        (("paper:olmoe:ii", "reduce"), ("paper:olmoe:iii", "reduce"), ("paper:olmoe:iv", "auto"), ("normuon", "auto")),
    ),
]


# cases whose owner exchanges also run with overlap=False: the overlapped step must equal it bit for bit
OVERLAP_CHECKED = {("fsdp+tp", "paper:qwen3:b-ii", "reduce"), ("ep-s1", "paper:olmoe:iii", "reduce")}


def _check_case(case, family, recipe, costs, rank):
    from torch.distributed.tensor import DTensor

    import equiopt
    from equiopt.distributed import record_collectives
    from equiopt.models import build
    from equiopt.optim.planner import plan_step

    ref = build(family, "tiny", seed=0)
    sharded = _layouts(case, ref)
    opt_ref, _ = equiopt.build_optimizer(ref, recipe, overrides=FLOAT32)
    opt, _ = equiopt.build_optimizer(sharded, recipe, overrides=FLOAT32, cost_model=costs)
    waited = None
    if (case, recipe, costs) in OVERLAP_CHECKED:  # the same step with every collective waited for at once
        waited = _layouts(case, ref)
        opt_waited, _ = equiopt.build_optimizer(waited, recipe, overrides=FLOAT32, cost_model=costs)
        opt_waited.overlap = False
    vocab_bytes = ref.get_input_embeddings().weight.numel() * 4
    with contextlib.ExitStack() as patched:
        mapped = patched.enter_context(counting_map_work()) if case == "hsdp" else None
        overlapped = patched.enter_context(_counting_overlapped_reduces()) if waited is not None else None
        for step in range(STEPS):
            grads = global_grads(ref, step, seed=2000)
            if waited is not None:
                give_grads(grads, ref, waited)
                opt_waited.step()
            give_grads(grads, ref, sharded)
            opt_ref.step()
            planned = plan_step(opt, ranks=[rank]).per_rank[rank][0]
            with record_collectives() as log:
                opt.step()
            # the planner's bytes are the step's: the same decisions, the maps' own reductions
            assert planned > 0 and log.total_bytes() == planned, (case, recipe, log.summary(), planned)
            # nothing vocabulary-sized is all-reduced or gathered (owner work all-to-alls carry
            # the blocks of every owner-mapped matrix at once; the plans below keep vocabularies off them)
            big = [
                (r.op, r.shape)
                for r in log
                if r.op != "all_to_all" and math.prod(r.shape[-2:]) * r.dtype.itemsize >= vocab_bytes / 2
            ]
            assert not big, (case, recipe, big)
    if mapped is not None:
        _check_replicas_divide(opt, mapped)
        # the replicas divide owner work inside buckets too (equiopt.optim.sharded_buckets):
        # some owner-mapped matrix steps in a bucket, whose exchange spans the replicas
        owned = [b for b in opt._buckets.matrix if b.map_fn is not None]
        if recipe != "normuon":  # (row moments keep the per-parameter step)
            assert owned and all(b.parts[0].placed.replicas == 2 for b in owned), (recipe, owned)
    if waited is not None:
        assert any(how.how == "owner" for how in _plans(opt).values())
        # the reduce buckets' maps ran in threads with their all-reduces started in turn
        assert overlapped[0] == STEPS, (case, recipe, overlapped)
        for (name, p), q in zip(sharded.named_parameters(), waited.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), f"{case} {recipe}: {name} differs with overlap"
    plans = _plans(opt)
    for name, how in plans.items():
        if costs == "reduce" and ("embed_tokens" in name or "lm_head" in name):
            assert how.how != "owner" or plans_rule(opt, name) == "spectral", (case, recipe, name, how)
        if case == "ep-whole" and "experts" in name:
            assert how.how == "local", (recipe, name, how)  # whole experts on every rank: nothing sent
    kinds = {how.how for how in plans.values()}
    if (case, recipe, costs) in (("fsdp+tp", "paper:qwen3:b-ii", "reduce"), ("ep-s1", "paper:olmoe:iii", "reduce")):
        assert kinds == {"local", "reduce", "owner"}, (case, recipe, plans)
    want = dict(ref.named_parameters())
    for name, p in sharded.named_parameters():
        got = p.full_tensor() if isinstance(p, DTensor) else p
        err = rel(got.detach(), want[name].detach())
        assert err <= 1e-5, f"{case} {recipe}: {name} {getattr(p, 'placements', '')} differs by {err:.2e}"
        for key, value in opt.state[p].items():
            if value.ndim:
                mine = value.full_tensor() if isinstance(value, DTensor) else value
                theirs = opt_ref.state[want[name]][key]
                if key == "momentum_buffer":
                    mine, theirs = in_quotient(mine, opt_ref, want[name]), in_quotient(theirs, opt_ref, want[name])
                assert rel(mine, theirs) <= 1e-5, (case, recipe, name, key)
    return sharded


@contextlib.contextmanager
def _counting_overlapped_reduces():
    """Yield a list whose one entry counts the steps whose reduce buckets ran overlapped."""
    from equiopt.optim import distribute

    counted, original = [0], distribute._Turns

    class Counting(original):
        def issue(self):
            counted[0] += 1
            super().issue()

    distribute._Turns = Counting
    try:
        yield counted
    finally:
        distribute._Turns = original


def _check_replicas_divide(opt, done):
    """HSDP: the replicas divide the owner maps. Over the 4 ranks, every owner-mapped work
    matrix was mapped once per step, not once per replica group."""
    from equiopt.optim.owners import map_cost

    owners = [
        (group, layout, p)
        for group in opt.param_groups
        if group["rule"] not in ("adamw", "sgd")
        for p, layout in zip(group["params"], group["layouts"])
        if opt.plan_of(group, layout, opt._sharding(p)).how == "owner"
    ]
    assert owners, "no owner-mapped parameter under HSDP"
    for group, layout, p in owners:
        how = opt.plan_of(group, layout, opt._sharding(p))
        assert [opt._sharding(p).axis_name(a) for a in how.replicas] == ["dp_replicate"], how
    check_work_divided(done, [map_cost(w) for _, layout, p in owners for w in layout.work_shapes(p.shape)] * STEPS)


def _plans(opt):
    out = {}
    for group in opt.param_groups:
        if group["rule"] in ("adamw", "sgd"):
            continue
        for name, p, layout in zip(group["names"], group["params"], group["layouts"]):
            out[name] = opt.plan_of(group, layout, opt._sharding(p))
    return out


def plans_rule(opt, name):
    return next(g["rule"] for g in opt.param_groups if name in g["names"])


def _check_placements_seen(sharded):
    """The torchtitan-style plan gives the placements the module docstring lists."""
    kinds = {}
    for name, p in sharded.named_parameters():
        kinds[name] = tuple(type(q).__name__ + (f"({q.dim})" if hasattr(q, "dim") else "") for q in p.placements)
    assert kinds["model.embed_tokens.weight"] == ("_StridedShard(0)", "Shard(0)"), kinds["model.embed_tokens.weight"]
    assert kinds["model.layers.0.mlp.down_proj.weight"] == ("Shard(0)", "Shard(1)")
    assert kinds["model.layers.0.input_layernorm.weight"] == ("Shard(0)", "Replicate")


def _check_reshard(rank, directory, recipe):
    """DCP: save the model and optimizer on the 2 x 2 FSDP + TP mesh, load them into the
    model sharded by FSDP alone over 4 ranks (4 x 1), and the next step still equals one
    process (as the trainer saves and restores: get_state_dict / set_state_dict)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    import equiopt
    from equiopt.models import build
    from equiopt.train.checkpoint import load_checkpoint, save_checkpoint
    from equiopt.train.parallel import apply_fsdp2

    ref = build("qwen3", "tiny", seed=0)
    first = _layouts("fsdp+tp", ref)
    opt_ref, _ = equiopt.build_optimizer(ref, recipe, overrides=FLOAT32)
    opt, _ = equiopt.build_optimizer(first, recipe, overrides=FLOAT32)
    give_grads(global_grads(ref, 0, seed=2000), ref, first)
    opt_ref.step()
    opt.step()
    model_sd, optim_sd = get_state_dict(first, opt)
    save_checkpoint(directory, 1, {"model": model_sd, "optimizer": {"state": optim_sd["state"]}})
    second = apply_fsdp2(build("qwen3", "tiny", seed=1), torch.device("cpu"), WORLD)  # other weights: all loaded
    opt2, _ = equiopt.build_optimizer(second, recipe, overrides=FLOAT32, eager_state=True)
    model_sd, optim_sd = get_state_dict(second, opt2)
    tensors = {"model": model_sd, "optimizer": {"state": optim_sd["state"]}}
    assert load_checkpoint(directory, tensors) is not None
    set_state_dict(
        second,
        opt2,
        model_state_dict=tensors["model"],
        optim_state_dict={"state": tensors["optimizer"]["state"], "param_groups": optim_sd["param_groups"]},
    )
    give_grads(global_grads(ref, 1, seed=2000), ref, second)
    opt_ref.step()
    opt2.step()
    want = dict(ref.named_parameters())
    for name, p in second.named_parameters():
        assert isinstance(p, DTensor) and len(p.placements) == 1, (name, p.placements)
        err = rel(p.full_tensor(), want[name].detach())
        assert err <= 1e-5, f"after resharding 2 x 2 -> 4: {name} differs by {err:.2e}"
        for key, value in opt2.state[p].items():  # momentum (as the map sees it), NorMuon's row moments
            if value.ndim:
                mine, theirs = value.full_tensor(), opt_ref.state[want[name]][key]
                if key == "momentum_buffer":
                    mine, theirs = in_quotient(mine, opt_ref, want[name]), in_quotient(theirs, opt_ref, want[name])
                assert rel(mine, theirs) <= 1e-5, f"after resharding 2 x 2 -> 4: {name} {key}"


def _worker(rank, world, cases, directory=None):
    if cases[0] == "reshard":
        _check_reshard(rank, directory, cases[1])
        cases = []
    for case, family, recipes in cases:
        for recipe, costs in recipes:
            sharded = _check_case(case, family, recipe, costs, rank)
            if case == "fsdp+tp" and recipe == recipes[0][0]:
                _check_placements_seen(sharded)
            del sharded


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_mesh_step_equals_one_process(case, gloo):
    cases = [c for c in CASES if c[0] == case]
    gloo(_worker, WORLD, cases)


@pytest.mark.parametrize("recipe", ["paper:qwen3:b-ii", "normuon"])
def test_checkpoint_saved_on_2x2_loads_on_4x1(recipe, gloo, tmp_path):
    gloo(_worker, WORLD, ("reshard", recipe), str(tmp_path / "checkpoint"))
