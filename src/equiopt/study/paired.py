"""Paired comparisons against a baseline, and learning-rate sweeps that tune every arm.

An optimizer comparison is only as good as its baseline's tuning and its seed noise. Two
tools answer both:

:func:`paired_rows` / :func:`paired_table`
    For every configuration against a named baseline, the per-seed differences
    ``value(arm, seed) - value(baseline, seed)`` over the seeds both ran (same seed =
    same initialisation and data order, so the differences cancel the shared noise), their
    mean, a 95 % Student-t confidence interval ``mean +- t_{0.975, n-1} s / sqrt(n)``, how
    many seeds agree in sign (the arm is better on ``k`` of ``n`` seeds) and the two-sided
    exact sign-flip p over all ``2**n`` sign assignments of the differences
    (:func:`~equiopt.study.stats.sign_flip_p`; at least ``2 / 2**n``, 0.0625 for five seeds).

:func:`decided_verdict`
    A verdict that says a difference exists ("reproduces", "reverses", "differs") is
    *decided* only where the interval excludes 0 and the sign-flip p is below the level
    (0.05 unless a protocol says otherwise): the interval rests on normality, the sign-flip
    test only on the pairing. With five seeds the test cannot go below 0.0625, so no
    five-seed verdict is decided; it reads "not decided: interval on the other side of 0
    (normal theory); exact test cannot decide at n = 5".

:func:`sweep` / :func:`sweep_report`
    Each arm (a run config) is trained at every multiplier of a learning-rate grid (the
    multiplier scales the lr of the chosen roles, all roles by default) on the tuning
    seeds, then at its chosen multiplier on the evaluation seeds; a run whose log already
    ends with ``status: done`` is skipped, so an interrupted sweep resumes. Each arm's best
    multiplier is the one with the lowest mean final metric over the tuning seeds (a run
    that diverged counts as +inf); the report then compares best against best, paired by
    seed over the evaluation seeds only, and lists every number with the run directory
    whose ``log.jsonl`` holds it. Tuning and evaluation seeds must be disjoint unless the
    overlap is allowed explicitly (:func:`seed_split`); the report's first line says so
    then. The lr is chosen on the same validation batches that the comparison reports (on
    other seeds); the report says so.

:class:`RunProgress`
    Runs done out of the total and the time left, for a sweep or ``equiopt compare``: one
    line per finished run on stderr (``[3/12 runs] done: qwen3-b-ii-s1 (41 s); ~6 min
    left``), or an outer tqdm bar when tqdm is installed and stderr is a terminal, beside
    each run's own progress bar. The estimate is the mean time of the runs trained so far in
    this invocation times the runs left; runs reused because they had already finished count
    as done without entering it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .compare_table import HIGHER_IS_BETTER, CompareRow, compare_rows, paired_differences
from .stats import paired_interval, sign_flip_floor, sign_flip_p, t_cdf, t_quantile

__all__ = [
    "t_cdf",
    "t_quantile",
    "sign_flip_p",
    "LEVEL",
    "decided_verdict",
    "is_decided",
    "PairedRow",
    "paired_rows",
    "paired_table",
    "SweepArm",
    "sweep",
    "sweep_report",
    "select_baseline",
    "seed_split",
    "RunProgress",
]


# ------------------------------------------------------------ paired compare
#: The level the exact sign-flip p must fall below for a verdict to be decided, unless a protocol sets its own.
LEVEL = 0.05
#: Interval verdicts that say a difference from 0 exists (and so need the exact test to agree).
_DIFFERENCE = {"reproduces": "on the paper's side of 0", "reverses": "on the other side of 0", "differs": "excludes 0"}


def decided_verdict(interval_verdict: str, p: float | None, n: int, level: float = LEVEL) -> str:
    """``interval_verdict`` (from :func:`~equiopt.study.protocol.verdict`) where the exact
    sign-flip p agrees, else why not.

    A verdict that a difference exists ("reproduces", "reverses", "differs") stands only
    where the sign-flip ``p`` of the ``n`` paired differences is below ``level``; otherwise
    it becomes "not decided: interval on the other side of 0 (normal theory); exact test
    cannot decide at n = 5" (when ``2 / 2**n >= level``, no data could decide it) or "...;
    exact test does not decide (sign-flip p = 0.19)". Verdicts about margins or no
    difference ("equivalent", "no harm", "harms", "inconclusive") are returned as they are.
    """
    where = _DIFFERENCE.get(interval_verdict)
    if where is None or (p is not None and p < level):
        return interval_verdict
    floor = sign_flip_floor(n)
    if floor is None or floor >= level:
        why = f"exact test cannot decide at n = {n}"
    else:
        why = "exact test does not decide (sign-flip p " + ("unknown" if p is None else f"= {p:.4g}") + ")"
    return f"not decided: interval {where} (normal theory); {why}"


def is_decided(verdict_text: str) -> bool:
    """Whether a verdict from :func:`decided_verdict` says a difference exists and both tests agree."""
    return verdict_text in _DIFFERENCE


@dataclass
class PairedRow:
    """An arm against the baseline over the seeds both have a finite value for.

    ``diffs[i] = values[i] - baseline_values[i]`` for ``seeds[i]``; ``ci`` is the 95 %
    Student-t interval of the mean difference (``None`` below two seeds); ``better`` counts
    the seeds on which the arm beats the baseline (lower, or higher for
    :data:`HIGHER_IS_BETTER` metrics), ``worse`` those on which it loses; ``sign_flip_p`` is
    the two-sided exact sign-flip p of the differences (None without any).
    """

    label: str
    baseline: str
    metric: str
    seeds: list[Any]
    values: list[float]
    baseline_values: list[float]
    diffs: list[float]
    mean: float | None
    std: float | None
    ci: tuple[float, float] | None
    better: int
    worse: int
    unpaired: list[Any] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    baseline_paths: list[str] = field(default_factory=list)
    sign_flip_p: float | None = None

    @property
    def n(self) -> int:
        return len(self.diffs)

    def as_dict(self) -> dict:
        return asdict(self)


def select_baseline(rows: Sequence[CompareRow], baseline: str) -> CompareRow:
    """The row whose label is ``baseline``, else the only one whose label or a run path contains it."""
    exact = [r for r in rows if r.label == baseline]
    if len(exact) == 1:
        return exact[0]
    found = [r for r in rows if baseline in r.label or any(baseline in p for p in r.paths)]
    if len(found) == 1:
        return found[0]
    labels = ", ".join(repr(r.label) for r in rows)
    what = "no configuration" if not found else f"{len(found)} configurations"
    raise ValueError(f"baseline {baseline!r}: {what} match; configurations: {labels}")


def _pair(row: CompareRow, base: CompareRow, metric: str) -> PairedRow:
    higher = metric in HIGHER_IS_BETTER
    seeds, vals, bvals, diffs, paths, bpaths, unpaired = paired_differences(row, base)
    mean, std, ci = paired_interval(diffs)
    better = sum(1 for d in diffs if (d > 0 if higher else d < 0))
    worse = sum(1 for d in diffs if (d < 0 if higher else d > 0))
    return PairedRow(
        row.label,
        base.label,
        metric,
        seeds,
        vals,
        bvals,
        diffs,
        mean,
        std,
        ci,
        better,
        worse,
        unpaired,
        paths,
        bpaths,
        sign_flip_p=sign_flip_p(diffs),
    )


def paired_rows(
    run_dirs: Iterable[Any] | Sequence[CompareRow], baseline: str, metric: str = "val/loss", ignore: Iterable[str] = ()
) -> list[PairedRow]:
    """Every configuration but the baseline, paired with it by seed (see :class:`PairedRow`).
    ``run_dirs``: what :func:`~equiopt.study.compare_table.compare_rows` takes, or its rows."""
    items = list(run_dirs)
    rows = (
        items
        if items and all(isinstance(r, CompareRow) for r in items)
        else compare_rows(items, metric=metric, ignore=ignore)
    )
    base = select_baseline(rows, baseline)
    return [_pair(r, base, metric) for r in rows if r is not base]


def _f(v: float | None, digits: int, sign: bool = False) -> str:
    if v is None or not math.isfinite(v):
        return "-" if v is None else str(v)
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def _p(p: float | None) -> str:
    """A p value as the table shows it: four decimals, or '-' without one."""
    return "-" if p is None else f"{p:.4f}"


def paired_table(rows: Sequence[PairedRow], digits: int = 4) -> str:
    """Markdown: one line per arm with the mean paired difference, its 95 % CI, the exact
    sign-flip p, the sign count and every seed's difference."""
    if not rows:
        return "(no configuration besides the baseline)"
    metric, base = rows[0].metric, rows[0].baseline
    better = "higher" if metric in HIGHER_IS_BETTER else "lower"
    header = [
        "configuration",
        "paired seeds",
        f"mean diff in {metric} vs {base}",
        "95 % CI (Student t)",
        "exact sign-flip p",
        f"seeds {better} than baseline",
        "per-seed diff (seed: diff)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in rows:
        ci = f"[{_f(r.ci[0], digits, True)}, {_f(r.ci[1], digits, True)}]" if r.ci else "- (one seed)"
        per = ", ".join(f"{s}: {_f(d, digits, True)}" for s, d in zip(r.seeds, r.diffs))
        if r.unpaired:
            per += f" (unpaired: {', '.join(map(str, r.unpaired))})"
        lines.append(
            "| "
            + " | ".join(
                [
                    r.label.replace("|", "\\|"),
                    str(r.n),
                    _f(r.mean, digits, True),
                    ci,
                    _p(r.sign_flip_p),
                    f"{r.better} of {r.n}",
                    per,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------- progress
def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class RunProgress:
    """Runs done of ``total`` and the time left, reported after each run (see the module docstring).

    Call :meth:`done` once per run, with ``reused=True`` for a run that had already
    finished: it counts as done but its (near zero) time does not enter the mean that the
    estimate scales. A trained run's time is the wall time since the previous call (or since
    construction). Only the main process reports (``RANK`` unset or 0); ``enabled=False``
    reports nothing. ``stream`` (stderr by default) gets the lines, or the tqdm bar when it is
    a terminal and tqdm is installed.
    """

    def __init__(self, total: int, enabled: bool = True, stream=None, clock=time.perf_counter):
        self.total, self.count, self.times = total, 0, []
        self.stream = stream or sys.stderr
        self.enabled = enabled and os.environ.get("RANK", "0") == "0"
        self.clock = clock
        self.mark = clock()
        self.bar = None
        if self.enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(
                    total=total,
                    desc="runs",
                    unit="run",
                    file=self.stream,
                    dynamic_ncols=True,
                    bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}",
                )
            except ImportError:
                pass

    def left(self) -> float | None:
        """Seconds left: the mean time of the runs trained so far times the runs not yet done."""
        return statistics.fmean(self.times) * (self.total - self.count) if self.times else None

    def done(self, name: str, reused: bool = False, seconds: float | None = None) -> str:
        """Count one run as done; report and return its line. ``seconds`` is the run's own time when
        runs overlap (the line shows it; the estimate still scales the time between runs done)."""
        now = self.clock()
        self.count += 1
        if reused:
            what = f"reused: {name} (already finished)"
        else:
            self.times.append(now - self.mark)
            what = f"done: {name} ({_duration(self.times[-1] if seconds is None else seconds)})"
        self.mark = now
        left = self.left()
        tail = "" if left is None or self.count >= self.total else f"; ~{_duration(left)} left"
        line = f"[{self.count}/{self.total} runs] {what}{tail}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"{what}{tail}", refresh=False)
            self.bar.update(1)
            if self.count >= self.total:
                self.bar.close()
        elif self.enabled:
            print(line, file=self.stream, flush=True)
        return line


# ------------------------------------------------------------------- sweeps
@dataclass
class SweepArm:
    """One config swept over lr multipliers: ``runs[mult][seed] = run directory``; the
    multiplier is chosen on ``tune_seeds`` (every seed of the grid when empty) and the arm
    is judged on ``eval_seeds`` at that multiplier (every seed run there when empty)."""

    label: str
    config: str
    base_lrs: dict[str, float]
    runs: dict[float, dict[int, str]] = field(default_factory=dict)
    tune_seeds: list[int] = field(default_factory=list)
    eval_seeds: list[int] = field(default_factory=list)


_OVERLAP_REMEDY = (
    "give disjoint tuning seeds (e.g. --tune-seeds 100,101 --seeds 5) or allow the overlap explicitly "
    "(--allow-seed-overlap; the report says so first)"
)


def seed_split(
    seeds: Sequence[int],
    tune_seeds: int | Sequence[int] | None,
    allow_overlap: bool = False,
    remedy: str = _OVERLAP_REMEDY,
) -> tuple[list[int], list[int], list[int]]:
    """``(tuning, evaluation, overlap)`` seeds of a sweep.

    ``seeds`` are the evaluation seeds; ``tune_seeds`` the seeds the lr grid runs on: a
    list, ``k`` (seeds ``0..k-1``) or None (the evaluation seeds themselves). A seed in
    both would choose an arm's lr and then judge it, which flatters every tuned arm by the
    noise it was selected on; that is refused unless ``allow_overlap`` (the error ends with
    ``remedy``).

    Raises:
        ValueError: for an empty seed list, or overlapping seeds without ``allow_overlap``.
    """
    evaluation = list(dict.fromkeys(int(s) for s in seeds))
    if not evaluation:
        raise ValueError("no evaluation seeds")
    if tune_seeds is None:
        tuning = list(evaluation)
    elif isinstance(tune_seeds, int) and not isinstance(tune_seeds, bool):
        if tune_seeds < 1:
            raise ValueError(f"tune_seeds must be >= 1, got {tune_seeds}")
        tuning = list(range(tune_seeds))
    else:
        tuning = list(dict.fromkeys(int(s) for s in tune_seeds))
        if not tuning:
            raise ValueError("tune_seeds is empty")
    overlap = [s for s in evaluation if s in tuning]
    if overlap and not allow_overlap:
        raise ValueError(
            f"evaluation seed(s) {', '.join(map(str, overlap))} are also tuning seeds: each arm's lr would be "
            f"chosen on the seeds that then judge it; {remedy}"
        )
    return tuning, evaluation, overlap


def base_lrs(cfg, roles: Sequence[str] | None) -> dict[str, float]:
    from ..recipes import ROLES, get_recipe

    recipe = get_recipe(cfg.optim.recipe)
    if cfg.optim.overrides:
        recipe = recipe.with_overrides(cfg.optim.overrides)
    wanted = list(roles) if roles else list(ROLES)
    unknown = [r for r in wanted if r not in ROLES]
    if unknown:
        raise ValueError(f"unknown role(s) {', '.join(unknown)}; valid: {', '.join(ROLES)}")
    return {role: float(recipe.settings(role)["lr"]) for role in wanted}


def _done(out: Path) -> bool:
    log = out / "log.jsonl"
    if not log.exists():
        return False
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    if not lines:
        return False
    try:
        last = json.loads(lines[-1])
    except json.JSONDecodeError:
        return False
    return last.get("kind") == "end" and last.get("status") in ("done", "nonfinite")


def mult_tag(mult: float) -> str:
    return f"lrx{mult:g}"


def sweep(
    configs: Sequence[str],
    multipliers: Sequence[float] | Mapping[str, Sequence[float]],
    seeds: Sequence[int],
    roles: Sequence[str] | None = None,
    sets: dict | None = None,
    force: bool = False,
    train_fn=None,
    progress: bool = True,
    tune_seeds: int | Sequence[int] | None = None,
    metric: str = "val/loss",
    allow_overlap: bool = False,
    jobs: int = 1,
    trainer: str | None = None,
    hold=None,
) -> list[SweepArm]:
    """Train every config at every lr multiplier and tuning seed, then at its chosen
    multiplier on every evaluation seed (resumable, see the module docstring).

    The run of config ``c`` at multiplier ``m`` and seed ``s`` goes to
    ``<c's out_dir>/lrx<m>-s<s>`` with run name ``<c's name>-lrx<m>-s<s>``; its
    ``optim.overrides`` set ``lr = m * base lr`` for each swept role on top of the config's
    own overrides. A run that diverges (``nonfinite``) is kept as a result, not retried.
    ``multipliers`` is one grid for every config, or a grid per config path. ``seeds`` are
    the evaluation seeds and ``tune_seeds`` the grid's (see :func:`seed_split`:
    overlapping seeds are refused unless ``allow_overlap``); the multiplier with the best
    mean ``metric`` over the tuning seeds is then run on every evaluation seed. With ``progress`` each
    run shows its own progress and a :class:`RunProgress` reports the runs done and the time left.

    ``jobs`` runs train at once (:class:`~equiopt.study.runpool.RunPool`): with 1, one after
    another in this process through ``train_fn``; with more, each in a process of its own through
    ``trainer`` (``"module:function"``, default :func:`equiopt.train.loop.train`); an arm's
    evaluation runs are queued once its own tuning runs are done, behind every tuning run still
    waiting, so an arm chosen at an edge of its grid shows before any evaluation run is spent on
    it. Either way every run trains as it would alone, so the runs, the choices and the report
    are the same.

    ``hold(arm, multiplier)``, when given, is asked once an arm's tuning runs are done and its
    multiplier chosen; a true answer (the reason) starts none of its evaluation runs
    (:func:`equiopt.study.guards.hidden_training_problem`).
    """
    from ..train.config import load_config
    from .runpool import DEFAULT_TRAINER, RunPool

    tuning, seeds, overlap = seed_split(seeds, tune_seeds, allow_overlap)
    grids = {str(c): list(multipliers[str(c)] if isinstance(multipliers, Mapping) else multipliers) for c in configs}
    if isinstance(multipliers, Mapping):
        stray = [k for k in multipliers if k not in grids]
        if stray:
            raise ValueError(f"grids given for configs not compared: {', '.join(stray)}")
    total = sum(len(g) * len(tuning) + len(seeds) - len(overlap) for g in grids.values())
    pool = RunPool(jobs, train_fn=train_fn, trainer=trainer or DEFAULT_TRAINER, progress=progress)
    runs = RunProgress(total, enabled=progress)
    arms, bases = [], []
    for path in configs:
        base_cfg = load_config(path, sets or {})
        base = base_lrs(base_cfg, roles)
        arms.append(SweepArm(base_cfg.run.name, str(path), base, tune_seeds=list(tuning), eval_seeds=list(seeds)))
        bases.append(base_cfg)
    waiting = {i: 0 for i in range(len(arms))}  # tuning runs not yet finished, per arm

    def run(i: int, mult: float, seed: int, phase: int) -> None:
        """Record the run of arm ``i`` at ``mult`` and ``seed``; queue it unless it is done already."""
        arm, base_cfg = arms[i], bases[i]
        overrides = json.loads(json.dumps(base_cfg.optim.overrides or {}))
        for role, lr in arm.base_lrs.items():
            overrides.setdefault(role, {})["lr"] = lr * mult
        tag = f"{mult_tag(mult)}-s{seed}"
        run_sets = dict(sets or {})
        run_sets.update(
            {
                "run.seed": seed,
                "run.name": f"{base_cfg.run.name}-{tag}",
                "run.out_dir": str(base_cfg.out_path / tag),
                "optim.overrides": overrides,
            }
        )
        out = base_cfg.out_path / tag
        arm.runs.setdefault(mult, {})[seed] = str(out)
        if not force and _done(out):
            if progress:
                print(f"{out}: already done, skipped")
            runs.done(run_sets["run.name"], reused=True)
            return
        if phase == 0:
            waiting[i] += 1
        pool.submit((i, phase, run_sets["run.name"]), arm.config, run_sets, priority=(phase, i))

    def evaluate(i: int) -> None:
        """Queue arm ``i``'s evaluation runs at its chosen multiplier (its tuning runs are all done)."""
        best, _ = _best(arms[i], metric)
        if hold is not None and hold(arms[i], best):
            return
        for seed in seeds:
            if seed not in arms[i].runs[best]:
                run(i, best, seed, phase=1)

    with pool:
        for i, arm in enumerate(arms):
            for mult in grids[arm.config]:
                for seed in tuning:
                    run(i, mult, seed, phase=0)
            if not waiting[i]:
                evaluate(i)
            if jobs == 1:  # one at a time: an arm's evaluation runs come before the next arm's tuning
                _drain(pool, runs, waiting, evaluate)
        _drain(pool, runs, waiting, evaluate)
    return arms


def _drain(pool, runs: RunProgress, waiting: dict[int, int], evaluate) -> None:
    """Wait for the pool's runs, queueing each arm's evaluation runs once its last tuning run ends."""
    while len(pool):
        for key in pool.wait():
            i, phase, name = key
            runs.done(name, seconds=pool.seconds.get(key))
            if phase == 0:
                waiting[i] -= 1
                if not waiting[i]:
                    evaluate(i)


def _final(path: str, metric: str) -> float:
    from .plots import read_run

    run = read_run(path)
    v = run.final(metric)
    return math.nan if v is None else v


def _best(arm: SweepArm, metric: str) -> tuple[float, dict[float, float]]:
    higher = metric in HIGHER_IS_BETTER
    means = {}
    for mult, by_seed in arm.runs.items():
        vals = [_final(p, metric) for s, p in by_seed.items() if not arm.tune_seeds or s in arm.tune_seeds]
        bad = any(not math.isfinite(v) for v in vals)
        mean = statistics.fmean(vals) if not bad else math.nan
        means[mult] = mean
    score = {m: (v if math.isfinite(v) else (-math.inf if higher else math.inf)) for m, v in means.items()}
    best = (max if higher else min)(score, key=lambda m: (score[m], m))
    return best, means


def _figure(
    arms: Sequence[SweepArm],
    metric: str,
    best: dict[str, float],
    grid: dict[str, dict[float, float]],
    pairs: Sequence[PairedRow],
    out: Path,
    stem: str,
) -> list[Path]:
    """``<stem>.png`` (the sweep) and ``<stem>-paired.png`` in ``out`` (named after the report, so
    reports written to one directory keep their own figures)."""
    from .plots import matplotlib_api

    Figure = matplotlib_api()[0]
    paths = []
    fig = Figure(figsize=(6.5, 4.5))
    ax = fig.subplots()
    for arm in arms:
        mults = sorted(arm.runs)
        means = [grid[arm.label][m] for m in mults]
        (line,) = ax.plot(mults, means, marker="o", label=arm.label)
        for m in mults:
            vals = [_final(p, metric) for p in arm.runs[m].values()]
            ax.scatter([m] * len(vals), vals, s=12, alpha=0.5, color=line.get_color())
        bm = best[arm.label]
        ax.plot([bm], [means[mults.index(bm)]], "*", color=line.get_color(), markersize=14)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("learning-rate multiplier (of each arm's own lrs)")
    ax.set_ylabel(f"final {metric}")
    ax.set_title("lr sweep: points = seeds, line = mean over tuning seeds, star = chosen", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / f"{stem}.png"
    fig.savefig(p, dpi=110)
    paths.append(p)
    if pairs:
        fig = Figure(figsize=(6.5, 0.6 + 0.55 * len(pairs) + 1.5))
        ax = fig.subplots()
        for i, r in enumerate(pairs):
            ax.scatter(r.diffs, [i] * len(r.diffs), s=18, alpha=0.7)
            if r.mean is not None:
                ax.plot([r.mean], [i], "k|", markersize=18)
            if r.ci:
                ax.plot(list(r.ci), [i, i], "k-", linewidth=2)
        ax.axvline(0.0, color="grey", linestyle="--")
        ax.set_yticks(range(len(pairs)), [r.label for r in pairs])
        ax.set_xlabel(f"{metric}: arm - baseline ({pairs[0].baseline}), per seed; bar = mean, line = 95 % CI")
        fig.tight_layout()
        p = out / f"{stem}-paired.png"
        fig.savefig(p, dpi=110)
        paths.append(p)
    return paths


def sweep_report(
    arms: Sequence[SweepArm],
    baseline: str,
    metric: str = "val/loss",
    out: str | Path | None = None,
    command: str = "",
    digits: int = 4,
    protocol=None,
) -> str:
    """The markdown report of a sweep (see the module docstring); figures go next to
    ``out`` (the report's path) when it is given, and the report is written there.

    The comparison is over each arm's evaluation seeds. Its first line says so when an
    evaluation seed was also a tuning seed; with ``protocol`` (a
    :class:`~equiopt.study.protocol.Protocol`) the report names the protocol file and its
    SHA-256 and ends with one verdict line per claim of the protocol."""
    best, grid = {}, {}
    for arm in arms:
        best[arm.label], grid[arm.label] = _best(arm, metric)
    overlap = sorted({s for arm in arms for s in arm.eval_seeds if s in arm.tune_seeds})
    lines = []
    if overlap:
        lines += [
            f"**Seed overlap: evaluation seed(s) {', '.join(map(str, overlap))} also chose the learning rates; "
            "the differences below are optimistic for every tuned arm (allowed explicitly).**",
            "",
        ]
    lines += ["# Learning-rate sweep and paired comparison", ""]
    if protocol is not None:
        lines += protocol.header() + [""]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    tuning = sorted({s for arm in arms for s in arm.tune_seeds})
    evaluation = sorted({s for arm in arms for s in arm.eval_seeds})
    lines += [
        f"Metric: final `{metric}` of each run (the last record of its `log.jsonl` holding it). "
        "Each arm's lr multiplier is chosen by the lowest mean over the tuning seeds on this same metric "
        "(a diverged run counts as +inf), then the chosen runs are compared with the baseline's "
        "chosen runs seed by seed. Selecting and reporting on the same validation batches favours "
        "every arm alike, slightly optimistically."
    ]
    if tuning and evaluation:
        lines += [
            "",
            f"Tuning seeds: {', '.join(map(str, tuning))}; evaluation seeds: {', '.join(map(str, evaluation))} "
            "(run at each arm's chosen multiplier after it was chosen; the grid's mean column is over the "
            "tuning seeds, the comparison over the evaluation seeds only).",
        ]
    lines += ["", "## Grid", ""]
    header = ["arm", "multiplier", "lrs", "mean", "per seed (seed: value, run directory)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for arm in arms:
        for mult in sorted(arm.runs):
            lrs = ", ".join(f"{role} {lr * mult:.4g}" for role, lr in arm.base_lrs.items())
            per = "; ".join(f"{s}: {_f(_final(p, metric), digits)} (`{p}`)" for s, p in sorted(arm.runs[mult].items()))
            mean = _f(grid[arm.label][mult], digits)
            mark = " **(chosen)**" if mult == best[arm.label] else ""
            edge = ""
            if mult == best[arm.label] and mult in (min(arm.runs), max(arm.runs)) and len(arm.runs) > 1:
                edge = " (at the grid's edge: widen it)"
            lines.append(f"| {arm.label} | {mult:g}{mark}{edge} | {lrs} | {mean} | {per} |")
    lines += ["", "## Best against best", ""]
    rows = []
    for arm in arms:
        by_seed = arm.runs[best[arm.label]]
        seeds = sorted(s for s in by_seed if not arm.eval_seeds or s in arm.eval_seeds)
        values = [_final(by_seed[s], metric) for s in seeds]
        finite = [v for v in values if math.isfinite(v)]
        rows.append(
            CompareRow(
                label=arm.label,
                metric=metric,
                runs=[Path(by_seed[s]).name for s in seeds],
                paths=[by_seed[s] for s in seeds],
                seeds=seeds,
                values=values,
                mean=statistics.fmean(finite) if finite else None,
                std=statistics.stdev(finite) if len(finite) > 1 else None,
                best=min(finite) if finite else None,
                train_loss=None,
                train_losses=[],
                tokens=[],
                status=[],
            )
        )
    pairs = paired_rows(rows, baseline, metric)
    base_row = select_baseline(rows, baseline)
    lines += [f"Baseline: **{base_row.label}** at multiplier {best[base_row.label]:g}.", ""]
    header = ["arm", "chosen multiplier", "mean", "std", "per seed"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in rows:
        lines.append(
            f"| {r.label} | {best[r.label]:g} | {_f(r.mean, digits)} | {_f(r.std, digits)} | "
            + ", ".join(f"{s}: {_f(v, digits)}" for s, v in zip(r.seeds, r.values))
            + " |"
        )
    lines += ["", paired_table(pairs, digits), ""]
    if protocol is not None:
        lines += protocol.verdict_lines(rows) + [""]
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            figs = _figure(arms, metric, best, grid, pairs, out.parent, out.stem)
        except ImportError:
            figs = []
        for p in figs:
            lines += [f"![{p.stem}]({p.name})", ""]
        text = "\n".join(lines)
        out.write_text(text + "\n")
        (out.parent / (out.stem + ".json")).write_text(
            json.dumps(
                {
                    "metric": metric,
                    "baseline": base_row.label,
                    "chosen": best,
                    "grid": {
                        a: {f"{m:g}": (None if not math.isfinite(v) else v) for m, v in g.items()}
                        for a, g in grid.items()
                    },
                    "paired": [{k: v for k, v in p.as_dict().items()} for p in pairs],
                    "tuning_seeds": tuning,
                    "evaluation_seeds": evaluation,
                    "seed_overlap": overlap,
                    "protocol": None if protocol is None else protocol.identity(),
                    "verdicts": [] if protocol is None else protocol.verdicts(rows),
                    "command": command,
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
        return text
    return "\n".join(lines)
