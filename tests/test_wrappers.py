"""A model reached through a wrapper gets the roles and layouts of the bare model."""

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import equiopt as eo
from equiopt.layouts import GateUp, Heads, Row
from equiopt.roles import RoleInferenceError, assign_roles


class Holder(nn.Module):
    """What a LightningModule or a user's training wrapper is: the model as an attribute."""

    def __init__(self, model):
        super().__init__()
        self.net = model

    def forward(self, **kw):
        return self.net(**kw)


def _by_name(table, prefix=""):
    out = {}
    for r in table:
        assert r.name.startswith(prefix), r.name
        out[r.name[len(prefix) :]] = (r.role, r.layout, r.shape)
    return out


@pytest.fixture(scope="module", params=["qwen3", "olmoe"])
def bare(request):
    model = eo.models.build(request.param, "tiny", seed=0)
    return model, _by_name(assign_roles(model))


@pytest.fixture
def gloo_group(tmp_path):
    """A world-size-1 gloo process group in this process (DDP and FSDP2 need one)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    gc.collect()  # wrappers hold the group: release them before it goes
    dist.destroy_process_group()


def _check_same(bare_roles, wrapped, prefix):
    table = assign_roles(wrapped)
    roles = _by_name(table, prefix)
    assert roles == bare_roles
    assert not table.notes  # nothing hidden, nothing probed
    per_head = [k for k, (role, layout, _) in roles.items() if isinstance(layout, Heads)]
    assert per_head, "attention projections must be split by heads"


def test_container_modules(bare):
    model, roles = bare
    _check_same(roles, Holder(model), "net.")
    _check_same(roles, Holder(Holder(model)), "net.net.")
    _check_same(roles, nn.ModuleDict({"student": model}), "student.")


def test_torch_compile(bare):
    model, roles = bare
    _check_same(roles, torch.compile(model), "_orig_mod.")


def test_ddp(bare, gloo_group):
    model, roles = bare
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    _check_same(roles, ddp, "module.")
    _check_same(roles, Holder(ddp), "net.module.")
    del ddp


def test_fsdp2(bare, gloo_group):
    from torch.distributed.fsdp import fully_shard

    model, roles = bare
    sharded = copy.deepcopy(model)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert type(sharded).__name__.startswith("FSDP")
    _check_same(roles, sharded, "")
    _check_same(roles, Holder(sharded), "net.")


def test_hf_base_model_nested(bare):
    """The decoder alone (``model.model``): no head, the same roles for every other parameter."""
    model, roles = bare
    inner = _by_name(assign_roles(model.model))
    assert inner == {k[len("model.") :]: v for k, v in roles.items() if k.startswith("model.")}


def test_lightning_module(bare):
    L = pytest.importorskip("lightning")
    model, roles = bare

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

    _check_same(roles, Module(), "model.")


def test_optimizer_through_a_wrapper_steps_like_the_bare_model(one_thread):
    torch.manual_seed(0)
    a = eo.models.build("qwen3", "tiny", seed=0)
    b = Holder(copy.deepcopy(a))
    opts = [eo.build_optimizer(m, "paper:qwen3:b-ii")[0] for m in (a, b)]
    ids = torch.randint(0, a.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, opt in zip((a, b), opts):
            opt.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    for (name, pa), pb in zip(a.named_parameters(), b.net.parameters()):
        assert torch.equal(pa, pb), name


class Attention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.q = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.attn = Attention(d, n_head)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class TinyLM(nn.Module):
    def __init__(self, heads=(4, 2), d=32, vocab=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h) for h in heads)
        self.head = nn.Linear(d, vocab, bias=False)


def test_dimensions_per_block_from_the_block_itself():
    table = assign_roles(Holder(TinyLM(heads=(4, 2))))
    assert table.row("net.blocks.0.attn.q.weight").layout == Heads(8)
    assert table.row("net.blocks.1.attn.q.weight").layout == Heads(16)
    assert table.row("net.blocks.1.attn.proj.weight").layout == Heads(16, "cols")
    assert table.row("net.tok.weight").role == "embedding" and table.row("net.head.weight").role == "lm_head"
    mha = nn.Module()
    mha.tok, mha.attn = nn.Embedding(64, 32), nn.MultiheadAttention(32, 4)
    table = assign_roles(mha)
    assert table.row("attn.in_proj_weight").layout == Heads(8)  # fused q/k/v, heads from the module


def test_missing_head_size_is_an_error_naming_the_parameter_and_the_setting():
    model = TinyLM()
    for block in model.blocks:
        del block.attn.n_head
    with pytest.raises(RoleInferenceError, match=r"blocks\.0\.attn\.q\.weight.*dims=\{'head_dim'.*per_head=False"):
        assign_roles(model)
    assert assign_roles(model, dims={"heads": 2}).row("blocks.0.attn.q.weight").layout == Heads(16)
    assert assign_roles(model, dims={"head_dim": 4}).row("blocks.1.attn.q.weight").layout == Heads(4)
    assert assign_roles(model, per_head=False).row("blocks.1.attn.q.weight").layout == Row()
    opt, _ = eo.build_optimizer(model, "muon", dims={"head_dim": 8})
    assert opt.role_table.row("blocks.0.attn.proj.weight").layout == Heads(8, "cols")


def test_a_wrapper_that_hides_its_model():
    class Hidden(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.models = [model]  # a plain list: not a submodule

    with pytest.raises(RoleInferenceError, match=r"'models'.*not registered"):
        assign_roles(Hidden(TinyLM()))
    with pytest.raises(RoleInferenceError, match="no parameters"):
        eo.build_optimizer(nn.Sequential())
    frozen = TinyLM().requires_grad_(False)
    with pytest.raises(RoleInferenceError, match="none requires grad"):
        assign_roles(frozen)

    class Pipeline:  # not a module, but holds one
        def __init__(self, model):
            self.model = model

    with pytest.raises(TypeError, match=r"nn.Module.*\.model: pass that"):
        assign_roles(Pipeline(TinyLM()))


def test_hf_model_without_a_known_convention_names_its_type():
    import transformers as T

    with torch.device("meta"):
        phi3 = T.Phi3ForCausalLM(
            T.Phi3Config(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    with pytest.raises(RoleInferenceError, match=r"gate_up_proj.*in a 'phi3' model.*rules="):
        assign_roles(Holder(phi3), dataflow=False)
    # the forward of the model inside the holder, on fake tensors, settles the pairing on meta
    row = assign_roles(Holder(phi3)).row("net.model.layers.0.mlp.gate_up_proj.weight")
    assert (row.layout, row.source) == (GateUp("concat"), "dataflow")


class Expert(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.up = nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)


class MoE(nn.Module):
    def __init__(self, d=32, ff=48, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)  # a plain Linear: only the block's structure says router
        self.experts = nn.ModuleList(Expert(d, ff) for _ in range(experts))


def test_expert_count_from_the_block_structure():
    model = nn.Module()
    model.tok, model.moe, model.head = nn.Embedding(64, 32), MoE(), nn.Linear(32, 64, bias=False)
    table = assign_roles(Holder(model))
    assert table.row("net.moe.gate.weight").role == "router"
    assert table.row("net.moe.experts.0.up.weight").role == "mlp_in"
    assert table.row("net.moe.experts.3.down.weight").role == "mlp_out"
