"""The paper's pre-training configurations, transcribed from its tables.

Source: "Experimental Details" appendix of the paper, optimizer hyperparameter
tables ``table:optim_hyperparams_qwen3``, ``table:optim_hyperparams_gemma3``,
``table:optim_hyperparams_olmoe`` and ``table:optim_hyperparams_gpt_oss``, and
the router ablations of the gpt-oss diagnostics
(``subsubsec:gpt_oss_router_diagnostics``).

Each table row is transcribed below as
``parameter type: (optimizer, gamma_0, momentum beta, weight decay lambda)``
exactly as printed; :func:`_settings` turns a row into a settings dict. The
table's parameter types map to roles as follows:

* ``scalar / vector`` -> ``vector``;
* ``linear / attention`` (dense models) -> ``attention`` and ``matrix``;
* ``SwiGLU MLP`` (dense models) -> ``mlp_in`` (gate, up) and ``mlp_out``
  (down; the optimizer acts on its transpose, so rows are intermediate neurons);
* ``matrix`` (MoE models: attention, and the expert SwiGLU tensors, on which
  the paper uses Muon-style updates) -> ``attention``, ``mlp_in``, ``mlp_out``
  and ``matrix``;
* ``embedding``, ``head`` and ``router`` -> ``embedding``, ``lm_head`` and
  ``router``.

Settings the tables leave implicit come from the appendix text and section 3:

* ``RowNormM``, ``LeftPolarGradM`` and ``HybridPolarGradM`` use
  eps = 1e-8 and eta(t) = 1/(t + eps) ("smoothed row normalization").
* ``LeftPolarGradM`` computes its inverse square root with Polar Express
  (5 steps), alpha = 1 as the tables state. ``HybridPolarGradM`` (alpha = 1)
  computed the polar factor of its one-sided step with Gram Newton-Schulz
  (5 steps) in the paper. The recipes use the damped Gram inverse square root
  (Polar Express, 5 steps), which computes ``Z (Z^T Z + eps I)^(-1/2)`` as
  Algorithm 2 writes it; ``overrides={"*": {"method": "gram_newton_schulz"}}``
  runs the paper's solver (undamped polar factor, ``nu`` = nuclear norm).
* ``HybridPolarGradM`` on embeddings, LM heads and SwiGLU projections is the
  row-norm/right-spectral composition (``row_then_right``); on routers it is
  the left-spectral/row-norm composition (``left_then_row``, the only router
  hybrid of Algorithm 2).
* LM-head and router updates with a matrix rule are centred/projected
  (``center=True``): Algorithm 2 and the quotient geometry of section 3.
* ``Muon`` uses Polar Express (5 steps). The paper does not state Muon's
  Nesterov flag or shape factor; its gamma_0 = 0.02 and beta = 0.95 are the
  original Muon defaults, which go with Nesterov momentum and the
  sqrt(max(1, rows/cols)) factor, so Muon here is ``nesterov=True``,
  ``lr_scale="spectral"`` (rows/cols of each head or expert block).
* The paper's own matrix rules use plain EMA momentum (``nesterov=False``) and
  have no shape factor.
* AdamW uses eps = 1e-8 (the PyTorch default; not stated in the paper).
* The inner-solver tolerance eps_NS = 1e-7 of the paper belongs to the solvers
  and has no settings field.
* The dense models (Qwen3, Gemma 3) have no router; their recipes still cover
  the ``router`` role, with the router row shared by the OLMoE and gpt-oss
  tables (centred RowNormM, gamma_0 = 0.00075, beta = 0.95, lambda = 0).
* Schedules: ``scalar / vector`` AdamW: 100 linear warmup steps then
  half-cosine to 0; every other parameter, whatever its optimizer: constant
  for 60 % of the steps then linear to 0.
"""

from __future__ import annotations

from typing import Any

from .recipe import Recipe

__all__ = ["paper_recipes", "PAPER_MODELS"]

_AW = (0.9, 0.95)  # the AdamW betas printed in every table

# ---------------------------------------------------------------------------
# table:optim_hyperparams_qwen3  (Qwen3-0.6B-style, 30,000 steps,
# table:config_qwen3). Final validation losses from section 4.1.
# ---------------------------------------------------------------------------
_QWEN3: dict[str, dict[str, Any]] = {
    "a-i": {  # (a)(i) AdamW + Muon + Muon + RowNormM
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("Muon", 0.02, 0.95, 0.001),
        "embedding": ("RowNormM", 0.50, 0.95, 0),
        "head": ("RowNormM", 0.005, 0.95, 0),
    },
    "a-ii": {  # (a)(ii) AdamW + Muon + Muon + HybridPolarGradM (row-norm/right-spectral; alpha=1)
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("Muon", 0.02, 0.95, 0.001),
        "embedding": ("HybridPolarGradM", 1.00, 0.95, 0),
        "head": ("HybridPolarGradM", 0.01, 0.95, 0),
    },
    "a-iii": {  # (a)(iii) AdamW + Muon + Muon + AdamW
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("Muon", 0.02, 0.95, 0.001),
        "embedding": ("AdamW", 0.10, _AW, 0),
        "head": ("AdamW", 0.001, _AW, 0),
    },
    "b-i": {  # (b)(i) AdamW + Muon + HybridPolarGradM (row-norm/right-spectral; alpha=1) + RowNormM
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("HybridPolarGradM", 0.02, 0.95, 0.001),
        "embedding": ("RowNormM", 0.50, 0.95, 0),
        "head": ("RowNormM", 0.005, 0.95, 0),
    },
    "b-ii": {  # (b)(ii) AdamW + Muon + HybridPolarGradM + HybridPolarGradM (alpha=1)
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("HybridPolarGradM", 0.02, 0.95, 0.001),
        "embedding": ("HybridPolarGradM", 1.00, 0.95, 0),
        "head": ("HybridPolarGradM", 0.01, 0.95, 0),
    },
    "b-iii": {  # (b)(iii) AdamW + Muon + HybridPolarGradM (alpha=1) + AdamW
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("HybridPolarGradM", 0.02, 0.95, 0.001),
        "embedding": ("AdamW", 0.10, _AW, 0),
        "head": ("AdamW", 0.001, _AW, 0),
    },
}
_QWEN3_LOSS = {"a-i": 4.2017, "a-ii": 4.2050, "a-iii": 4.2084, "b-i": 4.1950, "b-ii": 4.1955, "b-iii": 4.2046}

# ---------------------------------------------------------------------------
# table:optim_hyperparams_gemma3  (Gemma 3 1B-style, 50,000 steps,
# table:config_gemma3). The embedding/head rates are the best of the sweep in
# table:gemma3_lr_sweep. Final validation losses from section 4.2.
# ---------------------------------------------------------------------------
_GEMMA3: dict[str, dict[str, Any]] = {
    "a-i": {  # (a)(i) AdamW + Muon + Muon + RowNormM
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("Muon", 0.02, 0.95, 0.001),
        "embedding": ("RowNormM", 0.0025, 0.95, 0),
        "head": ("RowNormM", 0.0025, 0.95, 0),
    },
    "a-ii": {  # (a)(ii) AdamW + Muon + Muon + HybridPolarGradM (row-norm/right-spectral; alpha=1)
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("Muon", 0.02, 0.95, 0.001),
        "embedding": ("HybridPolarGradM", 0.0025, 0.95, 0),
        "head": ("HybridPolarGradM", 0.0025, 0.95, 0),
    },
    "a-iii": {  # (a)(iii) AdamW + Muon + Muon + AdamW
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("Muon", 0.02, 0.95, 0.001),
        "embedding": ("AdamW", 0.0005, _AW, 0),
        "head": ("AdamW", 0.0005, _AW, 0),
    },
    "b-i": {  # (b)(i) AdamW + Muon + HybridPolarGradM (alpha=1) + RowNormM
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("HybridPolarGradM", 0.02, 0.95, 0.001),
        "embedding": ("RowNormM", 0.0025, 0.95, 0),
        "head": ("RowNormM", 0.0025, 0.95, 0),
    },
    "b-ii": {  # (b)(ii) AdamW + Muon + HybridPolarGradM + HybridPolarGradM (alpha=1)
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("HybridPolarGradM", 0.02, 0.95, 0.001),
        "embedding": ("HybridPolarGradM", 0.001, 0.95, 0),
        "head": ("HybridPolarGradM", 0.001, 0.95, 0),
    },
    "b-iii": {  # (b)(iii) AdamW + Muon + HybridPolarGradM (alpha=1) + AdamW
        "scalar / vector": ("AdamW", 0.05, _AW, 0.001),
        "linear / attention": ("Muon", 0.02, 0.95, 0.001),
        "SwiGLU MLP": ("HybridPolarGradM", 0.02, 0.95, 0.001),
        "embedding": ("AdamW", 0.0005, _AW, 0),
        "head": ("AdamW", 0.0005, _AW, 0),
    },
}
_GEMMA3_LOSS = {"a-i": 4.0702, "a-ii": 4.0655, "a-iii": 4.1046, "b-i": 4.0516, "b-ii": 4.0435, "b-iii": 4.0862}

# ---------------------------------------------------------------------------
# table:optim_hyperparams_olmoe  (OLMoE-1B-7B-style, 30,000 steps,
# table:config_olmoe). Final validation losses from section 4.3.
# In (iii) the router's AdamW momentum is printed as "0.95" (a single number,
# where every other AdamW row prints (0.9, 0.95)); it is read as (0.9, 0.95).
# ---------------------------------------------------------------------------
_OLMOE: dict[str, dict[str, Any]] = {
    "i": {  # (i) AdamW + Muon + RowNormM
        "scalar / vector": ("AdamW", 0.01, _AW, 0.001),
        "matrix": ("Muon", 0.005, 0.95, 0.001),
        "embedding": ("RowNormM", 0.5, 0.95, 0),
        "head": ("RowNormM", 0.005, 0.95, 0),
        "router": ("RowNormM", 0.00075, 0.95, 0),
    },
    "ii": {  # (ii) AdamW + Muon + RowNormM + LeftPolarGradM (alpha=1)
        "scalar / vector": ("AdamW", 0.01, _AW, 0.001),
        "matrix": ("Muon", 0.005, 0.95, 0.001),
        "embedding": ("RowNormM", 0.5, 0.95, 0),
        "head": ("RowNormM", 0.005, 0.95, 0),
        "router": ("LeftPolarGradM", 0.00075, 0.95, 0),
    },
    "iii": {  # (iii) AdamW + Muon + RowNormM + AdamW
        "scalar / vector": ("AdamW", 0.01, _AW, 0.001),
        "matrix": ("Muon", 0.005, 0.95, 0.001),
        "embedding": ("RowNormM", 0.5, 0.95, 0),
        "head": ("RowNormM", 0.005, 0.95, 0),
        "router": ("AdamW", 0.00075, _AW, 0),  # printed momentum: 0.95
    },
    "iv": {  # (iv) AdamW + Muon + AdamW
        "scalar / vector": ("AdamW", 0.01, _AW, 0.001),
        "matrix": ("Muon", 0.005, 0.95, 0.001),
        "embedding": ("AdamW", 0.0005, _AW, 0),
        "head": ("AdamW", 0.0005, _AW, 0),
        "router": ("AdamW", 0.00075, _AW, 0),
    },
}
_OLMOE_LOSS = {"i": 4.0955, "ii": 4.0815, "iii": 4.1187, "iv": 4.1240}

# ---------------------------------------------------------------------------
# table:optim_hyperparams_gpt_oss  (downsized gpt-oss, 60,000 steps,
# table:config_gpt_oss). Final validation losses from section 4.4.
# Same reading of the (iii) router momentum as for OLMoE.
# ---------------------------------------------------------------------------
_GPT_OSS: dict[str, dict[str, Any]] = {
    "i": {  # (i) AdamW + Muon + RowNormM
        "scalar / vector": ("AdamW", 0.005, _AW, 0.001),
        "matrix": ("Muon", 0.001, 0.95, 0.001),
        "embedding": ("RowNormM", 0.1, 0.95, 0),
        "head": ("RowNormM", 0.001, 0.95, 0),
        "router": ("RowNormM", 0.00075, 0.95, 0),
    },
    "ii": {  # (ii) AdamW + Muon + RowNormM + LeftPolarGradM (alpha=1)
        "scalar / vector": ("AdamW", 0.005, _AW, 0.001),
        "matrix": ("Muon", 0.001, 0.95, 0.001),
        "embedding": ("RowNormM", 0.1, 0.95, 0),
        "head": ("RowNormM", 0.001, 0.95, 0),
        "router": ("LeftPolarGradM", 0.00075, 0.95, 0),
    },
    "iii": {  # (iii) AdamW + Muon + RowNormM + AdamW
        "scalar / vector": ("AdamW", 0.005, _AW, 0.001),
        "matrix": ("Muon", 0.001, 0.95, 0.001),
        "embedding": ("RowNormM", 0.1, 0.95, 0),
        "head": ("RowNormM", 0.001, 0.95, 0),
        "router": ("AdamW", 0.00075, _AW, 0),  # printed momentum: 0.95
    },
    "iv": {  # (iv) AdamW + Muon + AdamW
        "scalar / vector": ("AdamW", 0.005, _AW, 0.001),
        "matrix": ("Muon", 0.001, 0.95, 0.001),
        "embedding": ("AdamW", 0.0005, _AW, 0),
        "head": ("AdamW", 0.0005, _AW, 0),
        "router": ("AdamW", 0.00075, _AW, 0),
    },
}
_GPT_OSS_LOSS = {"i": 4.3080, "ii": 4.3136, "iii": 4.3388, "iv": 4.3687}

# ---------------------------------------------------------------------------
# Router ablations of the gpt-oss diagnostics (subsubsec:gpt_oss_router_
# diagnostics): every non-router assignment fixed as in
# table:optim_hyperparams_gpt_oss (AdamW for scalars/vectors, Muon for
# linear/attention/SwiGLU MLP, RowNormM for embedding and LM head), and "the
# hyperparameters of uncentered LeftPolarGradM and HybridPolarGradM are set to
# be the same as those of RowNormM and LeftPolarGradM": gamma_0 = 0.00075,
# beta = 0.95, lambda = 0, alpha = 1. The diagnostics were run both without
# and with auxiliary router losses (load balancing 0.01, z-loss 0.001); those
# are training-objective settings, not optimizer settings.
# ---------------------------------------------------------------------------
_ROUTER_ABLATIONS: dict[str, tuple[str, tuple]] = {
    "router-row": ("centred RowNormM", ("RowNormM", 0.00075, 0.95, 0)),
    "router-left-centered": ("centred LeftPolarGradM", ("LeftPolarGradM", 0.00075, 0.95, 0)),
    "router-left-uncentered": (
        "uncentred LeftPolarGradM (ablates the centring)",
        ("LeftPolarGradM-uncentered", 0.00075, 0.95, 0),
    ),
    "router-hybrid": (
        "centred HybridPolarGradM (left-spectral/row-norm)",
        ("HybridPolarGradM", 0.00075, 0.95, 0),
    ),
    "router-adamw": ("AdamW", ("AdamW", 0.00075, _AW, 0)),
}

# Dense models have no router. Their recipes still cover the role, with the
# router row shared by the OLMoE and gpt-oss tables (centred RowNormM,
# gamma_0 = 0.00075, beta = 0.95, lambda = 0).
_DENSE_ROUTER = ("RowNormM", 0.00075, 0.95, 0)

_TYPE_TO_ROLES = {
    "scalar / vector": ("vector",),
    "linear / attention": ("attention", "matrix"),
    "SwiGLU MLP": ("mlp_in", "mlp_out"),
    "matrix": ("attention", "mlp_in", "mlp_out", "matrix"),
    "embedding": ("embedding",),
    "head": ("lm_head",),
    "router": ("router",),
}

_CENTRED_ROLES = ("lm_head", "router")


def _settings(row: tuple, role: str) -> dict[str, Any]:
    """Settings dict of one table row ``(optimizer, gamma_0, momentum, weight decay)`` for ``role``."""
    optimizer, lr, momentum, wd = row
    base: dict[str, Any] = {"lr": float(lr), "weight_decay": float(wd)}
    if optimizer == "AdamW":
        return {"rule": "adamw", **base, "betas": tuple(momentum), "adam_eps": 1e-8}
    common = {**base, "beta": float(momentum), "nesterov": False}
    if optimizer == "Muon":
        return {
            "rule": "spectral",
            **common,
            "nesterov": True,
            "lr_scale": "spectral",
            "method": "polar_express",
            "steps": 5,
        }
    centred = role in _CENTRED_ROLES
    if optimizer == "RowNormM":
        return {"rule": "row", **common, "center": centred, "eps": 1e-8, "eta": "inverse"}
    if optimizer in ("LeftPolarGradM", "LeftPolarGradM-uncentered"):
        return {
            "rule": "left",
            **common,
            "center": optimizer == "LeftPolarGradM",
            "alpha": 1.0,
            "eps": 1e-8,
            "method": "polar_express",
            "steps": 5,
        }
    if optimizer == "HybridPolarGradM":
        return {
            "rule": "hybrid",
            **common,
            "center": centred,
            "order": "left_then_row" if role == "router" else "row_then_right",
            "alpha": 1.0,
            "eps": 1e-8,
            "eta": "inverse",
            "method": "polar_express",
            "steps": 5,
        }
    raise AssertionError(f"untranscribed optimizer {optimizer!r}")


def _roles(table_rows: dict[str, tuple]) -> dict[str, dict[str, Any]]:
    roles: dict[str, dict[str, Any]] = {}
    for ptype, row in table_rows.items():
        for role in _TYPE_TO_ROLES[ptype]:
            roles[role] = _settings(row, role)
    if "router" not in roles:
        roles["router"] = _settings(_DENSE_ROUTER, "router")
    return roles


def _label(config: str) -> str:
    """``"a-ii"`` -> ``"(a)(ii)"``, ``"iv"`` -> ``"(iv)"``, as the tables print them."""
    return "".join(f"({part})" for part in config.split("-"))


def _describe(rows: dict[str, tuple]) -> str:
    parts = []
    for ptype, row in rows.items():
        opt = row[0].replace("-uncentered", " (uncentred)")
        parts.append(f"{ptype}: {opt}")
    return "; ".join(parts)


_MODELS = {
    # model key: (title, hyperparameter table, training-config table,
    #             training steps (from the training-config table), rows, final validation losses)
    "qwen3": ("Qwen3-0.6B-style", "table:optim_hyperparams_qwen3", "table:config_qwen3", 30_000, _QWEN3, _QWEN3_LOSS),
    "gemma3": (
        "Gemma 3 1B-style",
        "table:optim_hyperparams_gemma3",
        "table:config_gemma3",
        50_000,
        _GEMMA3,
        _GEMMA3_LOSS,
    ),
    "olmoe": ("OLMoE-1B-7B-style", "table:optim_hyperparams_olmoe", "table:config_olmoe", 30_000, _OLMOE, _OLMOE_LOSS),
    "gpt_oss": (
        "downsized gpt-oss",
        "table:optim_hyperparams_gpt_oss",
        "table:config_gpt_oss",
        60_000,
        _GPT_OSS,
        _GPT_OSS_LOSS,
    ),
}

#: Model keys and their configuration names, in the paper's order.
PAPER_MODELS: dict[str, tuple[str, ...]] = {key: tuple(spec[4]) for key, spec in _MODELS.items()}


def paper_recipes() -> list[Recipe]:
    """Every configuration of the paper's tables, plus the gpt-oss router ablations."""
    out: list[Recipe] = []
    for key, (title, table, config_table, steps, configs, losses) in _MODELS.items():
        for config, rows in configs.items():
            dense_note = (
                " Dense model, no router in the table: router role filled with the MoE tables' centred RowNormM row."
                if "router" not in rows
                else ""
            )
            out.append(
                Recipe(
                    name=f"paper:{key}:{config}",
                    description=f"{title} {_label(config)}: {_describe(rows)}.{dense_note}",
                    roles=_roles(rows),
                    meta={
                        "table": table,
                        "config_table": config_table,
                        "train_steps": steps,
                        "final_val_loss": losses[config],
                    },
                )
            )
    gpt_base = _GPT_OSS["i"]
    for config, (label, router_row) in _ROUTER_ABLATIONS.items():
        rows = {**gpt_base, "router": router_row}
        out.append(
            Recipe(
                name=f"paper:gpt_oss:{config}",
                description=(
                    f"downsized gpt-oss router ablation, router: {label}; all other "
                    f"roles as gpt-oss (i). {_describe(rows)}."
                ),
                roles=_roles(rows),
                meta={
                    "table": "table:optim_hyperparams_gpt_oss",
                    "section": "subsubsec:gpt_oss_router_diagnostics",
                    "config_table": "table:config_gpt_oss",
                    "train_steps": 60_000,
                },
            )
        )
    return out
