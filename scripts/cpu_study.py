"""The CPU-scale study: Qwen3 (a)(i)-(iii) tuned, the gpt-oss router ablation, the Gemma 3
final-logit study (results/study/README.md).

    python scripts/cpu_study.py configs [--steps 150]   # write results/study/<study>/configs/*.toml
    python scripts/cpu_study.py report                  # tables, protocol reports and figures from the run logs

The configs are the shipped CPU-scale configs (configs/cpu/...) with fewer steps (the
schedule's decay fraction is kept), no checkpoints and no TensorBoard, and their run
directories under results/study/<study>/logs/ so that every number of the report can be
checked against a committed ``log.jsonl``. The runs themselves are ``equiopt compare``
commands, printed by ``configs`` and recorded in the README.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "study"

# normuon with only the hidden matrices' optimizer differing (the default recipe elsewhere in every
# arm); _wide: on grids without edges (its default arm chose x0.5, the lower edge); _wider: again (x0.25)
_NORMUON_HIDDEN = ("normuon_hidden", "normuon_hidden_wide", "normuon_hidden_wider")
# study -> (family, [config names]); the first config is the baseline. A name "NAME=SOURCE@RECIPE"
# is the shipped config SOURCE with its recipe replaced by RECIPE.
STUDIES = {
    "qwen3_a": ("qwen3", ["a-iii", "a-i", "a-ii"]),
    "qwen3_a_heldout": ("qwen3", ["a-iii", "a-i", "a-ii"]),
    "gpt_oss_router": (
        "gpt_oss",
        ["router-adamw", "router-row", "router-left-centered", "router-left-uncentered", "router-hybrid"],
    ),
    "gemma3_logits": ("gemma3", ["b-i-head-adamw", "b-i", "b-ii-head-adamw", "b-ii"]),
    "gemma3_b": ("gemma3", ["b-iii", "b-i", "b-ii"]),
    "gpt_oss": ("gpt_oss", ["iv", "i", "ii", "iii"]),
    "peers": ("qwen3", ["muon=a-iii@muon", "peer-muon=a-iii@peer:muon"]),
    "normuon": ("qwen3", ["muon=a-iii@muon", "normuon=a-iii@normuon", "peer-muon=a-iii@peer:muon"]),
    **dict.fromkeys(
        _NORMUON_HIDDEN,
        ("qwen3", ["default=a-iii@equiopt:default", "normuon=a-iii@normuon", "torch-muon=a-iii@equiopt:default"]),
    ),
    "muon_iteration": ("qwen3", ["pe=a-iii@muon", "quintic=a-iii@muon", "pe-scaled=a-iii@muon"]),
    # wider grids over the runs of gemma3_b and gpt_oss (reused: same settings, same run directories);
    # gemma3_b_wider: again, for AdamW (its x4, gemma3_b_wide's top edge)
    "gemma3_b_wide": ("gemma3", ["b-iii", "b-i", "b-ii"]),
    "gemma3_b_wider": ("gemma3", ["b-iii", "b-i", "b-ii"]),
    "gpt_oss_wide": ("gpt_oss", ["iv", "i", "ii", "iii"]),
}
# study -> the study whose run directories it shares (its finished runs are reused, not rerun)
LOGS_OF = {
    "gemma3_b_wide": "gemma3_b",
    "gemma3_b_wider": "gemma3_b",
    "gpt_oss_wide": "gpt_oss",
    **dict.fromkeys(_NORMUON_HIDDEN, "normuon"),
}
# study -> {config name: entries added to its [optim] overrides}: the normuon and muon_iteration
# studies pin the precision of equiopt's polar iterations to float32 (unset, it would follow the
# machine's processor); the wider grids pin bfloat16, the precision of the runs they reuse (made
# before the default followed the processor, on a CPU with bfloat16 hardware). muon_iteration's
# pe-scaled arm scales each hidden role's lr by the quintic's update RMS over Polar Express's
# (results/study/muon_iteration/update_rms.json: 0.917 attention, 0.928 mlp_in, 0.945 mlp_out of 0.02).
_FLOAT32_POLAR = '"*" = { polar_dtype = "float32" }'
_BFLOAT16_POLAR = '"*" = { polar_dtype = "bfloat16" }'
# torch.optim.Muon on the hidden matrices (its own bfloat16 quintic), the default recipe elsewhere
_TORCH_MUON = ", ".join(f'{role} = {{ rule = "torch_muon" }}' for role in ("attention", "mlp_in", "mlp_out", "matrix"))
OVERRIDES = {
    "normuon": {"muon": _FLOAT32_POLAR, "normuon": _FLOAT32_POLAR},
    **dict.fromkeys(
        _NORMUON_HIDDEN,
        {"default": _FLOAT32_POLAR, "normuon": _FLOAT32_POLAR, "torch-muon": _TORCH_MUON},
    ),
    "muon_iteration": {
        "pe": _FLOAT32_POLAR,
        "quintic": '"*" = { polar_dtype = "float32", method = "newton_schulz_torch" }',
        "pe-scaled": _FLOAT32_POLAR
        + ", attention = { lr = 0.01834 }, mlp_in = { lr = 0.01856 }, mlp_out = { lr = 0.0189 }",
    },
    "gemma3_b_wide": dict.fromkeys(STUDIES["gemma3_b_wide"][1], _BFLOAT16_POLAR),
    "gemma3_b_wider": dict.fromkeys(STUDIES["gemma3_b_wider"][1], _BFLOAT16_POLAR),
    "gpt_oss_wide": dict.fromkeys(STUDIES["gpt_oss_wide"][1], _BFLOAT16_POLAR),
}


def _config_text(src: Path, study: str, name: str, steps: int, recipe: str | None = None) -> str:
    text = src.read_text()
    if recipe is not None:
        text = re.sub(r'^recipe = ".*"$', f'recipe = "{recipe}"', text, count=1, flags=re.M)
        text = re.sub(r'^name = "(.*)"$', rf'name = "{src.parent.name}-{name}"', text, count=1, flags=re.M)
    extra = OVERRIDES.get(study, {}).get(name)
    if extra is not None:
        optim = text.index("[optim]")
        found = re.compile(r"^overrides = \{ ", re.M).search(text, optim)
        if found is not None and "\n[" not in text[optim + 1 : found.start()]:  # the [optim] table's own
            text = text[: found.end()] + extra + ", " + text[found.end() :]
        else:
            text = re.sub(
                r'^(recipe = ".*")$', lambda m: m.group(1) + f"\noverrides = {{ {extra} }}", text, count=1, flags=re.M
            )
    rel_logs = f"results/study/{LOGS_OF.get(study, study)}/logs/{name}"
    text = re.sub(r'^out_dir = ".*"$', f'out_dir = "{rel_logs}"', text, count=1, flags=re.M)
    text = re.sub(r"^steps = \d+$", f"steps = {steps}", text, count=1, flags=re.M)
    text = re.sub(r"^checkpoint_every = \d+$", "checkpoint_every = 0", text, count=1, flags=re.M)
    if "tensorboard" not in text:
        text = text.rstrip("\n") + "\ntensorboard = false\n"
    lines = [ln for ln in text.splitlines() if not ln.startswith("# Generated by") and not ln.startswith("# Data:")]
    if recipe is not None:  # the source's description names its own recipe
        lines = [ln for ln in lines if not ln.startswith(f"# {src.parent.name} {src.stem} at cpu scale")]
    head = [
        f"# CPU-scale study config: configs/cpu/{src.parent.name}/{src.name} with {steps} steps, "
        + (f"recipe {recipe}, " if recipe else "")
        + "no checkpoints, logs under results/study/.",
        "# Written by scripts/cpu_study.py configs; run from the repository root.",
    ]
    return "\n".join(head + lines) + "\n"


def write_configs(steps: int) -> dict[str, list[Path]]:
    written = {}
    for study, (family, names) in STUDIES.items():
        d = OUT / study / "configs"
        d.mkdir(parents=True, exist_ok=True)
        paths = []
        for entry in names:
            name, _, rest = entry.partition("=")
            source, _, recipe = (rest or name).partition("@")
            p = d / f"{name}.toml"
            p.write_text(
                _config_text(ROOT / "configs" / "cpu" / family / f"{source}.toml", study, name, steps, recipe or None)
            )
            paths.append(p)
        written[study] = paths
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("configs")
    c.add_argument("--steps", type=int, default=150)
    sub.add_parser("report")
    args = ap.parse_args(argv)
    if args.cmd == "configs":
        for study, paths in write_configs(args.steps).items():
            print(study + ":", " ".join(str(p.relative_to(ROOT)) for p in paths))
        return 0
    from_logs_report()
    return 0


# ------------------------------------------------------------------ report
# study -> (metrics at the final validation, [(arm, baseline)] pairs for paired differences)
_ROUTER = ["router/lb", "router/z", "router/dead", "router/max_load", "router/entropy", "router/cv", "router/logit_rms"]
_LOGITS = ["logits/rms", "logits/centred_rms", "logits/max_lse"]
METRICS = {
    "qwen3_a": ["val/loss", "ood/loss"],
    "qwen3_a_heldout": ["val/loss", "ood/loss"],
    "peers": ["val/loss", "ood/loss"],
    "normuon": ["val/loss", "ood/loss"],
    "normuon_hidden": ["val/loss", "ood/loss"],
    "muon_iteration": ["val/loss", "ood/loss"],
    "gemma3_b": ["val/loss", *_LOGITS, "ood/loss"],
    "gpt_oss": ["val/loss", *_ROUTER, "ood/loss"],
    "gpt_oss_router": [
        "val/loss",
        "router/lb",
        "router/z",
        "router/dead",
        "router/max_load",
        "router/entropy",
        "router/cv",
        "router/logit_rms",
    ],
    "gemma3_logits": ["val/loss", "logits/rms", "logits/centred_rms", "logits/max_lse", "ood/loss"],
}
# metrics also summarised over the whole run: each run's mean over its validations
RUN_MEAN = {
    "gpt_oss_router": ["router/lb", "router/z", "router/dead", "router/max_load"],
    "gpt_oss": ["router/lb", "router/z", "router/dead", "router/max_load"],
    "gemma3_logits": ["logits/rms", "logits/centred_rms", "logits/max_lse"],
}
PAIRS = {
    "gemma3_logits": [("gemma3-b-i", "gemma3-b-i-head-adamw"), ("gemma3-b-ii", "gemma3-b-ii-head-adamw")],
}
CURVES = {
    "qwen3_a": ["val/loss", "weight_rms/embedding", "weight_rms/lm_head"],
    "qwen3_a_heldout": ["val/loss", "weight_rms/embedding", "weight_rms/lm_head"],
    "peers": ["val/loss", "weight_rms/attention", "weight_rms/mlp_in"],
    "normuon": ["val/loss", "weight_rms/attention", "weight_rms/mlp_in"],
    "normuon_hidden": ["val/loss", "weight_rms/attention", "weight_rms/mlp_in"],
    "muon_iteration": ["val/loss", "weight_rms/attention", "weight_rms/mlp_in"],
    "gemma3_b": ["val/loss", *_LOGITS],
    "gpt_oss": ["val/loss", "router/lb", "router/z", "router/dead", "router/max_load", "weight_rms/router"],
    "gpt_oss_router": ["val/loss", "router/lb", "router/z", "router/dead", "router/max_load", "weight_rms/router"],
    "gemma3_logits": ["val/loss", "logits/rms", "logits/centred_rms", "logits/max_lse"],
}


def _run_dirs(study: str) -> list[Path]:
    """The study's finished runs; for a learning-rate sweep only each arm's chosen multiplier
    (and for a protocol's sweep only its evaluation seeds)."""
    logs = OUT / _source(study) / "logs"
    sweep = OUT / study / "sweep.json"
    protocol = OUT / study / GLANCE_REPORTS.get(study, "protocol-report.json")
    if study in TAKEN_OVER and not protocol.exists():
        return []  # its runs are the other study's until its own report chose among them
    if protocol.exists():
        from equiopt.study.paired import mult_tag

        report = json.loads(protocol.read_text())
        family, names = STUDIES[_source(study)]
        dirs = []
        for entry in names:
            name = entry.partition("=")[0]
            label = next(k for k in report["chosen"] if k.endswith(f"-{name}"))
            tag = mult_tag(report["chosen"][label])
            dirs += [
                logs / name / f"{tag}-s{s}"
                for s in report["evaluation_seeds"]
                if _finished(logs / name / f"{tag}-s{s}")
            ]
        return dirs
    if sweep.exists():
        from equiopt.study.paired import mult_tag

        chosen = json.loads(sweep.read_text())["chosen"]
        family, names = STUDIES[study]
        dirs = []
        for name in names:
            label = f"{family}-{name}"
            dirs += sorted(d for d in (logs / name).glob(f"{mult_tag(chosen[label])}-s*") if _finished(d))
        return dirs
    return sorted(p for p in logs.iterdir() if _finished(p))


def _finished(run_dir: Path) -> bool:
    from equiopt.study.plots import read_run

    return (run_dir / "log.jsonl").exists() and read_run(run_dir).status == "done"


def _fmt(v, digits=4):
    return "-" if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def _tables(study: str, dirs: list[Path]) -> list[str]:
    from equiopt.study.compare_table import compare_rows

    lines = []
    for metric in METRICS[_source(study)]:
        lines += _section(study, f"`{metric}` at the last validation", compare_rows(dirs, metric=metric), metric)
    for metric in RUN_MEAN.get(_source(study), []):
        rows = [_over_run(r, metric) for r in compare_rows(dirs, metric=metric)]
        lines += _section(study, f"`{metric}`, mean over each run's validations (steps 50, 100, 150)", rows, metric)
    return lines


def _section(study: str, title: str, rows, metric: str) -> list[str]:
    """One metric: mean ± std per arm, then the paired differences from each baseline of
    the study that was run."""
    from equiopt.study.paired import paired_rows, paired_table

    family, names = STUDIES[_source(study)]
    lines = [f"### {title}", "", "| arm | seeds | mean ± std | per seed |", "|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{sd}: {_fmt(v)}" for sd, v in zip(r.seeds, r.values))
        lines.append(f"| {r.label} | {len(r.values)} | {_fmt(r.mean)} ± {_fmt(r.std)} | {per} |")
    lines.append("")
    labels = {r.label for r in rows}
    for arm, base in PAIRS.get(_source(study)) or [(None, f"{family}-{names[0].partition('=')[0]}")]:
        base = _label_of(base, labels)
        if base is None or (arm is not None and arm not in labels):
            continue  # an arm of the study that was not run
        lines += [paired_table([p for p in paired_rows(rows, base, metric) if arm is None or p.label == arm]), ""]
    return lines


def _label_of(name: str, labels: set[str]) -> str | None:
    """The label of arm ``name``'s runs among ``labels``: the name itself, or the name with a
    sweep's ``-lrx<m>`` tag (``qwen3-pe-lrx1``, not ``qwen3-pe-scaled-lrx1``); None if not run."""
    if name in labels:
        return name
    found = [label for label in labels if re.fullmatch(re.escape(name) + r"-lrx[0-9.e+-]+", label)]
    return found[0] if len(found) == 1 else None


def _over_run(row, metric: str):
    """``row`` with each run's value replaced by its mean over the run's validations."""
    from dataclasses import replace

    from equiopt.study.plots import read_run

    values = []
    for path in row.paths:
        _, ys = read_run(path).series(metric, kind="val", x="step")
        values.append(float(ys.mean()) if len(ys) else math.nan)
    finite = [v for v in values if math.isfinite(v)]
    return replace(
        row,
        values=values,
        mean=statistics.fmean(finite) if finite else None,
        std=statistics.stdev(finite) if len(finite) > 1 else None,
    )


def _mean_band(ax, series: list, label_of, **style) -> None:
    """Seeds' ``(x, y)`` series on ``ax``: their mean as a line (``label_of(ys)`` its label, ``ys``
    the seeds' values stacked over their common steps) and a band from their minimum to maximum."""
    import numpy as np

    n = min(len(x) for x, _ in series)
    xs = series[0][0][:n]
    ys = np.stack([y[:n] for _, y in series])
    (line,) = ax.plot(xs, ys.mean(0), label=label_of(ys), **style)
    ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)


def _curves(study: str, dirs: list[Path]) -> Path:
    from equiopt.study.plots import matplotlib_api, read_run

    Figure = matplotlib_api()[0]
    keys = CURVES[_source(study)]
    runs = [read_run(d) for d in dirs]
    by_arm: dict[str, list] = {}
    for run in runs:
        by_arm.setdefault(re.sub(r"-s\d+$", "", run.name), []).append(run)
    cols = 2 if len(keys) > 3 else len(keys)
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(5.2 * cols, 3.4 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        for arm, group in by_arm.items():
            series = [r.series(key, x="step") for r in group if r.has(key)]
            if series:
                _mean_band(ax, series, lambda ys, arm=arm: f"{arm} ({len(ys)} seeds)")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{study}: mean over seeds, band = min..max", fontsize=10)
    fig.tight_layout()
    path = OUT / study / "curves.png"
    fig.savefig(path, dpi=100)
    return path


DOCS_IMG = ROOT / "docs" / "img"
# a verdict's colour: what the claim said held, the opposite held, the interval alone points one way
# (normal theory; the exact sign-flip test does not decide: pale), or neither
_VERDICT_COLOURS = (
    (("reproduces", "equivalent", "no harm"), "tab:green"),
    (("reverses", "differs", "harms"), "tab:red"),
    (("not decided: interval on the paper's side",), "yellowgreen"),
    (("not decided: interval on the other side", "not decided: interval excludes 0"), "lightcoral"),
)


def _verdict_colour(verdict: str) -> str:
    for starts, colour in _VERDICT_COLOURS:
        if verdict.startswith(starts):
            return colour
    return "tab:gray"


# studies drawn at a glance from a report of another name than protocol-report.json (a protocol
# that took over from another in the same folder); the GPU-scale study's configs and runs come
# from scripts/gpu_study.sh, not from this script
GLANCE_REPORTS = {"qwen3_gpu": "protocol-wider-report.json", "gemma3_b_wider": "protocol-widest-report.json"}
# protocols that took over a study's configs and runs on a wider grid: a tables.md and curves.png of
# their own, from their report's choices, with the metrics and arms of the study whose runs they reuse
TAKEN_OVER = {"gemma3_b_wider": "gemma3_b", "gpt_oss_wider": "gpt_oss"}


def _source(study: str) -> str:
    """The study whose arms, metrics and run directories ``study`` uses (itself, or the one it took over)."""
    return TAKEN_OVER.get(study, study)


def _glance(study: str) -> Path | None:
    """``docs/img/study-<study>.png``, a protocol study at a glance from its report and logs:
    the validation loss of each arm at its chosen multiplier on the evaluation seeds (mean,
    band min..max), and each claim's paired difference (arm minus baseline: the seeds as dots,
    the mean with its 95 % interval) coloured by its verdict. None for a study without a
    finished protocol report."""
    from equiopt.study.plots import matplotlib_api, read_run

    report = OUT / study / GLANCE_REPORTS.get(study, "protocol-report.json")
    if not report.exists():
        return None
    data = json.loads(report.read_text())
    arms: dict[str, list[str]] = {}
    for pair in data["paired"]:
        arms.setdefault(pair["label"], pair["paths"])
        arms.setdefault(pair["baseline"], pair["baseline_paths"])
    Figure = matplotlib_api()[0]
    fig = Figure(figsize=(11, 3.6))
    curves, claims = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.25]})
    for arm, paths in arms.items():
        series = [read_run(ROOT / path).series("val/loss", x="step") for path in paths]
        chosen = data["chosen"].get(arm, 1)
        _mean_band(
            curves,
            series,
            lambda ys, arm=arm, chosen=chosen: f"{arm} x{chosen:g}: {ys[:, -1].mean():.4f} ({len(ys)} seeds)",
            marker="o",
            ms=3,
        )
    curves.set_xlabel("step")
    curves.set_ylabel("validation loss")
    curves.set_title("validation loss, evaluation seeds", fontsize=9)
    curves.grid(True, alpha=0.3)
    curves.legend(fontsize=7)
    diffs = {(pair["label"], pair["baseline"]): pair["diffs"] for pair in data["paired"]}
    rows = data["verdicts"]
    for i, claim in enumerate(rows):
        colour = _verdict_colour(claim["verdict"])
        seeds = diffs.get((claim["arm"], claim["baseline"]), [])
        claims.scatter(seeds, [i] * len(seeds), s=12, color=colour, alpha=0.5)
        lo, hi = claim["ci"]
        claims.errorbar(
            claim["mean"], i, xerr=[[claim["mean"] - lo], [hi - claim["mean"]]], fmt="D", color=colour, capsize=3
        )
    claims.axvline(0.0, color="black", lw=0.8)
    claims.set_yticks(range(len(rows)))
    claims.set_yticklabels([f"{c['arm']} - {c['baseline']} ({c['direction']})" for c in rows], fontsize=7)
    claims.invert_yaxis()
    claims.set_xlabel(f"paired difference of final {data['metric']} (arm - baseline)")
    claims.set_title(
        "claims: seeds, mean, 95 % interval; green held, red the opposite (pale: the interval only,\n"
        "the exact sign-flip test does not decide), grey neither",
        fontsize=8,
    )
    claims.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"{study}: protocol {data['protocol']['name']}, arms tuned on seed 0", fontsize=10)
    fig.tight_layout()
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    path = DOCS_IMG / f"study-{study}.png"
    fig.savefig(path, dpi=80, metadata={"Software": None})
    return path


# studies whose arms were tuned: roles swept, and the commands that ran the sweep
SWEEPS = {
    "qwen3_a": (
        ["embedding", "lm_head"],
        """\
D=results/study/qwen3_a/configs
# tuning on seed 0 (grid 0.5-4), then seeds 1-2 at each arm's best
equiopt compare $D/a-iii.toml $D/a-i.toml --seeds 3 --tune-seeds 1 --sweep-lr 0.5,1,2,4 \\
    --sweep-roles embedding,lm_head --baseline qwen3-a-iii
# (a)(ii) was best at the grid's low edge: its own grid
equiopt compare $D/a-ii.toml --seeds 3 --tune-seeds 1 --sweep-lr 0.25,0.5,1,2 --sweep-roles embedding,lm_head \\
    --baseline qwen3-a-ii
python scripts/cpu_study.py report""",
    ),
}


def _sweep_arms(study: str):
    """The study's lr sweep read back from its run directories (``<arm>/lrx<m>-s<seed>``):
    each arm's own grid, tuned on seed 0."""
    from equiopt.study.paired import SweepArm, base_lrs
    from equiopt.train.config import load_config

    family, names = STUDIES[study]
    roles = SWEEPS[study][0]
    arms = []
    for name in names:
        cfg = load_config(OUT / study / "configs" / f"{name}.toml")
        arm = SweepArm(
            cfg.run.name,
            str((OUT / study / "configs" / f"{name}.toml").relative_to(ROOT)),
            base_lrs(cfg, roles),
            tune_seeds=[0],
            eval_seeds=[0, 1, 2],  # seed 0 both chose and judged: the report's first line says so
        )
        for d in sorted((OUT / study / "logs" / name).glob("lrx*-s*")):
            m = re.fullmatch(r"lrx([0-9.e+-]+)-s(\d+)", d.name)
            if m and _finished(d):
                arm.runs.setdefault(float(m.group(1)), {})[int(m.group(2))] = str(d.relative_to(ROOT))
        arms.append(arm)
    return arms


# protocols whose reports `report` rewrites from their runs' logs (a sweep's report: the grid, best
# against best, the claims with the exact sign-flip p); every run must have finished, none is trained
PROTOCOL_REPORTS = [
    "qwen3_a_heldout/protocol.toml",
    "peers/protocol.toml",
    "gemma3_b/protocol.toml",
    "gemma3_b_wider/protocol-widest.toml",
    "gpt_oss/protocol.toml",
    "gpt_oss_wider/protocol.toml",
    "normuon_hidden_wider/protocol.toml",
    "muon_iteration/protocol.toml",
]


def _refuse_training(cfg, progress=False):
    raise RuntimeError(f"run {cfg.run.name} has not finished: `cpu_study.py report` trains nothing")


def rewrite_protocol_report(rel: str) -> Path | None:
    """Rewrite ``results/study/<rel>``'s report (``<protocol>-report.md``, its ``.json`` and figures)
    from the finished runs' logs, with the command its last run recorded; None if it has no report yet.

    Raises:
        RuntimeError: a run the protocol needs has not finished (nothing is trained).
    """
    from equiopt.cli import baseline_label, parse_sets, toml_value
    from equiopt.study.paired import sweep, sweep_report
    from equiopt.study.protocol import load_protocol

    path = OUT / rel
    report = path.with_name(path.stem + "-report.md")
    if not report.exists():
        return None
    protocol = load_protocol(path.relative_to(ROOT).as_posix())
    found = re.search(r"```bash\n(equiopt compare [^\n]*)\n```", report.read_text())
    command = (
        found.group(1) if found else f"equiopt compare --protocol {protocol.path} --report {report.relative_to(ROOT)}"
    )
    sets = parse_sets([f"{k}={toml_value(v)}" for k, v in protocol.sets.items()])
    arms = sweep(
        protocol.configs,
        protocol.multipliers,
        protocol.eval_seeds,
        roles=protocol.roles,
        sets=sets,
        train_fn=_refuse_training,
        progress=False,
        tune_seeds=protocol.tune_seeds,
        metric=protocol.metric,
    )
    baseline = baseline_label(protocol.baseline, protocol.configs, arms)
    sweep_report(arms, baseline, protocol.metric, out=report.relative_to(ROOT), command=command, protocol=protocol)
    return report


def from_logs_report() -> None:
    """results/study/<study>/tables.md and curves.png for every study whose runs have
    finished; for a tuned study first its sweep report (sweep.md, sweep.json, figures); the
    protocol reports of :data:`PROTOCOL_REPORTS` rewritten from their logs (nothing is trained)."""
    import os

    from equiopt.study.paired import sweep_report

    os.chdir(ROOT)  # run directories are named relative to the repository root
    for rel in PROTOCOL_REPORTS:
        written = rewrite_protocol_report(rel)
        if written is not None:
            print(written)
    for study, (_roles, command) in SWEEPS.items():
        if (OUT / study / "logs").exists():
            family, names = STUDIES[study]
            sweep_report(_sweep_arms(study), f"{family}-{names[0]}", out=OUT / study / "sweep.md", command=command)
            print(OUT / study / "sweep.md")
    for study in dict.fromkeys([*STUDIES, *TAKEN_OVER]):
        logs = OUT / _source(study) / "logs"
        if not logs.exists():
            continue
        dirs = _run_dirs(study)
        if not dirs:
            continue
        lines = [
            f"# {study}: final metrics and paired differences",
            "",
            "Written by `python scripts/cpu_study.py report` from the `log.jsonl` of every run listed.",
            "Paired differences are arm minus baseline on the same seed (same initialisation and data order);",
            "the 95 % interval is Student t over the seeds.",
            "",
        ]
        lines += _tables(study, dirs)
        lines += ["Runs:", ""] + [f"- `{d.relative_to(ROOT)}`" for d in dirs] + [""]
        fig = _curves(study, dirs)
        lines += [f"![curves]({fig.name})", ""]
        (OUT / study / "tables.md").write_text("\n".join(lines))
        print(OUT / study / "tables.md")
    # a study that reuses another's runs has its own protocol report
    for study in dict.fromkeys([*STUDIES, *TAKEN_OVER, *GLANCE_REPORTS]):
        glance = _glance(study)
        if glance is not None:
            print(glance)


if __name__ == "__main__":
    sys.exit(main())
