"""The names inference reads: module classes that mark attention and MLP blocks and
routers, the attribute names of input and output projections, biases, and tensors named
by their axes (torchtitan's ``w1_EFD``)."""

from __future__ import annotations

import re

_ATTN_CLASS = re.compile(r"attention|attn", re.I)
_MLP_CLASS = re.compile(r"mlp|feedforward|feed_forward|ffn|moe|expert", re.I)
_ROUTER_CLASS = re.compile(r"router|topk|gate$", re.I)
# attention sub-module names that mark the output projection / the input projections
_ATTN_OUT_NAMES = {"o_proj", "out_proj", "c_proj", "dense", "wo", "o", "proj", "output"}
_ATTN_IN_NAMES = {
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "c_attn",
    "query_key_value",
    "wqkv",
    "query",
    "key",
    "value",
    "q",
    "k",
    "v",
    "wq",
    "wk",
    "wv",
    "qkv",
    "in_proj",
}
_MLP_OUT_NAMES = {"down_proj", "w2", "fc2", "c_proj", "fc_out", "dense_4h_to_h", "wo", "out_proj", "down"}
_MLP_IN_NAMES = {
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "w1",
    "w3",
    "fc1",
    "c_fc",
    "fc_in",
    "dense_h_to_4h",
    "wi",
    "up",
    "gate",
    "w12",
}


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


# A tensor named by its axes (torchtitan's ``w1_EFD``, ``w2_EDF``, ``mlp1_weight_EGD``,
# ``mlp1_bias_EG``): one capital letter per dimension; E = experts, D = model width,
# F = FFN width, G = fused gate/up (2 F).
_AXES_SUFFIX = re.compile(r"_([A-Z]+)$")


def _axes(attr: str, ndim: int) -> str | None:
    """The axis letters a parameter's name ends with, when there is one per dimension."""
    m = _AXES_SUFFIX.search(attr)
    return m.group(1) if m is not None and len(m.group(1)) == ndim else None


def _is_bias(attr: str) -> bool:
    """``bias``, ``q_bias``, or an axis-named bias such as ``mlp1_bias_EG``."""
    return attr.endswith("bias") or bool(re.search(r"(^|_)bias_[A-Z]+$", attr))
