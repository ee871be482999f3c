"""The pre-training loop: one process or ``torchrun`` with DDP or FSDP2, CPU or CUDA.

Per optimizer step: ``grad_accum`` micro-batches (``batch_size / grad_accum`` sequences
of all ranks together), bf16 autocast on CUDA, cross-entropy plus the optional router
auxiliary terms, optional gradient clipping (off by default, as in the paper), then the
recipe's optimizer and schedulers. Validation, final-logit and router diagnostics run
at ``val_every``; per-role weight and update RMS at ``log_every``. Checkpoints are
``torch.distributed.checkpoint`` directories written atomically by all ranks, each with
a manifest of its files' sizes and SHA-256 sums; ``resume=True`` continues from the
newest intact one at any world size and strategy (in one process on CPU bit for bit),
skipping a damaged newer one with a warning; ``resume_from=DIR`` continues from exactly
that checkpoint and fails with a :class:`~equiopt.train.CheckpointError` if it is damaged.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import diagnostics as diag
from ..data.loader import TokenLoader, ValidationBatches
from ..roles import build_optimizer
from .checkpoint import (
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    load_checkpoint,
    param_groups_from_json,
    param_groups_to_json,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import Config, ConfigError, check_data
from .parallel import gradient_sync, wrap_model
from .runlog import RunLogger

LOGIT_KEYS = {
    "raw_rms": "logits/rms",
    "centered_rms": "logits/centred_rms",
    "max_lse": "logits/max_lse",
    "mean_lse": "logits/mean_lse",
    "max_abs": "logits/max_abs",
}
ROUTER_KEYS = {
    "lb_loss": "router/lb",
    "z_loss": "router/z",
    "load_entropy": "router/entropy",
    "load_cv": "router/cv",
    "dead_fraction": "router/dead",
    "max_load": "router/max_load",
    "logit_rms": "router/logit_rms",
}


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or Inf; the run stopped and kept its last good checkpoint."""


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_pref: str) -> DistInfo:
    """Join the process group that ``torchrun`` describes (NCCL on CUDA, gloo on CPU), if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device_pref.startswith("cuda") or (device_pref == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        device = torch.device(device_pref if ":" in device_pref else f"cuda:{local}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DistInfo(rank, world, local, device)


def build_model(cfg: Config, device: torch.device) -> nn.Module:
    from .. import models

    if cfg.model.family:
        return models.build(cfg.model.family, cfg.model.size, device=device, seed=cfg.run.seed, **cfg.model.overrides)
    import transformers

    source = cfg.model.hf_config
    if isinstance(source, str):
        config = transformers.AutoConfig.from_pretrained(source)
    else:
        source = dict(source)
        config = transformers.AutoConfig.for_model(source.pop("model_type"), **source)
    for key, value in cfg.model.overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config)
    models.init_weights(model, seed=cfg.run.seed)
    return model.to(device)


def _top_k(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for key in ("num_experts_per_tok", "experts_per_token", "moe_top_k"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return None


class Trainer:
    """Holds the model, optimizer, data and logs of one run; :meth:`run` trains it.

    ``resume=True``: continue from the newest intact checkpoint of the run's own
    checkpoint directory, if any (a damaged newer one is skipped with a
    :class:`~equiopt.train.CheckpointWarning`). ``resume_from``: a checkpoint directory
    (``.../checkpoints/step_00001000``, of this run or another) to continue from exactly;
    a damaged one raises :class:`~equiopt.train.CheckpointError`.

    Args:
        cfg: the validated run config.
        resume: continue from the run's newest intact checkpoint, if any.
        progress: print progress lines.
        resume_from: a checkpoint directory to continue from exactly.

    Raises:
        ConfigError: when the config's data is missing or does not fit the model.
        CheckpointError: for a damaged ``resume_from``, or when no checkpoint of a
            run that has some is intact.
    """

    def __init__(
        self, cfg: Config, resume: bool = False, progress: bool = True, resume_from: str | os.PathLike | None = None
    ):
        self.cfg = cfg
        check_data(cfg)
        self.dist = setup_distributed(cfg.run.device)
        self.device = self.dist.device
        torch.manual_seed(cfg.run.seed)
        self.model = build_model(cfg, self.device)
        self.top_k = _top_k(self.model)
        # DDP wraps the model; FSDP2 shards it in place (its parameters become DTensors).
        # The optimizer is built after, from the model itself: same names, same roles.
        self.forward_model: nn.Module = wrap_model(self.model, cfg.run.strategy, self.device, self.dist.world_size)
        # Under DDP the replicas divide the matrix maps among themselves (the weights stay identical).
        self.optimizer, self.scheduler = build_optimizer(
            self.model,
            cfg.optim.recipe,
            total_steps=cfg.train.steps,
            overrides=cfg.optim.overrides or None,
            eager_state=True,
            divide_work=cfg.run.strategy == "ddp" and self.dist.world_size > 1,
        )
        # run.compile decides for the optimizer's step too (its automatic choice would
        # compile on CUDA, which takes minutes on a first step)
        self.optimizer.compile = cfg.run.compile
        table = self.optimizer.role_table
        self.tracker = diag.WeightTracker.from_assignments(self.model, table)
        if cfg.run.compile:
            self.forward_model = torch.compile(self.forward_model)
        use_bf16 = cfg.run.autocast == "bf16" or (cfg.run.autocast == "auto" and self.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext
        d = cfg.data
        micro = d.batch_size // d.grad_accum
        kw = dict(rank=self.dist.rank, world_size=self.dist.world_size, device=self.device)
        self.loader = TokenLoader(d.train, micro, d.seq_len, split="train", seed=cfg.run.seed, **kw)
        self.val = (
            ValidationBatches(d.val or d.train, micro, d.seq_len, split="val", num_batches=cfg.train.val_batches, **kw)
            if cfg.train.val_batches
            else None
        )
        self.ood = (
            ValidationBatches(d.ood_val, micro, d.seq_len, split="val", num_batches=cfg.train.val_batches, **kw)
            if d.ood_val and cfg.train.val_batches
            else None
        )
        self._check_vocab()
        self.out = cfg.out_path
        self.ckpt_dir = self.out / "checkpoints"
        self.step, self.tokens = 0, 0
        self.tokens_per_step = d.batch_size * d.seq_len
        restored, self._skipped = None, []
        if resume_from is not None:
            restored = self._restore(Path(resume_from), exact=True)
        elif resume:
            restored = self._restore(self.ckpt_dir)
        if self.dist.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
        self.log = RunLogger(
            self.out,
            enabled=self.dist.main,
            tensorboard=cfg.train.tensorboard,
            progress=progress,
            total_steps=cfg.train.steps,
        )
        if restored is None:
            from ..linalg import default_dtype, emulates_bfloat16
            from ..models import count_parameters

            self.log.log(
                "meta",
                0,
                0,
                params=count_parameters(self.model),
                device=str(self.device),
                torch=torch.__version__,
                # what Muon-like rules iterate in where a recipe leaves polar_dtype unset
                polar_dtype_default=str(default_dtype("polar_express", self.device)).replace("torch.", ""),
                # bfloat16 products as float32 products rounded to bfloat16 (no bfloat16 hardware)
                bfloat16_products="float32, rounded" if emulates_bfloat16(torch.bfloat16, self.device) else "native",
                recipe=str(cfg.optim.recipe),
                world_size=self.dist.world_size,
                strategy=self.strategy,
                roles={r.name: r.role for r in table},
            )
        else:
            skipped = {"skipped_damaged": self._skipped} if self._skipped else {}
            self.log.log(
                "meta",
                self.step,
                self.tokens,
                resumed_from=str(restored),
                world_size=self.dist.world_size,
                strategy=self.strategy,
                saved_world_size=self._saved_layout[0],
                saved_strategy=self._saved_layout[1],
                **skipped,
            )

    @property
    def strategy(self) -> str:
        """``"single"`` in one process, else the config's ``ddp`` or ``fsdp2``."""
        return self.cfg.run.strategy if self.dist.enabled else "single"

    def release_ddp(self) -> None:
        """Drop the DistributedDataParallel wrapper now, while the process group is alive.

        DDP sits in reference cycles; left to interpreter shutdown, its gloo state is torn
        down after the process group and the process aborts ("terminate called without an
        active exception") although training finished. ``self.model`` stays usable.
        """
        if self.forward_model is not self.model:
            self.forward_model = self.model
            gc.collect()

    def _check_vocab(self) -> None:
        """Token ids past the embedding's rows would fail deep inside the forward pass: say so now."""
        embed = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        rows = getattr(embed, "num_embeddings", None)
        if rows is None:
            return
        d = self.cfg.data
        for field, source in (("train", self.loader), ("val", self.val), ("ood_val", self.ood)):
            vocab = getattr(getattr(source, "stream", None), "vocab_size", None)
            if vocab is not None and vocab > rows:
                raise ConfigError(
                    f"[data].{field}: the shards in {getattr(d, field) or d.train} hold token ids of a "
                    f"{vocab}-token vocabulary, but the model embeds only {rows}; set [model].overrides.vocab_size "
                    f">= {vocab} or prepare the data with the model's tokenizer"
                )

    # ------------------------------------------------------------- checkpoints
    def _tensor_state(self) -> tuple[dict[str, Any], list[dict]]:
        """This rank's model and optimizer tensors (sharded under FSDP2) and the optimizer's groups."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": {"state": optim_sd["state"]}}, optim_sd["param_groups"]

    def save(self) -> Path:
        """Write a checkpoint of this step (every rank takes part) and return its directory.

        Returns:
            The checkpoint directory, ``<out_dir>/checkpoints/step_<step>``.
        """
        tensors, groups = self._tensor_state()
        extras = {
            "step": self.step,
            "tokens": self.tokens,
            "strategy": self.strategy,
            "optimizer": {"param_groups": param_groups_to_json(groups)},
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "config": json.loads(json.dumps(self.cfg.to_dict(), default=str)),
        }
        return save_checkpoint(
            self.ckpt_dir,
            self.step,
            tensors,
            extras,
            {"rng": rng_state(self.device)},
            keep=self.cfg.train.keep_checkpoints,
        )

    def _restore(self, source: Path, exact: bool = False) -> Path | None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from .checkpoint import _is_checkpoint

        if exact and not _is_checkpoint(source):
            held = sorted(p.name for p in source.glob("step_*")) if source.is_dir() else []
            raise CheckpointError(
                f"resume from {source}: not a checkpoint directory"
                + (
                    f" (it holds {', '.join(held)}: name one of them, or resume the run with --resume)"
                    if held
                    else (" (it does not exist)" if not source.exists() else "")
                )
            )
        tensors, groups = self._tensor_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            found = load_checkpoint(source, tensors)
        for w in caught:  # shown as usual, and kept for the run log
            if issubclass(w.category, CheckpointWarning):
                self._skipped.append(str(w.message))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if found is None:
            return None
        path, extras, mine = found
        groups = param_groups_from_json(extras["optimizer"]["param_groups"], groups)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=tensors["model"],
            optim_state_dict={"state": tensors["optimizer"]["state"], "param_groups": groups},
        )
        self.scheduler.load_state_dict(extras["scheduler"])
        self.loader.load_state_dict(extras["loader"])
        self.step, self.tokens = int(extras["step"]), int(extras["tokens"])
        self._saved_layout = (extras.get("world_size"), extras.get("strategy"))
        if mine is not None:
            set_rng_state(mine["rng"], self.device)
        else:  # a rank the saving run did not have: a seed of its own, the same on every resume
            torch.manual_seed(self.cfg.run.seed + 1_000_003 * (self.dist.rank + 1) + self.step)
        return path

    # ---------------------------------------------------------------- forward
    def _forward(self, x: torch.Tensor, y: torch.Tensor, want_router: bool):
        kwargs = {"output_router_logits": True} if self.top_k and want_router else {}
        with self.autocast():
            out = self.forward_model(input_ids=x, **kwargs)
        logits = out.logits
        if self.cfg.train.logit_softcap:
            logits = diag.softcap(logits, self.cfg.train.logit_softcap)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        router = getattr(out, "router_logits", None) if kwargs else None
        loss = ce
        if router:
            if self.cfg.train.aux_loss:
                loss = loss + self.cfg.train.aux_loss * diag.load_balancing_loss(router, self.top_k)
            if self.cfg.train.z_loss:
                loss = loss + self.cfg.train.z_loss * diag.z_loss(router)
        return loss, ce, logits, router

    def _mean(self, value: float) -> float:
        if not self.dist.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.dist.world_size

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ train
    def train_step(self, log_now: bool, diag_now: bool) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches.

        Args:
            log_now: add timings, learning rates, the skipped-step count and the per-role
                weight and update RMS to the metrics.
            diag_now: add the final-logit and router diagnostics of the last micro-batch.

        Returns:
            The step's metrics (``loss``, ``ce``, and what the flags add).

        Raises:
            NonFiniteLossError: when the loss is NaN or Inf.
        """
        cfg = self.cfg
        self.model.train()
        want_router = bool(self.top_k) and (cfg.train.aux_loss > 0 or cfg.train.z_loss > 0 or diag_now)
        t0 = time.perf_counter()
        accum = cfg.data.grad_accum
        ce_sum, loss_sum, last = 0.0, 0.0, None
        for micro in range(accum):
            x, y = self.loader.next_batch()
            sync = micro == accum - 1 or not self.dist.enabled
            with gradient_sync(self.forward_model, sync):
                loss, ce, logits, router = self._forward(x, y, want_router)
                (loss / accum).backward()
            loss_sum += float(loss.detach())
            ce_sum += float(ce.detach())
            last = (logits.detach(), router)
        self._sync()
        t1 = time.perf_counter()
        loss_value = self._mean(loss_sum / accum)
        if not math.isfinite(loss_value):
            raise NonFiniteLossError(f"non-finite training loss {loss_value} at step {self.step + 1}")
        if cfg.optim.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.clip_grad_norm)
        if log_now:
            self.tracker.snapshot()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        t2 = time.perf_counter()
        self.step += 1
        self.tokens += self.tokens_per_step
        metrics: dict[str, float] = {"loss": loss_value, "ce": self._mean(ce_sum / accum)}
        if log_now:
            metrics.update(
                {
                    "time/fwd_bwd": t1 - t0,
                    "time/opt": t2 - t1,
                    "time/step": t2 - t0,
                    "tokens_per_s": self.tokens_per_step / (t2 - t0),
                    "nonfinite_steps": self.optimizer.nonfinite_steps,
                }
            )
            for group in self.optimizer.param_groups:
                metrics[f"lr/{group['role']}"] = group["lr"]
            for role, stats in self.tracker.update_stats().items():
                metrics[f"weight_rms/{role}"] = stats["weight_rms"]
                metrics[f"update_rms/{role}"] = stats["update_rms"]
        if diag_now and last is not None:
            metrics.update(self._diagnostics(*last))
        return metrics

    def _diagnostics(self, logits: torch.Tensor, router) -> dict[str, float]:
        out = {}
        n = self.cfg.train.logit_positions
        if n:
            flat = logits.reshape(-1, logits.shape[-1])
            g = torch.Generator().manual_seed(self.cfg.run.seed + self.step)
            idx = torch.randperm(flat.shape[0], generator=g)[: min(n, flat.shape[0])].to(flat.device)
            m = diag.logit_metrics(flat[idx], all_reduce=self.dist.enabled)
            out.update({key: m[k] for k, key in LOGIT_KEYS.items()})
        if router and self.top_k:
            r = diag.router_metrics([t.detach() for t in router], self.top_k, all_reduce=self.dist.enabled)
            out.update({key: r[k] for k, key in ROUTER_KEYS.items()})
            for i, layer in enumerate(r["per_layer"]):
                out.update({f"router/L{i}/{key.split('/')[1]}": layer[k] for k, key in ROUTER_KEYS.items()})
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation (and out-of-domain) loss, with the diagnostics of the first validation batch.

        Returns:
            ``{"val/loss": ..., "ood/loss": ..., ...}`` for the sets the config names.
        """
        self.model.eval()
        out: dict[str, float] = {}
        for prefix, batches in (("val", self.val), ("ood", self.ood)):
            if batches is None:
                continue
            total, count, first = 0.0, 0, None
            for x, y in batches:
                _, ce, logits, router = self._forward(x, y, want_router=prefix == "val")
                total += float(ce) * y.numel()
                count += y.numel()
                if first is None:
                    first = (logits, router)
            out[f"{prefix}/loss"] = self._mean(total / count)
            if prefix == "val" and first is not None:
                out.update(self._diagnostics(*first))
        self.model.train()
        return out

    def run(self) -> dict[str, Any]:
        """Train to the config's step count, logging, validating and checkpointing on its cadences.

        Returns:
            ``{"status", "step", "tokens", "out_dir"}`` and the last validation metrics.

        Raises:
            NonFiniteLossError: when the loss became NaN or Inf (the message names the last
                good checkpoint).
        """
        cfg = self.cfg.train
        status, message, last_val = "done", "", {}
        try:
            while self.step < cfg.steps:
                next_step = self.step + 1
                log_now = cfg.log_every > 0 and (next_step % cfg.log_every == 0 or next_step == cfg.steps)
                val_now = cfg.val_every > 0 and (next_step % cfg.val_every == 0 or next_step == cfg.steps)
                metrics = self.train_step(log_now, val_now)
                if log_now or val_now:
                    self.log.log("train", self.step, self.tokens, **metrics)
                    self.log.progress(
                        self.step,
                        f"loss {metrics['loss']:.4f}"
                        + (f" | {metrics['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in metrics else ""),
                    )
                if val_now and (self.val is not None or self.ood is not None):
                    last_val = self.evaluate()
                    self.log.log("val", self.step, self.tokens, **last_val)
                    self.log.progress(self.step, f"val {last_val.get('val/loss', float('nan')):.4f}")
                if cfg.checkpoint_every and (self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps):
                    self.save()
        except NonFiniteLossError as err:
            found = latest_checkpoint(self.ckpt_dir)
            keep = f"; the last good checkpoint is {found}" if found else "; no checkpoint was written yet"
            status, message = "nonfinite", f"{err}{keep}. Lower the learning rate or enable clipping, then resume."
            self.log.log("end", self.step, self.tokens, status=status, message=message)
            self.log.close()
            raise NonFiniteLossError(message) from None
        except KeyboardInterrupt:
            status, message = "interrupted", f"interrupted at step {self.step}"
            self.log.log("end", self.step, self.tokens, status=status, message=message)
            self.log.close()
            raise
        self.log.log("end", self.step, self.tokens, status=status, message=message)
        self.log.close()
        if self.dist.enabled:
            dist.barrier()  # no rank leaves (and tears down its process group) while a peer still talks
            self.release_ddp()
        return {"status": status, "step": self.step, "tokens": self.tokens, **last_val, "out_dir": str(self.out)}


def train(
    cfg: Config, resume: bool = False, progress: bool = True, resume_from: str | os.PathLike | None = None
) -> dict[str, Any]:
    """Train one run from a validated :class:`Config`; returns its final validation metrics.

    ``resume`` and ``resume_from`` as for :class:`Trainer`.

    Args:
        cfg: the validated run config (see :func:`load_config`).
        resume: continue from the run's newest intact checkpoint, if any.
        progress: print progress lines.
        resume_from: a checkpoint directory to continue from exactly.

    Returns:
        What :meth:`Trainer.run` returns: the status, step, tokens, output directory and
        the last validation metrics.
    """
    return Trainer(cfg, resume=resume, progress=progress, resume_from=resume_from).run()
