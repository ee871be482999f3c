"""Training harness: configs, the pre-training loop, checkpoints, logs."""

from .checkpoint import (
    CheckpointError,
    CheckpointWarning,
    check_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from .config import Config, ConfigError, from_dict, load_config
from .loop import NonFiniteLossError, Trainer, train

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "from_dict",
    "train",
    "Trainer",
    "NonFiniteLossError",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "latest_checkpoint",
    "check_checkpoint",
    "CheckpointError",
    "CheckpointWarning",
]
