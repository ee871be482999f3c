"""The device whose choices a step takes: one switch for the meta device.

A few choices of the step depend on the device its tensors are on: the polar iterations'
precision (:func:`equiopt.linalg.polar.default_dtype`), whether bfloat16 products are
emulated in float32 (:func:`equiopt.linalg.polar.emulates_bfloat16`), what
``gram_dtype="auto"`` resolves to and whether a bfloat16 product returns float32 in one
operator (:func:`equiopt.maps.gram_precision`, :func:`equiopt.maps.low_product`,
:func:`equiopt.linalg.products.wide_product`), the row blocks of an unformed stage
(:func:`equiopt.maps.row_blocks`), and how a CPU reads a large gradient's finite flags
(:func:`equiopt.optim.apply.finite_flags`). Each asks :func:`decides_like` instead of reading
``tensor.device.type``.

A tensor decides as its own device, except on the meta device (shapes, no data), which
inside :func:`decide_as` takes the choices of the device named there: counting a step on
the meta device inside ``decide_as("cuda")`` counts the operators a CUDA step dispatches
(``python -m equiopt.bench --roofline``). Outside it the meta device is its own type, which
no choice names (bfloat16 iterations, float32 Grams, whole-matrix stages). Whether the
optimizer compiles its buckets and which kernel a torch peer optimizer takes are not
routed here: the meta device steps eagerly, as torch's fused optimizers refuse it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["decide_as", "decides_like"]

_META_DECIDES_AS = "meta"


def decides_like(x: torch.Tensor | torch.device) -> str:
    """The device type whose choices apply to ``x`` (a tensor or a device): its own type,
    or on the meta device the type set by the innermost :func:`decide_as` around the call."""
    kind = (x.device if isinstance(x, torch.Tensor) else x).type
    return _META_DECIDES_AS if kind == "meta" else kind


@contextlib.contextmanager
def decide_as(device_type: str) -> Iterator[None]:
    """Inside it, tensors on the meta device take the choices of ``device_type``
    (``"cuda"``, ``"cpu"``, or ``"meta"`` for none); the previous setting returns on exit."""
    global _META_DECIDES_AS
    previous, _META_DECIDES_AS = _META_DECIDES_AS, torch.device(device_type).type
    try:
        yield
    finally:
        _META_DECIDES_AS = previous
