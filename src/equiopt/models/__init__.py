"""The paper's model architectures, built from transformers' own classes.

>>> import equiopt as eo
>>> model = eo.models.build("qwen3", "tiny", seed=0)               # CPU, fp32
>>> model = eo.models.build("gpt_oss", "paper", device="meta")     # allocates nothing
>>> cfg = eo.models.config("gemma3", "small", final_logit_softcapping=30.0)
>>> model = eo.models.build("olmoe", "small", vocab_size=8192, num_hidden_layers=2)

Families (:data:`FAMILIES`) and the transformers classes they use:

* ``qwen3``: ``Qwen3ForCausalLM`` (GQA, QK-norm, SwiGLU, RoPE, no QKV bias);
* ``gemma3``: ``Gemma3ForCausalLM`` with ``Gemma3TextConfig`` (text only; MQA,
  QK-norm, GeGLU with tanh, sandwich norms, 5 sliding-window : 1 global layers,
  optional final-logit soft-capping ``final_logit_softcapping=30.0``);
* ``olmoe``: ``OlmoeForCausalLM`` (QK-norm, top-k softmax router without bias,
  fused SwiGLU experts);
* ``gpt_oss``: ``GptOssForCausalLM`` (GQA with QKV/output biases, attention
  sinks, alternating sliding/full attention, router with bias, clamped SwiGLU
  experts with biases).

Every model has untied input and output embeddings, and every matrix and fused
expert tensor starts from ``N(0, 0.02)`` (biases zero, norms as their class
sets them), see :func:`init_weights`.  Attention runs on torch SDPA except for
gpt-oss, whose sinks need the eager kernel (``attn_implementation=`` overrides).

Sizes (:data:`SIZES`; "sw" = sliding-window layers, "w" = window; trainable
parameters measured on the meta device, also in :data:`PARAM_COUNTS`):

=======  ======  ======  ====  ====  ==========  ========  ========  ===============  =======  ================
family   size    layers  d     d_ff  heads q/kv  head dim  experts   attention        vocab    trainable params
=======  ======  ======  ====  ====  ==========  ========  ========  ===============  =======  ================
qwen3    tiny    2       64    192   4/2         24        -         full             512      176,544
qwen3    small   6       192   576   6/3         32        -         full             50,304   21,973,824
qwen3    medium  12      768   2304  12/6        64        -         full             50,304   162,222,336
qwen3    paper   20      1024  3072  16/8        128       -         full             151,936  625,784,832
gemma3   tiny    2       64    384   4/1         32        -         1sw/1full w16    512      254,656
gemma3   small   6       192   1152  4/1         64        -         5sw/1full w128   50,304   24,040,896
gemma3   medium  12      768   4608  4/1         256       -         10sw/2full w512  50,304   228,305,664
gemma3   paper   18      1152  6912  4/1         256       -         15sw/3full w512  262,144  1,087,138,944
olmoe    tiny    2       64    48    4/4         16        8 top-2   full             512      247,360
olmoe    small   4       192   96    6/6         32        16 top-4  full             50,304   23,461,056
olmoe    medium  8       768   192   12/12       64        32 top-8  full             50,304   209,609,472
olmoe    paper   12      2048  1024  16/16       128       32 top-8  full             50,304   2,824,177,664
gpt_oss  tiny    2       64    96    8/1         16        8 top-2   1sw/1full w16    512      403,232
gpt_oss  small   4       192   192   8/1         48        8 top-2   2sw/2full w64    50,304   23,548,288
gpt_oss  medium  8       768   384   24/3        64        16 top-4  4sw/4full w128   50,304   212,076,608
gpt_oss  paper   12      2048  2048  64/8        64        16 top-4  6sw/6full w128   201,088  3,467,779,008
=======  ======  ======  ====  ====  ==========  ========  ========  ===============  =======  ================

``paper`` is the paper's Table "Modified model architectures" exactly (its
trainable parameter counts are reproduced; :mod:`equiopt.models.presets`
explains which config fields give them).  ``small`` and ``medium`` use GPT-2's
vocabulary padded to 50,304 so the r50k tokenizer fits; pass ``vocab_size=`` for
another tokenizer.  ``tiny`` is for tests (one CPU training step in milliseconds).

MoE families build with ``output_router_logits=False`` and
``router_aux_loss_coef=0.0``: router logits and the load-balancing ``aux_loss``
can be requested (``model(..., output_router_logits=True)``) without changing
the loss; set ``router_aux_loss_coef`` to train with the auxiliary loss.
"""

from .build import FAMILIES, SIZES, build, build_vocab_shaped, config, count_parameters, init_weights
from .presets import PAPER_PARAM_COUNTS, PARAM_COUNTS

__all__ = [
    "build_vocab_shaped",
    "FAMILIES",
    "SIZES",
    "PAPER_PARAM_COUNTS",
    "PARAM_COUNTS",
    "build",
    "config",
    "count_parameters",
    "init_weights",
]
