"""Read run directories and draw the paper's figures from them.

A run directory holds ``config.json`` (the run's config as a dict) and ``log.jsonl``, one
JSON record per line with a ``kind`` (``meta``, ``train``, ``val``, ``end``), a ``step`` and
the number of ``tokens`` seen. :func:`read_run` turns it into a :class:`Run`:

- later records for the same ``(kind, step)`` replace earlier ones, and a resume (a
  ``meta`` record carrying ``resumed_from`` at step ``s``) also drops the abandoned
  timeline's ``train``/``val`` records after ``s`` and its ``end`` record;
- a line that is not valid JSON (a crash mid-write leaves a truncated last line) is
  skipped with a :class:`RunLogWarning`;
- non-finite numbers, which JSON cannot hold and the logger writes as ``"nan"``,
  ``"inf"``, ``"-inf"``, are read back as floats.

:func:`plot_runs` writes PNG figures like the paper's (``matplotlib`` is needed:
``pip install 'equiopt[plot]'``):

- ``loss.png``: training and validation loss against tokens (and out-of-domain
  validation loss when logged), one colour per run;
- ``logits.png``: final-logit diagnostics (raw RMS, centred RMS, max log-sum-exp);
- ``router.png``: MoE router diagnostics (load-balancing loss, z-loss, load entropy,
  load CV, dead-expert fraction, max expert load), only when some run logged them;
- ``weights.png``: per-role weight RMS and per-step update RMS (log scale).

Validation series are drawn as lines with markers; diagnostics measured on a training
batch (logged with the ``train`` record at each validation step) are drawn dashed.
The figures use ``matplotlib.figure.Figure`` directly, so they never touch pyplot's
global state or the interactive backend.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..roles.table import ROLES

__all__ = [
    "Run",
    "RunLogWarning",
    "read_run",
    "read_runs",
    "find_run_dirs",
    "plot_runs",
    "plot_loss",
    "plot_logits",
    "plot_router",
    "plot_weights",
    "main_plot",
]

LOGIT_PANELS = (
    ("logits/rms", "Raw final-logit RMS", "RMS (logit units)"),
    ("logits/centred_rms", "Centred final-logit RMS", "RMS (logit units)"),
    ("logits/max_lse", "Max log-sum-exp of final logits", "max LSE (nats)"),
)
ROUTER_PANELS = (
    ("router/lb", "Load-balancing loss $L_{LB}$", "$E\\,\\Sigma_i f_i P_i$ (1 = balanced)"),
    ("router/z", "Router z-loss", "$L_z$ (nats$^2$)"),
    ("router/entropy", "Expert-load entropy", "$H(f)$ (nats)"),
    ("router/cv", "Expert-load coefficient of variation", "std(f) / mean(f)"),
    ("router/dead", "Dead-expert fraction", "fraction of experts"),
    ("router/max_load", "Maximum expert load", "max$_i$ $f_i$ (share of assignments)"),
)
_NONFINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


class RunLogWarning(UserWarning):
    """A run log line that could not be read (skipped) or a run directory without a config."""


# ----------------------------------------------------------------------------- reading
@dataclass
class Run:
    """One run directory, read back.

    ``records`` maps a kind (``meta``, ``train``, ``val``, ``end``) to its records sorted by
    step. ``status`` is the final ``end`` record's status (``done``, ``nonfinite``,
    ``interrupted``), or ``incomplete`` when the log has no end record (still running, or
    killed without one).
    """

    path: Path
    name: str
    config: dict
    records: dict[str, list[dict]]
    status: str = "incomplete"
    message: str = ""
    skipped_lines: list[int] = field(default_factory=list)

    @property
    def train(self) -> list[dict]:
        return self.records.get("train", [])

    @property
    def val(self) -> list[dict]:
        return self.records.get("val", [])

    @property
    def seed(self) -> Any:
        return self.config.get("run", {}).get("seed") if isinstance(self.config.get("run"), dict) else None

    @property
    def recipe(self) -> str | None:
        optim = self.config.get("optim")
        if isinstance(optim, dict) and optim.get("recipe"):
            return str(optim["recipe"])
        for meta in self.records.get("meta", []):
            if meta.get("recipe"):
                return str(meta["recipe"])
        return None

    @property
    def tokens(self) -> int:
        """Tokens seen at the last record of the run."""
        return max((int(r.get("tokens", 0) or 0) for recs in self.records.values() for r in recs), default=0)

    @property
    def steps(self) -> int:
        return max((int(r.get("step", 0) or 0) for recs in self.records.values() for r in recs), default=0)

    def has(self, key: str, kind: str | None = None) -> bool:
        kinds = [kind] if kind else list(self.records)
        return any(key in r for k in kinds for r in self.records.get(k, []))

    def kind_of(self, key: str) -> str | None:
        """The kind whose records hold ``key``: ``val`` first, then ``train``, then any."""
        for kind in ("val", "train", *self.records):
            if self.has(key, kind):
                return kind
        return None

    def series(self, key: str, kind: str | None = None, x: str = "tokens") -> tuple[np.ndarray, np.ndarray]:
        """``(x, values)`` of ``key`` over the records of ``kind`` that hold it (``kind=None``:
        see :meth:`kind_of`); non-finite values come back as NaN."""
        kind = kind or self.kind_of(key)
        recs = [r for r in self.records.get(kind or "", []) if key in r]
        xs = np.array([float(r.get(x, 0) or 0) for r in recs], dtype=float)
        ys = np.array([_as_float(r[key]) for r in recs], dtype=float)
        ys[~np.isfinite(ys)] = np.nan
        return xs, ys

    def final(self, key: str, kind: str | None = None) -> float | None:
        """The value of ``key`` at the last record that holds it, or ``None``."""
        kind = kind or self.kind_of(key)
        for r in reversed(self.records.get(kind or "", [])):
            if key in r:
                return _as_float(r[key])
        return None

    def roles(self, prefix: str = "weight_rms/") -> list[str]:
        found = {k[len(prefix) :] for r in self.train for k in r if k.startswith(prefix)}
        return [r for r in ROLES if r in found] + sorted(found - set(ROLES))


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return float(value.strip().lower().replace("infinity", "inf"))
    return value


def read_run(path: str | Path) -> Run:
    """Read ``path/config.json`` and ``path/log.jsonl`` into a :class:`Run`.

    The label (``Run.name``) is ``config["run"]["name"]``, else the directory name.
    Raises ``FileNotFoundError`` when ``log.jsonl`` is missing.
    """
    path = Path(path)
    log_path = path / "log.jsonl"
    if not log_path.is_file():
        raise FileNotFoundError(f"{path} is not a run directory: {log_path} does not exist")
    config: dict = {}
    cfg_path = path / "config.json"
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except json.JSONDecodeError as err:
            warnings.warn(
                f"{cfg_path}: not valid JSON ({err}); reading the run without its config", RunLogWarning, stacklevel=2
            )

    by_key: dict[tuple[str, int], dict] = {}
    end: dict | None = None
    skipped: list[int] = []
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "kind" not in rec:
                raise ValueError("not a record with a 'kind'")
            step = int(rec.get("step", 0))
        except (ValueError, TypeError) as err:
            skipped.append(i + 1)
            what = "truncated last line" if i == last else "unreadable line"
            warnings.warn(f"{log_path}:{i + 1}: skipped {what} ({err})", RunLogWarning, stacklevel=2)
            continue
        rec = {k: _decode(v) for k, v in rec.items()}
        kind = str(rec["kind"])
        if kind == "meta" and "resumed_from" in rec:
            # the run went back to the checkpoint at `step`: what the old timeline logged after it is void
            by_key = {k: r for k, r in by_key.items() if k[0] == "meta" or k[1] <= step}
            end = None
        if kind == "end":
            end = rec
        by_key.pop((kind, step), None)  # later wins (and moves to the end of the insertion order)
        by_key[(kind, step)] = rec

    records: dict[str, list[dict]] = {}
    for (kind, _), rec in by_key.items():
        if kind != "end":
            records.setdefault(kind, []).append(rec)
    for recs in records.values():
        recs.sort(key=lambda r: int(r.get("step", 0)))
    if end is not None:
        records["end"] = [end]
    run_cfg = config.get("run") if isinstance(config.get("run"), dict) else {}
    name = str(run_cfg.get("name") or path.resolve().name)
    return Run(
        path=path,
        name=name,
        config=config,
        records=records,
        status=str(end.get("status", "done")) if end else "incomplete",
        message=str(end.get("message", "")) if end else "",
        skipped_lines=skipped,
    )


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Each path that holds a ``log.jsonl``, or else its subdirectories that do (sorted).
    Raises ``FileNotFoundError`` for a path with neither."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "log.jsonl").is_file():
            out.append(p)
            continue
        children = sorted(c for c in p.iterdir() if (c / "log.jsonl").is_file()) if p.is_dir() else []
        if not children:
            raise FileNotFoundError(f"{p}: no log.jsonl there or in its subdirectories")
        out.extend(children)
    return out


def as_runs(items, what: str = "read") -> list[Run]:
    """:class:`Run` objects from a mix of runs and run directories (or folders of runs)."""
    items = list(items)
    runs = [r for r in items if isinstance(r, Run)]
    paths = [p for p in items if not isinstance(p, Run)]
    if paths:
        runs += read_runs(paths)
    if not runs:
        raise ValueError(f"no runs to {what}")
    return runs


def read_runs(paths: Iterable[str | Path]) -> list[Run]:
    """:func:`read_run` on every run directory of :func:`find_run_dirs`; labels that would
    clash get their directory name appended, so every run has a distinct ``name``."""
    runs = [read_run(p) for p in find_run_dirs(paths)]
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.name] = counts.get(run.name, 0) + 1
    for run in runs:
        if counts[run.name] > 1 and run.path.resolve().name != run.name:
            run.name = f"{run.name} ({run.path.resolve().name})"
    seen: dict[str, int] = {}
    for run in runs:  # still clashing (same name and directory name): number them
        seen[run.name] = seen.get(run.name, 0) + 1
        if seen[run.name] > 1:
            run.name = f"{run.name} #{seen[run.name]}"
    return runs


# ----------------------------------------------------------------------------- plotting
def matplotlib_api():
    """Import matplotlib's object-oriented API, or fail with the install hint."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter
    except ImportError as err:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: pip install 'equiopt[plot]' (or pip install matplotlib)"
        ) from err
    return Figure, Line2D, FuncFormatter


def _si(value: float, _pos: Any = None) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:.3g}"


def _colors(n: int) -> list:
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](i / max(n - 1, 1)) for i in range(n)]


class _Style:
    """Shared axes decoration: x axis in tokens (or steps), grid, legends."""

    def __init__(self, runs: Sequence[Run], x: str, log_x: bool):
        Figure, self.Line2D, FuncFormatter = matplotlib_api()
        self.Figure = Figure
        self.formatter = FuncFormatter(_si)
        self.x, self.log_x = x, log_x
        self.color = {id(r): c for r, c in zip(runs, _colors(len(runs)))}

    def figure(self, nrows: int, ncols: int, title: str):
        fig = self.Figure(figsize=(5.2 * ncols, 3.9 * nrows), dpi=150, layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True).ravel()
        self.ncols, self.nrows = ncols, nrows
        fig.suptitle(title, fontsize=13)
        return fig, axes

    def axes(self, ax, title: str, ylabel: str, log_y: bool = False) -> None:
        ax.set_title(title, fontsize=11)
        if ax.get_subplotspec().is_last_row():
            ax.set_xlabel("training tokens" if self.x == "tokens" else "optimizer steps")
        ax.set_ylabel(ylabel)
        if self.log_x:
            ax.set_xscale("log")
        else:
            ax.set_xlim(left=0)
        if log_y:
            ax.set_yscale("log")
        ax.xaxis.set_major_formatter(self.formatter)
        ax.grid(True, which="major", alpha=0.3)
        ax.grid(True, which="minor", alpha=0.1)

    def xy(self, run: Run, key: str, kind: str | None, positive: bool = False):
        xs, ys = run.series(key, kind, x=self.x)
        if self.log_x:
            ys = np.where(xs > 0, ys, np.nan)
        if positive:
            ys = np.where(ys > 0, ys, np.nan)
        return xs, ys

    def run_legend(self, fig, runs: Sequence[Run], extra: Sequence = ()) -> None:
        handles = [self.Line2D([], [], color=self.color[id(r)], lw=2, label=r.name) for r in runs]
        handles += list(extra)
        ncol = min(len(handles), 4)
        fig.legend(handles=handles, loc="outside lower center", ncol=ncol, frameon=False, fontsize=9)


def _val_style(n_points: int) -> dict:
    return {"marker": "o", "markersize": 3.5 if n_points <= 60 else 2.0, "lw": 1.5}


def _zoom(ax, curves: list[np.ndarray], xs: list[np.ndarray], log_x: bool) -> None:
    """Loss curves start far above where they end; unless the x axis is logarithmic, clip
    the y axis to what happens after the first 10% of training so the end stays readable."""
    if log_x or not curves:
        return
    xmax = max((float(np.nanmax(x)) for x in xs if x.size), default=0.0)
    late = [y[(x >= 0.1 * xmax) & np.isfinite(y)] for x, y in zip(xs, curves)]
    late = [v for v in late if v.size]
    every = [y[np.isfinite(y)] for y in curves if np.isfinite(y).any()]
    if not late or not every:
        return
    lo = min(float(v.min()) for v in every)
    hi = max(float(v.max()) for v in late)
    top = max(float(v.max()) for v in every)
    if top - lo > 2.0 * (hi - lo) and hi > lo:
        pad = 0.08 * (hi - lo)
        ax.set_ylim(lo - pad, hi + pad)


def plot_loss(
    runs: Sequence[Run], path: Path, x: str = "tokens", log_x: bool = False, smooth: float = 0.0
) -> Path | None:
    """Training loss, validation loss and (when logged) out-of-domain validation loss."""
    has_val = any(r.has("val/loss", "val") for r in runs)
    has_ood = any(r.has("ood/loss", "val") for r in runs)
    has_train = any(r.has("loss", "train") for r in runs)
    if not (has_train or has_val or has_ood):
        return None
    st = _Style(runs, x, log_x)
    panels = [p for p, on in (("train", has_train), ("val", has_val), ("ood", has_ood)) if on]
    fig, axes = st.figure(1, len(panels), "Training and validation losses")
    for ax, panel in zip(axes, panels):
        curves, xs_all = [], []
        for run in runs:
            color = st.color[id(run)]
            if panel == "train":
                xs, ys = st.xy(run, "loss", "train")
                if smooth > 0 and ys.size:
                    ys = _ema(ys, smooth)
                ax.plot(xs, ys, color=color, lw=1.2, label=run.name)
            else:
                key = "val/loss" if panel == "val" else "ood/loss"
                xs, ys = st.xy(run, key, "val")
                if not xs.size:
                    continue
                final = run.final(key, "val")
                label = f"{run.name}: {final:.4f}" if final is not None and math.isfinite(final) else run.name
                ax.plot(xs, ys, color=color, label=label, **_val_style(xs.size))
            curves.append(ys)
            xs_all.append(xs)
        _zoom(ax, curves, xs_all, log_x)
        title = {
            "train": "Training loss" + (f" (EMA {smooth:g})" if smooth > 0 else ""),
            "val": "Validation loss",
            "ood": "Out-of-domain validation loss",
        }[panel]
        ylabel = "loss (nats/token)" if panel == "train" else "cross-entropy (nats/token)"
        st.axes(ax, title, ylabel)
        if panel != "train":
            ax.legend(title="final", fontsize=8, title_fontsize=8, loc="upper right")
    st.run_legend(fig, runs)
    fig.savefig(path, dpi=150)
    return path


def _ema(ys: np.ndarray, beta: float) -> np.ndarray:
    out = np.empty_like(ys)
    acc, weight = 0.0, 0.0
    for i, y in enumerate(ys):
        if math.isfinite(y):
            acc = beta * acc + (1 - beta) * y
            weight = beta * weight + (1 - beta)
        out[i] = acc / weight if weight > 0 else np.nan
    return out


def _diagnostic_figure(
    runs: Sequence[Run],
    path: Path,
    panels,
    title: str,
    nrows: int,
    ncols: int,
    x: str,
    log_x: bool,
    reference: dict[str, float] | None = None,
) -> Path | None:
    keys = [k for k, _, _ in panels]
    if not any(r.has(k) for r in runs for k in keys):
        return None
    st = _Style(runs, x, log_x)
    fig, axes = st.figure(nrows, ncols, title)
    any_train = False
    for ax, (key, panel_title, ylabel) in zip(axes, panels):
        for run in runs:
            color = st.color[id(run)]
            xs, ys = st.xy(run, key, "val")
            if xs.size:
                ax.plot(xs, ys, color=color, **_val_style(xs.size))
            xs, ys = st.xy(run, key, "train")
            if xs.size:
                any_train = True
                ax.plot(xs, ys, color=color, lw=1.0, ls="--", alpha=0.75)
        if reference and key in reference:
            ax.axhline(reference[key], color="0.4", lw=0.8, ls=":")
        st.axes(ax, panel_title, ylabel)
    extra = []
    if any_train:
        extra = [
            st.Line2D([], [], color="0.3", marker="o", markersize=3.5, lw=1.5, label="validation batch"),
            st.Line2D([], [], color="0.3", ls="--", lw=1.0, label="training batch"),
        ]
    st.run_legend(fig, runs, extra)
    fig.savefig(path, dpi=150)
    return path


def plot_logits(runs: Sequence[Run], path: Path, x: str = "tokens", log_x: bool = False) -> Path | None:
    """Final-logit diagnostics: raw RMS, centred RMS, max log-sum-exp. ``None`` if no run logged them."""
    return _diagnostic_figure(runs, path, LOGIT_PANELS, "Final vocabulary-logit diagnostics", 1, 3, x, log_x)


def plot_router(runs: Sequence[Run], path: Path, x: str = "tokens", log_x: bool = False) -> Path | None:
    """MoE router diagnostics (layer averages). ``None`` if no run logged router metrics."""
    return _diagnostic_figure(
        runs,
        path,
        ROUTER_PANELS,
        "MoE router diagnostics (mean over MoE layers)",
        2,
        3,
        x,
        log_x,
        reference={"router/lb": 1.0},
    )


_ROLE_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ("-", "v"), ("--", "P"), (":", "X"), ("-.", "*")]


def plot_weights(runs: Sequence[Run], path: Path, x: str = "tokens", log_x: bool = False) -> Path | None:
    """Per-role weight RMS and per-step update RMS, one line per run and role (log y).
    Colour marks the run, line style and marker the role. ``None`` if nothing was logged."""
    roles: list[str] = []
    for run in runs:
        for role in run.roles("weight_rms/") + run.roles("update_rms/"):
            if role not in roles:
                roles.append(role)
    if not roles:
        return None
    st = _Style(runs, x, log_x)
    style = {role: _ROLE_STYLES[i % len(_ROLE_STYLES)] for i, role in enumerate(roles)}
    fig, axes = st.figure(1, 2, "Per-role weight and update RMS")
    for ax, (prefix, title, ylabel) in zip(
        axes,
        (
            ("weight_rms/", "Weight RMS", "RMS of weights"),
            ("update_rms/", "Update RMS (one optimizer step)", "RMS of $W_{t+1} - W_t$"),
        ),
    ):
        for run in runs:
            for role in roles:
                xs, ys = st.xy(run, prefix + role, "train", positive=True)
                if not xs.size:
                    continue
                ls, marker = style[role]
                ax.plot(
                    xs,
                    ys,
                    color=st.color[id(run)],
                    ls=ls,
                    marker=marker,
                    markersize=3,
                    markevery=max(1, xs.size // 12),
                    lw=1.2,
                )
        st.axes(ax, title, ylabel, log_y=True)
    extra = [st.Line2D([], [], color="0.3", ls=style[r][0], marker=style[r][1], markersize=4, label=r) for r in roles]
    st.run_legend(fig, runs, extra)
    fig.savefig(path, dpi=150)
    return path


def plot_runs(
    run_dirs: Iterable[str | Path | Run],
    out_dir: str | Path,
    prefix: str = "",
    *,
    x: str = "tokens",
    log_x: bool = False,
    smooth: float = 0.0,
) -> list[Path]:
    """Write the figures for ``run_dirs`` (run directories, parents of run directories, or
    :class:`Run` objects) into ``out_dir`` as ``{prefix}loss.png``, ``{prefix}logits.png``,
    ``{prefix}router.png`` and ``{prefix}weights.png``; a figure whose metrics no run
    logged is not written. ``x``: ``"tokens"`` or ``"step"``; ``log_x``: logarithmic x
    axis; ``smooth``: EMA coefficient in ``[0, 1)`` for the training loss (0 = raw).
    Returns the written paths. Needs matplotlib (``ImportError`` with the install hint)."""
    if x not in ("tokens", "step"):
        raise ValueError(f"x must be 'tokens' or 'step', got {x!r}")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    matplotlib_api()
    runs = as_runs(run_dirs, "plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_loss(runs, out / f"{prefix}loss.png", x=x, log_x=log_x, smooth=smooth),
        plot_logits(runs, out / f"{prefix}logits.png", x=x, log_x=log_x),
        plot_router(runs, out / f"{prefix}router.png", x=x, log_x=log_x),
        plot_weights(runs, out / f"{prefix}weights.png", x=x, log_x=log_x),
    ]
    return [p for p in written if p is not None]


def main_plot(argv: Sequence[str] | None = None) -> int:
    """``equiopt plot RUN... [--out DIR]``: write the figures and print their paths."""
    parser = argparse.ArgumentParser(
        prog="equiopt plot",
        description="Plot loss curves and diagnostics of run directories (or directories of runs) as PNG files.",
    )
    parser.add_argument("runs", nargs="+", help="run directories (holding log.jsonl), or directories of them")
    parser.add_argument("--out", default=None, help="output directory (default: the first run's plots/)")
    parser.add_argument("--prefix", default="", help="prefix of the file names, e.g. 'gemma3-'")
    parser.add_argument("--log-x", action="store_true", help="logarithmic token axis")
    parser.add_argument("--steps", action="store_true", help="optimizer steps on the x axis instead of tokens")
    parser.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        metavar="BETA",
        help="EMA coefficient for the training loss, in [0, 1) (default 0: raw)",
    )
    args = parser.parse_args(argv)
    try:
        dirs = find_run_dirs(args.runs)
        out = Path(args.out) if args.out else dirs[0] / "plots"
        paths = plot_runs(
            dirs, out, args.prefix, x="step" if args.steps else "tokens", log_x=args.log_x, smooth=args.smooth
        )
    except (ImportError, FileNotFoundError, ValueError) as err:
        raise SystemExit(f"equiopt plot: {err}") from None
    for p in paths:
        print(p)
    return 0
