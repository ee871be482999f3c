"""Runs side by side (RunPool, ``equiopt compare --jobs``): the same runs and choices as one at a
time, at most ``jobs`` at once, evaluation only after the arm's tuning and behind every arm's tuning,
clear failures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from equiopt.study.paired import sweep
from equiopt.study.runpool import RunFailed, RunPool

HERE = Path(__file__).resolve().parent
MULTS = [0.5, 2.0]


def _configs(tmp_path, base_lrs=(0.02, 0.005)):
    tmp_path.mkdir(parents=True, exist_ok=True)
    configs = []
    for arm, lr in zip(("a", "b"), base_lrs):
        p = tmp_path / f"{arm}.toml"
        p.write_text(
            f'[run]\nname = "{arm}"\nout_dir = "{tmp_path / "runs" / arm}"\n[model]\nfamily = "qwen3"\n'
            f'[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n'
            f"[optim.overrides.attention]\nlr = {lr}\n"
        )
        configs.append(str(p))
    return configs


@pytest.fixture
def trainer_env(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RUNPOOL_TEST_SLEEP", "2")


def _when(path) -> tuple[float, float, int]:
    return tuple(json.loads((Path(path) / "when.json").read_text())[:3])


def test_runs_side_by_side_give_the_runs_and_choices_of_one_at_a_time(tmp_path, trainer_env, monkeypatch):
    import _runpool_trainer

    monkeypatch.setenv("RUNPOOL_TEST_SLEEP", "0")
    one = sweep(
        _configs(tmp_path / "one"), MULTS, seeds=[10], roles=["attention"], tune_seeds=[0],
        train_fn=_runpool_trainer.quadratic, progress=False,
    )  # fmt: skip
    monkeypatch.setenv("RUNPOOL_TEST_SLEEP", "2")
    two = sweep(
        _configs(tmp_path / "two"), MULTS, seeds=[10], roles=["attention"], tune_seeds=[0],
        jobs=2, trainer="_runpool_trainer:quadratic", progress=False,
    )  # fmt: skip
    for a, b in zip(one, two):
        assert a.base_lrs == b.base_lrs
        assert {m: sorted(s) for m, s in a.runs.items()} == {m: sorted(s) for m, s in b.runs.items()}
    # arm a (base lr 0.02) is best at x0.5, arm b (0.005) at x2: both evaluated there
    assert sorted(two[0].runs[0.5]) == [0, 10] and sorted(two[1].runs[2.0]) == [0, 10]
    for arm_one, arm_two in zip(one, two):
        for mult, seeds in arm_two.runs.items():
            for seed, path in seeds.items():
                mine = json.loads(Path(path, "log.jsonl").read_text().splitlines()[0])
                theirs = json.loads(Path(arm_one.runs[mult][seed], "log.jsonl").read_text().splitlines()[0])
                assert mine == theirs
    paths = [p for arm in two for seeds in arm.runs.values() for p in seeds.values()]
    spans = [_when(p) for p in paths]
    assert len({pid for *_, pid in spans}) == len(spans)  # each run in a process of its own
    assert os.getpid() not in {pid for *_, pid in spans}
    events = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    assert peak == 2  # two at once, never more
    for arm in two:  # an arm's evaluation starts after every one of its tuning runs ended
        best = next(m for m, s in arm.runs.items() if 10 in s)
        tuned = max(_when(arm.runs[m][0])[1] for m in MULTS)
        assert _when(arm.runs[best][10])[0] >= tuned
    tuning = [_when(arm.runs[m][0]) for arm in two for m in MULTS]
    evaluation = [_when(arm.runs[m][10]) for arm in two for m in MULTS if 10 in arm.runs[m]]
    assert max(s for s, *_ in tuning) <= min(s for s, *_ in evaluation)  # every arm's tuning goes first


def test_a_failed_run_stops_the_pool_and_names_itself(tmp_path, trainer_env):
    (config, _) = _configs(tmp_path)
    pool = RunPool(2, trainer="_runpool_trainer:broken")
    with pool, pytest.raises(RunFailed, match=r"run (a-[xy]) exited with code 1(.|\n)*no data for \1"):
        pool.submit("x", config, {"run.name": "a-x"})
        pool.submit("y", config, {"run.name": "a-y", "run.out_dir": str(tmp_path / "y")})
        pool.submit("z", config, {"run.name": "a-z", "run.out_dir": str(tmp_path / "z")}, priority=1)
        while len(pool):
            pool.wait()
    assert len(pool) == 0  # the queue is dropped and no run is left going


def test_a_diverged_run_is_a_result_not_a_failure(tmp_path, trainer_env):
    (config, _) = _configs(tmp_path)
    with RunPool(2, trainer="_runpool_trainer:diverging") as pool:
        pool.submit("x", config, {"run.name": "a-x"})
        assert pool.wait() == ["x"]
    last = json.loads((tmp_path / "runs" / "a" / "log.jsonl").read_text().splitlines()[-1])
    assert last["status"] == "nonfinite"


def test_closing_the_pool_ends_the_runs_still_going(tmp_path, trainer_env, monkeypatch):
    monkeypatch.setenv("RUNPOOL_TEST_SLEEP", "60")
    (config, _) = _configs(tmp_path)
    pool = RunPool(2, trainer="_runpool_trainer:quadratic")
    pool.submit("x", config, {"run.name": "a-x"})
    pool.submit("y", config, {"run.name": "a-y"})
    pool._start(*pool._queue.pop()[2:])  # start one without waiting for it
    (proc,) = pool._running
    pool.close()
    assert proc.poll() is not None and len(pool) == 0


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        RunPool(0)
    with pytest.raises(ValueError, match="trainer='module:function'"):
        RunPool(2, train_fn=lambda cfg, progress: None)
    with pytest.raises(ValueError, match="trainer must be 'module:function'"):
        RunPool(2, trainer="equiopt.train.loop.train")
    configs = _configs(tmp_path)
    cmd = [sys.executable, "-m", "equiopt", "compare", *configs, "--jobs", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode != 0 and "--jobs: runs side by side are for learning-rate sweeps" in done.stderr
    done = subprocess.run([*cmd[:-1], "0"], capture_output=True, text=True)
    assert done.returncode != 0 and "expected a positive integer, got '0'" in done.stderr


def test_runs_are_spread_over_the_gpus_each_seeing_one(tmp_path, trainer_env):
    (config, _) = _configs(tmp_path)
    with RunPool(2, trainer="_runpool_trainer:quadratic", devices=["3", "5"]) as pool:
        for k in range(4):
            sets = {
                "run.name": f"a-{k}",
                "run.out_dir": str(tmp_path / str(k)),
                "optim.overrides": {"attention": {"lr": 0.01}},
            }
            pool.submit(k, config, sets)
        while len(pool):
            pool.wait()
    runs = [json.loads((tmp_path / str(k) / "when.json").read_text()) for k in range(4)]
    assert sorted(r[3] for r in runs) == ["3", "3", "5", "5"]
    for a in runs:  # runs that overlapped in time saw different GPUs
        for b in runs:
            if a is not b and a[0] < b[1] and b[0] < a[1]:
                assert a[3] != b[3]


def test_the_gpus_a_pool_spreads_over(monkeypatch):
    from equiopt.study.runpool import _visible_gpus

    assert _visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 7"}) == ["2", "7"]
    assert _visible_gpus({"CUDA_VISIBLE_DEVICES": "4"}) is None and _visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert RunPool(2).devices == ["0", "1"] and RunPool(1).devices == []
    assert RunPool(2, devices=None).devices == []
    with pytest.raises(ValueError, match="devices must be 'auto', None or a list of GPU ids"):
        RunPool(2, devices="cuda")
