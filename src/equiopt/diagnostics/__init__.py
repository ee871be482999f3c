"""Diagnostics: equivariance of update maps, final logits, MoE routers, per-role weights."""

from .equivariance import GROUPS, check_equivariance, random_orthogonal, random_permutation
from .logits import LOGIT_METRIC_KEYS, logit_metrics, sample_positions, softcap
from .replicas import check_replicas
from .router import (
    ROUTER_METRIC_KEYS,
    RouterLogitsRecorder,
    collect_router_logits,
    expert_load,
    load_balancing_loss,
    router_metrics,
    z_loss,
)
from .weights import WEIGHT_STAT_KEYS, WeightTracker

__all__ = [
    "check_equivariance",
    "check_replicas",
    "random_orthogonal",
    "random_permutation",
    "GROUPS",
    "logit_metrics",
    "softcap",
    "sample_positions",
    "LOGIT_METRIC_KEYS",
    "router_metrics",
    "expert_load",
    "load_balancing_loss",
    "z_loss",
    "collect_router_logits",
    "RouterLogitsRecorder",
    "ROUTER_METRIC_KEYS",
    "WeightTracker",
    "WEIGHT_STAT_KEYS",
]
