"""Checks that keep a study's design from misleading, made before its runs are spent.

``equiopt compare --protocol`` calls :func:`design_problems` before it trains anything, and
:func:`hidden_training_problem` on each arm's chosen tuning runs before that arm's evaluation
runs. Each check names what it found and the fix:

- **Warm-up** (:func:`warmup_problems`): a role whose schedule warms up for more than a tenth
  of the run (the paper warms up for 100 of 30,000 steps; 100 of 150 steps measures the
  warm-up, not the optimizer).
- **Source** (:func:`source_problems`): a study config records the config it was made from in
  its first comment line (``# CPU-scale study config: configs/cpu/qwen3/a-ii.toml with 150
  steps, ...``, or ``... study config: the recipe of configs/...``). Its optimizer settings
  (``[optim]``, every field of the source's ``overrides``) must equal the source's, field by
  field; without "the recipe of", its ``[model]``, ``[data]`` and the ``[train]`` fields that
  change what is trained must too. A study may add optimizer overrides the source does not set
  (it pins a precision, a warm-up) and change the recipe it names in that line
  (``..., recipe muon, ...``); it may not drop or change one of the source's.
- **Shared multiplier** (:func:`shared_multiplier_problems`): one lr multiplier over roles whose
  optima may differ (the embedding, the LM head, the router, the hidden matrices and the
  vectors are five such classes) forces one role's optimum onto the others; a protocol doing
  so says why in ``[tuning] shared_because``.
- **Hidden layers training** (:func:`hidden_training_problem`): in the tuning run an arm is
  chosen from, each hidden matrix role's weight RMS (``weight_rms/<role>`` in ``log.jsonl``)
  must change by at least ``[tuning] min_hidden_rms_change`` (default 10 %) between its first
  and last logged values; otherwise the hidden layers barely train and the comparison is of
  an embedding and a head on a random network. The arm gets no evaluation runs.

Protocols written before these checks keep loading: when every run a protocol needs has
finished (a report rebuilt from its logs), the problems become warnings printed first in the
report; when a run would start, ``equiopt compare`` refuses.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..train.config import tomllib

__all__ = [
    "MAX_WARMUP_FRACTION",
    "MIN_HIDDEN_RMS_CHANGE",
    "HIDDEN_ROLES",
    "warmup_problems",
    "source_of",
    "source_problems",
    "shared_multiplier_problems",
    "hidden_rms_change",
    "hidden_training_problem",
    "design_problems",
]

#: the longest warm-up a study run may have, as a fraction of its steps
MAX_WARMUP_FRACTION = 0.1
#: the least relative change of a hidden role's weight RMS in a tuning run (first to last logged value)
MIN_HIDDEN_RMS_CHANGE = 0.1
#: the roles of the hidden matrices
HIDDEN_ROLES = ("attention", "mlp_in", "mlp_out", "matrix")
# roles whose learning-rate optima may differ: one multiplier over two classes needs a reason
_ROLE_CLASS = {
    "embedding": "embedding",
    "lm_head": "lm_head",
    "router": "router",
    "vector": "vector",
    **dict.fromkeys(HIDDEN_ROLES, "hidden"),
}
# [train] fields a study config sets for itself (length, logging, checkpoints)
_STUDY_TRAIN = {"steps", "log_every", "val_every", "val_batches", "checkpoint_every", "keep_checkpoints", "tensorboard"}
_SOURCE = re.compile(r"study config: (the recipe of )?(configs/\S+?\.toml)(?:,?\s+with \d+ steps, recipe ([^,\s]+),)?")


def warmup_problems(config: str | Path, sets: Mapping[str, Any] | None = None) -> list[str]:
    """Roles of ``config`` (with the ``--set`` values ``sets``) that warm up for more than
    :data:`MAX_WARMUP_FRACTION` of the run's steps."""
    from ..recipes import ROLES, get_recipe
    from ..train.config import load_config

    cfg = load_config(config, dict(sets or {}))
    recipe = get_recipe(cfg.optim.recipe)
    if cfg.optim.overrides:
        recipe = recipe.with_overrides(cfg.optim.overrides)
    steps = cfg.train.steps
    out = []
    for role in ROLES:
        sched = recipe.settings(role).get("schedule") or {}
        if sched.get("kind") != "warmup_cosine":
            continue
        warm = int(sched.get("warmup_steps", 0))
        if warm > MAX_WARMUP_FRACTION * steps:
            out.append(
                f"{config}: role {role!r} warms up for {warm} of {steps} steps, more than a tenth of the run; "
                f'set optim.overrides.{role}.schedule = {{ kind = "warmup_cosine", warmup_steps = '
                f"{int(MAX_WARMUP_FRACTION * steps)} }} or fewer"
            )
    return out


def source_of(config: str | Path) -> tuple[str, bool, str | None] | None:
    """The config ``config`` was made from, as its first comment lines record it: ``(path,
    recipe_only, recipe)``, where ``recipe_only`` says only its optimizer was taken and ``recipe``
    is the recipe the study put in its place (None: the source's own); None when no source is
    recorded."""
    for line in Path(config).read_text().splitlines():
        if not line.startswith("#"):
            break
        m = _SOURCE.search(line)
        if m:
            return m.group(2), bool(m.group(1)), m.group(3)
    return None


def _flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool | str):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def source_problems(config: str | Path, root: str | Path = ".") -> list[str]:
    """The fields in which ``config`` departs from the config it records as its source (see the
    module docstring); ``root``: the directory the source path is relative to."""
    found = source_of(config)
    if found is None:
        return []
    src, recipe_only, recipe = found
    src_path = Path(root) / src
    if not src_path.exists():
        return [f"{config}: its source {src} does not exist"]
    mine = _flat(tomllib.loads(Path(config).read_text()))
    theirs = _flat(tomllib.loads(src_path.read_text()))
    sections = ("optim.",) if recipe_only else ("optim.", "model.", "data.", "train.")

    def compared(key: str) -> bool:
        if not key.startswith(sections):
            return False
        if key.startswith("train."):
            return key.split(".", 1)[1] not in _STUDY_TRAIN
        return not (key == "optim.recipe" and recipe is not None)

    out = []
    for key in sorted(k for k in theirs if compared(k)):
        if key not in mine:
            out.append(f"{config}: {key} = {theirs[key]!r} in its source {src} is missing")
        elif not _same(mine[key], theirs[key]):
            out.append(f"{config}: {key} = {mine[key]!r} where its source {src} has {theirs[key]!r}")
    if recipe is not None and mine.get("optim.recipe") != recipe:
        out.append(f"{config}: optim.recipe = {mine.get('optim.recipe')!r}, not the recipe {recipe} its header names")
    for key in sorted(k for k in mine if compared(k) and k not in theirs and not k.startswith("optim.")):
        out.append(f"{config}: {key} = {mine[key]!r} is not in its source {src}")
    return [p + " (study configs keep their source's settings; regenerate it or record the change)" for p in out]


def shared_multiplier_problems(roles: Sequence[str] | None, reason: str = "", where: str = "[tuning]") -> list[str]:
    """One multiplier over ``roles`` (None: every role) whose optima may differ, without a reason."""
    from ..recipes import ROLES

    swept = list(roles) if roles else list(ROLES)
    classes = sorted({_ROLE_CLASS.get(r, r) for r in swept})
    if len(classes) < 2 or reason.strip():
        return []
    return [
        f"{where}: one lr multiplier over {', '.join(swept)} ties roles whose optima may differ "
        f"({', '.join(classes)}); tune them apart or say why in [tuning] shared_because"
    ]


def hidden_rms_change(run_dir: str | Path) -> dict[str, float]:
    """Per hidden matrix role, the relative change ``last / first - 1`` of its logged weight RMS
    (``weight_rms/<role>``, first and last ``train`` records of the run's ``log.jsonl``)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    log = Path(run_dir) / "log.jsonl"
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") != "train":
            continue
        for role in HIDDEN_ROLES:
            v = rec.get(f"weight_rms/{role}")
            if isinstance(v, (int, float)) and math.isfinite(v):
                first.setdefault(role, float(v))
                last[role] = float(v)
    return {r: last[r] / first[r] - 1.0 for r in first if first[r] > 0}


def hidden_training_problem(
    label: str, run_dirs: Sequence[str | Path], fraction: float = MIN_HIDDEN_RMS_CHANGE
) -> str | None:
    """Why ``label``'s evaluation runs should not start: a hidden role whose weight RMS changed by
    less than ``fraction`` in one of its chosen tuning runs ``run_dirs``; None when every hidden
    role trained (or the runs log no weight RMS: nothing to judge)."""
    slow = []
    for d in run_dirs:
        for role, change in sorted(hidden_rms_change(d).items()):
            if abs(change) < fraction:
                slow.append(f"{role} {change:+.1%} in {d}")
    if not slow:
        return None
    return (
        f"{label}: the hidden matrices barely train in its chosen tuning run(s) (weight RMS, first to last "
        f"logged value: {'; '.join(slow)}; at least {fraction:.0%} is required); its evaluation runs are not "
        "started: raise the hidden learning rate or tune it ([tuning.hidden])"
    )


def design_problems(protocol, sets: Mapping[str, Any] | None = None, root: str | Path = ".") -> list[str]:
    """The warm-up, source and shared-multiplier problems of ``protocol`` (a
    :class:`~equiopt.study.protocol.Protocol`) with the ``--set`` values ``sets``."""
    out: list[str] = []
    for config in protocol.configs:
        out += warmup_problems(config, sets)
        out += source_problems(config, root)
    if protocol.sweeps:
        out += shared_multiplier_problems(protocol.roles, protocol.shared_because, f"{protocol.path}, [tuning]")
    if protocol.hidden is not None:
        out += shared_multiplier_problems(
            protocol.hidden["roles"], protocol.shared_because, f"{protocol.path}, [tuning.hidden]"
        )
    return out


def runs_pending(protocol, sets: Mapping[str, Any] | None = None) -> bool:
    """Whether ``equiopt compare --protocol`` would train a run: False only when every run the
    protocol needs has finished (its report is being rebuilt from the logs)."""
    from ..train.config import load_config
    from .paired import SweepArm, _best, _done, mult_tag

    if protocol.hidden is not None:
        return True  # its later stages depend on its earlier ones: judged as pending
    for config in protocol.configs:
        cfg = load_config(config, dict(sets or {}))
        if not protocol.sweeps:
            seeds = protocol.eval_seeds
            if not all(_done(Path(f"{cfg.out_path}-s{s}")) for s in seeds):
                return True
            continue
        grid = protocol.multipliers[config] if isinstance(protocol.multipliers, dict) else protocol.multipliers
        arm = SweepArm(cfg.run.name, config, {}, tune_seeds=list(protocol.tune_seeds))
        for m in grid:
            for s in protocol.tune_seeds:
                out = cfg.out_path / f"{mult_tag(m)}-s{s}"
                if not _done(out):
                    return True
                arm.runs.setdefault(m, {})[s] = str(out)
        best, _ = _best(arm, protocol.metric)
        if not all(_done(cfg.out_path / f"{mult_tag(best)}-s{s}") for s in protocol.eval_seeds):
            return True
    return False


def hold_untrained(protocol, held: dict[str, str]):
    """A ``hold`` for :func:`~equiopt.study.paired.sweep`: an arm whose hidden matrices barely
    train in its chosen tuning runs gets no evaluation runs (its reason goes into ``held``),
    unless they have all finished already (an old study's report: then nothing is held)."""
    from .paired import _done, mult_tag

    def hold(arm, mult) -> str | None:
        tuned = [arm.runs[mult][s] for s in arm.tune_seeds if s in arm.runs[mult]]
        if not tuned:
            return None
        where = Path(tuned[0]).parent
        if all(_done(where / f"{mult_tag(mult)}-s{s}") for s in arm.eval_seeds):
            return None
        reason = hidden_training_problem(arm.label, tuned, protocol.min_hidden_rms_change)
        if reason:
            held[arm.label] = reason
            print(f"held, no evaluation runs: {reason}", flush=True)
        return reason

    return hold
