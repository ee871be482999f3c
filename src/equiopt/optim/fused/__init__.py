"""A bucket's element-wise stages as fused operators (:mod:`.ops`): the gradients' finite
flags, the momentum stage (sanitising, the momentum EMA, Nesterov's direction written where
the map reads it), and the decay with the update add. Each is one ``torch.library`` custom
operator in the ``equiopt`` namespace that reads and writes each of its tensors once: the
eager stages on the CPU (bitwise today's), Triton kernels (:mod:`.kernels`) on CUDA, and a
fake implementation for the meta device, the roofline and ``torch.compile``."""

from .ops import decay_add_, grad_flags, momentum_stage

__all__ = ["decay_add_", "grad_flags", "momentum_stage"]
