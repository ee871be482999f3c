"""equiopt.models: the paper's architectures from transformers' classes."""

from __future__ import annotations

import math
import re
import resource
import sys

import pytest
import torch

pytest.importorskip("transformers")

import equiopt.models as M

PAPER = {
    "qwen3": 625_784_832,
    "gemma3": 1_087_138_944,
    "olmoe": 2_824_177_664,
    "gpt_oss": 3_467_779_008,
}
MOE = ("olmoe", "gpt_oss")


@pytest.fixture(scope="module")
def tiny():
    return {name: M.build(name, "tiny", seed=0) for name in M.FAMILIES}


def _matrices(model):
    """(name, tensor) of every weight matrix / expert tensor, biases excluded."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim >= 2 and not (leaf == "bias" or leaf.endswith("_bias")):
            yield name, p


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# --------------------------------------------------------------------- names


def test_families_and_sizes():
    assert set(M.FAMILIES) == set(PAPER)
    assert set(M.SIZES) == {"tiny", "small", "medium", "paper"}


# ----------------------------------------------------------- parameter counts


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_trainable_parameters_exact_on_meta(name):
    before = _max_rss_bytes()
    model = M.build(name, "paper", device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n == PAPER[name] == M.PAPER_PARAM_COUNTS[name]
    assert M.count_parameters(model) == PAPER[name]
    # A real fp32 allocation would be >= 2.5 GB; meta allocates nothing.
    assert _max_rss_bytes() - before < 256 * 2**20


def test_paper_architectures_match_table():
    c = M.config("qwen3", "paper")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (20, 1024, 3072)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (16, 8, 128, 151_936)
    assert not c.attention_bias
    c = M.config("gemma3", "paper")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (18, 1152, 6912)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 1, 256, 262_144)
    assert c.sliding_window == 512 and c.layer_types.count("full_attention") == 3
    c = M.config("olmoe", "paper")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (12, 2048, 1024)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (16, 16, 50_304)
    assert (c.num_experts, c.num_experts_per_tok) == (32, 8)
    c = M.config("gpt_oss", "paper")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (12, 2048, 2048)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (64, 8, 64, 201_088)
    assert (c.num_local_experts, c.num_experts_per_tok) == (16, 4)
    assert c.attention_bias and c.sliding_window == 128


@pytest.mark.parametrize("name", sorted(PAPER))
def test_every_size_count_matches_documented_table(name):
    for size in M.SIZES:
        model = M.build(name, size, device="meta")
        assert M.count_parameters(model) == M.PARAM_COUNTS[name][size], size


@pytest.mark.parametrize("name", sorted(PAPER))
def test_small_and_medium_parameter_ranges(name):
    small = M.count_parameters(M.build(name, "small", device="meta"))
    medium = M.count_parameters(M.build(name, "medium", device="meta"))
    assert 10e6 <= small <= 30e6
    assert 100e6 <= medium <= 300e6


def test_vocab_override_changes_embedding_and_head():
    model = M.build("qwen3", "small", device="meta", vocab_size=8192)
    assert tuple(model.get_input_embeddings().weight.shape) == (8192, 192)
    assert tuple(model.get_output_embeddings().weight.shape) == (8192, 192)
    base = M.PARAM_COUNTS["qwen3"]["small"]
    assert M.count_parameters(model) == base - 2 * (50_304 - 8192) * 192


# ------------------------------------------------------------------- training


@pytest.mark.parametrize("name", sorted(PAPER))
def test_tiny_forward_backward_finite(tiny, name):
    model = tiny[name]
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 32, model.config.vocab_size)
    assert torch.isfinite(out.loss)
    # Random init: the loss is close to log(vocab).
    assert abs(out.loss.item() - math.log(model.config.vocab_size)) < 0.5
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["lm_head.weight"].abs().sum() > 0
    assert grads["model.embed_tokens.weight"].abs().sum() > 0
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_embeddings_untied(tiny, name):
    model = tiny[name]
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    assert emb is not head
    assert emb.data_ptr() != head.data_ptr()
    assert not torch.equal(emb, head)
    assert model.config.tie_word_embeddings is False
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        M.config(name, "tiny", tie_word_embeddings=True)


# ------------------------------------------------------------------------ init


@pytest.mark.parametrize("name", sorted(PAPER))
def test_init_matrices_normal_002(tiny, name):
    model = tiny[name]
    names = []
    for pname, p in _matrices(model):
        names.append(pname)
        n = p.numel()
        assert abs(p.std().item() - 0.02) < 0.15 * 0.02, pname
        assert abs(p.mean().item()) < 6 * 0.02 / math.sqrt(n), pname
    assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)
    if name in MOE:  # fused (E, ., .) tensors, or one Linear per expert in older transformers
        assert any(".experts." in n for n in names)
    if name == "gpt_oss":
        assert any(p.ndim == 3 for _, p in _matrices(model))


@pytest.mark.parametrize("name", sorted(PAPER))
def test_init_biases_zero_norms_as_class(tiny, name):
    model = tiny[name]
    # Gemma's RMSNorm scales by (1 + weight): its identity weight is 0.
    identity = 0.0 if name == "gemma3" else 1.0
    n_norms = 0
    for pname, p in model.named_parameters():
        leaf = pname.rsplit(".", 1)[-1]
        if leaf == "bias" or leaf.endswith("_bias"):
            assert torch.count_nonzero(p) == 0, pname
        elif "norm" in pname:
            n_norms += 1
            assert torch.all(p == identity), pname
    assert n_norms > 0


def test_init_std_override_and_seed_reproducible():
    a = M.build("gpt_oss", "tiny", seed=7)
    b = M.build("gpt_oss", "tiny", seed=7)
    c = M.build("gpt_oss", "tiny", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    assert not torch.equal(sa["model.layers.0.self_attn.sinks"], sc["model.layers.0.self_attn.sinks"])
    wide = M.build("qwen3", "tiny", seed=0, initializer_range=0.05)
    assert abs(wide.lm_head.weight.std().item() - 0.05) < 0.005


def test_seed_does_not_touch_global_rng():
    state = torch.random.get_rng_state()
    M.build("olmoe", "tiny", seed=3)
    assert torch.equal(state, torch.random.get_rng_state())


def test_dtype_bfloat16():
    model = M.build("qwen3", "tiny", dtype=torch.bfloat16, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    ids = torch.arange(16).view(1, 16)
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    with pytest.raises(ValueError, match="floating"):
        M.build("qwen3", "tiny", dtype=torch.int32)


# ----------------------------------------------------------------- features


def test_qwen3_features(tiny):
    model = tiny["qwen3"]
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    assert attn.q_proj.bias is None
    c = model.config
    assert c.num_attention_heads == 2 * c.num_key_value_heads
    assert c.hidden_act == "silu"


def test_gemma3_features(tiny):
    model = tiny["gemma3"]
    c = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert type(c).__name__ == "Gemma3TextConfig"
    assert c.hidden_activation == "gelu_pytorch_tanh"
    assert c.num_key_value_heads == 1 and c.num_attention_heads > 1
    assert set(c.layer_types) == {"sliding_attention", "full_attention"}
    assert c.final_logit_softcapping is None
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    # The layer pattern follows the number of layers.
    c = M.config("gemma3", "paper", num_hidden_layers=12)
    assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 2


def test_gemma3_final_logit_softcapping():
    model = M.build("gemma3", "tiny", seed=0, final_logit_softcapping=30.0)
    assert model.config.final_logit_softcapping == 30.0
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
        ids = torch.arange(8).view(1, 8)
        capped = model(input_ids=ids).logits
        model.config.final_logit_softcapping = None
        raw = model(input_ids=ids).logits
    assert raw.abs().max() > 100
    assert capped.abs().max() <= 30.0 + 1e-4


def test_gpt_oss_features(tiny):
    model = tiny["gpt_oss"]
    c = model.config
    layer = model.model.layers[0]
    assert layer.self_attn.sinks.shape == (c.num_attention_heads,)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert getattr(layer.self_attn, proj).bias is not None
    assert layer.mlp.router.bias is not None
    assert layer.mlp.experts.gate_up_proj_bias is not None
    assert set(c.layer_types) == {"sliding_attention", "full_attention"}
    assert c.num_attention_heads == 8 * c.num_key_value_heads


@pytest.mark.parametrize("name", MOE)
def test_moe_features(tiny, name):
    c = tiny[name].config
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    assert experts > 1 and 1 <= c.num_experts_per_tok < experts
    assert c.output_router_logits is False and c.router_aux_loss_coef == 0.0


@pytest.mark.parametrize("name", MOE)
def test_router_logits_without_and_with_aux_loss(tiny, name):
    model = tiny[name]
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids)
        routed = model(input_ids=ids, labels=ids, output_router_logits=True)
    experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    assert plain.aux_loss is None
    assert len(routed.router_logits) == model.config.num_hidden_layers
    assert routed.router_logits[0].shape[-1] == experts
    assert torch.isfinite(routed.aux_loss)
    assert torch.allclose(plain.loss, routed.loss)  # coefficient 0: loss unchanged
    aux = M.build(name, "tiny", seed=0, router_aux_loss_coef=0.01, output_router_logits=True)
    with torch.no_grad():
        out = aux(input_ids=ids, labels=ids)
        ref = aux(input_ids=ids, labels=ids, output_router_logits=False)
    assert torch.allclose(out.loss, ref.loss + 0.01 * out.aux_loss, atol=1e-5)


def test_attention_implementation_defaults_and_override():
    for name in ("qwen3", "gemma3", "olmoe"):
        assert M.config(name, "tiny")._attn_implementation == "sdpa"
    assert M.config("gpt_oss", "tiny")._attn_implementation == "eager"
    assert M.build("qwen3", "tiny", attn_implementation="eager").config._attn_implementation == "eager"


def test_config_without_building():
    c = M.config("olmoe", "small", vocab_size=8192, num_hidden_layers=3)
    assert type(c).__name__ == "OlmoeConfig"
    assert (c.vocab_size, c.num_hidden_layers, c.tie_word_embeddings) == (8192, 3, False)
    # gpt-oss's alias for the expert count (where the config has it) replaces the preset's value.
    if "num_experts" in getattr(type(M.config("gpt_oss", "tiny")), "attribute_map", {}):
        assert M.config("gpt_oss", "tiny", num_experts=4).num_local_experts == 4


# -------------------------------------------------------------------- errors


def test_unknown_family():
    with pytest.raises(ValueError, match=r"llama.*qwen3.*gemma3.*olmoe.*gpt_oss"):
        M.build("llama", "tiny", device="meta")
    with pytest.raises(ValueError, match="valid families"):
        M.config("mixtral")


def test_unknown_size():
    with pytest.raises(ValueError, match=r"huge.*tiny.*small.*medium.*paper"):
        M.build("qwen3", "huge", device="meta")


def test_unknown_field():
    with pytest.raises(ValueError, match=re.escape("'hiden_size'")) as err:
        M.build("qwen3", "tiny", device="meta", hiden_size=32)
    assert "hidden_size" in str(err.value)  # a suggestion
    with pytest.raises(ValueError, match="head_dim"):  # OLMoE derives head_dim
        M.config("olmoe", "tiny", head_dim=8)
    with pytest.raises(ValueError, match="final_logit_softcap"):
        M.config("qwen3", "tiny", final_logit_softcap=30.0)
