"""FSDP2 training and distributed checkpoints: 2 gloo processes against one, resumed at another world size."""

import gc
import json
import shutil

import pytest
import torch
import torch.distributed as dist
from test_train import data_dir, make_cfg, records  # noqa: F401  (data_dir is a fixture)

from equiopt.train import ConfigError, Trainer, from_dict, read_checkpoint

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

# The paper's OLMoE recipe (ii): Muon on attention and experts, row-norm on embedding and
# head, left-spectral routers, AdamW on vectors; exact solvers so that one process and two
# agree to float rounding.
RECIPE = {"recipe": "paper:olmoe:ii", "overrides": {"*": {"method": "exact"}}, "clip_grad_norm": 0.5}
STEPS = 8


def _cfg(data_dir, out, strategy="ddp"):
    cfg = make_cfg(data_dir, out, steps=STEPS, log_every=1, checkpoint_every=4).to_dict()
    cfg["optim"] = json.loads(json.dumps(RECIPE))
    cfg["run"]["strategy"] = strategy
    return cfg


def _worker(rank, world, jobs):
    for cfg, resume in jobs:
        trainer = Trainer(from_dict(cfg), resume=resume, progress=False)
        trainer.run()
        del trainer
        gc.collect()


def _copy_checkpoint(src_run, step, dst_run):
    """A run directory holding only ``src_run``'s checkpoint of ``step``, as if it had stopped there."""
    name = f"step_{step:08d}"
    (dst_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_run / "checkpoints" / name, dst_run / "checkpoints" / name)
    (dst_run / "checkpoints" / "latest").write_text(name)


def _assert_same_run(run, reference, rtol=2e-4, atol=2e-5):
    a, b = read_checkpoint(run / "checkpoints"), read_checkpoint(reference / "checkpoints")
    assert a["step"] == b["step"] == STEPS
    for name, want in b["model"].items():
        torch.testing.assert_close(a["model"][name], want, rtol=rtol, atol=atol, msg=name)
    # every state key of every parameter, counters included
    assert {k: set(v) for k, v in a["optimizer"]["state"].items()} == {
        k: set(v) for k, v in b["optimizer"]["state"].items()
    }
    for name, state in b["optimizer"]["state"].items():
        for key, want in state.items():
            torch.testing.assert_close(
                a["optimizer"]["state"][name][key], want, rtol=rtol, atol=atol, msg=f"{name}.{key}"
            )
    assert a["scheduler"] == b["scheduler"] and a["loader"] == b["loader"]
    losses = {r["step"]: r["loss"] for r in records(run, "train")}
    want = {r["step"]: r["loss"] for r in records(reference, "train")}
    assert set(want) <= set(losses) or min(losses) > 1  # a resumed run logs only the steps it trained
    for step, loss in losses.items():
        assert loss == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    assert records(run, "val")[-1]["val/loss"] == pytest.approx(records(reference, "val")[-1]["val/loss"], rel=1e-5)


def _write_toml(cfg, path):
    from equiopt._tomlw import toml_tables

    path.write_text(
        toml_tables({section: {k: v for k, v in table.items() if v is not None} for section, table in cfg.items()})
    )
    return path


@pytest.mark.slow
def test_fsdp2_trains_like_one_process_and_checkpoints_resume_at_another_world_size(data_dir, tmp_path, gloo, torchrun):
    torch.set_num_threads(1)
    single = tmp_path / "single"
    Trainer(from_dict(_cfg(data_dir, single)), progress=False).run()
    # 2 ranks, sharded, from scratch
    fsdp = tmp_path / "fsdp2"
    gloo(_worker, 2, [(_cfg(data_dir, fsdp, "fsdp2"), False)])
    meta = records(fsdp, "meta")[0]
    assert (meta["world_size"], meta["strategy"]) == (2, "fsdp2")
    _assert_same_run(fsdp, single)
    # 2 -> 1: the sharded checkpoint of step 4, resumed in one process
    two_to_one = tmp_path / "two-to-one"
    _copy_checkpoint(fsdp, 4, two_to_one)
    saved = json.loads((two_to_one / "checkpoints" / "step_00000004" / "checkpoint.json").read_text())
    assert (saved["world_size"], saved["strategy"]) == (2, "fsdp2")
    assert sorted(p.name for p in (two_to_one / "checkpoints" / "step_00000004").glob("rank_*.json")) == [
        "rank_00000.json",
        "rank_00001.json",
    ]
    Trainer(from_dict(_cfg(data_dir, two_to_one)), resume=True, progress=False).run()
    _assert_same_run(two_to_one, single)
    # 1 -> 2, as a user runs it: `equiopt train --resume` under torchrun
    one_to_two = tmp_path / "one-to-two"
    _copy_checkpoint(single, 4, one_to_two)
    toml = _write_toml(_cfg(data_dir, one_to_two, "fsdp2"), tmp_path / "run.toml")
    torchrun("-m", "equiopt", "train", toml, "--resume", timeout=300)
    meta = records(one_to_two, "meta")[0]
    assert meta["resumed_from"].endswith("step_00000004")
    assert (meta["saved_world_size"], meta["saved_strategy"], meta["world_size"], meta["strategy"]) == (
        1,
        "single",
        2,
        "fsdp2",
    )
    assert records(one_to_two, "end")[-1]["status"] == "done"
    _assert_same_run(one_to_two, single)


def test_strategy_is_validated(data_dir):
    base = {"model": {"family": "qwen3"}, "data": {"train": str(data_dir)}}
    assert from_dict(base).run.strategy == "ddp"
    assert from_dict({**base, "run": {"strategy": "fsdp2"}}).run.strategy == "fsdp2"
    with pytest.raises(ConfigError, match=r"\[run\]\.strategy: expected 'ddp' or 'fsdp2', got 'fsdp'"):
        from_dict({**base, "run": {"strategy": "fsdp"}})
