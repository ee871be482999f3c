"""The checkpoint exceptions: :class:`CheckpointError` for what cannot be written or read,
:class:`CheckpointWarning` for a damaged checkpoint skipped on resume."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message says which and why."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older intact one."""
