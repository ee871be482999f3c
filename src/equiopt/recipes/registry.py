"""Named recipes: the generic ones, the paper's, and any the user registers."""

from __future__ import annotations

import difflib
import os

from ..optim.fields import RULE_FIELDS
from .recipe import Recipe
from .tomlio import parse_recipe_toml, read_recipe_text

__all__ = [
    "get_recipe",
    "list_recipes",
    "register_recipe",
    "default_recipe",
    "muon_recipe",
    "normuon_recipe",
    "adamw_recipe",
    "peer_adamw_recipe",
    "peer_muon_recipe",
    "DEFAULT_RECIPE",
    "load_recipe_toml",
    "loads_recipe_toml",
]


# Muon on hidden matrices, as in muon_recipe and equiopt:default
_MUON = {
    "rule": "spectral",
    "lr": 0.02,
    "beta": 0.95,
    "nesterov": True,
    "lr_scale": "spectral",
    "method": "polar_express",
    "steps": 5,
    "weight_decay": 0.0,
}


def muon_recipe() -> Recipe:
    """``muon``: Muon on every hidden matrix, AdamW elsewhere.

    Muon (``spectral``; Polar Express, 5 steps; Nesterov; beta 0.95; lr 0.02
    with the sqrt(max(1, rows/cols)) factor; no weight decay: the original Muon
    defaults) on ``attention``, ``mlp_in``, ``mlp_out`` and ``matrix``.
    AdamW (lr 3e-4, betas (0.9, 0.95), eps 1e-8, no weight decay) on
    ``embedding``, ``lm_head``, ``router`` and ``vector``. Schedules as in
    the paper: warmup-cosine (100 warmup steps) on ``vector``, stable-decay
    (60 %) elsewhere. Starting points, not tuned values.

    Returns:
        A new :class:`Recipe` named ``muon``.
    """
    adamw = {"rule": "adamw", "lr": 3e-4, "betas": (0.9, 0.95), "adam_eps": 1e-8, "weight_decay": 0.0}
    roles = {role: dict(_MUON) for role in ("attention", "mlp_in", "mlp_out", "matrix")}
    roles.update({role: dict(adamw) for role in ("embedding", "lm_head", "router", "vector")})
    return Recipe(
        name="muon",
        description="Muon (Polar Express, Nesterov, lr 0.02) on hidden matrices; AdamW (lr 3e-4) "
        "on embedding, LM head, router and vectors",
        roles=roles,
    )


DEFAULT_RECIPE = "equiopt:default"


def default_recipe() -> Recipe:
    """``equiopt:default``: the default of :func:`equiopt.build_optimizer`, safe at any model size.

    Every rule bounds the size of each step independently of the gradient's scale and of
    the model's width, so no role can run away whatever the size:

    - ``attention``, ``mlp_in``, ``mlp_out``, ``matrix``: Muon (``spectral``; Polar
      Express, Nesterov, beta 0.95, lr 0.02 with the ``sqrt(max(1, rows/cols))`` factor, no
      weight decay: Muon's own conventions). Every singular value of the update is 1.
    - ``embedding``: RowNormM with rows of unit RMS (``row``, ``eta = "rms"``, lr 3e-3):
      every token row that moves, moves by exactly lr per entry, as AdamW's lr at its
      largest, so the embedding changes relative to its initial scale at the same rate at
      any width.
    - ``lm_head``: centred RowNormM (lr 5e-3, the paper's head rate) and ``router``:
      centred RowNormM (lr 7.5e-4, the paper's router rate): each row of the update has
      norm lr and the shared-shift direction, to which softmax is blind, is removed.
    - ``vector``: AdamW (lr 1e-3, betas (0.9, 0.95), no weight decay).

    Schedules as in the paper: warmup-cosine (100 warmup steps) on ``vector``,
    stable-decay (60 %) elsewhere. The paper's tuned configurations stay available by
    name (:func:`list_recipes`); this one is a robust starting point, not a tuned value.

    Returns:
        A new :class:`Recipe` named ``equiopt:default``.
    """
    roles = {role: dict(_MUON) for role in ("attention", "mlp_in", "mlp_out", "matrix")}
    roles["embedding"] = {"rule": "row", "lr": 3e-3, "eta": "rms", "beta": 0.95, "weight_decay": 0.0}
    roles["lm_head"] = {"rule": "row", "lr": 5e-3, "center": True, "beta": 0.95, "weight_decay": 0.0}
    roles["router"] = {"rule": "row", "lr": 7.5e-4, "center": True, "beta": 0.95, "weight_decay": 0.0}
    roles["vector"] = {"rule": "adamw", "lr": 1e-3, "betas": (0.9, 0.95), "adam_eps": 1e-8, "weight_decay": 0.0}
    return Recipe(
        name=DEFAULT_RECIPE,
        description="safe at any size: Muon on hidden matrices, unit-RMS RowNormM on the embedding, centred "
        "RowNormM on LM head and router, AdamW on vectors",
        roles=roles,
    )


def normuon_recipe() -> Recipe:
    """``normuon``: NorMuon on hidden matrices, the choices of ``equiopt:default`` elsewhere.

    ``attention``, ``mlp_in``, ``mlp_out``, ``matrix``: NorMuon (``normuon``: Muon's polar
    factor, Polar Express, 5 steps, Nesterov, beta 0.95, then each row divided by the
    square root of its mean-square EMA, beta2 0.95, rescaled to the polar factor's
    Frobenius norm; lr 0.02 with the ``sqrt(max(1, rows/cols))`` factor; no weight decay).
    ``embedding``, ``lm_head``, ``router`` and ``vector`` as in :func:`default_recipe`
    (unit-RMS RowNormM, centred RowNormM, AdamW), with its schedules. Starting points, not
    tuned values.

    Returns:
        A new :class:`Recipe` named ``normuon``.
    """
    base = default_recipe()
    roles = {role: dict(base.roles[role]) for role in base.roles}
    for role in ("attention", "mlp_in", "mlp_out", "matrix"):
        roles[role] = {**_MUON, "rule": "normuon", "beta2": 0.95}
    return Recipe(
        name="normuon",
        description="NorMuon (polar factor, rows normalised by their second-moment EMA, lr 0.02) on hidden "
        "matrices; equiopt:default's rules elsewhere",
        roles=roles,
    )


def adamw_recipe() -> Recipe:
    """``adamw``: AdamW on every role.

    lr 3e-4, betas (0.9, 0.95), eps 1e-8; weight decay 0.1 on every matrix role
    and 0 on ``vector``; warmup-cosine (100 warmup steps) on every role.
    Starting points, not tuned values.

    Returns:
        A new :class:`Recipe` named ``adamw``.
    """
    sched = {"kind": "warmup_cosine", "warmup_steps": 100}
    roles = {
        role: {
            "rule": "adamw",
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "adam_eps": 1e-8,
            "weight_decay": 0.0 if role == "vector" else 0.1,
            "schedule": dict(sched),
        }
        for role in ("embedding", "lm_head", "attention", "mlp_in", "mlp_out", "router", "matrix", "vector")
    }
    return Recipe(
        name="adamw",
        description="AdamW everywhere (lr 3e-4, betas (0.9, 0.95), wd 0.1 on matrices), warmup-cosine",
        roles=roles,
    )


def _as_peer(settings: dict) -> dict:
    """Settings of equiopt's AdamW / Muon for torch's classes (the rule's fields only)."""
    rule = {"adamw": "torch_adamw", "spectral": "torch_muon"}[settings["rule"]]
    keep = RULE_FIELDS[rule] + ("schedule",)
    return {**{k: v for k, v in settings.items() if k in keep}, "rule": rule}


def peer_adamw_recipe() -> Recipe:
    """``peer:adamw``: torch's own ``torch.optim.AdamW`` (fused on CUDA, foreach otherwise)
    on every role, with the settings of :func:`adamw_recipe`: an outside reference arm.

    Returns:
        A new :class:`Recipe` named ``peer:adamw``.
    """
    base = adamw_recipe()
    return Recipe(
        name="peer:adamw",
        description="torch.optim.AdamW everywhere, with the adamw recipe's settings (lr 3e-4, betas (0.9, 0.95), "
        "wd 0.1 on matrices), warmup-cosine",
        roles={role: _as_peer(base.settings(role)) for role in base.roles},
    )


def peer_muon_recipe() -> Recipe:
    """``peer:muon``: torch's own ``torch.optim.Muon`` (torch >= 2.9) on every hidden 2-D
    matrix as torch documents it, ``torch.optim.AdamW`` elsewhere, with the settings of
    :func:`muon_recipe` (lr 0.02 with ``sqrt(max(1, rows/cols))``, momentum 0.95, Nesterov,
    5 Newton-Schulz steps): the reference against which equiopt's Muon is compared.
    Stacked expert weights are refused (torch's Muon steps 2-D matrices only).

    Returns:
        A new :class:`Recipe` named ``peer:muon``.
    """
    base = muon_recipe()
    return Recipe(
        name="peer:muon",
        description="torch.optim.Muon on hidden matrices, torch.optim.AdamW elsewhere, with the muon recipe's settings",
        roles={role: _as_peer(base.settings(role)) for role in base.roles},
    )


_REGISTRY: dict[str, Recipe] | None = None


def _registry() -> dict[str, Recipe]:
    global _REGISTRY
    if _REGISTRY is None:
        from .paper import paper_recipes

        reg = {
            r.name: r
            for r in (
                default_recipe(),
                muon_recipe(),
                adamw_recipe(),
                peer_adamw_recipe(),
                peer_muon_recipe(),
                normuon_recipe(),
            )
        }
        for recipe in paper_recipes():
            reg[recipe.name] = recipe
        _REGISTRY = reg
    return _REGISTRY


def list_recipes() -> list[str]:
    """Names of all registered recipes: ``equiopt:default``, ``muon``, ``adamw``, ``peer:adamw``, ``peer:muon``,
    ``normuon``, then the paper's, then the user's.

    Returns:
        The names, in registration order; each is accepted by :func:`get_recipe`.
    """
    return list(_registry())


def _canonical(name: str) -> str:
    name = name.strip().lower()
    parts = name.split(":")
    if len(parts) >= 2:
        parts[1] = parts[1].replace("-", "_").replace("gptoss", "gpt_oss")
    return ":".join(parts)


def get_recipe(name: str | os.PathLike[str] | Recipe) -> Recipe:
    """The recipe called ``name``.

    ``name`` may also be a :class:`Recipe` (returned as is) or the path of a
    ``.toml`` recipe file (see :func:`load_recipe_toml`). Model names are
    matched case-insensitively, with ``gpt-oss`` accepted for ``gpt_oss``.
    Unknown names raise :class:`ValueError` with close matches.

    Args:
        name: a registered name (e.g. ``"paper:qwen3:b-ii"``), a path to a ``.toml``
            recipe, or a :class:`Recipe`.

    Returns:
        The recipe.

    Raises:
        ValueError: for an unknown name (the message lists close matches and every valid
            name) or a recipe file with errors.
    """
    if isinstance(name, Recipe):
        return name
    if isinstance(name, os.PathLike) or (isinstance(name, str) and name.endswith(".toml")):
        return load_recipe_toml(name)
    if not isinstance(name, str):
        raise ValueError(f"recipe name must be a string, got {name!r}")
    reg = _registry()
    if name in reg:
        return reg[name]
    canonical = _canonical(name)
    for key, recipe in reg.items():
        if _canonical(key) == canonical:
            return recipe
    close = difflib.get_close_matches(canonical, list(reg), n=5, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(f"unknown recipe {name!r}; {hint}valid recipes: {', '.join(reg)}")


def loads_recipe_toml(text: str, *, source: str = "<string>", default_name: str | None = None) -> Recipe:
    """Parse a recipe from TOML text, resolving its ``base``; errors name ``source``.

    Args:
        text: the TOML text (format: :mod:`equiopt.recipes.tomlio`).
        source: the name errors give for the text (a file name).
        default_name: the recipe's name when the text sets none.

    Returns:
        The recipe: a whole one, or its ``base`` recipe with the text's overrides.

    Raises:
        ValueError: naming ``source``, the role and the field at fault.
    """
    parsed = parse_recipe_toml(text, source=source, default_name=default_name)
    if parsed.recipe is not None:
        return parsed.recipe
    try:
        base = get_recipe(parsed.base)
        return base.with_overrides(
            parsed.roles,
            name=parsed.name,
            description=parsed.description if parsed.description is not None else f"{base.name} with overrides",
        )
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def load_recipe_toml(path: str | os.PathLike[str]) -> Recipe:
    """Read a recipe file (format: :mod:`equiopt.recipes.tomlio`). Errors name the file, and the role and field at fault.

    Args:
        path: the ``.toml`` file; its stem is the recipe's name when the file sets none.

    Returns:
        The recipe.

    Raises:
        ValueError: naming the file, the role and the field at fault.
    """
    text, source, stem = read_recipe_text(path)
    return loads_recipe_toml(text, source=source, default_name=stem)


def register_recipe(recipe: Recipe, *, overwrite: bool = False) -> Recipe:
    """Make ``recipe`` available to :func:`get_recipe` under ``recipe.name``.

    Args:
        recipe: the recipe to register.
        overwrite: replace a registered recipe of the same name.

    Returns:
        ``recipe`` itself.

    Raises:
        ValueError: when ``recipe`` is not a :class:`Recipe`, or its name is taken and
            ``overwrite`` is False.
    """
    if not isinstance(recipe, Recipe):
        raise ValueError(f"expected a Recipe, got {recipe!r}")
    reg = _registry()
    if recipe.name in reg and not overwrite:
        raise ValueError(f"a recipe named {recipe.name!r} exists; pass overwrite=True to replace it")
    reg[recipe.name] = recipe
    return recipe
