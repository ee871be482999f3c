"""The config sanity check (scripts/check_configs.py): its verdict on synthetic logs, and
the opt-in soak check that trains every CPU config briefly (EQUIOPT_SLOW_TESTS=1 or -m soak)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_configs", ROOT / "scripts" / "check_configs.py")
check_configs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_configs)


def write_log(path, weight_rms, val, status="done"):
    path.mkdir(parents=True, exist_ok=True)
    recs = [
        {"kind": "train", "step": 10, "loss": 5.0, "weight_rms/embedding": weight_rms, "weight_rms/attention": 0.05},
        {"kind": "val", "step": 10, "val/loss": val},
        {"kind": "end", "step": 10, "status": status},
    ]
    (path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_check_flags_exploding_weights_losses_and_divergence(tmp_path):
    write_log(tmp_path / "good", 0.5, 6.0)
    ok, info = check_configs.check_run(tmp_path / "good", 4096, 5.0, 0.0)
    assert ok and info["max_weight_rms"]["embedding"] == 0.5
    write_log(tmp_path / "big", 96.0, 6.0)
    ok, info = check_configs.check_run(tmp_path / "big", 4096, 5.0, 0.0)
    assert not ok and "weight_rms/embedding reached 96" in info["problems"][0]
    write_log(tmp_path / "loss", 0.5, 27.6)  # worse than a uniform guess, ln 4096 = 8.3
    ok, info = check_configs.check_run(tmp_path / "loss", 4096, 5.0, 0.0)
    assert not ok and "val/loss" in info["problems"][0]
    write_log(tmp_path / "nan", 0.5, float("nan"), status="nonfinite")
    assert not check_configs.check_run(tmp_path / "nan", 4096, 5.0, 0.0)[0]


@pytest.mark.soak  # trains every CPU config for 50 steps (about 30 minutes on 2 cores); EQUIOPT_SLOW_TESTS=1
@pytest.mark.skipif(not (ROOT / "data" / "poetry-bpe4096").exists(), reason="CPU data not prepared (configs/README.md)")
def test_every_cpu_config_trains_sanely(tmp_path):
    os.chdir(ROOT)
    assert check_configs.main(["--out", str(tmp_path / "check")]) == 0
