import copy
import re

import pytest
import torch
from torch import nn

import equiopt as eo
from equiopt.layouts import Col, Experts, GateUp, Heads, Row
from equiopt.roles import RoleInferenceError, assign_roles

FAMILIES = ["qwen3", "gemma3", "olmoe", "gpt_oss"]

# (name pattern, role, layout) per family, for the tiny configs (d = 64)
EXPECTED = {
    "qwen3": [
        (r"embed_tokens\.weight", "embedding", Row()),
        (r"q_proj\.weight", "attention", Heads(24)),
        (r"[kv]_proj\.weight", "attention", Heads(24)),
        (r"o_proj\.weight", "attention", Heads(24, "cols")),
        (r"(gate|up)_proj\.weight", "mlp_in", Row()),
        (r"down_proj\.weight", "mlp_out", Col()),
        (r"norm\.weight", "vector", None),
        (r"^lm_head\.weight", "lm_head", Row()),
    ],
    "gemma3": [
        (r"embed_tokens\.weight", "embedding", Row()),
        (r"[qkv]_proj\.weight", "attention", Heads(32)),
        (r"o_proj\.weight", "attention", Heads(32, "cols")),
        (r"(gate|up)_proj\.weight", "mlp_in", Row()),
        (r"down_proj\.weight", "mlp_out", Col()),
        (r"norm\.weight", "vector", None),
        (r"^lm_head\.weight", "lm_head", Row()),
    ],
    "olmoe": [
        (r"embed_tokens\.weight", "embedding", Row()),
        (r"[qkv]_proj\.weight", "attention", Heads(16)),
        (r"o_proj\.weight", "attention", Heads(16, "cols")),
        (r"mlp\.gate\.weight", "router", Row()),
        (r"experts\.gate_up_proj$", "mlp_in", Experts(GateUp("concat"))),
        (r"experts\.down_proj$", "mlp_out", Experts(Col())),
        (r"norm\.weight", "vector", None),
        (r"^lm_head\.weight", "lm_head", Row()),
    ],
    "gpt_oss": [
        (r"embed_tokens\.weight", "embedding", Row()),
        (r"sinks", "vector", None),
        (r"\.bias$|_bias$", "vector", None),
        (r"[qkv]_proj\.weight", "attention", Heads(16)),
        (r"o_proj\.weight", "attention", Heads(16, "cols")),
        (r"router\.weight", "router", Row()),
        (r"experts\.gate_up_proj$", "mlp_in", Experts(GateUp("interleave", axis=1))),
        (r"experts\.down_proj$", "mlp_out", Experts(Row())),
        (r"norm\.weight", "vector", None),
        (r"^lm_head\.weight", "lm_head", Row()),
    ],
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, eo.models.build(request.param, "tiny", seed=0)


def test_role_tables_parameter_by_parameter(family_model):
    family, model = family_model
    table = assign_roles(model)
    assert [r.name for r in table] == [n for n, p in model.named_parameters() if p.requires_grad]
    for row in table:
        match = next(((role, lay) for pat, role, lay in EXPECTED[family] if re.search(pat, row.name)), None)
        assert match is not None, f"{family}: unexpected parameter {row.name}"
        assert (row.role, row.layout) == match, f"{family}: {row.name} got {row.role} {row.layout}, reason {row.reason}"
        assert row.reason
    assert not table.tied_embeddings


def test_mlp_work_matrices_have_hidden_size_columns(family_model):
    family, model = family_model
    hidden = model.config.hidden_size
    for row in assign_roles(model):
        if row.role in ("mlp_in", "mlp_out", "router", "embedding", "lm_head"):
            work = row.layout.to_work_list(row.param.detach())
            assert all(w.shape[-1] == hidden for w in work), (row.name, [w.shape for w in work])
        if row.role in ("mlp_in", "mlp_out"):
            neurons = {w.shape[-2] for w in row.layout.to_work_list(row.param.detach())}
            assert neurons == {model.config.intermediate_size}


def test_roles_on_meta_paper_size_allocate_nothing():
    model = eo.models.build("olmoe", "paper", device="meta")
    table = assign_roles(model)
    by = table.by_role()
    assert len(by["router"]) == 12 and all(r.shape == (32, 2048) for r in by["router"])
    assert by["mlp_in"][0].work_shapes == [(32, 2, 1024, 2048)]


def _transformers_models():
    import transformers as T

    return {
        "gpt2": T.GPT2LMHeadModel(
            T.GPT2Config(vocab_size=300, n_embd=64, n_layer=1, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
        ),
        "phi3": T.Phi3ForCausalLM(
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
        ),
        "neox": T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(
                vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
            )
        ),
        "mixtral": T.MixtralForCausalLM(
            T.MixtralConfig(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=48,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
            )
        ),
    }


def test_other_architectures_conv1d_fused_qkv_fused_gate_up():
    models = _transformers_models()
    gpt2 = assign_roles(models["gpt2"])
    assert gpt2.tied_embeddings  # GPT-2 ties its head to the embedding: reported
    assert gpt2.row("transformer.h.0.attn.c_attn.weight").layout == Heads(16, "cols")  # Conv1D (in, out), fused qkv
    assert gpt2.row("transformer.h.0.attn.c_proj.weight").layout == Heads(16)
    assert gpt2.row("transformer.h.0.mlp.c_fc.weight").layout == Col()  # Conv1D: (d, 4d) -> neurons x d
    assert gpt2.row("transformer.h.0.mlp.c_proj.weight").layout == Row()
    assert gpt2.row("transformer.h.0.mlp.c_proj.weight").role == "mlp_out"
    phi3 = assign_roles(models["phi3"])
    assert phi3.row("model.layers.0.mlp.gate_up_proj.weight").layout == GateUp("concat")  # found by probing
    assert phi3.row("model.layers.0.self_attn.qkv_proj.weight").layout == Heads(16)
    assert any("probing" in n for n in phi3.notes)
    neox = assign_roles(models["neox"])
    assert neox.row("gpt_neox.layers.0.attention.dense.weight").layout == Heads(16, "cols")
    assert neox.row("gpt_neox.layers.0.mlp.dense_4h_to_h.weight").role == "mlp_out"
    mixtral = assign_roles(models["mixtral"])
    assert mixtral.row("model.layers.0.mlp.gate.weight").role == "router"
    assert mixtral.row("model.layers.0.mlp.experts.gate_up_proj").layout == Experts(GateUp("concat"))


def test_paired_gate_up_and_whole_matrix_attention_options():
    model = eo.models.build("gpt_oss", "tiny", seed=0)
    table = assign_roles(model, gate_up="paired", per_head=False)
    row = table.row("model.layers.0.mlp.experts.gate_up_proj")
    assert row.layout == Experts(GateUp("interleave", split=False, axis=1))
    assert row.work_shapes == [(8, 96, 128)]
    assert table.row("model.layers.0.self_attn.q_proj.weight").layout == Row()


class FusedSwiGLUMLP(nn.Module):
    def __init__(self, d, ff, interleave=False):
        super().__init__()
        self.w_in = nn.Linear(d, 2 * ff, bias=False)
        self.w_out = nn.Linear(ff, d, bias=False)
        self.interleave = interleave

    def forward(self, x):
        h = self.w_in(x)
        g, u = (h[..., ::2], h[..., 1::2]) if self.interleave else h.chunk(2, -1)
        return self.w_out(torch.nn.functional.silu(g) * u)


class PlainLM(nn.Module):
    def __init__(self, vocab=50, d=16, ff=24, interleave=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.block = FusedSwiGLUMLP(d, ff, interleave)
        self.wrapper = nn.ModuleDict({"proj": nn.Linear(d, d, bias=False)})
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        x = x + self.block(x)
        return self.out(self.wrapper["proj"](x))


@pytest.mark.parametrize("interleave", [False, True])
def test_plain_module_fused_gate_up_pairing_is_probed(interleave):
    table = assign_roles(PlainLM(interleave=interleave))
    mode = "interleave" if interleave else "concat"
    assert table.row("block.w_in.weight").layout == GateUp(mode)
    assert table.row("block.w_out.weight").layout == Col()
    assert table.row("tok.weight").role == "embedding" and table.row("out.weight").role == "lm_head"
    assert table.row("wrapper.proj.weight").role == "matrix"


def test_plain_module_on_meta_pairing_from_the_dataflow_or_an_explicit_rule():
    with torch.device("meta"):
        model = PlainLM()
    table = assign_roles(model)  # the forward on fake tensors shows which half feeds the activation
    assert table.row("block.w_in.weight").layout == GateUp("concat")
    assert table.row("block.w_in.weight").source == "dataflow"
    with pytest.raises(RoleInferenceError, match="block.w_in.weight.*meta"):
        assign_roles(model, dataflow=False)  # names and shapes alone cannot probe on meta
    table = assign_roles(model, rules={r"block\.w_in": ("mlp_in", "gate_up:concat"), r"block\.w_out": "mlp_out"})
    assert table.row("block.w_in.weight").layout == GateUp("concat")
    assert table.row("block.w_in.weight").reason == "explicit rule"
    assert table.row("block.w_out.weight").layout == Col()  # role given, layout inferred
    with pytest.raises(ValueError, match="unknown role 'mlp'"):
        assign_roles(model, rules={"w_in": "mlp"})
    with pytest.raises(ValueError, match="block.w_out.weight"):
        assign_roles(model, rules={r"w_in": ("mlp_in", "gate_up"), r"w_out": ("mlp_out", "heads:5")})


def test_first_matching_rule_wins_and_overrides_inference():
    model = eo.models.build("qwen3", "tiny", seed=0)
    table = assign_roles(model, rules=[(r"layers\.0\.mlp\.down_proj", "matrix"), (r"down_proj", "attention")])
    assert table.row("model.layers.0.mlp.down_proj.weight").role == "matrix"
    assert table.row("model.layers.1.mlp.down_proj.weight").role == "attention"


def test_build_optimizer_groups_and_horizontal_updates_after_one_step():
    for family in ("olmoe", "gpt_oss"):
        model = eo.models.build(family, "tiny", seed=0)
        opt, sched = eo.build_optimizer(model, "paper:olmoe:ii", total_steps=10)
        table = opt.role_table
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        watched = [r for r in table if r.role in ("lm_head", "router", "embedding")]
        with torch.no_grad():  # from W = 0 the step leaves exactly -lr * U (these roles have no decay here)
            for r in watched:
                r.param.zero_()
        opt.step()
        sched.step()
        for r in watched:
            update = r.layout.to_work_list(r.param.detach())[0]
            assert update.abs().max() > 0, r.name
            column_sums = update.double().sum(dim=-2).abs().max() / update.abs().max()
            if r.role in ("lm_head", "router"):
                # horizontal: 1^T U = 0 up to the float32 rounding of an m-term sum
                assert column_sums < 4 * torch.finfo(torch.float32).eps * update.shape[-2], r.name
            else:
                assert column_sums > 1e-2, r.name  # the embedding is not centred
        roles = {g["role"]: g for g in opt.param_groups}
        assert roles["router"]["rule"] == "left" and roles["router"]["center"]
        assert roles["embedding"]["rule"] == "row" and not roles["embedding"]["center"]
        assert sched.get_last_lr()[0] == roles["embedding"]["lr"]


def test_build_optimizer_overrides_and_errors():
    model = eo.models.build("qwen3", "tiny", seed=0)
    opt, _ = eo.build_optimizer(model, "paper:qwen3:b-ii", overrides={"lm_head": {"lr": 1e-4}})
    assert {g["role"]: g["lr"] for g in opt.param_groups}["lm_head"] == 1e-4
    with pytest.raises(ValueError, match="recipe"):
        eo.build_optimizer(model, "paper:qwen3:z-ix")
    with pytest.raises(ValueError, match="lm_head"):
        eo.build_optimizer(model, "paper:qwen3:b-ii", overrides={"lm_head": {"lrate": 1.0}})


def _permute_neurons_and_experts(model, gen):
    """Permute every MoE layer's experts and every expert's neurons, in place; return the permutations."""
    perms = []
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            E = mlp.experts.gate_up_proj.shape[0]
            f = mlp.experts.down_proj.shape[-1]
            pe = torch.randperm(E, generator=gen)
            pn = torch.randperm(f, generator=gen)
            mlp.gate.weight.copy_(mlp.gate.weight[pe])
            gu = mlp.experts.gate_up_proj[pe]
            mlp.experts.gate_up_proj.copy_(torch.cat([gu[:, :f][:, pn], gu[:, f:][:, pn]], 1))
            mlp.experts.down_proj.copy_(mlp.experts.down_proj[pe][:, :, pn])
            perms.append((pe, pn))
    return perms


def test_permuting_neurons_and_experts_before_a_step_gives_the_permuted_step():
    """Model-level equivariance: optimizer(permuted model) == permuted(optimizer(model))."""
    torch.manual_seed(0)
    a = eo.models.build("olmoe", "tiny", seed=0)
    b = copy.deepcopy(a)
    perms = _permute_neurons_and_experts(b, torch.Generator().manual_seed(1))
    exact = {"*": {"method": "exact"}}
    opts = [eo.build_optimizer(m, "paper:olmoe:ii", overrides=exact)[0] for m in (a, b)]
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    for m, opt in zip((a, b), opts):
        opt.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    # apply the same permutations to a's result: must equal b's
    c = copy.deepcopy(a)
    with torch.no_grad():
        for layer, (pe, pn) in zip(c.model.layers, perms):
            mlp = layer.mlp
            f = mlp.experts.down_proj.shape[-1]
            mlp.gate.weight.copy_(mlp.gate.weight[pe])
            gu = mlp.experts.gate_up_proj[pe]
            mlp.experts.gate_up_proj.copy_(torch.cat([gu[:, :f][:, pn], gu[:, f:][:, pn]], 1))
            mlp.experts.down_proj.copy_(mlp.experts.down_proj[pe][:, :, pn])
    for (name, pc), pb in zip(c.named_parameters(), b.parameters()):
        torch.testing.assert_close(pc, pb, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(a.model.layers[0].mlp.gate.weight, b.model.layers[0].mlp.gate.weight)


def test_print_roles_and_command(capsys):
    model = eo.models.build("qwen3", "tiny", seed=0)
    eo.print_roles(model, recipe="paper:qwen3:a-ii")
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.down_proj.weight" in out and "hybrid" in out and "mlp_out" in out
    from equiopt.cli import main

    assert main(["roles", "gpt_oss:paper", "--recipe", "paper:gpt_oss:ii"]) == 0
    out = capsys.readouterr().out
    assert "201088x2048" in out and "router" in out and "left centred" in out


def test_rules_matching_vectors_and_scalar_gates():
    import transformers as T

    gpt_oss = eo.models.build("gpt_oss", "tiny", seed=0)
    table = assign_roles(gpt_oss, rules={r"q_proj": "matrix"})
    assert table.row("model.layers.0.self_attn.q_proj.weight").role == "matrix"
    assert table.row("model.layers.0.self_attn.q_proj.bias").role == "vector"
    assert any("stays a vector" in n for n in table.notes)
    moe = T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    table = assign_roles(moe)
    assert table.row("model.layers.0.mlp.shared_expert_gate.weight").role == "matrix"
    assert table.row("model.layers.0.mlp.shared_expert.down_proj.weight").role == "mlp_out"
    assert eo.verify_roles(moe, table).ok
