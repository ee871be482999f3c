"""Compare runs across seeds: the paper's tables of final validation losses.

Runs are grouped by configuration: two runs belong to one configuration when their
``config.json`` agree on everything except ``run.seed``, ``run.name`` and
``run.out_dir`` (and any extra dotted keys passed as ``ignore``). For each configuration
:func:`compare_rows` gives the final value of a metric for every seed, the mean, the
sample standard deviation (``None`` for a single seed) and the best seed's value, plus
the final training loss and tokens; :func:`compare_table` renders them as a
markdown table with the best configuration's mean in bold::

    | configuration | seeds | final val/loss (mean ± std) | best | per seed | ... |
    |---|---|---|---|---|---|
    | rownorm | 3 | 4.0530 ± 0.0012 | 4.0516 | 4.0516, 4.0539, 4.0535 | ... |

A configuration's label is its runs' ``run.name`` with a trailing seed suffix removed
(``-s1``, ``_seed2``, ``.seed=3``, or ``-<seed>`` when it equals the run's seed), else
its optimizer recipe; labels that still clash get the config entries that tell them
apart appended.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .plots import Run, _si, as_runs
from .stats import paired_interval

__all__ = ["CompareRow", "compare_rows", "compare_table", "config_key", "strip_seed_suffix", "main_table"]

#: Config entries that do not make a different configuration.
IGNORED_KEYS = ("run.seed", "run.name", "run.out_dir")
#: Metrics for which larger is better (everything else: smaller is better).
HIGHER_IS_BETTER = {"router/entropy", "tokens_per_s"}

_SEED_SUFFIX = re.compile(r"(?:[-_.]?seed[-_=]?\d+|[-_.]s\d+)$", re.IGNORECASE)


@dataclass
class CompareRow:
    """One configuration: the final ``metric`` of each of its runs and their summary.

    ``values`` holds each run's final value (NaN where the run never logged the metric);
    ``mean``, ``std`` (sample standard deviation, ``None`` for fewer than two values) and
    ``best`` are over the finite ones. ``train_loss`` is the mean final training loss,
    ``tokens`` each run's final token count.
    """

    label: str
    metric: str
    runs: list[str]
    paths: list[str]
    seeds: list[Any]
    values: list[float]
    mean: float | None
    std: float | None
    best: float | None
    train_loss: float | None
    train_losses: list[float]
    tokens: list[int]
    status: list[str]
    config: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return len(self.runs)

    def as_dict(self) -> dict:
        return asdict(self)


def strip_seed_suffix(name: str, seed: Any = None) -> str:
    """``"rownorm-s1"`` -> ``"rownorm"``; ``"rownorm-1"`` -> ``"rownorm"`` only when the run's seed is 1."""
    out = _SEED_SUFFIX.sub("", name)
    if out == name and seed is not None:
        out = re.sub(rf"[-_.]{re.escape(str(seed))}$", "", name)
    return out or name


def _without(config: dict, keys: Iterable[str]) -> dict:
    cfg = copy.deepcopy(config)
    for dotted in keys:
        parts = dotted.split(".")
        node = cfg
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return cfg


def config_key(run: Run, ignore: Iterable[str] = ()) -> str:
    """A canonical string of the run's config without the seed, name, output directory
    and the ``ignore`` keys: equal keys mean one configuration. A run without a config is
    keyed by its name without the seed suffix."""
    if not run.config:
        return "name:" + strip_seed_suffix(run.name, run.seed)
    cfg = _without(run.config, (*IGNORED_KEYS, *ignore))
    return json.dumps(cfg, sort_keys=True, default=str)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _label(runs: list[Run]) -> str:
    names = set()
    for run in runs:
        cfg_name = run.config.get("run", {}).get("name") if isinstance(run.config.get("run"), dict) else None
        names.add(strip_seed_suffix(str(cfg_name), run.seed) if cfg_name else "")
    if len(names) == 1 and (name := names.pop()) and name != "run":
        return name
    recipe = runs[0].recipe
    if recipe:
        return recipe
    return strip_seed_suffix(runs[0].path.resolve().name, runs[0].seed)


def _disambiguate(groups: list[tuple[str, list[Run]]], ignore: Sequence[str]) -> list[str]:
    labels = [label for label, _ in groups]
    for label in set(labels):
        idx = [i for i, lab in enumerate(labels) if lab == label]
        if len(idx) < 2:
            continue
        flat = [_flatten(_without(groups[i][1][0].config, (*IGNORED_KEYS, *ignore))) for i in idx]
        keys = sorted(set().union(*flat))
        differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1]
        for i, f in zip(idx, flat):
            parts = [f"{k}={f.get(k)}" for k in differ[:3]] + (["..."] if len(differ) > 3 else [])
            labels[i] = f"{label} [{', '.join(parts)}]" if parts else labels[i]
    seen: dict[str, int] = {}
    for i, lab in enumerate(labels):
        seen[lab] = seen.get(lab, 0) + 1
        if seen[lab] > 1:
            labels[i] = f"{lab} #{seen[lab]}"
    return labels


def _final_train_loss(run: Run) -> float | None:
    return run.final("loss", "train")


def compare_rows(
    run_dirs: Iterable[str | Path | Run], metric: str = "val/loss", ignore: Iterable[str] = (), sort: bool = False
) -> list[CompareRow]:
    """Group the runs by configuration and summarise the final ``metric`` of each group
    (see the module docstring). ``run_dirs``: run directories, parents of run
    directories, or :class:`Run` objects. ``ignore``: extra dotted config keys that do not
    make a different configuration (e.g. ``"data.train"``). Rows come in the order the
    configurations first appear, or by mean (best first) with ``sort=True``."""
    ignore = tuple(ignore)
    runs = as_runs(run_dirs, "compare")
    grouped: dict[str, list[Run]] = {}
    for run in runs:
        grouped.setdefault(config_key(run, ignore), []).append(run)
    groups = [(_label(g), g) for g in grouped.values()]
    labels = _disambiguate(groups, ignore)
    higher = metric in HIGHER_IS_BETTER
    rows = []
    for label, (_, group) in zip(labels, groups):
        group = sorted(group, key=lambda r: (str(r.seed) if r.seed is not None else "", r.name))
        values = []
        for run in group:
            v = run.final(metric)
            values.append(math.nan if v is None else v)
        finite = [v for v in values if math.isfinite(v)]
        train = [_final_train_loss(r) for r in group]
        train_f = [t for t in train if t is not None and math.isfinite(t)]
        rows.append(
            CompareRow(
                label=label,
                metric=metric,
                runs=[r.name for r in group],
                paths=[str(r.path) for r in group],
                seeds=[r.seed for r in group],
                values=values,
                mean=statistics.fmean(finite) if finite else None,
                std=statistics.stdev(finite) if len(finite) > 1 else None,
                best=(max(finite) if higher else min(finite)) if finite else None,
                train_loss=statistics.fmean(train_f) if train_f else None,
                train_losses=[math.nan if t is None else t for t in train],
                tokens=[r.tokens for r in group],
                status=[r.status for r in group],
                config=_without(group[0].config, IGNORED_KEYS),
            )
        )
    if sort:
        rows.sort(key=lambda r: (r.mean is None, -(r.mean or 0.0) if higher else (r.mean or 0.0)))
    return rows


def paired_differences(row: CompareRow, base: CompareRow) -> tuple[list, list, list, list, list, list, list]:
    """``row`` against ``base`` seed by seed: ``(seeds, values, base values, differences,
    paths, base paths, unpaired seeds)`` over the seeds both have a finite value for."""
    by_seed = {s: (v, p) for s, v, p in zip(base.seeds, base.values, base.paths)}
    seeds, vals, bvals, diffs, paths, bpaths, unpaired = [], [], [], [], [], [], []
    for s, v, p in zip(row.seeds, row.values, row.paths):
        if s not in by_seed or not math.isfinite(v) or not math.isfinite(by_seed[s][0]):
            unpaired.append(s)
            continue
        b, bp = by_seed[s]
        seeds.append(s), vals.append(v), bvals.append(b), diffs.append(v - b), paths.append(p), bpaths.append(bp)
    return seeds, vals, bvals, diffs, paths, bpaths, unpaired


def _separated(best: CompareRow, other: CompareRow, metric: str) -> bool:
    """Whether the paired 95 % Student-t interval of ``best - other`` (see
    :class:`~equiopt.study.paired.PairedRow`; at least two common seeds) lies strictly on
    ``best``'s side of 0."""
    ci = paired_interval(paired_differences(best, other)[3])[2]
    if ci is None:
        return False
    return ci[0] > 0 if metric in HIGHER_IS_BETTER else ci[1] < 0


def _fmt(v: float | None, digits: int) -> str:
    if v is None or not math.isfinite(v):
        return "-" if v is None else str(v)
    return f"{v:.{digits}f}"


def _status(statuses: list[str]) -> str:
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    if list(counts) == ["done"]:
        return "done"
    return ", ".join(f"{n} {s}" for s, n in counts.items())


def compare_table(
    run_dirs: Iterable[str | Path | Run],
    metric: str = "val/loss",
    ignore: Iterable[str] = (),
    sort: bool = False,
    digits: int = 4,
) -> str:
    """The rows of :func:`compare_rows` as a markdown table (one line per configuration):
    configuration, number of seeds, final ``metric`` as mean ± sample std ("-" for one
    seed), the best seed's value, each seed's value, mean final training loss, tokens and
    run status. The best configuration's mean is in bold only when the data separate it
    from every other: the 95 % Student-t interval of its paired differences (over at least
    two common seeds) excludes 0 against each. One seed, or an interval that reaches 0,
    bolds nothing."""
    rows = compare_rows(run_dirs, metric=metric, ignore=ignore, sort=sort)
    higher = metric in HIGHER_IS_BETTER
    means = [r.mean for r in rows if r.mean is not None]
    winner = (max(means) if higher else min(means)) if len(rows) > 1 and means else None
    if winner is not None:
        best = next(r for r in rows if r.mean == winner)
        if not all(_separated(best, r, metric) for r in rows if r is not best):
            winner = None
    header = [
        "configuration",
        "seeds",
        f"final {metric} (mean ± std)",
        "best",
        "per seed",
        "final train loss",
        "tokens",
        "status",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in rows:
        mean = _fmt(r.mean, digits)
        cell = f"{mean} ± {_fmt(r.std, digits)}" if r.std is not None else f"{mean} ± -"
        if winner is not None and r.mean == winner:
            cell = f"**{cell}**"
        lo, hi = min(r.tokens), max(r.tokens)
        tokens = _si(lo) if lo == hi else f"{_si(lo)}-{_si(hi)}"
        cells = [
            r.label.replace("|", "\\|"),
            str(r.n),
            cell,
            _fmt(r.best, digits),
            ", ".join(_fmt(v, digits) for v in r.values),
            _fmt(r.train_loss, digits),
            tokens,
            _status(r.status),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    """NaN and infinities (not JSON) become ``null``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def main_table(argv: Sequence[str] | None = None) -> int:
    """``equiopt table RUN... [--metric KEY]``: print the comparison table."""
    parser = argparse.ArgumentParser(
        prog="equiopt table",
        description="Table of final metrics of run directories, grouped by configuration across seeds.",
    )
    parser.add_argument("runs", nargs="+", help="run directories (holding log.jsonl), or directories of them")
    parser.add_argument("--metric", default="val/loss", help="logged key to compare (default %(default)s)")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="KEY",
        help="dotted config key that does not make a different configuration (repeatable), e.g. data.train",
    )
    parser.add_argument("--sort", action="store_true", help="order configurations by mean, best first")
    parser.add_argument("--digits", type=int, default=4, help="decimals (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the raw rows as JSON instead")
    args = parser.parse_args(argv)
    try:
        if args.json:
            rows = compare_rows(args.runs, metric=args.metric, ignore=args.ignore, sort=args.sort)
            print(
                json.dumps(
                    [_jsonable({k: v for k, v in r.as_dict().items() if k != "config"}) for r in rows],
                    indent=2,
                    default=str,
                )
            )
        else:
            print(compare_table(args.runs, metric=args.metric, ignore=args.ignore, sort=args.sort, digits=args.digits))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"equiopt table: {err}") from None
    return 0
