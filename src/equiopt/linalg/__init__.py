"""Numerical oracles on batched matrices ``(..., m, n)``: polar factor and inverse square root."""

from .coefficients import greedy_schedule, minimax_quintic
from .inv_sqrt import INV_SQRT_METHODS, inv_sqrt
from .polar import POLAR_METHODS, bfloat16_products, chunks, default_dtype, empty_factor, emulates_bfloat16, polar

__all__ = [
    "inv_sqrt",
    "polar",
    "empty_factor",
    "chunks",
    "default_dtype",
    "emulates_bfloat16",
    "bfloat16_products",
    "greedy_schedule",
    "minimax_quintic",
    "INV_SQRT_METHODS",
    "POLAR_METHODS",
]
