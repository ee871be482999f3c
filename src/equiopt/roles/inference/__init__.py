"""The parts of role inference; the entry point is :func:`equiopt.roles.infer.assign_roles`.

Modules, by what each holds:

- ``errors``: :class:`RoleInferenceError` and the ``rules=`` fix proposed for a tensor of
  more than two axes.
- ``names``: the class and attribute names that mark attention and MLP blocks, routers,
  input and output projections, biases and axis-named tensors (``w1_EFD``).
- ``dims``: :class:`ModelDims` and where each dimension comes from (a config, a block's
  attributes, ``dims=``); :func:`model_dims`.
- ``embeddings``: the input embedding, the output embedding (LM head), and whether they
  are tied.
- ``storage``: how a module stores its weight (``nn.Linear``, ``Conv1D``, convolutions).
- ``rules``: the explicit ``rules=`` overrides.
- ``model_check``: errors for something that is not a model, or a wrapper that hides it.
- ``context``: what is in force around a parameter (its block, dimensions, model type).
- ``attention``: per-head layouts of attention projections (fused q/k/v, MLA).
- ``mlp``: MLP input and output projections.
- ``gate_up``: probing the pairing of a fused gate/up projection.
- ``experts``: MoE routers and expert tensors.
"""
