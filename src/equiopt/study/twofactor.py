"""Tuning two learning-rate factors per arm: the hidden matrices' rate, then the others'.

A protocol with ``[tuning.hidden]`` tunes each arm in two stages on its tuning seeds, one factor
at a time (coordinate-wise, so an arm costs the sum of its two grids' runs, not their product):

1. the **hidden** factor ``h`` (a multiplier of the rates of ``[tuning.hidden] roles``, the hidden
   matrices) over its grid, with the first factor at the middle value of its grid (the lower of
   the two middle values for an even count);
2. the **first** factor ``m`` (a multiplier of the rates of ``[tuning] roles``) over its grid, at
   the chosen ``h``.

A value chosen at an edge of its grid adds the next value beyond that edge (the grid's ratio
there), at most ``[tuning] extend`` times per factor, before the next stage; an arm still chosen at
an edge, or whose hidden matrices barely train in its chosen tuning runs
(:func:`~equiopt.study.guards.hidden_training_problem`), gets no evaluation runs. Otherwise the
arm runs at ``(h, m)`` on every evaluation seed. The run at ``h`` and ``m`` on seed ``s`` goes to
``<config's out_dir>/hx<h>-lrx<m>-s<s>``; a finished run is reused, so a study resumes where it
stopped and every choice is replayed from the logs.

:func:`sweep_two` returns, per arm, a :class:`~equiopt.study.paired.SweepArm` over the first
factor at the chosen ``h`` (for :func:`~equiopt.study.paired.sweep_report`), and the records of
both stages; :func:`hidden_lines` and :func:`gap_lines` add the hidden stage's table and the
paired gap at every validation step to the report.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .compare_table import HIGHER_IS_BETTER
from .paired import RunProgress, SweepArm, _done, _final, base_lrs, seed_split
from .stats import paired_interval

__all__ = ["TwoFactorArm", "sweep_two", "hidden_lines", "gap_lines", "val_series"]


def _tag(h: float, m: float, seed: int) -> str:
    return f"hx{h:g}-lrx{m:g}-s{seed}"


@dataclass
class TwoFactorArm:
    """One arm's two-stage tuning: its grids as run (with extensions), choices and runs."""

    label: str
    config: str
    first_lrs: dict[str, float]
    hidden_lrs: dict[str, float]
    first_grid: list[float]
    hidden_grid: list[float]
    start: float  # the first factor during the hidden stage
    runs: dict[tuple[float, float], dict[int, str]] = field(default_factory=dict)
    hidden: float | None = None
    first: float | None = None
    held: str = ""
    stage: str = "hidden"
    extended: dict[str, int] = field(default_factory=lambda: {"hidden": 0, "first": 0})

    def sweep_arm(self, tune_seeds: Sequence[int], eval_seeds: Sequence[int]) -> SweepArm:
        """The first-factor grid at the chosen hidden factor, as a sweep's arm."""
        h = self.hidden if self.hidden is not None else 1.0
        arm = SweepArm(
            self.label, self.config, dict(self.first_lrs), tune_seeds=list(tune_seeds), eval_seeds=list(eval_seeds)
        )
        for (hh, m), by_seed in sorted(self.runs.items()):
            if hh == h:
                arm.runs[m] = dict(by_seed)
        return arm


def _score(paths: Sequence[str], metric: str) -> float:
    vals = [_final(p, metric) for p in paths]
    if not vals or any(not math.isfinite(v) for v in vals):
        return -math.inf if metric in HIGHER_IS_BETTER else math.inf
    return statistics.fmean(vals)


def _choose(arm: TwoFactorArm, stage: str, tune: Sequence[int], metric: str) -> float:
    grid = arm.hidden_grid if stage == "hidden" else arm.first_grid
    keys = [(v, arm.start) if stage == "hidden" else (arm.hidden, v) for v in grid]
    scores = {v: _score([arm.runs[k][s] for s in tune], metric) for v, k in zip(grid, keys)}
    pick = max if metric in HIGHER_IS_BETTER else min
    return pick(scores, key=lambda v: (scores[v], v))


def sweep_two(
    configs: Sequence[str],
    first_grids: Mapping[str, Sequence[float]],
    first_roles: Sequence[str] | None,
    hidden_roles: Sequence[str],
    hidden_grids: Mapping[str, Sequence[float]],
    seeds: Sequence[int],
    tune_seeds: Sequence[int],
    sets: dict | None = None,
    extend: int = 0,
    min_hidden_rms_change: float = 0.1,
    metric: str = "val/loss",
    jobs: int = 1,
    train_fn=None,
    trainer: str | None = None,
    progress: bool = True,
    force: bool = False,
) -> list[TwoFactorArm]:
    """Tune and evaluate every config as the module docstring says; returns the arms' records
    (``held`` says why an arm got no evaluation runs)."""
    from ..train.config import load_config
    from .guards import hidden_training_problem
    from .runpool import DEFAULT_TRAINER, RunPool

    tuning, seeds, _ = seed_split(seeds, tune_seeds, False)
    pool = RunPool(jobs, train_fn=train_fn, trainer=trainer or DEFAULT_TRAINER, progress=progress)
    arms: list[TwoFactorArm] = []
    bases = []
    for path in configs:
        cfg = load_config(path, sets or {})
        first = sorted(float(m) for m in first_grids[str(path)])
        arms.append(
            TwoFactorArm(
                cfg.run.name,
                str(path),
                base_lrs(cfg, first_roles),
                base_lrs(cfg, hidden_roles),
                first,
                sorted(float(h) for h in hidden_grids[str(path)]),
                first[(len(first) - 1) // 2],
            )
        )
        bases.append(cfg)
    total = sum(len(a.hidden_grid) + len(a.first_grid) - 1 for a in arms) * len(tuning) + len(arms) * len(seeds)
    runs = RunProgress(total, enabled=progress)
    waiting = dict.fromkeys(range(len(arms)), 0)

    def run(i: int, h: float, m: float, seed: int, phase: int) -> None:
        arm, cfg = arms[i], bases[i]
        overrides = json.loads(json.dumps(cfg.optim.overrides or {}))
        for role, lr in arm.hidden_lrs.items():
            overrides.setdefault(role, {})["lr"] = lr * h
        for role, lr in arm.first_lrs.items():
            overrides.setdefault(role, {})["lr"] = lr * m
        tag = _tag(h, m, seed)
        out = cfg.out_path / tag
        arm.runs.setdefault((h, m), {})[seed] = str(out)
        run_sets = dict(sets or {})
        run_sets.update(
            {
                "run.seed": seed,
                "run.name": f"{cfg.run.name}-{tag}",
                "run.out_dir": str(out),
                "optim.overrides": overrides,
            }
        )
        if not force and _done(out):
            if progress:
                print(f"{out}: already done, skipped")
            runs.done(run_sets["run.name"], reused=True)
            return
        waiting[i] += 1
        pool.submit((i, run_sets["run.name"]), arm.config, run_sets, priority=(phase, i))

    def grow(arm: TwoFactorArm, stage: str, chosen: float) -> float | None:
        """The value beyond the edge ``chosen`` sits at, if the protocol allows one more."""
        grid = arm.hidden_grid if stage == "hidden" else arm.first_grid
        if len(grid) < 2 or chosen not in (grid[0], grid[-1]) or arm.extended[stage] >= extend:
            return None
        arm.extended[stage] += 1
        if chosen == grid[0]:
            value = grid[0] * grid[0] / grid[1]
            grid.insert(0, value)
        else:
            value = grid[-1] * grid[-1] / grid[-2]
            grid.append(value)
        return value

    def advance(i: int) -> None:
        """Arm ``i``'s runs queued so far are done: choose, extend, or queue the next stage."""
        arm = arms[i]
        while not waiting[i] and arm.stage not in ("done", "held"):
            if arm.stage == "hidden":
                if not all((h, arm.start) in arm.runs for h in arm.hidden_grid):
                    for h in arm.hidden_grid:
                        for seed in tuning:
                            run(i, h, arm.start, seed, 0)
                    continue
                best = _choose(arm, "hidden", tuning, metric)
                value = grow(arm, "hidden", best)
                if value is not None:
                    for seed in tuning:
                        run(i, value, arm.start, seed, 0)
                    continue
                arm.hidden, arm.stage = best, "first"
                for m in arm.first_grid:
                    for seed in tuning:
                        run(i, best, m, seed, 0)
            elif arm.stage == "first":
                best = _choose(arm, "first", tuning, metric)
                value = grow(arm, "first", best)
                if value is not None:
                    for seed in tuning:
                        run(i, arm.hidden, value, seed, 0)
                    continue
                arm.first = best
                key = (arm.hidden, best)
                edges = [
                    f"{name} factor x{v:g} at the edge of its grid {[f'{g:g}' for g in grid]}"
                    for name, v, grid in (("hidden", arm.hidden, arm.hidden_grid), ("first", best, arm.first_grid))
                    if len(grid) > 1 and v in (grid[0], grid[-1])
                ]
                if edges:
                    arm.held = f"{arm.label}: chosen with its {' and '.join(edges)} after {extend} extension(s)"
                else:
                    arm.held = (
                        hidden_training_problem(arm.label, [arm.runs[key][s] for s in tuning], min_hidden_rms_change)
                        or ""
                    )
                if arm.held:
                    arm.stage = "held"
                    print(f"held, no evaluation runs: {arm.held}", flush=True)
                    return
                arm.stage = "eval"
                for seed in seeds:
                    run(i, arm.hidden, best, seed, 1)
            else:
                arm.stage = "done"

    def drain() -> None:
        while len(pool):
            for key in pool.wait():
                i, name = key
                runs.done(name, seconds=pool.seconds.get(key))
                waiting[i] -= 1
                if not waiting[i]:
                    advance(i)

    with pool:
        for i in range(len(arms)):
            advance(i)
            if jobs == 1:  # one arm at a time: its evaluation runs before the next arm's tuning
                drain()
        drain()
    return arms


def hidden_lines(arms: Sequence[TwoFactorArm], tune_seeds: Sequence[int], metric: str, digits: int = 4) -> list[str]:
    """Markdown: every tuning run of both stages, with the choices and any held arm."""
    lines = [
        "## Two-factor tuning (hidden rate first, then the first factor at the chosen hidden rate)",
        "",
        "| arm | hidden factor | first factor | hidden lrs | first lrs | mean | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        for (h, m), by_seed in sorted(a.runs.items()):
            tune = [by_seed[s] for s in tune_seeds if s in by_seed]
            if not tune:
                continue
            mean = _score(tune, metric)
            mark = " **(chosen)**" if (h, m) == (a.hidden, a.first) else ""
            lines.append(
                f"| {a.label} | {h:g} | {m:g}{mark} | "
                + ", ".join(f"{r} {lr * h:.4g}" for r, lr in a.hidden_lrs.items())
                + " | "
                + ", ".join(f"{r} {lr * m:.4g}" for r, lr in a.first_lrs.items())
                + f" | {mean:.{digits}f} | "
                + "; ".join(f"`{p}`" for p in tune)
                + " |"
            )
    held = [a.held for a in arms if a.held]
    if held:
        lines += ["", "Held (no evaluation runs):", "", *[f"- {h}" for h in held]]
    return lines + [""]


def val_series(path: str, metric: str = "val/loss") -> dict[int, float]:
    """``{step: value}`` of every validation record of a run's ``log.jsonl`` holding ``metric``."""
    out = {}
    log = Path(path) / "log.jsonl"
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if metric in rec and isinstance(rec[metric], (int, float)):
            out[int(rec["step"])] = float(rec[metric])
    return out


def gap_lines(
    arms: Sequence[TwoFactorArm],
    pairs: Sequence[tuple[str, str]],
    eval_seeds: Sequence[int],
    metric: str = "val/loss",
    digits: int = 4,
) -> list[str]:
    """Markdown: for each ``(arm, baseline)`` label pair, the paired gap arm - baseline in
    ``metric`` at every validation step over the evaluation seeds, mean and 95 % Student-t."""
    by_label = {a.label: a for a in arms}
    lines = [f"## The gap at every validation step (arm - baseline in {metric}, evaluation seeds)", ""]
    for arm, base in pairs:
        a, b = by_label.get(arm), by_label.get(base)
        if a is None or b is None or a.first is None or b.first is None:
            continue
        ra, rb = a.runs.get((a.hidden, a.first), {}), b.runs.get((b.hidden, b.first), {})
        seeds = [s for s in eval_seeds if s in ra and s in rb]
        series = {s: (val_series(ra[s], metric), val_series(rb[s], metric)) for s in seeds}
        steps = sorted(set.intersection(*[set(x) & set(y) for x, y in series.values()])) if series else []
        if not steps:
            continue
        lines += [f"{arm} - {base}:", "", "| step | seeds | mean | 95 % CI |", "|---|---|---|---|"]
        for step in steps:
            diffs = [series[s][0][step] - series[s][1][step] for s in seeds]
            mean, _, ci = paired_interval(diffs)
            ci_txt = "-" if ci is None else f"[{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"
            lines.append(f"| {step} | {len(diffs)} | {mean:+.{digits}f} | {ci_txt} |")
        lines.append("")
    return lines
