"""Role inference for the conventions of torchtitan's models, on plain modules built here
(no torchtitan needed): expert stacks named by their axes (``w1_EFD``, ``w2_EDF``,
``mlp1_weight_EGD``, ``mlp1_bias_EG``), stored ``(experts, out, in)`` like ``nn.Linear``,
and multi-head latent attention (DeepSeek V2/V3)."""

import pytest
import torch
from torch import nn

from equiopt.layouts import Col, Experts, GateUp, Heads, Row
from equiopt.roles import RoleInferenceError, assign_roles


class Experts3(nn.Module):
    def __init__(self, experts, dim, hidden):
        super().__init__()
        self.num_experts = experts
        self.w1_EFD = nn.Parameter(torch.randn(experts, hidden, dim))
        self.w2_EDF = nn.Parameter(torch.randn(experts, dim, hidden))
        self.w3_EFD = nn.Parameter(torch.randn(experts, hidden, dim))


class Router(nn.Module):
    def __init__(self, experts, dim):
        super().__init__()
        self.num_experts = experts
        self.gate = nn.Linear(dim, experts, bias=False)


class MoE(nn.Module):
    def __init__(self, experts, dim, hidden):
        super().__init__()
        self.router = Router(experts, dim)
        self.experts = Experts3(experts, dim, hidden)


class FusedExperts(nn.Module):
    """gpt-oss style: gate/up rows fused on one axis (G = 2 F), biases named by axes."""

    def __init__(self, experts, dim, hidden):
        super().__init__()
        self.mlp1_weight_EGD = nn.Parameter(torch.randn(experts, 2 * hidden, dim))
        self.mlp1_bias_EG = nn.Parameter(torch.randn(experts, 2 * hidden))
        self.mlp2_weight_EDF = nn.Parameter(torch.randn(experts, dim, hidden))
        self.mlp2_bias_ED = nn.Parameter(torch.randn(experts, dim))


class FusedMoE(nn.Module):
    def __init__(self, experts, dim, hidden):
        super().__init__()
        self.router = Router(experts, dim)
        self.experts = FusedExperts(experts, dim, hidden)


class Model(nn.Module):
    def __init__(self, block, vocab=96, dim=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.block = block
        self.lm_head = nn.Linear(dim, vocab, bias=False)


def _rows(model, **kwargs):
    return {r.name: r for r in assign_roles(model, **kwargs)}


@pytest.mark.parametrize("hidden", [48, 32])  # 32: square experts, where only the axis names tell the sides
def test_axis_named_expert_stacks_are_stored_out_in(hidden):
    rows = _rows(Model(MoE(4, 32, hidden)))
    assert (rows["block.experts.w1_EFD"].role, rows["block.experts.w1_EFD"].layout) == ("mlp_in", Experts(Row()))
    assert (rows["block.experts.w3_EFD"].role, rows["block.experts.w3_EFD"].layout) == ("mlp_in", Experts(Row()))
    assert (rows["block.experts.w2_EDF"].role, rows["block.experts.w2_EDF"].layout) == ("mlp_out", Experts(Col()))
    assert rows["block.router.gate.weight"].role == "router"
    # the work matrices have the neurons as rows, one per expert
    w2 = rows["block.experts.w2_EDF"]
    assert tuple(w2.layout.to_work(w2.param.detach()).shape) == (4, hidden, 32)


def test_axis_named_fused_gate_up_needs_its_pairing_and_biases_are_vectors():
    model = Model(FusedMoE(4, 32, 24))
    with pytest.raises(RoleInferenceError, match=r"mlp1_weight_EGD.*concatenated or interleaved"):
        assign_roles(model)
    rows = _rows(model, rules={r"mlp1_weight_EGD$": ("mlp_in", "experts:gate_up:interleave")})
    assert rows["block.experts.mlp1_weight_EGD"].layout == Experts(GateUp("interleave"))
    assert (rows["block.experts.mlp2_weight_EDF"].role, rows["block.experts.mlp2_weight_EDF"].layout) == (
        "mlp_out",
        Experts(Col()),
    )
    assert rows["block.experts.mlp1_bias_EG"].role == "vector"
    assert rows["block.experts.mlp2_bias_ED"].role == "vector"


class MLA(nn.Module):
    """Multi-head latent attention with the attribute names of torchtitan's DeepSeek V3."""

    def __init__(self, dim=32, heads=4, nope=8, rope=4, v=8, kv_rank=16, q_rank=0):
        super().__init__()
        self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = heads, nope, rope, v
        self.qk_head_dim, self.kv_lora_rank, self.q_lora_rank = nope + rope, kv_rank, q_rank
        if q_rank:
            self.wq_a = nn.Linear(dim, q_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_rank)
            self.wq_b = nn.Linear(q_rank, heads * (nope + rope), bias=False)
        else:
            self.wq = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(dim, kv_rank + rope, bias=False)
        self.kv_norm = nn.RMSNorm(kv_rank)
        self.wkv_b = nn.Linear(kv_rank, heads * (nope + v), bias=False)
        self.wo = nn.Linear(heads * v, dim, bias=False)


class Attention(MLA):
    pass


def test_multi_head_latent_attention_has_a_block_per_head():
    rows = _rows(Model(Attention()))
    assert rows["block.wq.weight"].layout == Heads(12)  # qk_head_dim = nope + rope rows per head
    assert rows["block.wkv_b.weight"].layout == Heads(8)  # a key and a value block of 8 rows per head
    assert rows["block.wo.weight"].layout == Heads(8, "cols")
    assert rows["block.wkv_a.weight"].layout == Row()  # latent: no head axis
    assert rows["block.kv_norm.weight"].role == "vector"
    assert all(rows[n].role == "attention" for n in ("block.wq.weight", "block.wkv_b.weight", "block.wkv_a.weight"))
    work = rows["block.wkv_b.weight"].layout.to_work(rows["block.wkv_b.weight"].param.detach())
    assert tuple(work.shape) == (8, 8, 16)  # 4 heads x (key, value)


def test_multi_head_latent_attention_with_a_query_latent_and_unequal_head_sizes():
    rows = _rows(Model(Attention(nope=8, v=6, q_rank=20)))
    assert rows["block.wq_a.weight"].layout == Row()
    assert rows["block.wq_b.weight"].layout == Heads(12)
    assert rows["block.wkv_b.weight"].layout == Heads(14)  # key (8) and value (6) rows of a head together
    assert rows["block.wo.weight"].layout == Heads(6, "cols")
    # per_head=False keeps every projection whole
    whole = _rows(Model(Attention(q_rank=20)), per_head=False)
    assert {whole[n].layout for n in whole if whole[n].role == "attention"} == {Row()}
