"""The demo's two runs are the held-out study's runs on one evaluation seed: same model,
data settings, schedule and tuned learning rates, so its numbers can be checked against the
study's report."""

from pathlib import Path

import pytest

from equiopt.demos import pretrain
from equiopt.study.paired import base_lrs
from equiopt.study.protocol import load_protocol
from equiopt.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / pretrain.STUDY


@pytest.mark.parametrize("arm", list(pretrain.ARMS))
def test_demo_arm_is_the_study_arm_at_its_chosen_multiplier(arm, tmp_path):
    recipe, mult = pretrain.ARMS[arm]
    config = {"paper:qwen3:a-iii": "a-iii", "paper:qwen3:a-i": "a-i"}[recipe]
    study = load_config(STUDY / "configs" / f"{config}.toml")
    demo = pretrain.arm_config(arm, recipe, mult, tmp_path / "d", tmp_path / "o", tmp_path, pretrain.STEPS, 10)
    assert demo.model == study.model and demo.train == study.train
    assert (demo.data.seq_len, demo.data.batch_size) == (study.data.seq_len, study.data.batch_size)
    assert demo.optim.recipe == study.optim.recipe and demo.run.seed == 10
    # the sweep's run at multiplier m sets each swept role's lr to m x its base lr
    proto = load_protocol(STUDY / "protocol.toml")
    assert mult in proto.multipliers[str(Path(pretrain.STUDY) / "configs" / f"{config}.toml")]
    for role, lr in base_lrs(study, proto.roles).items():
        assert demo.optim.overrides[role]["lr"] == lr * mult
    assert pretrain.SEED in proto.eval_seeds and pretrain.SEED not in proto.tune_seeds
