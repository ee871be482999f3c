"""Tests of equiopt.recipes: the paper's configurations as data, overrides, TOML, schedules."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch

import equiopt
from equiopt.recipes import (
    ROLES,
    Recipe,
    StableDecay,
    WarmupCosine,
    build_scheduler,
    get_recipe,
    list_recipes,
    load_recipe_toml,
    make_lr_lambda,
    register_recipe,
    save_recipe_toml,
)

PAPER_NAMES = (
    [f"paper:{m}:{c}" for m in ("qwen3", "gemma3") for c in ("a-i", "a-ii", "a-iii", "b-i", "b-ii", "b-iii")]
    + [f"paper:{m}:{c}" for m in ("olmoe", "gpt_oss") for c in ("i", "ii", "iii", "iv")]
    + [
        "paper:gpt_oss:router-row",
        "paper:gpt_oss:router-left-centered",
        "paper:gpt_oss:router-left-uncentered",
        "paper:gpt_oss:router-hybrid",
        "paper:gpt_oss:router-adamw",
    ]
)

AW = (0.9, 0.95)

# Values read off the paper's hyperparameter tables:
# (recipe, role, rule, gamma_0, momentum, weight decay).
PAPER_ROWS = [
    # table:optim_hyperparams_qwen3
    ("paper:qwen3:a-i", "vector", "adamw", 0.05, AW, 0.001),
    ("paper:qwen3:a-i", "attention", "spectral", 0.02, 0.95, 0.001),
    ("paper:qwen3:a-i", "mlp_in", "spectral", 0.02, 0.95, 0.001),
    ("paper:qwen3:a-i", "embedding", "row", 0.50, 0.95, 0.0),
    ("paper:qwen3:a-i", "lm_head", "row", 0.005, 0.95, 0.0),
    ("paper:qwen3:a-ii", "embedding", "hybrid", 1.00, 0.95, 0.0),
    ("paper:qwen3:a-ii", "lm_head", "hybrid", 0.01, 0.95, 0.0),
    ("paper:qwen3:a-ii", "mlp_out", "spectral", 0.02, 0.95, 0.001),
    ("paper:qwen3:a-iii", "embedding", "adamw", 0.10, AW, 0.0),
    ("paper:qwen3:a-iii", "lm_head", "adamw", 0.001, AW, 0.0),
    ("paper:qwen3:b-i", "mlp_in", "hybrid", 0.02, 0.95, 0.001),
    ("paper:qwen3:b-i", "embedding", "row", 0.50, 0.95, 0.0),
    ("paper:qwen3:b-ii", "mlp_out", "hybrid", 0.02, 0.95, 0.001),
    ("paper:qwen3:b-ii", "embedding", "hybrid", 1.00, 0.95, 0.0),
    ("paper:qwen3:b-ii", "lm_head", "hybrid", 0.01, 0.95, 0.0),
    ("paper:qwen3:b-iii", "lm_head", "adamw", 0.001, AW, 0.0),
    ("paper:qwen3:b-iii", "matrix", "spectral", 0.02, 0.95, 0.001),
    # table:optim_hyperparams_gemma3
    ("paper:gemma3:a-i", "embedding", "row", 0.0025, 0.95, 0.0),
    ("paper:gemma3:a-i", "lm_head", "row", 0.0025, 0.95, 0.0),
    ("paper:gemma3:a-i", "vector", "adamw", 0.05, AW, 0.001),
    ("paper:gemma3:a-ii", "embedding", "hybrid", 0.0025, 0.95, 0.0),
    ("paper:gemma3:a-ii", "mlp_in", "spectral", 0.02, 0.95, 0.001),
    ("paper:gemma3:a-iii", "lm_head", "adamw", 0.0005, AW, 0.0),
    ("paper:gemma3:b-i", "mlp_out", "hybrid", 0.02, 0.95, 0.001),
    ("paper:gemma3:b-ii", "embedding", "hybrid", 0.001, 0.95, 0.0),
    ("paper:gemma3:b-ii", "lm_head", "hybrid", 0.001, 0.95, 0.0),
    ("paper:gemma3:b-iii", "embedding", "adamw", 0.0005, AW, 0.0),
    # table:optim_hyperparams_olmoe
    ("paper:olmoe:i", "vector", "adamw", 0.01, AW, 0.001),
    ("paper:olmoe:i", "attention", "spectral", 0.005, 0.95, 0.001),
    ("paper:olmoe:i", "mlp_in", "spectral", 0.005, 0.95, 0.001),
    ("paper:olmoe:i", "embedding", "row", 0.5, 0.95, 0.0),
    ("paper:olmoe:i", "lm_head", "row", 0.005, 0.95, 0.0),
    ("paper:olmoe:i", "router", "row", 0.00075, 0.95, 0.0),
    ("paper:olmoe:ii", "router", "left", 0.00075, 0.95, 0.0),
    ("paper:olmoe:iii", "router", "adamw", 0.00075, AW, 0.0),
    ("paper:olmoe:iv", "embedding", "adamw", 0.0005, AW, 0.0),
    ("paper:olmoe:iv", "lm_head", "adamw", 0.0005, AW, 0.0),
    ("paper:olmoe:iv", "router", "adamw", 0.00075, AW, 0.0),
    # table:optim_hyperparams_gpt_oss
    ("paper:gpt_oss:i", "vector", "adamw", 0.005, AW, 0.001),
    ("paper:gpt_oss:i", "matrix", "spectral", 0.001, 0.95, 0.001),
    ("paper:gpt_oss:i", "mlp_out", "spectral", 0.001, 0.95, 0.001),
    ("paper:gpt_oss:i", "embedding", "row", 0.1, 0.95, 0.0),
    ("paper:gpt_oss:i", "lm_head", "row", 0.001, 0.95, 0.0),
    ("paper:gpt_oss:i", "router", "row", 0.00075, 0.95, 0.0),
    ("paper:gpt_oss:ii", "router", "left", 0.00075, 0.95, 0.0),
    ("paper:gpt_oss:iii", "router", "adamw", 0.00075, AW, 0.0),
    ("paper:gpt_oss:iv", "embedding", "adamw", 0.0005, AW, 0.0),
    ("paper:gpt_oss:iv", "router", "adamw", 0.00075, AW, 0.0),
    # subsubsec:gpt_oss_router_diagnostics: same hyperparameters as RowNormM / LeftPolarGradM
    ("paper:gpt_oss:router-left-uncentered", "router", "left", 0.00075, 0.95, 0.0),
    ("paper:gpt_oss:router-hybrid", "router", "hybrid", 0.00075, 0.95, 0.0),
]


# ---------------------------------------------------------------------------
# registry and paper data
# ---------------------------------------------------------------------------


def test_every_paper_recipe_exists_and_validates():
    names = list_recipes()
    for name in PAPER_NAMES + ["muon", "adamw", "peer:adamw", "peer:muon"]:
        assert name in names
        recipe = get_recipe(name)
        assert isinstance(recipe, Recipe) and recipe.name == name
        assert set(recipe.roles) == set(ROLES)
        # the stored data re-validates to an equal recipe
        assert Recipe(recipe.name, recipe.description, recipe.to_dict()["roles"]) == recipe


@pytest.mark.parametrize("name, role, rule, lr, momentum, wd", PAPER_ROWS)
def test_paper_table_values(name, role, rule, lr, momentum, wd):
    s = get_recipe(name).settings(role)
    assert s["rule"] == rule
    assert s["lr"] == pytest.approx(lr, rel=0, abs=1e-15)
    assert s["weight_decay"] == wd
    if rule == "adamw":
        assert s["betas"] == momentum
    else:
        assert s["beta"] == momentum


def test_paper_structural_choices():
    # table:optim_hyperparams_olmoe (ii): LeftPolarGradM (alpha = 1) on a centred router
    router = get_recipe("paper:olmoe:ii").settings("router")
    assert (router["rule"], router["center"], router["alpha"]) == ("left", True, 1.0)
    # Algorithm 2: the router row-norm update and the LM-head update are projected
    assert get_recipe("paper:olmoe:i").settings("router")["center"] is True
    assert get_recipe("paper:olmoe:i").settings("lm_head")["center"] is True
    assert get_recipe("paper:olmoe:i").settings("embedding")["center"] is False
    # table:optim_hyperparams_qwen3 (a)(ii)/(b): HybridPolarGradM (row-norm/right-spectral; alpha = 1)
    for name, role in [
        ("paper:qwen3:a-ii", "embedding"),
        ("paper:qwen3:b-i", "mlp_in"),
        ("paper:gemma3:b-ii", "lm_head"),
    ]:
        s = get_recipe(name).settings(role)
        assert (s["order"], s["alpha"], s["method"]) == ("row_then_right", 1.0, "polar_express")
    assert get_recipe("paper:qwen3:b-ii").settings("mlp_in")["center"] is False
    # Muon with Polar Express everywhere the tables say Muon
    muon = get_recipe("paper:gemma3:a-i").settings("attention")
    assert (muon["method"], muon["steps"], muon["nesterov"], muon["lr_scale"]) == ("polar_express", 5, True, "spectral")
    # appendix text: eps = 1e-8 and eta(t) = 1/(t + eps) for RowNormM
    row = get_recipe("paper:gpt_oss:i").settings("embedding")
    assert (row["eps"], row["eta"], row["nesterov"]) == (1e-8, "inverse", False)


def test_router_ablations_hold_everything_else_fixed():
    base = get_recipe("paper:gpt_oss:i")
    for name in [n for n in PAPER_NAMES if "router-" in n]:
        recipe = get_recipe(name)
        for role in ROLES:
            if role != "router":
                assert recipe.settings(role) == base.settings(role), (name, role)
    assert get_recipe("paper:gpt_oss:router-row").roles == base.roles
    assert get_recipe("paper:gpt_oss:router-left-centered").roles == get_recipe("paper:gpt_oss:ii").roles
    assert get_recipe("paper:gpt_oss:router-adamw").roles == get_recipe("paper:gpt_oss:iii").roles
    unc = get_recipe("paper:gpt_oss:router-left-uncentered").settings("router")
    assert (unc["rule"], unc["center"], unc["alpha"]) == ("left", False, 1.0)
    hyb = get_recipe("paper:gpt_oss:router-hybrid").settings("router")
    assert (hyb["order"], hyb["center"], hyb["alpha"]) == ("left_then_row", True, 1.0)


def test_paper_schedules():
    # appendix: warmup (100 steps) + cosine for scalar/vector AdamW, stable-decay (60 %) for all others
    for name in PAPER_NAMES:
        recipe = get_recipe(name)
        assert recipe.settings("vector")["schedule"] == {"kind": "warmup_cosine", "warmup_steps": 100}
        for role in ROLES:
            if role != "vector":
                assert recipe.settings(role)["schedule"] == {"kind": "stable_decay", "stable_fraction": 0.6}


def test_paper_meta():
    assert get_recipe("paper:gemma3:b-ii").meta["table"] == "table:optim_hyperparams_gemma3"
    assert get_recipe("paper:gemma3:b-ii").meta["train_steps"] == 50_000
    assert get_recipe("paper:olmoe:ii").meta["final_val_loss"] == 4.0815


def test_generic_recipes():
    muon = get_recipe("muon")
    for role in ("attention", "mlp_in", "mlp_out", "matrix"):
        assert muon.settings(role)["rule"] == "spectral"
    for role in ("embedding", "lm_head", "router", "vector"):
        assert muon.settings(role)["rule"] == "adamw"
    assert {get_recipe("adamw").settings(r)["rule"] for r in ROLES} == {"adamw"}


def test_lookup_aliases_and_unknown_names():
    assert get_recipe("paper:gpt-oss:ii") is get_recipe("paper:gpt_oss:ii")
    assert get_recipe("PAPER:Qwen3:B-II") is get_recipe("paper:qwen3:b-ii")
    recipe = get_recipe("muon")
    assert get_recipe(recipe) is recipe
    with pytest.raises(ValueError, match=r"unknown recipe 'paper:qwen3:c-i'.*paper:qwen3:"):
        get_recipe("paper:qwen3:c-i")
    with pytest.raises(ValueError, match="valid recipes: equiopt:default, muon, adamw"):
        get_recipe("sgd-please")


def test_register_recipe():
    recipe = get_recipe("muon").with_overrides({"router": {"lr": 1e-3}}, name="test-registered")
    register_recipe(recipe, overwrite=True)
    assert get_recipe("test-registered") == recipe
    with pytest.raises(ValueError, match="exists"):
        register_recipe(recipe)


# ---------------------------------------------------------------------------
# overrides and validation
# ---------------------------------------------------------------------------


def test_with_overrides():
    base = get_recipe("paper:qwen3:b-ii")
    new = base.with_overrides({"router": {"lr": 1e-3}, "*": {"weight_decay": 0.0}})
    assert new.settings("router")["lr"] == 1e-3
    assert all(new.settings(r)["weight_decay"] == 0.0 for r in ROLES)
    assert new.settings("embedding")["lr"] == 1.0  # untouched
    assert base.settings("router")["lr"] == 0.00075 and base.settings("vector")["weight_decay"] == 0.001
    assert new.name == base.name and new.meta == {"base": "paper:qwen3:b-ii"}
    assert base.with_overrides({}, name="copy").roles == base.roles


def test_star_override_applies_where_the_rule_accepts_it():
    new = get_recipe("paper:olmoe:iii").with_overrides({"*": {"beta": 0.9}})
    assert new.settings("router") == get_recipe("paper:olmoe:iii").settings("router")  # AdamW
    assert new.settings("embedding")["beta"] == 0.9 and new.settings("matrix")["beta"] == 0.9
    # role-specific settings win over "*"
    new = get_recipe("muon").with_overrides({"*": {"lr": 0.5}, "vector": {"lr": 0.1}})
    assert new.settings("vector")["lr"] == 0.1 and new.settings("attention")["lr"] == 0.5
    with pytest.raises(ValueError, match=r"role '\*'.*'order'.*apply to no role"):
        get_recipe("muon").with_overrides({"*": {"order": "row_then_right"}})


def test_rule_change_drops_foreign_fields_and_fills_defaults():
    new = get_recipe("paper:gpt_oss:iii").with_overrides(
        {"router": {"rule": "hybrid", "order": "left_then_row", "center": True}}
    )
    router = new.settings("router")
    assert "betas" not in router and "adam_eps" not in router
    assert router["lr"] == 0.00075  # kept
    assert (router["beta"], router["alpha"], router["eps"]) == (0.95, 1.0, 1e-8)  # rule defaults
    back = new.with_overrides({"router": {"rule": "adamw"}}).settings("router")
    assert set(back) == {"rule", "lr", "weight_decay", "betas", "adam_eps", "schedule"}


def test_schedule_override_merges_or_replaces():
    r = get_recipe("paper:qwen3:a-i")
    assert r.with_overrides({"vector": {"schedule": {"warmup_steps": 10}}}).settings("vector")["schedule"] == {
        "kind": "warmup_cosine",
        "warmup_steps": 10,
    }
    assert r.with_overrides({"vector": {"schedule": {"kind": "constant"}}}).settings("vector")["schedule"] == {
        "kind": "constant"
    }


def test_recipe_is_immutable():
    r = get_recipe("paper:qwen3:a-i")
    with pytest.raises(TypeError):
        r.roles["router"]["lr"] = 1.0  # type: ignore[index]
    with pytest.raises(TypeError):
        r.roles["router"] = {}  # type: ignore[index]
    s = r.settings("router")
    s["lr"] = 123.0
    assert r.settings("router")["lr"] == 0.00075
    assert pickle.loads(pickle.dumps(r)) == r


def test_unknown_role_and_field_errors():
    r = get_recipe("paper:qwen3:b-ii")
    with pytest.raises(ValueError, match=r"unknown role 'routr'; valid roles: embedding, lm_head, .*vector"):
        r.with_overrides({"routr": {"lr": 1e-3}})
    with pytest.raises(ValueError, match=r"role 'router': unknown field 'learning_rate'; valid fields: rule, lr"):
        r.with_overrides({"router": {"learning_rate": 1e-3}})
    with pytest.raises(ValueError, match=r"role 'router', field 'betas': does not apply to rule 'row'"):
        r.with_overrides({"router": {"betas": (0.9, 0.99)}})
    roles = get_recipe("muon").to_dict()["roles"]
    del roles["router"]
    with pytest.raises(ValueError, match="missing settings for role.*router"):
        Recipe("partial", "", roles)
    with pytest.raises(ValueError, match="unknown role 'expert'"):
        Recipe("extra", "", {**get_recipe("muon").to_dict()["roles"], "expert": {"rule": "sgd", "lr": 1.0}})


@pytest.mark.parametrize(
    "role, patch, pattern",
    [
        ("router", {"beta": 1.0}, r"role 'router', field 'beta': must be in \[0, 1\)"),
        ("router", {"beta": -0.1}, r"field 'beta'"),
        ("embedding", {"lr": -0.5}, r"role 'embedding', field 'lr': must be >= 0"),
        ("embedding", {"lr": -1.0}, r"field 'lr': must be >= 0"),
        ("embedding", {"lr": "fast"}, r"field 'lr': expected a number"),
        ("embedding", {"lr": float("nan")}, r"field 'lr': expected a finite number"),
        ("embedding", {"weight_decay": -0.1}, r"field 'weight_decay': must be >= 0"),
        ("mlp_in", {"alpha": 1.5}, r"role 'mlp_in', field 'alpha': must be in \[0, 1\]"),
        ("vector", {"betas": (0.9, 1.0)}, r"role 'vector', field 'betas': must be a pair in \[0, 1\)"),
        ("vector", {"betas": (0.9,)}, r"field 'betas': expected a pair"),
        ("vector", {"adam_eps": 0.0}, r"field 'adam_eps': must be > 0"),
        ("router", {"rule": "lion"}, r"role 'router', field 'rule': unknown rule 'lion'; valid: spectral, right"),
        ("mlp_in", {"order": "right_then_left"}, r"field 'order': unknown hybrid order .*row_then_right"),
        (
            "attention",
            {"method": "svd"},
            r"role 'attention', field 'method': unknown method 'svd' for rule 'spectral'; valid: polar_express",
        ),
        ("attention", {"steps": 0}, r"field 'steps': must be >= 1"),
        ("attention", {"steps": 2.5}, r"field 'steps': expected an integer"),
        ("attention", {"nesterov": "yes"}, r"field 'nesterov': expected true or false"),
        ("attention", {"lr_scale": "sqrt"}, r"field 'lr_scale': unknown lr_scale 'sqrt'"),
        ("embedding", {"lr_scale": "spectral"}, r"field 'lr_scale': does not apply to rule 'hybrid'"),
        ("lm_head", {"center": 1}, r"role 'lm_head', field 'center': expected true or false"),
        ("lm_head", {"eps": 0.0}, r"field 'eps': must be > 0"),
        ("lm_head", {"eta": "sqrt"}, r"field 'eta': unknown eta 'sqrt'"),
        ("mlp_in", {"method": "householder"}, r"role 'mlp_in', field 'method'"),
        ("lm_head", {"schedule": {"kind": "linear"}}, r"field 'schedule': unknown kind 'linear'"),
        ("lm_head", {"schedule": {"stable_fraction": 1.5}}, r"field 'schedule.stable_fraction'"),
        ("lm_head", {"schedule": {"warmup_steps": 3}}, r"unknown key\(s\) 'warmup_steps' for kind 'stable_decay'"),
    ],
)
def test_bad_values(role, patch, pattern):
    with pytest.raises(ValueError, match=pattern):
        get_recipe("paper:qwen3:b-ii").with_overrides({role: patch})


# ---------------------------------------------------------------------------
# TOML
# ---------------------------------------------------------------------------


def test_toml_round_trip(tmp_path):
    for name in ("paper:gpt_oss:router-hybrid", "paper:qwen3:b-ii", "adamw"):
        recipe = get_recipe(name)
        path = tmp_path / "recipe.toml"
        save_recipe_toml(recipe, path)
        loaded = load_recipe_toml(path)
        assert loaded == recipe
        assert loaded.to_dict() == recipe.to_dict()


def test_toml_with_base(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        'name = "my-recipe"\n'
        'base = "paper:qwen3:b-ii"\n'
        "[roles.router]\n"
        'rule = "row"\n'
        "center = true\n"
        "lr = 0.001\n"
        '[roles."*"]\n'
        "weight_decay = 0.0\n"
        "[roles.vector]\n"
        "betas = [0.8, 0.99]\n"
        'schedule = { kind = "warmup_cosine", warmup_steps = 20 }\n'
    )
    recipe = load_recipe_toml(path)
    assert recipe.name == "my-recipe"
    router = recipe.settings("router")
    assert (router["rule"], router["center"], router["lr"]) == ("row", True, 0.001)
    assert recipe.settings("vector")["betas"] == (0.8, 0.99)
    assert recipe.settings("vector")["schedule"]["warmup_steps"] == 20
    assert recipe.settings("mlp_in") == {**get_recipe("paper:qwen3:b-ii").settings("mlp_in"), "weight_decay": 0.0}
    assert get_recipe(str(path)) == recipe


def test_toml_without_base(tmp_path):
    lines = ['description = "sgd everywhere"', '[roles."*"]', 'rule = "sgd"', "lr = 0.1", "beta = 0.9"]
    lines += [f"[roles.{role}]" for role in ROLES]
    path = tmp_path / "plain.toml"
    path.write_text("\n".join(lines) + "\n")
    recipe = load_recipe_toml(path)
    assert recipe.name == "plain"  # file stem
    assert all(recipe.settings(r)["rule"] == "sgd" and recipe.settings(r)["beta"] == 0.9 for r in ROLES)


@pytest.mark.parametrize(
    "body, pattern",
    [
        ('base = "paper:qwen3:b-ii"\n[roles.router]\nbeta = 1.5\n', r"role 'router', field 'beta': must be in"),
        ('base = "paper:qwen3:b-ii"\n[roles.router]\nspeed = 1\n', r"role 'router': unknown field 'speed'"),
        ('base = "paper:qwen3:b-ii"\n[roles.routers]\nlr = 1.0\n', r"unknown role 'routers'"),
        ('base = "paper:qwen3:z"\n', r"unknown recipe 'paper:qwen3:z'"),
        ('bases = "muon"\n', r"unknown top-level key\(s\) 'bases'"),
        ("[roles.router]\nrule = 'row'\nlr = 1.0\n", r"missing settings for role\(s\) embedding"),
        ("name = \n", r"invalid TOML"),
    ],
)
def test_toml_errors_name_file_role_and_field(tmp_path, body, pattern):
    path = tmp_path / "broken.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match=pattern) as info:
        load_recipe_toml(path)
    assert str(info.value).startswith(str(path))


def test_toml_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nothere.toml: cannot read"):
        load_recipe_toml(tmp_path / "nothere.toml")


# ---------------------------------------------------------------------------
# schedules
# ---------------------------------------------------------------------------


def test_warmup_cosine_values():
    f = make_lr_lambda({"kind": "warmup_cosine", "warmup_steps": 100}, 1000)
    assert f(0) == pytest.approx(1 / 100)
    assert f(49) == pytest.approx(0.5)
    assert f(99) == 1.0  # warmup ends: full rate for update 100
    assert f(100) == 1.0  # cosine starts at 1
    assert f(550) == pytest.approx(0.5)  # half way through the cosine
    assert f(999) == pytest.approx(0.5 * (1 + math.cos(math.pi * 899 / 900)))
    assert f(1000) == 0.0 and f(1200) == 0.0
    values = [f(s) for s in range(1001)]
    assert all(a <= b for a, b in zip(values[:100], values[1:100]))
    assert all(a >= b for a, b in zip(values[99:], values[100:]))
    # without total_steps: warmup, then constant
    g = make_lr_lambda({"kind": "warmup_cosine", "warmup_steps": 4}, None)
    assert [g(s) for s in (0, 3, 4, 10**6)] == [0.25, 1.0, 1.0, 1.0]
    # no warmup
    h = make_lr_lambda({"kind": "warmup_cosine", "warmup_steps": 0}, 10)
    assert h(0) == 1.0 and h(10) == 0.0


def test_stable_decay_values():
    f = make_lr_lambda({"kind": "stable_decay", "stable_fraction": 0.6}, 1000)
    assert f(0) == 1.0
    assert f(599) == 1.0 and f(600) == 1.0  # 60 % point
    assert f(601) == pytest.approx(399 / 400)
    assert f(800) == pytest.approx(0.5)
    assert f(999) == pytest.approx(1 / 400)
    assert f(1000) == 0.0 and f(5000) == 0.0
    values = [f(s) for s in range(1001)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert make_lr_lambda({"kind": "stable_decay"}, None)(10**6) == 1.0
    assert make_lr_lambda({"kind": "stable_decay"}, 1000) == StableDecay(0.6, 1000)  # default fraction
    # floor(f * T) is robust to float rounding: 0.29 * 100 = 28.999999999999996
    assert StableDecay(0.29, 100).stable_steps == 29
    assert StableDecay(1.0, 10)(9) == 1.0 and StableDecay(1.0, 10)(10) == 0.0
    assert make_lr_lambda(None, 10)(5) == 1.0 and make_lr_lambda({"kind": "constant"}, 10)(10) == 1.0


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match="total_steps must be a positive integer"):
        make_lr_lambda({"kind": "stable_decay"}, 0)
    with pytest.raises(ValueError, match="unknown kind 'exp'"):
        make_lr_lambda({"kind": "exp"}, 10)


def _sgd(groups_schedules):
    groups = []
    for i, sched in enumerate(groups_schedules):
        g = {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1 * (i + 1)}
        if sched is not None:
            g["schedule"] = sched
        groups.append(g)
    return torch.optim.SGD(groups, lr=0.1)


SCHEDS = [
    {"kind": "warmup_cosine", "warmup_steps": 3},
    {"kind": "stable_decay", "stable_fraction": 0.6},
    None,
]


def test_build_scheduler_follows_each_group():
    opt = _sgd(SCHEDS)
    sched = build_scheduler(opt, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    seen.append([g["lr"] for g in opt.param_groups])
    wc, sd = WarmupCosine(3, 10), StableDecay(0.6, 10)
    for step, lrs in enumerate(seen):
        assert lrs[0] == pytest.approx(0.1 * wc(step))
        assert lrs[1] == pytest.approx(0.2 * sd(step))
        assert lrs[2] == pytest.approx(0.3)
    assert seen[10][:2] == [0.0, 0.0]


def test_scheduler_state_dict_round_trip():
    opt = _sgd(SCHEDS)
    sched = build_scheduler(opt, total_steps=20)
    for _ in range(7):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    # a fresh scheduler built without total_steps gets it back from the state dict
    opt2 = _sgd(SCHEDS)
    sched2 = build_scheduler(opt2)
    assert sched2.lr_lambdas[1](15) == 1.0
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    assert sched2.lr_lambdas[0] == WarmupCosine(3, 20)
    assert sched2.lr_lambdas[1] == StableDecay(0.6, 20)
    for _ in range(5):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    assert pickle.loads(pickle.dumps(sched.lr_lambdas)) == sched.lr_lambdas


def test_build_scheduler_rejects_bad_group_schedule():
    opt = _sgd([{"kind": "stable_decay", "stable_fraction": 2.0}])
    with pytest.raises(ValueError, match=r"param group 0: field 'schedule.stable_fraction'"):
        build_scheduler(opt, total_steps=10)


def test_recipe_param_groups_drive_a_scheduler():
    recipe = get_recipe("paper:olmoe:ii")
    params = {role: [torch.nn.Parameter(torch.zeros(3, 2))] for role in ("embedding", "router", "vector")}
    groups = recipe.param_groups(params)
    assert [g["role"] for g in groups] == ["embedding", "router", "vector"]
    assert groups[1]["rule"] == "left" and groups[1]["lr"] == 0.00075
    opt = torch.optim.SGD(groups, lr=1.0)  # torch keeps the extra keys
    sched = build_scheduler(opt, total_steps=1000)
    for _ in range(700):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 300 / 400)  # stable-decay, step 700
    assert opt.param_groups[2]["lr"] == pytest.approx(0.01 * WarmupCosine(100, 1000)(700))


@pytest.mark.parametrize(
    "name", ["muon", "adamw", "paper:qwen3:b-ii", "paper:gemma3:a-iii", "paper:olmoe:ii", "paper:gpt_oss:router-hybrid"]
)
def test_recipe_groups_step_the_optimizer(name):
    EquivariantOptimizer = getattr(equiopt, "EquivariantOptimizer", None)
    if EquivariantOptimizer is None:
        pytest.skip("equiopt.EquivariantOptimizer is not available")
    torch.manual_seed(0)
    params = {role: [torch.nn.Parameter(torch.randn(6, 4))] for role in ROLES if role != "vector"}
    params["vector"] = [torch.nn.Parameter(torch.randn(4))]
    opt = EquivariantOptimizer(get_recipe(name).param_groups(params))
    sched = build_scheduler(opt, total_steps=10)
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    after = [p.detach() for g in opt.param_groups for p in g["params"]]
    assert all(torch.isfinite(a).all() and not torch.equal(a, b) for a, b in zip(after, before))
