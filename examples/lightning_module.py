"""A tiny Qwen3-style model trained by Lightning with equiopt (CPU, seconds).

    python examples/lightning_module.py --steps 40 --out runs/example-lightning
    python examples/lightning_module.py --steps 40 --out runs/example-lightning --resume   # continue an interrupted run

The one line is ``configure_optimizers``: the recipe's optimizer for the model the
LightningModule holds, and its scheduler stepping every optimizer step.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from _data import Progressions

import equiopt
from equiopt.integrations import lightning as eol


class TinyLM(L.LightningModule):
    def __init__(self, recipe: str = "equiopt:default"):
        super().__init__()
        self.model = equiopt.models.build("qwen3", "tiny", seed=0)
        self.recipe = recipe
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return eol.configure_optimizers(self, recipe=self.recipe)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/example-lightning")
    parser.add_argument("--recipe", default="equiopt:default")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    module = TinyLM(args.recipe)
    data = torch.utils.data.DataLoader(Progressions(module.model.config.vocab_size), batch_size=8, shuffle=True)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=Path(args.out) / "checkpoints",
        save_last=True,
        every_n_train_steps=max(1, args.steps // 2),
        save_top_k=-1,
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = Path(args.out) / "checkpoints" / "last.ckpt"
    trainer.fit(module, data, ckpt_path=str(last) if args.resume and last.exists() else None)
    print(json.dumps({"first_loss": module.losses[0], "last_loss": module.losses[-1], "steps": trainer.global_step}))


if __name__ == "__main__":
    main()
