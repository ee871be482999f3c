"""One line per trainer, each used as a real client on a tiny model: HF Trainer, Lightning, torchrun."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import equiopt as eo
from equiopt.recipes import make_lr_lambda

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def examples_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return EXAMPLES


def _progressions(vocab, n):
    sys.path.insert(0, str(EXAMPLES))
    try:
        from _data import Progressions
    finally:
        sys.path.remove(str(EXAMPLES))
    return Progressions(vocab, n=n)


# ----------------------------------------------------------------------------- Hugging Face


def _hf_trainer(out, how, steps=6, **extra):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from equiopt.integrations import hf

    model = eo.models.build("qwen3", "tiny", seed=0)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        save_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    if how == "optimizers":
        kw = {"optimizers": eo.build_optimizer(model, total_steps=steps)}
    elif how == "factory":
        kw = hf.trainer_kwargs()
    else:
        kw = {"optimizer_cls_and_kwargs": hf.optimizer_cls_and_kwargs()}
    return Trainer(model=model, args=args, train_dataset=_progressions(model.config.vocab_size, 64), **kw, **extra)


@pytest.mark.parametrize("how", ["optimizers", "factory"])
def test_hf_trainer_recipe_groups_schedules_and_exact_resume(tmp_path, how, one_thread):
    pytest.importorskip("transformers")
    from equiopt.integrations.hf import _inner

    full = _hf_trainer(tmp_path / "full", how)
    full.train()
    opt = _inner(full.optimizer)
    assert isinstance(opt, eo.EquivariantOptimizer)
    recipe = eo.recipes.get_recipe("equiopt:default")
    for group in opt.param_groups:  # the recipe's groups, not the Trainer's decay / no-decay pair
        assert group["rule"] == recipe.settings(group["role"])["rule"]
    first = opt.param_groups[0]
    multiplier = make_lr_lambda(first["schedule"], 6)
    logged = [e["learning_rate"] for e in full.state.log_history if "learning_rate" in e]
    expected = [
        first["initial_lr"] * multiplier(k) for k in range(6)
    ]  # the lr of each step: the recipe's, not "linear"
    assert logged == pytest.approx(expected)

    resumed = _hf_trainer(tmp_path / "resumed", how)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_hf_optimizer_cls_and_kwargs_alone_warns_that_the_schedule_is_the_trainers(tmp_path, one_thread):
    pytest.importorskip("transformers")
    trainer = _hf_trainer(tmp_path, "cls", steps=1)
    with pytest.warns(UserWarning, match="RecipeSchedule"):
        trainer.train()
    with pytest.raises(ValueError, match="unknown recipe"):
        from equiopt.integrations import hf

        hf.optimizer_cls_and_kwargs(recipe="paper:qwen3:z-ix")


def test_hf_trainer_example(examples_path, tmp_path, one_thread):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import hf_trainer

    out = tmp_path / "hf"
    hf_trainer.main(["--steps", "12", "--out", str(out)])
    assert (out / "checkpoint-12").is_dir()


# ----------------------------------------------------------------------------- Lightning


def _lightning_fit(tmp_path, ckpt_path=None, name="run"):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from equiopt.integrations import lightning as eol

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = eo.models.build("qwen3", "tiny", seed=0)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return eol.configure_optimizers(self)

    module = Lit()
    data = torch.utils.data.DataLoader(_progressions(module.model.config.vocab_size, 4), batch_size=4)  # 1 batch/epoch
    ckpt = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[ckpt],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, trainer


def test_lightning_configure_optimizers_and_exact_resume(tmp_path, one_thread):
    full, trainer = _lightning_fit(tmp_path, name="full")
    config = trainer.lr_scheduler_configs[0]
    assert config.interval == "step"
    opt = trainer.optimizers[0]
    roles = {g["role"]: g for g in opt.param_groups}
    assert roles["attention"]["rule"] == "spectral" and roles["embedding"]["rule"] == "row"
    assert {r.name.split(".")[0] for r in opt.role_table} == {"model"}  # names as the LightningModule reports them
    assert roles["attention"]["lr"] == 0.0  # total steps from the trainer: the stable-decay schedule ended
    step3 = next((tmp_path / "full").glob("*step=3.ckpt"))
    resumed, _ = _lightning_fit(tmp_path, ckpt_path=str(step3), name="resumed")
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_lightning_example(examples_path, tmp_path, one_thread, capsys):
    pytest.importorskip("lightning")
    import lightning_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_module.main(["--steps", "12", "--out", str(tmp_path)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steps"] == 12 and result["last_loss"] < result["first_loss"]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


# ----------------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_torchrun_ddp_example_two_processes(tmp_path, torchrun):
    done = torchrun(EXAMPLES / "torchrun_ddp.py", "--steps", "6", "--out", tmp_path, env={"PYTHONWARNINGS": "ignore"})
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert len({r["weights"] for r in results}) == 1  # DDP kept the ranks identical
    assert all(r["steps"] == 6 for r in results)
    bare = {f"module.{r.name}": r.role for r in eo.assign_roles(eo.models.build("qwen3", "tiny", seed=0))}
    assert all(r["roles"] == bare for r in results)  # roles through DDP are the bare model's
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 6 and state["scheduler"]["last_epoch"] == 6
