"""Model level: the role and layout of every parameter, and the paper's optimizer stack on it.

Modules: ``table`` (role rows and tables), ``infer`` (:func:`assign_roles`; its conventions
one module each in ``inference``), ``verify`` (:func:`verify_roles`; its checks one module
each in ``checks``), ``build`` (:func:`build_optimizer`, :func:`print_roles`).
"""

from .build import build_optimizer, print_roles
from .infer import ModelDims, RoleInferenceError, assign_roles, model_dims
from .table import ROLES, RoleRow, RoleTable
from .verify import RoleCheck, RoleReport, verify_roles

__all__ = [
    "assign_roles",
    "print_roles",
    "build_optimizer",
    "verify_roles",
    "RoleReport",
    "RoleCheck",
    "RoleRow",
    "RoleTable",
    "ROLES",
    "RoleInferenceError",
    "ModelDims",
    "model_dims",
]
