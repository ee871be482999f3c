"""One line per trainer: Hugging Face ``Trainer``, Lightning, and plain ``torchrun`` loops.

Each submodule imports its trainer library only when used, so equiopt needs none of them:

- :mod:`equiopt.integrations.hf`: ``Trainer(..., **hf.trainer_kwargs(recipe=...))``
  (the recipe's param groups built from the Trainer's model, and the recipe's
  per-role schedules), or ``Trainer(..., optimizers=equiopt.build_optimizer(model, ...))``.
- :mod:`equiopt.integrations.lightning`: ``configure_optimizers`` returns
  ``lightning.configure_optimizers(self, recipe=...)``.
- :mod:`equiopt.integrations.torchtitan`: ``config.optimizer = torchtitan.equiopt_config(recipe=...)``
  in a torchtitan ``Trainer.Config`` (a container that resolves the optimizer name
  ``"equiopt"``; roles of torchtitan's Llama 3, Qwen3, DeepSeek V3 and gpt-oss models).
- :mod:`equiopt.integrations.olmo_core`: ``optim=olmo_core.EquioptConfig(recipe=...)`` in an
  OLMo-core train module config (an ``OptimConfig`` registered as ``"equiopt"``; roles of
  its dense and MoE transformers from their forward).
- A plain loop (one process or ``torchrun`` with DDP / FSDP2) needs no adapter:
  ``optimizer, scheduler = equiopt.build_optimizer(ddp_model, recipe, total_steps)``;
  roles are those of the bare model, whatever wraps it.

Runnable scripts for each are in the repository's ``examples/`` folder.
"""

__all__ = ["hf", "lightning", "torchtitan", "olmo_core"]


def __getattr__(name):
    if name in __all__:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
