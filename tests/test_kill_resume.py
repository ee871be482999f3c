"""kill -9 at random moments of a ``torchrun --nproc_per_node=2`` FSDP2 run that checkpoints
every step, then ``--resume``: nothing is lost.

Resumed at 2 processes the run ends bit for bit where an uninterrupted run ends (weights,
optimizer state, scheduler, data position, every logged loss); every checkpoint a kill
left visible is intact. Then rank 1's shard of the last checkpoint is truncated:
``--resume-from`` it fails with a message naming the file and the intact checkpoint, and
``--resume`` falls back to that one with a warning and again ends bit for bit. Resumed at 1 process from a
checkpoint the killed 2-process run wrote, it ends within float rounding of it: gradients
are summed in another order (one process against gloo's reduce-scatter of two), which
with the exact (SVD) solvers of the recipe moves weights and optimizer state by at most
``rtol=2e-4, atol=2e-5`` and losses by ``1e-5`` relative after 16 steps (the tolerances
of the FSDP2 world-size tests in ``test_sharded_train.py``).

Opt-in (``soak``): ``EQUIOPT_SLOW_TESTS=1 pytest tests/test_kill_resume.py`` or
``pytest -m soak``. Linux only (reads ``/proc`` to find torchrun's worker processes).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import torchrun_command
from test_train import data_dir, make_cfg  # noqa: F401  (data_dir is a fixture)

from equiopt.study.plots import read_run
from equiopt.train import Trainer, check_checkpoint, from_dict, latest_checkpoint, read_checkpoint

pytestmark = [
    pytest.mark.soak,
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find torchrun's workers"),
]

STEPS = 16
KILLS = int(os.environ.get("EQUIOPT_KILLS", "5"))
RECIPE = {"recipe": "paper:olmoe:ii", "overrides": {"*": {"method": "exact"}}, "clip_grad_norm": 0.5}


def _cfg(data_dir, out):
    cfg = make_cfg(
        data_dir, out, steps=STEPS, log_every=1, val_every=8, checkpoint_every=1, keep_checkpoints=2
    ).to_dict()
    cfg["optim"] = json.loads(json.dumps(RECIPE))
    cfg["run"]["strategy"] = "fsdp2"
    return cfg


def _write_toml(cfg, path):
    from equiopt._tomlw import toml_tables

    path.write_text(toml_tables({s: {k: v for k, v in t.items() if v is not None} for s, t in cfg.items()}))
    return path


def _launch(toml, log, *resume):
    cmd, env = torchrun_command("-m", "equiopt", "train", toml, *(resume or ("--resume",)))
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid):
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _losses(run):
    return {r["step"]: r["loss"] for r in read_run(run).records["train"]}


def _step(path):
    return int(path.name.split("_")[1]) if path is not None else 0


def _train_records(run):
    log = run / "log.jsonl"
    if not log.is_file():
        return 0
    return sum('"kind": "train"' in line for line in log.read_text(errors="replace").splitlines())


def test_kill_9_at_random_moments_then_resume_loses_nothing(data_dir, tmp_path):
    seed = int(os.environ.get("EQUIOPT_KILL_SEED", time.time_ns() % 2**31))
    rng = random.Random(seed)
    # the uninterrupted reference, timed
    reference = tmp_path / "reference"
    start = time.monotonic()
    with open(tmp_path / "reference.log", "w") as log:
        assert _launch(_write_toml(_cfg(data_dir, reference), tmp_path / "reference.toml"), log).wait(600) == 0, (
            tmp_path / "reference.log"
        ).read_text()[-3000:]
    took = time.monotonic() - start
    times = [r["time"] for r in read_run(reference).records["train"]]
    window = times[-1] - times[0]  # training and checkpointing, without the start-up
    # the same run, killed K times at random moments: all processes at once (a machine
    # that dies) or one worker (a rank that dies; torchrun stops the other). Most kills
    # fall while it trains and checkpoints (a random time after its first step in this
    # attempt); one in four anywhere from the launch (start-up, the resume's own loading)
    run = tmp_path / "killed"
    toml = _write_toml(_cfg(data_dir, run), tmp_path / "killed.toml")
    kills, copied, at, attempt = [], None, [], 0
    while len(kills) < KILLS:
        attempt += 1
        assert attempt <= 3 * KILLS, f"the runs kept finishing before their kills: {kills}"
        before = _train_records(run)
        found = latest_checkpoint(run / "checkpoints")
        done = _step(found)
        if done == STEPS:
            break
        with open(tmp_path / f"attempt{attempt}.log", "w") as log:
            proc = _launch(toml, log)
            anywhere = rng.random() < 0.25
            if not anywhere:
                while proc.poll() is None and _train_records(run) == before:
                    time.sleep(0.02)
            left = 0.8 * window * (STEPS - done) / STEPS
            delay = rng.uniform(0, took - window + left if anywhere else left)
            try:
                proc.wait(timeout=delay)
                if len(kills) >= 2:
                    break  # finished before its kill
                shutil.rmtree(run)  # finished before its kill (a loaded machine): start over
                kills, copied, at = [], None, []
                shutil.rmtree(tmp_path / "one-process", ignore_errors=True)
                continue
            except subprocess.TimeoutExpired:
                pass
            workers = _descendants(proc.pid)
            what = "all" if rng.random() < 0.5 or not workers else "one rank"
            _kill(workers + [proc.pid] if what == "all" else [rng.choice(workers)])
            try:
                proc.wait(timeout=120)
            finally:
                _kill(_descendants(proc.pid) + [proc.pid])
                proc.wait()
            kills.append(
                (what, "from launch" if anywhere else "while training", round(delay, 2), _train_records(run) - before)
            )
        found = latest_checkpoint(run / "checkpoints")
        at.append(found.name if found else None)
        # every visible checkpoint a kill left is intact (atomic writes; the manifest agrees)
        for ckpt in (run / "checkpoints").glob("step_*") if (run / "checkpoints").is_dir() else ():
            assert check_checkpoint(ckpt) == [], (kills, ckpt)
        if copied is None and found is not None and found.name != f"step_{STEPS:08d}":
            copied = tmp_path / "one-process"  # to resume at 1 process later
            (copied / "checkpoints").mkdir(parents=True)
            shutil.copytree(found, copied / "checkpoints" / found.name)
            (copied / "checkpoints" / "latest").write_text(found.name)
    with open(tmp_path / "final.log", "w") as log:
        assert _launch(toml, log).wait(600) == 0, (tmp_path / "final.log").read_text()[-3000:]
    info = f"seed {seed}; kills (how, when, delay, steps logged) {kills}; latest intact after each: {at}"
    print(info)
    # 2 processes: bit for bit
    a, b = read_checkpoint(run / "checkpoints"), read_checkpoint(reference / "checkpoints")
    assert a["step"] == b["step"] == STEPS, info
    for name, want in b["model"].items():
        assert torch.equal(a["model"][name], want), (name, info)
    assert set(a["optimizer"]["state"]) == set(b["optimizer"]["state"])
    for name, state in b["optimizer"]["state"].items():
        for key, want in state.items():
            assert torch.equal(a["optimizer"]["state"][name][key], want), (name, key, info)
    assert a["scheduler"] == b["scheduler"] and a["loader"] == b["loader"], info
    assert _losses(run) == _losses(reference), info  # every step's loss, as floats, exactly
    assert read_run(run).records["val"][-1]["val/loss"] == read_run(reference).records["val"][-1]["val/loss"]
    # damage at 2 processes: rank 1's shard of the last checkpoint truncated. --resume-from
    # it fails naming the file and the intact checkpoint; --resume falls back to it, warns,
    # and ends bit for bit where the reference does
    last = run / "checkpoints" / f"step_{STEPS:08d}"
    shard = last / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with open(tmp_path / "resume-from.log", "w") as log:
        assert _launch(toml, log, "--resume-from", str(last)).wait(600) != 0
    text = (tmp_path / "resume-from.log").read_text()
    assert f"{last} is damaged: __1_0.distcp is truncated" in text, text[-3000:]
    assert f"intact checkpoints in {run / 'checkpoints'}: step_{STEPS - 1:08d}" in text
    # no traceback through equiopt or DCP (torchrun prints its own ChildFailedError summary)
    assert "CheckpointException" not in text and "equiopt/train" not in text and "distributed/checkpoint" not in text
    with open(tmp_path / "fallback.log", "w") as log:
        assert _launch(toml, log).wait(600) == 0, (tmp_path / "fallback.log").read_text()[-3000:]
    text = (tmp_path / "fallback.log").read_text()
    assert "CheckpointWarning" in text and f"{last} is damaged: __1_0.distcp is truncated" in text
    meta = [r for r in read_run(run).records["meta"] if "resumed_from" in r][-1]
    assert meta["resumed_from"].endswith(f"step_{STEPS - 1:08d}") and meta["skipped_damaged"]
    again = read_checkpoint(run / "checkpoints")
    assert again["step"] == STEPS and all(torch.equal(again["model"][n], t) for n, t in b["model"].items())
    assert _losses(run) == _losses(reference)
    # 1 process, from a checkpoint the killed 2-process run wrote: float rounding
    if copied is None:
        pytest.skip(f"no kill left a checkpoint before the last step to resume at 1 process ({info})")
    torch.set_num_threads(1)
    trainer = Trainer(from_dict(_cfg(data_dir, copied)), resume=True, progress=False)
    assert trainer.dist.world_size == 1 and 0 < trainer.step < STEPS
    trainer.run()
    c = read_checkpoint(copied / "checkpoints")
    assert c["step"] == STEPS and c["world_size"] == 1
    for name, want in b["model"].items():
        torch.testing.assert_close(c["model"][name], want, rtol=2e-4, atol=2e-5, msg=f"{name} {info}")
    for name, state in b["optimizer"]["state"].items():
        for key, want in state.items():
            torch.testing.assert_close(
                c["optimizer"]["state"][name][key], want, rtol=2e-4, atol=2e-5, msg=f"{name}.{key} {info}"
            )
    assert c["scheduler"] == b["scheduler"] and c["loader"] == b["loader"]
    want = _losses(reference)
    for step, loss in _losses(copied).items():
        assert loss == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, info)
