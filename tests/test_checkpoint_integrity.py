"""Checkpoints that survive damage: a manifest of every rank's files (sizes, SHA-256) written
with the checkpoint and verified at load; a damaged latest checkpoint is skipped for the
newest intact one with a warning, and one named directly fails with a message that says
what is damaged and which checkpoints are intact. One process, and 2 gloo processes."""

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from test_train import data_dir, make_cfg, records  # noqa: F401  (data_dir is a fixture)

from equiopt.train import (
    CheckpointError,
    CheckpointWarning,
    Trainer,
    check_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)

STEP = "step_{:08d}".format


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path, where=0.5):
    data = bytearray(path.read_bytes())
    i = int(len(data) * where)
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _garble_json(path):
    path.write_text(path.read_text().replace('"step"', '"stpe"', 1))  # same size, other bytes


# kind -> (file, how, what the problem line says)
DAMAGE = {
    "truncated shard": ("__0_0.distcp", _truncate, r"__0_0\.distcp is truncated \(\d+ of \d+ bytes\)"),
    "flipped byte": ("__0_0.distcp", _flip, r"__0_0\.distcp is damaged \(its SHA-256 differs"),
    "damaged checkpoint.json": ("checkpoint.json", _garble_json, r"checkpoint\.json is damaged"),
    "missing file": ("__0_0.distcp", os.unlink, r"__0_0\.distcp is missing"),
    "missing rank file": ("rank_00000.json", os.unlink, r"rank_00000\.json is missing"),
    "damaged metadata": (".metadata", lambda p: _flip(p, 0.9), r"\.metadata is damaged"),
    "damaged manifest": ("manifest.json", lambda p: _flip(p, 0.5), r"manifest\.json is damaged"),
    "missing manifest": ("manifest.json", os.unlink, r"manifest\.json is missing"),
}


def _tensors(step):
    return {"w": torch.full((4, 3), float(step)), "opt": {"m": torch.arange(5.0) + step}}


def _template():
    return {"w": torch.empty(4, 3), "opt": {"m": torch.empty(5)}}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_or_fails_by_name(tmp_path, kind):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, _tensors(step), {"note": step}, {"rng": step}, keep=0)
    assert check_checkpoint(tmp_path / STEP(2)) == []
    name, damage, says = DAMAGE[kind]
    damage(tmp_path / STEP(2) / name)
    problems = check_checkpoint(tmp_path / STEP(2))
    assert len(problems) >= 1 and any(__import__("re").match(says, p) for p in problems), problems
    assert latest_checkpoint(tmp_path).name == STEP(1)
    # a run's directory: the newest intact checkpoint, and a warning naming the damaged one
    template = _template()
    with pytest.warns(CheckpointWarning, match=rf"{STEP(2)} is damaged: .*{says}.*Resuming from .*{STEP(1)}"):
        path, extras, mine = load_checkpoint(tmp_path, template)
    assert (path.name, extras["note"], mine) == (STEP(1), 1, {"rng": 1})
    assert torch.equal(template["w"], torch.full((4, 3), 1.0))
    assert torch.equal(template["opt"]["m"], torch.arange(5.0) + 1)
    # the damaged checkpoint named directly: what is damaged, and which are intact
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no DCP traceback or warning on the way
        intact = rf"{STEP(2)} is damaged: .*{says}.*intact checkpoints in .*: {STEP(1)}$"
        with pytest.raises(CheckpointError, match=intact):
            load_checkpoint(tmp_path / STEP(2), _template())
        with pytest.raises(CheckpointError, match=rf"{STEP(2)} is damaged: .*{says}"):
            read_checkpoint(tmp_path / STEP(2))
    assert read_checkpoint(tmp_path)["note"] == 1


def test_the_manifest_lists_every_file_with_its_size_and_hash(tmp_path):
    import hashlib

    path = save_checkpoint(tmp_path, 3, _tensors(3), {"note": 3}, {"rng": 0})
    manifest = json.loads((path / "manifest.json").read_text())
    files = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files == {".metadata", "__0_0.distcp", "checkpoint.json", "rank_00000.json"}
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert json.loads((path / "checkpoint.json").read_text())["manifest"] == "manifest.json"


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    save_checkpoint(tmp_path, 1, _tensors(1))
    _truncate(tmp_path / STEP(1) / "__0_0.distcp")
    with pytest.raises(
        CheckpointError,
        match=rf"no intact checkpoint in .*{STEP(1)} is damaged: __0_0\.distcp is "
        r"truncated.*Remove the damaged checkpoints",
    ):
        load_checkpoint(tmp_path, _template())
    with pytest.raises(CheckpointError, match=r"there is no intact checkpoint in"):
        load_checkpoint(tmp_path / STEP(1), _template())
    # an empty or absent directory: nothing to resume, no error
    assert load_checkpoint(tmp_path / "nothing", _template()) is None


def test_checkpoints_without_a_manifest_still_load(tmp_path):
    """Checkpoints of earlier versions have no manifest and a checkpoint.json that names none."""
    path = save_checkpoint(tmp_path, 1, _tensors(1), {"note": 1})
    (path / "manifest.json").unlink()
    meta = json.loads((path / "checkpoint.json").read_text())
    del meta["manifest"]
    (path / "checkpoint.json").write_text(json.dumps(meta))
    assert check_checkpoint(path) == []
    template = _template()
    assert load_checkpoint(tmp_path, template)[1]["note"] == 1 and torch.equal(template["w"], torch.ones(4, 3))


def test_a_template_the_checkpoint_does_not_fit_fails_without_a_dcp_traceback(tmp_path):
    save_checkpoint(tmp_path, 1, _tensors(1))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, {**_template(), "extra": torch.empty(2)})
    text = str(err.value)
    assert STEP(1) in text and "extra" in text and "Traceback" not in text


def test_a_crash_while_pruning_leaves_no_visible_half_checkpoint(tmp_path, monkeypatch):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, _tensors(step), keep=2)
    import shutil

    real = shutil.rmtree

    def crash(path, *args, **kwargs):
        if str(path).endswith(".deleted") and os.path.isdir(path):
            for f in sorted(os.listdir(path))[:2]:  # half deleted when the process dies
                os.unlink(os.path.join(path, f))
            raise KeyboardInterrupt("killed while pruning")
        return real(path, *args, **kwargs)

    monkeypatch.setattr("equiopt.train.checkpoint.shutil.rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, _tensors(3), keep=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["latest", STEP(2), STEP(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_checkpoint(tmp_path, _template())[0].name == STEP(3)
    (tmp_path / ".latest.abc123.tmp").write_text(STEP(9))  # a pointer update that died half-way
    save_checkpoint(tmp_path, 4, _tensors(4), keep=2)  # and the next save clears both
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", STEP(3), STEP(4)]


# --------------------------------------------------------------- the trainer and the CLI
def test_resume_skips_a_truncated_shard_and_resume_from_names_what_is_damaged(data_dir, tmp_path):
    from equiopt.cli import main

    torch.set_num_threads(1)
    straight = Trainer(make_cfg(data_dir, tmp_path / "a", steps=8), progress=False)
    straight.run()
    run = tmp_path / "b"
    Trainer(make_cfg(data_dir, run, steps=8), progress=False).run()
    ckpts = run / "checkpoints"
    _truncate(ckpts / STEP(8) / "__0_0.distcp")
    skipped = rf"{STEP(8)} is damaged: __0_0\.distcp is truncated.*Resuming from .*{STEP(4)}"
    with pytest.warns(CheckpointWarning, match=skipped):
        resumed = Trainer(make_cfg(data_dir, run, steps=8), resume=True, progress=False)
    assert resumed.step == 4
    resumed.run()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    meta = [r for r in records(run, "meta") if "resumed_from" in r][-1]
    assert meta["resumed_from"].endswith(STEP(4)) and "__0_0.distcp is truncated" in meta["skipped_damaged"][0]
    assert check_checkpoint(ckpts / STEP(8)) == []  # written again by the resumed run
    # --resume-from a damaged checkpoint: a one-line error naming the file and the intact checkpoints
    from test_sharded_train import _write_toml

    toml = _write_toml(make_cfg(data_dir, run, steps=8).to_dict(), tmp_path / "run.toml")
    _flip(ckpts / STEP(8) / "rank_00000.json")
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(toml), "--resume-from", str(ckpts / STEP(8))])
    message = str(exit_.value.code)
    assert f"{STEP(8)} is damaged: rank_00000.json is damaged" in message
    assert message.endswith(f"intact checkpoints in {ckpts}: {STEP(4)}") and "Traceback" not in message
    with pytest.raises(
        SystemExit,
        match=r"not a checkpoint directory \(it holds step_00000004, step_00000008: "
        r"name one of them, or resume the run with --resume\)",
    ):
        main(["train", str(toml), "--resume-from", str(ckpts)])
    # --resume-from an intact one continues from there (step 4 of the same run)
    main(["train", str(toml), "--resume-from", str(ckpts / STEP(4))])
    meta = [r for r in records(run, "meta") if "resumed_from" in r][-1]
    assert meta["resumed_from"] == str(ckpts / STEP(4)) and records(run, "end")[-1]["status"] == "done"
    final = read_checkpoint(ckpts)
    for name, want in straight.model.state_dict().items():
        assert torch.equal(final["model"][name], want), name


# ------------------------------------------------------------------ 2 gloo processes
def _two_rank_worker(rank, world, root):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    def tensors(step):  # every rank writes its own half of each tensor
        return {
            "w": distribute_tensor(torch.arange(24.0).reshape(8, 3) + step, mesh, [Shard(0)]),
            "opt": {"m": distribute_tensor(torch.arange(6.0) * step, mesh, [Shard(0)])},
        }

    def template():
        return {
            "w": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)]),
            "opt": {"m": distribute_tensor(torch.zeros(6), mesh, [Shard(0)])},
        }

    for kind, (name, damage, says) in TWO_RANK_DAMAGE.items():
        directory = root / kind.replace(" ", "_")
        for step in (1, 2):
            save_checkpoint(directory, step, tensors(step), {"note": step}, {"rank": rank}, keep=0)
        manifest = json.loads((directory / STEP(2) / "manifest.json").read_text())
        assert set(manifest["files"]) == {
            ".metadata",
            "checkpoint.json",
            "__0_0.distcp",
            "__1_0.distcp",
            "rank_00000.json",
            "rank_00001.json",
        }
        dist.barrier()
        if rank == 0:
            damage(directory / STEP(2) / name)
        dist.barrier()
        got = template()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path, extras, mine = load_checkpoint(directory, got)
        assert (path.name, extras["note"], mine) == (STEP(1), 1, {"rank": rank}), kind
        assert torch.equal(got["w"].full_tensor(), torch.arange(24.0).reshape(8, 3) + 1), kind
        assert torch.equal(got["opt"]["m"].full_tensor(), torch.arange(6.0)), kind
        shown = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        if rank == 0:  # warned once, by rank 0
            assert len(shown) == 1 and __import__("re").search(rf"{STEP(2)} is damaged: {says}", shown[0]), shown
        else:
            assert shown == []
        try:
            load_checkpoint(directory / STEP(2), template())
            raise AssertionError(f"{kind}: a damaged checkpoint loaded")
        except CheckpointError as err:  # the same message on every rank
            messages = [None] * world
            dist.all_gather_object(messages, str(err))
            assert messages[0] == messages[1], messages
            assert __import__("re").search(
                rf"{STEP(2)} is damaged: {says}.*intact checkpoints in .*: {STEP(1)}$", messages[0]
            ), messages[0]


TWO_RANK_DAMAGE = {
    "rank 1 shard truncated": ("__1_0.distcp", _truncate, r"__1_0\.distcp is truncated"),
    "rank 1 shard flipped byte": ("__1_0.distcp", _flip, r"__1_0\.distcp is damaged"),
    "rank 0 shard missing": ("__0_0.distcp", os.unlink, r"__0_0\.distcp is missing"),
    "rank 1 file missing": ("rank_00001.json", os.unlink, r"rank_00001\.json is missing"),
    "damaged checkpoint.json": ("checkpoint.json", _garble_json, r"checkpoint\.json is damaged"),
}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_verify_every_rank_file_and_agree(gloo, tmp_path):
    gloo(_two_rank_worker, 2, tmp_path)
