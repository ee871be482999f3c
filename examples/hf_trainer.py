"""A tiny Qwen3-style model trained by the Hugging Face Trainer with equiopt (CPU, seconds).

    python examples/hf_trainer.py --steps 40 --out runs/example-hf
    python examples/hf_trainer.py --steps 40 --out runs/example-hf --resume   # continue an interrupted run

The one line is ``**hf.trainer_kwargs(recipe=...)``: the Trainer builds the recipe's
param groups from the model it trains and runs the recipe's per-role schedules.
"""

import argparse
import json

from _data import Progressions
from transformers import Trainer, TrainingArguments

import equiopt
from equiopt.integrations import hf


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/example-hf")
    parser.add_argument("--recipe", default="equiopt:default")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    model = equiopt.models.build("qwen3", "tiny", seed=0)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        logging_steps=1,
        save_steps=max(1, args.steps // 2),
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Progressions(model.config.vocab_size),
        **hf.trainer_kwargs(recipe=args.recipe),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(json.dumps({"first_loss": losses[0], "last_loss": losses[-1], "steps": trainer.state.global_step}))


if __name__ == "__main__":
    main()
