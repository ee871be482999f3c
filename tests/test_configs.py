"""The shipped run configs: generated, valid, and faithful to the paper's protocol tables."""

import importlib.util
import re
from pathlib import Path

import pytest

from equiopt.models import build
from equiopt.roles import build_optimizer
from equiopt.study.experiments import AUX_LOSS, PROTOCOLS, SCALES, SOFTCAP, Z_LOSS, experiments, run_config
from equiopt.train import from_dict, load_config, train

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
PAPER_TEX = sorted((ROOT.parent / "shared" / "paper").glob("*.tex"))


def _generator():
    spec = importlib.util.spec_from_file_location("configs_generate", CONFIGS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_configs_are_what_the_generator_writes(capsys):
    assert _generator().main(["--check"]) == 0, capsys.readouterr().out


def test_every_shipped_config_validates():
    files = sorted(CONFIGS.rglob("*.toml"))
    assert len(files) == len(SCALES) * len(experiments())
    for path in files:
        cfg = load_config(path)
        scale, family, name = path.relative_to(CONFIGS).with_suffix("").parts
        assert cfg.model.family == family and cfg.out_path == Path("runs") / scale / family / name


def test_experiment_coverage_matches_the_paper():
    names = {fam: {e.name for e in experiments(fam)} for fam in PROTOCOLS}
    table = {f"{g}-{c}" for g in "ab" for c in ("i", "ii", "iii")}
    assert names["qwen3"] == table
    assert names["gemma3"] == {n + s for n in table | {"b-i-head-adamw", "b-ii-head-adamw"} for s in ("", "-softcap")}
    assert names["olmoe"] == {"i", "ii", "iii", "iv"}
    routers = {f"router-{r}" for r in ("row", "left-centered", "left-uncentered", "hybrid", "adamw")}
    assert names["gpt_oss"] == {n + s for n in {"i", "ii", "iii", "iv"} | routers for s in ("", "-aux")}


@pytest.mark.parametrize("scale", SCALES)
def test_switches_are_set_exactly_where_the_experiment_flips_them(scale):
    for e in experiments():
        cfg = from_dict(run_config(e, scale))
        capped = cfg.model.overrides.get("final_logit_softcapping")
        assert capped == (SOFTCAP if e.name.endswith("-softcap") else None), e.name
        aux = e.name.endswith("-aux")
        assert (cfg.train.aux_loss, cfg.train.z_loss) == ((AUX_LOSS, Z_LOSS) if aux else (0.0, 0.0)), e.name
        assert cfg.optim.recipe == "paper:{}:{}".format(
            e.family, re.sub(r"(-head-adamw)?(-softcap|-aux)?$", "", e.name)
        )


def test_paper_scale_uses_the_paper_protocol():
    for e in experiments():
        p, cfg = PROTOCOLS[e.family], from_dict(run_config(e, "paper"))
        assert cfg.model.size == "paper" and cfg.data.seq_len == p.seq_len
        assert cfg.data.batch_size == p.per_device_batch * p.data_parallel and cfg.data.grad_accum == 1
        assert cfg.train.steps == p.steps and cfg.train.val_batches == p.val_steps
        assert cfg.train.steps * cfg.data.batch_size * cfg.data.seq_len == p.train_tokens
        assert cfg.train.val_batches * cfg.data.batch_size * cfg.data.seq_len == p.val_tokens


@pytest.mark.skipif(not PAPER_TEX, reason="the paper's source is not beside the repository")
def test_protocols_match_the_papers_tables():
    tex = PAPER_TEX[0].read_text()
    fields = {
        "Context length": "seq_len",
        "Per-device batch size": "per_device_batch",
        "Training steps": "steps",
        "Training tokens": "train_tokens",
        "Validation steps": "val_steps",
        "Validation tokens": "val_tokens",
    }
    for family, p in PROTOCOLS.items():
        start = tex.index(f"\\label{{{p.table}}}")
        body = tex[start : tex.index("\\end{tabular}", start)]
        for label, attr in fields.items():
            found = re.search(re.escape(label) + r"\s*&\s*([\d,]+)", body)
            assert found is not None, (family, label)
            assert int(found.group(1).replace(",", "")) == getattr(p, attr), (family, label)
        assert re.search(r"Data-parallel size\s*&\s*(\d+)", body).group(1) == str(p.data_parallel)


def test_head_adamw_variant_changes_only_the_lm_head():
    e = next(x for x in experiments("gemma3") if x.name == "b-i-head-adamw")
    plain = next(x for x in experiments("gemma3") if x.name == "b-i")
    cfg = from_dict(run_config(e, "cpu"))
    base_cfg = from_dict(run_config(plain, "cpu"))  # the same experiment at the same scale, head unchanged
    model = build("gemma3", "tiny")
    opt, _ = build_optimizer(model, cfg.optim.recipe, overrides=cfg.optim.overrides)
    base, _ = build_optimizer(
        build("gemma3", "tiny"), base_cfg.optim.recipe, overrides=base_cfg.optim.overrides or None
    )
    rules = {g["role"]: (g["rule"], g["lr"]) for g in opt.param_groups}
    before = {g["role"]: (g["rule"], g["lr"]) for g in base.param_groups}
    assert rules.pop("lm_head") == ("adamw", 0.0005) and before.pop("lm_head")[0] == "row"
    assert rules == before


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from equiopt.data.prepare import prepare

    rng = __import__("random").Random(1)
    words = "a b c d e f g h i j k l m n o p".split()
    docs = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(60)]
    out = tmp_path_factory.mktemp("cfgdata") / "data"
    prepare(docs, "bytes", out, shard_tokens=50_000, val_fraction=0.1, progress=False)
    return out


@pytest.mark.parametrize(
    "path",
    [
        "cpu/qwen3/b-ii.toml",
        "cpu/gpt_oss/router-left-uncentered-aux.toml",
        "gpu/gemma3/a-i-softcap.toml",
        "paper/olmoe/iv.toml",
    ],
)
def test_shipped_configs_train_at_tiny_size(corpus, tmp_path, path):
    sets = {
        "model.size": "tiny",
        "data.train": str(corpus),
        "data.ood_val": "",
        "data.seq_len": 16,
        "data.batch_size": 4,
        "train.steps": 2,
        "train.val_every": 2,
        "train.val_batches": 1,
        "train.checkpoint_every": 0,
        "train.tensorboard": False,
        "run.out_dir": str(tmp_path),
        "run.device": "cpu",
    }
    cfg = load_config(CONFIGS / path, sets)
    cfg.model.overrides["vocab_size"] = 512  # the byte tokenizer's ids and specials fit
    result = train(cfg, progress=False)
    assert result["status"] == "done" and result["val/loss"] < 10


def test_readme_prepares_the_data_every_config_reads():
    from equiopt.study.experiments import TOKENIZERS, data_dir

    readme = (CONFIGS / "README.md").read_text()
    for family, tokenizer in TOKENIZERS.items():
        assert f"--tokenizer {tokenizer} --out {data_dir('paper', family)}" in readme, family
    for scale in ("gpu", "cpu"):
        assert f"--out {data_dir(scale, 'qwen3')}" in readme
    needed = {load_config(p).data.ood_val for p in CONFIGS.rglob("*.toml")} - {""}
    assert all(f"--out {d}" in readme for d in needed)


def test_downsized_scales_use_the_transferable_embedding_update_and_paper_scale_stays_the_papers():
    from equiopt.study.experiments import DOWNSIZED

    changed = 0
    for e in experiments():
        paper = from_dict(run_config(e, "paper")).optim
        assert paper.overrides == (e.optim_overrides or {})  # the paper's settings exactly
        for scale in ("gpu", "cpu"):
            small = from_dict(run_config(e, scale)).optim
            extra = {r: v for r, v in small.overrides.items() if v != (e.optim_overrides or {}).get(r)}
            for role, change in extra.items():
                assert role in DOWNSIZED and all(
                    small.overrides[role][k] == v for k, v in change.items() if k in DOWNSIZED[role]
                )
            changed += bool(extra)
    assert changed >= 2 * 8  # qwen3 and gemma3 (ii) configs at both downsized scales
