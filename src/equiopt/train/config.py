"""Run configuration: TOML in, validated dataclasses out, errors that name the field.

A config has five tables (every field optional unless marked)::

    [run]    name, out_dir, seed, device ("auto" | "cpu" | "cuda"), compile (bool: the
             forward and the optimizer's step),
             autocast ("auto": bf16 on CUDA, off on CPU | "bf16" | "off"),
             strategy (under torchrun: "ddp", the default, replicates the model;
             "fsdp2" shards every parameter by rows with fully_shard)
    [model]  family + size (equiopt.models), or hf_config (path of a config.json or a
             transformers config dict), and overrides (config fields)
    [data]   train (prepared shard directory), val (default: train's validation split),
             ood_val (optional second validation set), seq_len, batch_size (sequences
             per optimizer step, all ranks together), grad_accum
    [optim]  recipe (name or TOML path), overrides ({role: {field: value}}),
             clip_grad_norm (0 = off, the paper's setting)
    [train]  steps, log_every, val_every, val_batches, checkpoint_every, keep_checkpoints,
             aux_loss (router load-balancing coefficient; 0.01 in the paper when on),
             z_loss (router z-loss coefficient; 0.001), logit_positions (sampled per
             validation for the final-logit diagnostics), logit_softcap (c of
             c tanh(z / c) on the final logits, 0 = off; Gemma 3 has its own config
             switch final_logit_softcapping), tensorboard (bool)
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config value that is missing, unknown or out of range; the message names the field."""


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = ""
    seed: int = 0
    device: str = "auto"
    compile: bool = False
    autocast: str = "auto"
    strategy: str = "ddp"


@dataclass
class ModelConfig:
    family: str = ""
    size: str = "tiny"
    hf_config: Any = None
    overrides: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    train: str = ""
    val: str = ""
    ood_val: str = ""
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1


@dataclass
class OptimConfig:
    recipe: str = "equiopt:default"
    overrides: dict = field(default_factory=dict)
    clip_grad_norm: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 100
    log_every: int = 10
    val_every: int = 50
    val_batches: int = 8
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    aux_loss: float = 0.0
    z_loss: float = 0.0
    logit_positions: int = 256
    logit_softcap: float = 0.0
    tensorboard: bool = True


@dataclass
class Config:
    """A validated run config: the five tables of the module docstring.

    Args:
        run: ``[run]``: name, output directory, seed, device, compile, autocast, strategy.
        model: ``[model]``: the architecture.
        data: ``[data]``: shards, sequence length, batch size, gradient accumulation.
        optim: ``[optim]``: the recipe, its overrides, gradient clipping.
        train: ``[train]``: steps and the logging, validation and checkpoint cadences.
    """

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        """The config as nested plain data.

        Returns:
            ``{table: {field: value}}``; :func:`from_dict` reads it back.
        """
        return dataclasses.asdict(self)

    @property
    def out_path(self) -> Path:
        return Path(self.run.out_dir or Path("runs") / self.run.name)


SECTIONS = {"run": RunConfig, "model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}


def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"{where}: {message}")


def _coerce(where: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise _fail(where, f"expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(where, f"expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(where, f"expected a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise _fail(where, f"expected a string, got {value!r}")
        return value
    if isinstance(default, dict):
        if not isinstance(value, Mapping):
            raise _fail(where, f"expected a table, got {value!r}")
        return dict(value)
    return value


def from_dict(data: Mapping[str, Any], source: str = "config") -> Config:
    """Validate a nested mapping (as TOML gives) into a :class:`Config`.

    Args:
        data: ``{table: {field: value}}``.
        source: the name errors give for the data (a file name).

    Returns:
        The config, with defaults for every field not given.

    Raises:
        ConfigError: for an unknown table or field, or a value of the wrong type or out
            of range; the message names the field.
    """
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        raise _fail(source, f"unknown table(s) {', '.join(map(repr, unknown))}; valid: {', '.join(SECTIONS)}")
    cfg = Config()
    for section, cls in SECTIONS.items():
        table = data.get(section, {})
        if not isinstance(table, Mapping):
            raise _fail(f"{source} [{section}]", "expected a table")
        target = getattr(cfg, section)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in table.items():
            where = f"{source} [{section}].{key}"
            if key not in fields:
                raise _fail(where, f"unknown field; valid: {', '.join(fields)}")
            setattr(target, key, _coerce(where, value, getattr(target, key)))
    _check(cfg, source)
    return cfg


def _check(cfg: Config, source: str) -> None:
    def need(ok: bool, where: str, message: str) -> None:
        if not ok:
            raise _fail(f"{source} {where}", message)

    need(
        cfg.run.device in ("auto", "cpu", "cuda") or cfg.run.device.startswith("cuda:"),
        "[run].device",
        f"expected 'auto', 'cpu' or 'cuda[:N]', got {cfg.run.device!r}",
    )
    need(
        cfg.run.autocast in ("auto", "bf16", "off"),
        "[run].autocast",
        f"expected 'auto', 'bf16' or 'off', got {cfg.run.autocast!r}",
    )
    from .parallel import STRATEGIES

    need(
        cfg.run.strategy in STRATEGIES,
        "[run].strategy",
        f"expected {' or '.join(map(repr, STRATEGIES))}, got {cfg.run.strategy!r}",
    )
    need(
        bool(cfg.model.family) != (cfg.model.hf_config is not None),
        "[model]",
        "give exactly one of 'family' (equiopt.models) or 'hf_config'",
    )
    if cfg.model.family:
        from .. import models

        need(
            cfg.model.family in models.FAMILIES,
            "[model].family",
            f"unknown family {cfg.model.family!r}; valid: {', '.join(models.FAMILIES)}",
        )
        need(
            cfg.model.size in models.SIZES,
            "[model].size",
            f"unknown size {cfg.model.size!r}; valid: {', '.join(models.SIZES)}",
        )
    hf_config = cfg.model.hf_config
    if isinstance(hf_config, str) and hf_config.endswith(".json") and Path(hf_config).is_file():
        import json

        try:
            hf_config = json.loads(Path(hf_config).read_text())
        except (OSError, ValueError) as err:
            raise _fail(f"{source} [model].hf_config", f"cannot read {cfg.model.hf_config}: {err}") from None
    if isinstance(hf_config, Mapping):
        kind = hf_config.get("model_type")
        need(isinstance(kind, str) and bool(kind), "[model].hf_config", "a config table needs its 'model_type'")
        from transformers import CONFIG_MAPPING

        need(
            kind in CONFIG_MAPPING,
            "[model].hf_config.model_type",
            f"{kind!r} is not a model type this transformers knows; close: "
            f"{', '.join(difflib.get_close_matches(kind, list(CONFIG_MAPPING), n=5)) or 'none'}",
        )
    need(bool(cfg.data.train), "[data].train", "required: a directory prepared by 'equiopt data prepare'")
    for name in ("seq_len", "batch_size", "grad_accum"):
        need(getattr(cfg.data, name) >= 1, f"[data].{name}", f"must be >= 1, got {getattr(cfg.data, name)}")
    need(
        cfg.data.batch_size % cfg.data.grad_accum == 0,
        "[data].batch_size",
        f"must be divisible by grad_accum ({cfg.data.grad_accum}), got {cfg.data.batch_size}",
    )
    need(cfg.train.steps >= 1, "[train].steps", f"must be >= 1, got {cfg.train.steps}")
    for name in ("log_every", "val_every", "val_batches", "checkpoint_every", "keep_checkpoints", "logit_positions"):
        need(getattr(cfg.train, name) >= 0, f"[train].{name}", f"must be >= 0, got {getattr(cfg.train, name)}")
    for name in ("aux_loss", "z_loss", "logit_softcap"):
        need(getattr(cfg.train, name) >= 0, f"[train].{name}", f"must be >= 0, got {getattr(cfg.train, name)}")
    need(cfg.optim.clip_grad_norm >= 0, "[optim].clip_grad_norm", f"must be >= 0, got {cfg.optim.clip_grad_norm}")
    from ..recipes import get_recipe

    try:
        recipe = get_recipe(cfg.optim.recipe)
        if cfg.optim.overrides:
            recipe.with_overrides(cfg.optim.overrides)
    except ValueError as err:
        raise _fail(f"{source} [optim]", str(err)) from None


def check_data(cfg: Config) -> None:
    """Every data path of ``cfg`` exists and holds prepared shards, or a :class:`ConfigError`
    names the field and the command that makes it."""
    for name in ("train", "val", "ood_val"):
        value = getattr(cfg.data, name)
        if not value:
            continue
        path = Path(value)
        make = (
            f"make it with: equiopt data prepare --corpus CORPUS --tokenizer TOKENIZER --out {value} "
            "(configs/README.md lists the data each config reads)"
        )
        if not path.exists():
            raise ConfigError(f"[data].{name}: {value} does not exist; {make}")
        if path.is_dir() and not (path / "manifest.json").exists():
            what = "is empty" if not any(path.iterdir()) else "is not a prepared shard directory (no manifest.json)"
            raise ConfigError(f"[data].{name}: {value} {what}; {make}")


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read and validate a TOML run config; ``overrides`` maps ``"section.field"`` to values.

    Args:
        path: the ``.toml`` file.
        overrides: values to set over the file's, by dotted name (deeper keys reach into
            tables: ``"optim.overrides.attention.polar_dtype"``).

    Returns:
        The config.

    Raises:
        ConfigError: for a missing or invalid file, or a bad field.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML ({err})") from None
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: expected 'section.field=value'")
        # deeper keys reach into tables: optim.overrides.attention.polar_dtype=float32
        *tables, key = [section, *key.split(".")]
        target = data
        for i, name in enumerate(tables):
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override {dotted!r}: {'.'.join(tables[: i + 1])} is not a table")
        target[key] = value
    base = path.parent
    cfg = from_dict(data, str(path))
    for attr in ("train", "val", "ood_val"):  # data paths are relative to the config file
        value = getattr(cfg.data, attr)
        if value and not Path(value).is_absolute() and (base / value).exists():
            setattr(cfg.data, attr, str(base / value))
    return cfg
