"""Study protocols: what a comparison will run and how it will be judged, fixed before its data.

A protocol is a TOML file committed before the runs it governs. ``equiopt compare
--protocol FILE`` runs exactly what it says and writes the file's SHA-256 into the report,
so a reader can check that the arms, grids, seeds, metric and decision rule were not
changed after the results came in::

    [study]
    name = "qwen3-a"
    question = "Does RowNormM or HybridPolarGradM on embedding and LM head beat AdamW there?"
    configs = ["configs/cpu/qwen3/a-iii.toml", "configs/cpu/qwen3/a-i.toml"]
    baseline = "qwen3-a-iii"           # a run name or one of the configs
    metric = "val/loss"                # the last logged value of each run
    set = { "train.steps" = 400 }      # overrides for every run (optional)

    [tuning]                           # optional: without it the configs' lrs are used as given
    multipliers = [0.5, 1, 2]          # of each arm's learning rates
    grids = { "configs/cpu/qwen3/a-i.toml" = [1, 2, 4] }   # per-config grids (optional)
    roles = ["embedding", "lm_head"]   # whose lrs are multiplied (default: all)
    seeds = [100, 101]                 # the grid's seeds
    shared_because = "..."             # why one multiplier may serve roles whose optima may differ
    min_hidden_rms_change = 0.1        # hidden weight RMS must move this much in a chosen tuning run
    extend = 2                         # a value chosen at a grid's edge adds one beyond it, this often
    hidden = { roles = ["attention", "mlp_in", "mlp_out"], multipliers = [0.5, 1, 2] }
                                       # a second factor, tuned first (equiopt.study.twofactor)

    [evaluation]
    seeds = [0, 1, 2, 3, 4]            # disjoint from the tuning seeds

    [analysis]
    statistic = "paired difference arm - baseline over the evaluation seeds, 95 % Student-t interval"
    decision = "reproduces / reverses when the interval excludes 0 on the paper's / the other side"
    level = 0.05                       # the exact sign-flip p must be below it too (default 0.05)

    [[claims]]                         # one per claim of the paper the study tests
    arm = "qwen3-a-i"
    says = "RowNormM on embedding and head reaches a lower validation loss than AdamW there"
    paper = "3.41 vs 3.46 (Table 2)"
    direction = "lower"                # the paper's sign of arm - baseline in the metric
    # baseline = "qwen3-a-ii"          # another arm to compare with (default: the study's)

Each claim gets a verdict from the paired interval of its arm against its baseline:
``reproduces`` when the interval lies on the paper's side of 0, ``reverses`` when it lies on
the other, ``inconclusive at this scale`` otherwise (and with one seed). A verdict that a
difference exists stands only where the exact paired sign-flip p is below the analysis'
``level`` too (:func:`~equiopt.study.paired.decided_verdict`); with five seeds it cannot be. A claim of no
difference (``direction = "equal"`` with a ``margin``) is ``equivalent`` when the interval
lies inside ``[-margin, margin]``, ``differs`` when it excludes 0, ``inconclusive`` otherwise.
A claim of no harm (``direction = "not_higher"`` with a ``margin``: the arm is not worse than
the baseline by ``margin`` or more, a non-inferiority test) holds when the interval's upper
end lies below ``margin``, ``harms`` when its lower end lies above it, ``inconclusive``
otherwise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..train.config import tomllib

__all__ = ["Claim", "Protocol", "load_protocol", "verdict", "VERDICTS"]

VERDICTS = ("reproduces", "reverses", "inconclusive at this scale")
DIRECTIONS = ("lower", "higher", "equal", "not_higher")
MARGINED = ("equal", "not_higher")  # directions that need a margin
_SECTIONS = {
    "study": {"name", "question", "configs", "baseline", "metric", "set", "budget"},
    "tuning": {
        "multipliers",
        "grids",
        "roles",
        "seeds",
        "shared_because",
        "min_hidden_rms_change",
        "extend",
        "hidden",
    },
    "evaluation": {"seeds", "tuned_on"},
    "analysis": {"statistic", "decision", "level"},
}


@dataclass(frozen=True)
class Claim:
    """One claim of the paper: ``arm`` against the protocol's baseline, in ``direction``."""

    arm: str
    says: str
    paper: str
    direction: str  # "lower", "higher" (the sign of arm - baseline the paper reports), "equal" or "not_higher"
    baseline: str = ""  # the arm compared with ("": the protocol's baseline)
    margin: float = 0.0  # the margin of an "equal" or "not_higher" claim


@dataclass(frozen=True)
class Protocol:
    """A parsed protocol file (see the module docstring)."""

    path: str
    sha256: str
    name: str
    question: str
    configs: list[str]
    baseline: str
    metric: str
    sets: dict[str, Any]
    multipliers: list[float] | dict[str, list[float]]
    roles: list[str] | None
    tune_seeds: list[int]
    eval_seeds: list[int]
    statistic: str
    decision: str
    claims: list[Claim] = field(default_factory=list)
    budget: str = ""
    shared_because: str = ""  # why one multiplier may serve roles whose optima may differ
    min_hidden_rms_change: float = 0.1  # see equiopt.study.guards.hidden_training_problem
    extend: int = 0  # times a value chosen at a grid's edge adds one beyond it (two-factor tuning)
    hidden: dict[str, Any] | None = None  # the second factor: roles, and a grid per config path
    warnings: list[str] = field(default_factory=list)  # design problems, printed first in the report
    level: float = 0.05  # the exact sign-flip p must be below it for a verdict to be decided

    @property
    def sweeps(self) -> bool:
        """Whether the protocol tunes each arm's learning rates on a grid."""
        return bool(self.multipliers)

    def identity(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256, "name": self.name}

    def header(self) -> list[str]:
        """The report's protocol lines: file, hash, question, statistic and decision rule."""
        lines = [
            f"Protocol: `{self.path}` (SHA-256 `{self.sha256}`), study **{self.name}**, committed before its runs.",
            "",
        ]
        if self.warnings:
            lines += [
                "**Design warnings** (equiopt.study.guards; this protocol's runs were made before these checks, "
                "which now refuse new runs of it):",
                "",
                *[f"- {w}" for w in self.warnings],
                "",
            ]
        lines += [f"Question: {self.question}"]
        if self.budget:
            lines += ["", f"Budget: {self.budget}"]
        if self.statistic:
            lines += ["", f"Statistic: {self.statistic}"]
        if self.decision:
            lines += ["", f"Decision rule: {self.decision}"]
        return lines

    def verdicts(self, rows: Sequence[Any]) -> list[dict[str, Any]]:
        """One record per claim: the paper's number, ours (the paired difference of the
        claim's arm and baseline over their common seeds, with its 95 % interval), the verdict.
        ``rows``: the comparison's :class:`~equiopt.study.compare_table.CompareRow` per arm."""
        from .paired import decided_verdict, paired_rows

        out = []
        for claim in self.claims:
            baseline = claim.baseline or self.baseline
            try:
                pairs = paired_rows(rows, baseline, metric=self.metric)
            except ValueError:
                pairs = []
            match = [p for p in pairs if p.label == claim.arm] or [p for p in pairs if claim.arm in p.label]
            pair = match[0] if len(match) == 1 else None
            interval = "not run" if pair is None else verdict(pair.ci, claim.direction, claim.margin)
            out.append(
                {
                    "arm": claim.arm,
                    "baseline": baseline,
                    "says": claim.says,
                    "paper": claim.paper,
                    "direction": claim.direction,
                    "mean": None if pair is None else pair.mean,
                    "ci": None if pair is None else pair.ci,
                    "n": 0 if pair is None else pair.n,
                    "sign_flip_p": None if pair is None else pair.sign_flip_p,
                    "interval_verdict": interval,
                    "verdict": interval
                    if pair is None
                    else decided_verdict(interval, pair.sign_flip_p, pair.n, self.level),
                }
            )
        return out

    def verdict_lines(self, rows: Sequence[Any], digits: int = 4) -> list[str]:
        """Markdown: one line per claim (see :meth:`verdicts`)."""
        if not self.claims:
            return []
        lines = [
            "## Claims",
            "",
            f"A verdict is decided only where the 95 % interval excludes 0 and the exact sign-flip p is below "
            f"{self.level:g} (with n seeds that p cannot go below 2 / 2^n, 0.0625 for five).",
            "",
            f"| claim | paper | ours: mean diff in {self.metric} [95 % CI], seeds | exact sign-flip p | verdict |",
            "|---|---|---|---|---|",
        ]
        for v in self.verdicts(rows):
            if v["mean"] is None:
                ours = "-"
            elif v["ci"] is None:
                ours = f"{v['mean']:+.{digits}f} (one seed)"
            else:
                lo, hi = v["ci"]
                ours = f"{v['mean']:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}], {v['n']} seeds"
            p = "-" if v["sign_flip_p"] is None else f"{v['sign_flip_p']:.4f}"
            lines.append(
                f"| {v['arm']} vs {v['baseline']}: {v['says']} | {v['paper']} | {ours} | {p} | {v['verdict']} |"
            )
        return lines


def verdict(ci: tuple[float, float] | None, direction: str, margin: float = 0.0) -> str:
    """The verdict of a paired interval of arm - baseline on a claim (see the module docstring):
    ``direction`` ``"lower"`` (the paper has the arm below the baseline), ``"higher"``,
    ``"equal"`` (no difference beyond ``margin``) or ``"not_higher"`` (no increase of
    ``margin`` or more)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    finite = ci is not None and all(math.isfinite(c) for c in ci)
    if direction in MARGINED:
        if not margin > 0:
            raise ValueError(f"an {direction!r} claim needs a margin > 0, got {margin!r}")
        if not finite:
            return "inconclusive"
        lo, hi = ci  # type: ignore[misc]
        if direction == "not_higher":
            if hi < margin:
                return f"no harm (below +{margin:g})"
            return f"harms (above +{margin:g})" if lo > margin else "inconclusive"
        if -margin <= lo and hi <= margin:
            return f"equivalent (within +-{margin:g})"
        return "differs" if lo > 0 or hi < 0 else "inconclusive"
    if not finite:
        return VERDICTS[2]
    lo, hi = ci  # type: ignore[misc]
    below, above = hi < 0, lo > 0
    if (below and direction == "lower") or (above and direction == "higher"):
        return VERDICTS[0]
    if below or above:
        return VERDICTS[1]
    return VERDICTS[2]


def _seeds(value: Any, where: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    ):
        raise ValueError(f"{where}: expected a non-empty list of integer seeds, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{where}: repeated seeds in {value!r}")
    return list(value)


def _text(table: dict, key: str, where: str, required: bool = True) -> str:
    value = table.get(key, "" if not required else None)
    if not isinstance(value, str) or (required and not value.strip()):
        raise ValueError(f"{where}, field {key!r}: expected {'a non-empty' if required else 'a'} string, got {value!r}")
    return value


def load_protocol(path: str | Path, allow_overlap: bool = False) -> Protocol:
    """Read and check a protocol file; errors name the file, the section and the field.

    Args:
        path: the ``.toml`` file.
        allow_overlap: accept evaluation seeds that are also tuning seeds.

    Returns:
        The :class:`Protocol`, with the SHA-256 of the file's bytes.

    Raises:
        ValueError: for a missing or unknown section or field, a bad value, a config that
            does not exist, or overlapping tuning and evaluation seeds.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    where = str(path)
    unknown = set(doc) - set(_SECTIONS) - {"claims"}
    if unknown:
        raise ValueError(
            f"{where}: unknown section(s) {', '.join(sorted(unknown))}; valid: {', '.join(_SECTIONS)}, claims"
        )
    for section, keys in _SECTIONS.items():
        extra = set(doc.get(section, {})) - keys
        if extra:
            raise ValueError(
                f"{where}, [{section}]: unknown field(s) {', '.join(sorted(extra))}; valid: {', '.join(sorted(keys))}"
            )
    study = doc.get("study")
    if not isinstance(study, dict):
        raise ValueError(f"{where}: missing [study] section")
    name = _text(study, "name", f"{where}, [study]")
    configs = study.get("configs")
    if not isinstance(configs, list) or not configs or not all(isinstance(c, str) for c in configs):
        raise ValueError(
            f"{where}, [study], field 'configs': expected a non-empty list of config paths, got {configs!r}"
        )
    resolved = []
    for c in configs:
        candidate = Path(c) if Path(c).exists() else path.parent / c
        if not candidate.exists():
            raise ValueError(f"{where}, [study], field 'configs': {c!r} does not exist")
        resolved.append(str(candidate) if not Path(c).exists() else c)
    sets = study.get("set", {})
    if not isinstance(sets, dict):
        raise ValueError(f"{where}, [study], field 'set': expected a table SECTION.FIELD = value, got {sets!r}")
    tuning = doc.get("tuning", {})
    multipliers = tuning.get("multipliers", [])
    if tuning and (
        not isinstance(multipliers, list)
        or not multipliers
        or not all(isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 for m in multipliers)
    ):
        raise ValueError(f"{where}, [tuning], field 'multipliers': expected positive numbers, got {multipliers!r}")
    grids = tuning.get("grids")
    if grids is not None:
        if not isinstance(grids, dict):
            raise ValueError(
                f"{where}, [tuning], field 'grids': expected a table config = [multipliers], got {grids!r}"
            )
        for c, grid in grids.items():
            if c not in configs:
                raise ValueError(f"{where}, [tuning], field 'grids': {c!r} is not one of [study] configs")
            if (
                not isinstance(grid, list)
                or not grid
                or not all(isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 for m in grid)
            ):
                raise ValueError(f"{where}, [tuning], field 'grids': {c!r}: expected positive numbers, got {grid!r}")
    roles = tuning.get("roles")
    if roles is not None and (not isinstance(roles, list) or not all(isinstance(r, str) for r in roles)):
        raise ValueError(f"{where}, [tuning], field 'roles': expected a list of role names, got {roles!r}")
    evaluation = doc.get("evaluation")
    if not isinstance(evaluation, dict):
        raise ValueError(f"{where}: missing [evaluation] section (its seeds)")
    eval_seeds = _seeds(evaluation.get("seeds"), f"{where}, [evaluation], field 'seeds'")
    if tuning:
        tune_seeds = _seeds(tuning.get("seeds"), f"{where}, [tuning], field 'seeds'")
    else:
        tune_seeds = (
            _seeds(evaluation["tuned_on"], f"{where}, [evaluation], field 'tuned_on'")
            if "tuned_on" in evaluation
            else []
        )
    if tune_seeds:
        from .paired import seed_split

        try:
            seed_split(
                eval_seeds,
                tune_seeds,
                allow_overlap,
                remedy="make them disjoint in the protocol (or pass --allow-seed-overlap, and the report says so first)",
            )
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    claims = []
    for k, c in enumerate(doc.get("claims", [])):
        cw = f"{where}, claims[{k}]"
        extra = set(c) - {"arm", "says", "paper", "direction", "baseline", "margin"}
        if extra:
            raise ValueError(f"{cw}: unknown field(s) {', '.join(sorted(extra))}")
        direction = _text(c, "direction", cw)
        if direction not in DIRECTIONS:
            raise ValueError(f"{cw}, field 'direction': expected one of {', '.join(DIRECTIONS)}, got {direction!r}")
        margin = c.get("margin", 0.0)
        if direction in MARGINED and (
            not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 < margin < math.inf
        ):
            raise ValueError(f"{cw}, field 'margin': a {direction!r} claim needs a margin > 0, got {margin!r}")
        claims.append(
            Claim(
                _text(c, "arm", cw),
                _text(c, "says", cw),
                _text(c, "paper", cw),
                direction,
                _text(c, "baseline", cw, required=False),
                float(margin),
            )
        )
    shared_because = _text(tuning, "shared_because", f"{where}, [tuning]", required=False)
    min_change = tuning.get("min_hidden_rms_change", 0.1)
    if not isinstance(min_change, (int, float)) or isinstance(min_change, bool) or not 0 <= min_change < 1:
        raise ValueError(
            f"{where}, [tuning], field 'min_hidden_rms_change': expected a fraction in [0, 1), got {min_change!r}"
        )
    extend = tuning.get("extend", 0)
    if not isinstance(extend, int) or isinstance(extend, bool) or extend < 0:
        raise ValueError(f"{where}, [tuning], field 'extend': expected an integer >= 0, got {extend!r}")
    hidden = _hidden(tuning.get("hidden"), configs, resolved, f"{where}, [tuning.hidden]")
    analysis = doc.get("analysis", {})
    level = analysis.get("level", 0.05)
    if not isinstance(level, (int, float)) or isinstance(level, bool) or not 0 < level < 1:
        raise ValueError(f"{where}, [analysis], field 'level': expected a number in (0, 1), got {level!r}")
    return Protocol(
        path=str(path),
        sha256=hashlib.sha256(data).hexdigest(),
        name=name,
        question=_text(study, "question", f"{where}, [study]"),
        configs=resolved,
        baseline=_text(study, "baseline", f"{where}, [study]"),
        metric=study.get("metric", "val/loss"),
        sets=dict(sets),
        multipliers=(
            {resolved[configs.index(c)]: [float(m) for m in (grids or {}).get(c, multipliers)] for c in configs}
            if grids
            else [float(m) for m in multipliers]
        ),
        roles=roles,
        tune_seeds=tune_seeds,
        eval_seeds=eval_seeds,
        statistic=_text(analysis, "statistic", f"{where}, [analysis]", required=False),
        decision=_text(analysis, "decision", f"{where}, [analysis]", required=False),
        claims=claims,
        budget=_text(study, "budget", f"{where}, [study]", required=False),
        level=float(level),
        shared_because=shared_because,
        min_hidden_rms_change=float(min_change),
        extend=extend,
        hidden=hidden,
    )


def _grid(value: Any, where: str) -> list[float]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 for m in value)
    ):
        raise ValueError(f"{where}: expected positive numbers, got {value!r}")
    return [float(m) for m in value]


def _hidden(table: Any, configs: list[str], resolved: list[str], where: str) -> dict[str, Any] | None:
    """``[tuning.hidden]``: ``roles`` (default: the hidden matrices), ``multipliers`` and optional
    per-config ``grids``, as ``{"roles": [...], "grids": {resolved config: [...]}}``."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table with roles and multipliers, got {table!r}")
    extra = set(table) - {"roles", "multipliers", "grids"}
    if extra:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(extra))}; valid: grids, multipliers, roles")
    from .guards import HIDDEN_ROLES

    roles = table.get("roles", list(HIDDEN_ROLES))
    if not isinstance(roles, list) or not roles or not all(isinstance(r, str) for r in roles):
        raise ValueError(f"{where}, field 'roles': expected a list of role names, got {roles!r}")
    default = _grid(table.get("multipliers"), f"{where}, field 'multipliers'")
    grids = table.get("grids", {})
    if not isinstance(grids, dict) or any(c not in configs for c in grids):
        raise ValueError(f"{where}, field 'grids': expected a table of [study] configs, got {grids!r}")
    return {
        "roles": list(roles),
        "grids": {
            r: (_grid(grids[c], f"{where}, field 'grids': {c!r}") if c in grids else default)
            for c, r in zip(configs, resolved)
        },
    }
