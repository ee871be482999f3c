"""The errors the optimizer raises beside torch's own."""

from __future__ import annotations

__all__ = ["NonFiniteGradientError", "UnsupportedTensorError"]


class NonFiniteGradientError(FloatingPointError, ValueError):
    """Raised for a NaN/Inf gradient when a group's ``nonfinite="raise"``."""


class UnsupportedTensorError(ValueError, RuntimeError):
    """A parameter or gradient a rule cannot step: a complex parameter of a matrix rule, a
    sparse gradient. A :class:`RuntimeError`, as torch's own optimizers raise for these,
    and a :class:`ValueError`, as every other check of a parameter here."""
