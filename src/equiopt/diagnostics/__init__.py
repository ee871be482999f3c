"""Diagnostics: equivariance checks for update maps."""

from .equivariance import GROUPS, check_equivariance, random_orthogonal, random_permutation

__all__ = ["check_equivariance", "random_orthogonal", "random_permutation", "GROUPS"]
