"""Recipes reach every option of the engine; the default recipe is safe; first errors are clear."""

import math
import sys

import pytest
import torch

import equiopt as eo
from equiopt.cli import main, parse_sets
from equiopt.recipes import FIELDS, RULE_FIELDS, get_recipe, loads_recipe_toml
from equiopt.recipes.schema import ENGINE_KEYS
from equiopt.train.config import ConfigError, from_dict, load_config


def test_every_engine_group_key_is_a_recipe_field():
    engine = eo.EquivariantOptimizer([torch.zeros(1, requires_grad=True)], rule="adamw")
    keys = [k for k in engine.defaults if k not in ("layout", "layouts", "names")]
    assert sorted(ENGINE_KEYS) == sorted(keys)
    assert "polar_dtype" in keys and "nonfinite" in keys
    for key in keys:
        assert key in FIELDS
        assert any(key in fields for fields in RULE_FIELDS.values())


def test_hand_built_groups_and_recipes_give_a_rule_the_same_defaults():
    """One table: for every rule, a param group that names only the rule gets exactly the
    settings a recipe fills in for it."""
    from equiopt.recipes.schema import normalize_settings

    for rule in eo.optim.RULES:
        if rule == "torch_muon" and not hasattr(torch.optim, "Muon"):
            continue
        shape = (4, 3) if rule in eo.optim.MATRIX_RULES + ("torch_muon",) else (3,)
        opt = eo.EquivariantOptimizer([{"params": [torch.zeros(shape, requires_grad=True)], "rule": rule, "lr": 0.1}])
        group = opt.param_groups[0]
        recipe = normalize_settings({"rule": rule, "lr": 0.1}, "matrix")
        for key, value in recipe.items():
            if key != "schedule":
                assert group[key] == value, (rule, key, group[key], value)
    adamw = eo.EquivariantOptimizer([torch.zeros(3, requires_grad=True)], rule="adamw").param_groups[0]
    sgd = eo.EquivariantOptimizer([torch.zeros(3, requires_grad=True)], rule="sgd").param_groups[0]
    assert adamw["betas"] == (0.9, 0.95) and sgd["beta"] == 0.95
    assert normalize_settings({"rule": "sgd", "lr": 0.1}, "vector")["beta"] == 0.95


def _attention_after_one_step(overrides):
    model = eo.models.build("qwen3", "tiny", seed=0)
    opt, _ = eo.build_optimizer(model, "muon", overrides=overrides)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    group = next(g for g in opt.param_groups if g["role"] == "attention")
    return group, model.model.layers[0].self_attn.q_proj.weight.detach().clone()


def test_polar_dtype_from_python_reaches_the_engine(one_thread, monkeypatch):
    # a processor that multiplies bfloat16 natively, where the unset default is bfloat16
    monkeypatch.setattr(sys.modules["equiopt.linalg.polar"], "CPU_BFLOAT16", True)
    group, w32 = _attention_after_one_step({"attention": {"polar_dtype": "float32"}})
    assert group["polar_dtype"] is torch.float32
    group, w32b = _attention_after_one_step({"attention": {"polar_dtype": torch.float32}})
    assert torch.equal(w32, w32b)
    group, w16 = _attention_after_one_step(None)
    assert group["polar_dtype"] is None  # the engine's default (bfloat16) applies
    assert not torch.equal(w32, w16)  # a different iteration precision gives a different step


def test_polar_dtype_and_nonfinite_from_toml_round_trip():
    recipe = loads_recipe_toml(
        'base = "muon"\nname = "mine"\n[roles.attention]\npolar_dtype = "float32"\n[roles."*"]\nnonfinite = "raise"\n'
    )
    assert recipe.settings("attention")["polar_dtype"] is torch.float32
    assert recipe.settings("mlp_in").get("polar_dtype") is None
    assert {recipe.settings(r)["nonfinite"] for r in eo.recipes.ROLES} == {"raise"}
    assert 'polar_dtype = "float32"' in recipe.to_toml()
    assert loads_recipe_toml(recipe.to_toml()) == recipe
    assert "polar_dtype" not in get_recipe("paper:qwen3:a-i").to_toml()  # the paper's recipes are unchanged


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"attention": {"polar_dtype": "int8"}}, r"role 'attention', field 'polar_dtype': expected a floating dtype"),
        ({"embedding": {"polar_dtype": "float32"}}, r"role 'embedding', field 'polar_dtype': does not apply to rule"),
        ({"*": {"nonfinite": "ignore"}}, r"field 'nonfinite': unknown nonfinite policy 'ignore'; valid: skip, raise"),
        ({"*": {"polar_dtyp": "float32"}}, r"unknown field 'polar_dtyp'; valid fields: .*polar_dtype"),
    ],
)
def test_engine_options_are_validated_naming_the_field(patch, message):
    with pytest.raises(ValueError, match=message):
        get_recipe("muon").with_overrides(patch)


def _config(tmp_path, **data):
    path = tmp_path / "run.toml"
    lines = ['[model]\nfamily = "qwen3"\n[optim]\nrecipe = "muon"\n[data]']
    lines += [f'{k} = "{v}"' for k, v in {"train": str(tmp_path / "data"), **data}.items()]
    lines += ["[train]\nsteps = 2\nval_batches = 0\ntensorboard = false", f'[run]\nout_dir = "{tmp_path / "out"}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def test_engine_options_from_the_command_line(tmp_path):
    path = _config(tmp_path)
    sets = parse_sets(["optim.overrides.attention.polar_dtype=float32", "optim.overrides.*.nonfinite=raise"])
    cfg = load_config(path, sets)
    assert cfg.optim.overrides == {"attention": {"polar_dtype": "float32"}, "*": {"nonfinite": "raise"}}
    with pytest.raises(ConfigError, match=r"\[optim\].*'attention', field 'polar_dtype'"):
        load_config(path, parse_sets(["optim.overrides.attention.polar_dtype=int8"]))
    with pytest.raises(ConfigError, match=r"optim\.recipe is not a table"):
        load_config(path, {"optim.recipe.x": 1})


def test_missing_or_empty_data_directory_names_the_field_and_the_command(tmp_path, capsys):
    from equiopt.train.loop import Trainer

    path = _config(tmp_path)
    with pytest.raises(
        SystemExit,
        match=r"\[data\]\.train: .*data does not exist; make it with: equiopt data prepare "
        r".*--out .*data",
    ):
        main(["train", str(path)])
    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError, match=r"\[data\]\.train: .*data is empty; make it with: equiopt data prepare"):
        Trainer(load_config(path))
    (tmp_path / "data" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"not a prepared shard directory"):
        Trainer(load_config(path))
    with pytest.raises(ConfigError, match=r"\[data\]\.ood_val: .*sotu does not exist"):
        (tmp_path / "data" / "manifest.json").write_text("{}")
        Trainer(load_config(_config(tmp_path, ood_val=tmp_path / "sotu")))


def test_unknown_hf_model_type_in_a_run_config(tmp_path):
    base = {"data": {"train": "x"}, "model": {"hf_config": {"model_type": "qwen33", "hidden_size": 8}}}
    with pytest.raises(ConfigError, match=r"\[model\]\.hf_config\.model_type: 'qwen33' is not a model type.*qwen3"):
        from_dict(base)
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "lama"}')
    with pytest.raises(ConfigError, match=r"'lama' is not a model type.*llama"):
        from_dict({"data": {"train": "x"}, "model": {"hf_config": str(path)}})
    path.write_text('{"model_type": "llama"}')
    assert from_dict({"data": {"train": "x"}, "model": {"hf_config": str(path)}}).model.hf_config == str(path)


def test_default_recipe_is_safe_and_trains(one_thread):
    """60 steps of a tiny model: the loss falls and the embedding stays near its initial scale
    (each entry moves by at most lr per step)."""
    recipe = get_recipe(eo.recipes.DEFAULT_RECIPE)
    assert recipe.settings("embedding")["rule"] == "row" and recipe.settings("lm_head")["center"]
    model = eo.models.build("qwen3", "tiny", seed=0)
    opt, sched = eo.build_optimizer(model)
    assert opt.recipe is recipe
    emb = model.get_input_embeddings().weight
    rms0 = float(emb.detach().pow(2).mean().sqrt())
    g = torch.Generator().manual_seed(0)
    losses, steps = [], 60
    for _ in range(steps):
        start = torch.randint(0, model.config.vocab_size, (8, 1), generator=g)
        stride = torch.randint(1, 5, (8, 1), generator=g)
        ids = (start + stride * torch.arange(64)) % model.config.vocab_size  # learnable sequences
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    rms = float(emb.detach().pow(2).mean().sqrt())
    lr = recipe.settings("embedding")["lr"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert rms <= rms0 + lr * steps and rms < 10 * rms0


def test_engine_options_are_checked_by_the_one_table():
    """The recipe schema and the engine run the same check, so their errors agree."""
    from equiopt.optim.fields import check_settings
    from equiopt.recipes import schema

    with pytest.raises(ValueError, match=r"ctx, field 'nonfinite': unknown nonfinite policy 'bad'"):
        check_settings({"rule": "spectral", "lr": 0.1, "nonfinite": "bad"}, "ctx")
    with pytest.raises(ValueError, match=r"param_groups\[0\], field 'nonfinite': unknown nonfinite policy 'bad'"):
        eo.EquivariantOptimizer([torch.zeros(2, 2, requires_grad=True)], nonfinite="bad")
    with pytest.raises(ValueError, match=r"role 'matrix', field 'nonfinite': unknown nonfinite policy 'bad'"):
        schema.normalize_settings({"rule": "spectral", "lr": 0.1, "nonfinite": "bad"}, "matrix")
    assert (
        check_settings({"rule": "spectral", "lr": 0.1, "polar_dtype": "bf16"}, "ctx")["polar_dtype"] is torch.bfloat16
    )
    with pytest.raises(ValueError, match="field 'polar_dtype': expected a floating dtype"):
        check_settings({"rule": "spectral", "lr": 0.1, "polar_dtype": "int64"}, "ctx")
