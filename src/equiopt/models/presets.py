"""The paper's four architectures and their downsized variants, as plain data.

Each family names a transformers config class and causal-LM class and gives, per
size, the config fields that differ from that class's defaults.  Nothing here
imports transformers; :mod:`equiopt.models.build` turns these dicts into configs.

Paper sizes (Table "Modified model architectures").  The trainable parameter
counts of the paper follow from the transformers classes with their stock
layout; the fields that decide the count are:

* every family: ``tie_word_embeddings=False`` (an untied ``(v, d)`` LM head, the
  paper's main object of study), which adds ``v * d`` parameters.
* qwen3: QK-norm (``q_norm``/``k_norm`` of size ``head_dim`` in every layer,
  built in), ``attention_bias=False`` (the paper: "without QKV bias terms"),
  ``head_dim=128`` so that ``q_proj`` is ``(2048, 1024)``.
  20 * 15,730,944 + 2 * 151,936 * 1024 + 1024 = 625,784,832.
* gemma3: four RMSNorms per layer (input, post-attention, pre- and
  post-feed-forward), QK-norm of size ``head_dim=256``, no biases, one KV head.
  18 * 26,842,112 + 2 * 262,144 * 1152 + 1152 = 1,087,138,944.
* olmoe: QK-norm over the whole projection (``q_norm``/``k_norm`` of size
  ``n_heads * head_dim = 2048``), ``attention_bias=False``, a bias-free
  ``(32, 2048)`` router, experts fused as ``(E, 2 d_ff, d)`` and ``(E, d, d_ff)``.
  12 * 218,177,536 + 2 * 50,304 * 2048 + 2048 = 2,824,177,664.
* gpt_oss: ``attention_bias=True`` (QKV *and* output-projection biases), one
  attention-sink logit per query head (``sinks``, 64 per layer), a router with
  bias, and expert biases (``gate_up_proj_bias (E, 2 d_ff)``, ``down_proj_bias
  (E, d)``).  12 * 220,343,376 + 2 * 201,088 * 2048 + 2048 = 3,467,779,008.

Other choices follow the families' released configurations (Qwen3-0.6B,
Gemma 3 1B, OLMoE-1B-7B-0924, gpt-oss-20b): RoPE bases and scaling, sliding
windows and their layer pattern, RMSNorm epsilons.  They do not change the
parameter count.

Defaults shared by every size (all overridable):

* ``pad_token_id=None``: no ``padding_idx`` on the input embedding, so no
  vocabulary row is silently frozen when pre-training with another tokenizer.
* ``use_cache=False``: these models are built for training.
* MoE families: ``output_router_logits=False`` and ``router_aux_loss_coef=0.0``.
  ``OlmoeForCausalLM`` and ``GptOssForCausalLM`` add
  ``router_aux_loss_coef * aux_loss`` to ``loss`` whenever router logits are
  output (config flag or ``model(..., output_router_logits=True)``) and labels
  are given; with the coefficient at 0 the router logits and the load-balancing
  ``aux_loss`` can be requested for diagnostics without changing the training
  loss, as in the paper's runs without auxiliary losses.  Pass
  ``router_aux_loss_coef=0.01`` (and ``output_router_logits=True``) to train with
  it; the classes read the coefficient once, at construction
  (``model.router_aux_loss_coef``).
* gemma3: ``final_logit_softcapping=None`` and ``attn_logit_softcapping=None``;
  the paper's soft-capping switch is ``final_logit_softcapping=30.0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Family", "FAMILY_SPECS", "SIZES", "PARAM_COUNTS", "PAPER_PARAM_COUNTS"]

SIZES: tuple[str, ...] = ("tiny", "small", "medium", "paper")

# GPT-2's 50,257 tokens padded to a multiple of 64 (also OLMoE's vocabulary size).
_GPT2_VOCAB = 50_304
_TINY_VOCAB = 512

# Trainable parameters on the paper's Table "Modified model architectures".
PAPER_PARAM_COUNTS: dict[str, int] = {
    "qwen3": 625_784_832,
    "gemma3": 1_087_138_944,
    "olmoe": 2_824_177_664,
    "gpt_oss": 3_467_779_008,
}

# Measured trainable parameter counts of every (family, size), with the default
# vocabulary of that size.  Checked by the tests.
PARAM_COUNTS: dict[str, dict[str, int]] = {
    "qwen3": {"tiny": 176_544, "small": 21_973_824, "medium": 162_222_336, "paper": 625_784_832},
    "gemma3": {"tiny": 254_656, "small": 24_040_896, "medium": 228_305_664, "paper": 1_087_138_944},
    "olmoe": {"tiny": 247_360, "small": 23_461_056, "medium": 209_609_472, "paper": 2_824_177_664},
    "gpt_oss": {"tiny": 403_232, "small": 23_548_288, "medium": 212_076_608, "paper": 3_467_779_008},
}


@dataclass(frozen=True)
class Family:
    """One architecture family: its transformers classes and per-size config fields."""

    name: str
    title: str
    config_class: str
    model_class: str
    moe: bool
    sizes: dict[str, dict[str, Any]]
    # Extra keyword arguments the family's config accepts besides its fields.
    extra_fields: tuple[str, ...] = ()
    # Config fields every size of the family sets (before the size's own fields).
    common: dict[str, Any] = field(default_factory=dict)


_COMMON: dict[str, Any] = {
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "pad_token_id": None,
    "use_cache": False,
}

_MOE_COMMON: dict[str, Any] = {
    "output_router_logits": False,
    "router_aux_loss_coef": 0.0,
}

QWEN3 = Family(
    name="qwen3",
    title="Qwen3-0.6B-style dense model (GQA, QK-norm, SwiGLU, RoPE, no QKV bias)",
    config_class="Qwen3Config",
    model_class="Qwen3ForCausalLM",
    moe=False,
    extra_fields=("rope_theta", "rope_scaling"),
    common={
        **_COMMON,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 40_960,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    sizes={
        # Qwen3-0.6B with 20 instead of 28 layers (untied embeddings).
        "paper": {
            "vocab_size": 151_936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 20,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "bos_token_id": 151_643,
            "eos_token_id": 151_645,
        },
        "medium": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 768,
            "intermediate_size": 2304,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 6,
            "head_dim": 64,
        },
        "small": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 192,
            "intermediate_size": 576,
            "num_hidden_layers": 6,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": 32,
        },
        # Every family's tiny size keeps its matrices non-square where the family
        # allows it (OLMoE's attention is square by design), so that a transposed
        # layout cannot pass a shape check by accident.
        "tiny": {
            "vocab_size": _TINY_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
        },
    },
)

GEMMA3 = Family(
    name="gemma3",
    title="Gemma 3 1B-style dense model (MQA, QK-norm, GeGLU-tanh, 5:1 local/global attention)",
    config_class="Gemma3TextConfig",
    model_class="Gemma3ForCausalLM",
    moe=False,
    # ``sliding_window_pattern``: every p-th layer is full attention, the others
    # sliding-window (Gemma 3 uses p = 6); turned into ``layer_types`` here.
    extra_fields=("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern"),
    common={
        **_COMMON,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "max_position_embeddings": 32_768,
        "sliding_window_pattern": 6,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    sizes={
        # Gemma 3 1B with 18 instead of 26 layers (untied embeddings).
        "paper": {
            "vocab_size": 262_144,
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "bos_token_id": 2,
            "eos_token_id": 1,
        },
        "medium": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 768,
            "intermediate_size": 4608,
            "num_hidden_layers": 12,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
        },
        "small": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 192,
            "intermediate_size": 1152,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 128,
        },
        "tiny": {
            "vocab_size": _TINY_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
        },
    },
)

OLMOE = Family(
    name="olmoe",
    title="OLMoE-1B-7B-style sparse MoE (QK-norm, SwiGLU experts, top-k softmax router)",
    config_class="OlmoeConfig",
    model_class="OlmoeForCausalLM",
    moe=True,
    extra_fields=("rope_theta", "rope_scaling"),
    common={
        **_COMMON,
        **_MOE_COMMON,
        "hidden_act": "silu",
        "attention_bias": False,
        "clip_qkv": None,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    sizes={
        # OLMoE-1B-7B with 12 instead of 16 layers and 32 instead of 64 experts.
        "paper": {
            "vocab_size": 50_304,
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 32,
            "num_experts_per_tok": 8,
            "eos_token_id": 50_279,
        },
        "medium": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 768,
            "intermediate_size": 192,
            "num_hidden_layers": 8,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "num_experts": 32,
            "num_experts_per_tok": 8,
        },
        "small": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 192,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 6,
            "num_key_value_heads": 6,
            "num_experts": 16,
            "num_experts_per_tok": 4,
        },
        "tiny": {
            "vocab_size": _TINY_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
    },
)

GPT_OSS = Family(
    name="gpt_oss",
    title="gpt-oss-style sparse MoE (GQA with QKV biases and attention sinks, "
    "alternating sliding/full attention, clamped SwiGLU experts, router bias)",
    config_class="GptOssConfig",
    model_class="GptOssForCausalLM",
    moe=True,
    extra_fields=("rope_theta", "rope_scaling"),
    common={
        **_COMMON,
        **_MOE_COMMON,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    sizes={
        # gpt-oss-20b with 12 instead of 24 layers, d = d_ff = 2048 instead of
        # 2880 and 16 instead of 32 experts.  Sliding window 128 on every other
        # layer and YaRN RoPE (theta 150,000, factor 32) are the class defaults.
        "paper": {
            "vocab_size": 201_088,
            "hidden_size": 2048,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 16,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
        },
        "medium": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 768,
            "intermediate_size": 384,
            "num_hidden_layers": 8,
            "num_attention_heads": 24,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "num_local_experts": 16,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
        },
        "small": {
            "vocab_size": _GPT2_VOCAB,
            "hidden_size": 192,
            "intermediate_size": 192,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 48,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
        },
        "tiny": {
            "vocab_size": _TINY_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
        },
    },
)

FAMILY_SPECS: dict[str, Family] = {f.name: f for f in (QWEN3, GEMMA3, OLMOE, GPT_OSS)}
