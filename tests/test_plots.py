"""Reading run directories, figures, and the seed-comparison table."""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest

from equiopt.study.compare_table import compare_rows, compare_table, main_table, strip_seed_suffix
from equiopt.study.plots import RunLogWarning, main_plot, plot_runs, read_run, read_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROUTER = ("lb", "z", "entropy", "cv", "dead", "max_load", "logit_rms")


def make_run(
    root,
    dirname,
    *,
    name=None,
    seed=0,
    recipe="paper:qwen3:b-i",
    moe=False,
    val_losses=None,
    steps=(10, 20, 30, 40),
    lr=0.02,
    extra_lines=(),
    end="done",
    config=True,
):
    """A run directory in the training loop's format: config.json and log.jsonl."""
    run = root / dirname
    run.mkdir(parents=True)
    if config:
        cfg = {
            "run": {"name": name or dirname, "seed": seed, "out_dir": str(run), "device": "cpu"},
            "model": {"family": "olmoe" if moe else "qwen3", "size": "tiny", "overrides": {}},
            "data": {"seq_len": 64, "batch_size": 4},
            "optim": {"recipe": recipe, "overrides": {"embedding": {"lr": lr}}, "clip_grad_norm": 0.0},
            "train": {"steps": steps[-1], "log_every": 10, "val_every": 20},
        }
        (run / "config.json").write_text(json.dumps(cfg))
    tokens_per_step = 256
    lines = [
        {
            "kind": "meta",
            "step": 0,
            "tokens": 0,
            "time": 0.0,
            "params": 1000,
            "device": "cpu",
            "recipe": recipe,
            "world_size": 1,
        }
    ]
    val_steps = [s for s in steps if s % 20 == 0]
    val_losses = list(val_losses) if val_losses is not None else [6.0 - 0.01 * s for s in val_steps]
    for i, step in enumerate(steps):
        rec = {
            "kind": "train",
            "step": step,
            "tokens": step * tokens_per_step,
            "time": 0.1 * step,
            "loss": 7.0 - 0.02 * step + 0.01 * seed,
            "tokens_per_s": 1e4,
            "time/fwd_bwd": 0.01,
            "time/opt": 0.005,
            "time/step": 0.015,
            "nonfinite_steps": 0,
        }
        for role in ("embedding", "lm_head", "attention", "mlp_in", "vector") + (("router",) if moe else ()):
            rec[f"lr/{role}"] = lr
            rec[f"weight_rms/{role}"] = 0.02 + 0.001 * step
            rec[f"update_rms/{role}"] = 1e-3 / (1 + i)
        lines.append(rec)
        if step in val_steps:
            v = {
                "kind": "val",
                "step": step,
                "tokens": step * tokens_per_step,
                "time": 0.1 * step,
                "val/loss": val_losses[val_steps.index(step)],
                "ood/loss": 7.5 - 0.01 * step,
                "logits/rms": 1.0 + 0.01 * step,
                "logits/centred_rms": 0.8 + 0.01 * step,
                "logits/max_lse": 12.0 + 0.02 * step,
                "logits/mean_lse": 11.0,
                "logits/max_abs": 5.0,
            }
            if moe:
                v.update({f"router/{m}": 0.5 + 0.01 * step for m in ROUTER})
                v.update({f"router/L{layer}/{m}": 0.5 for layer in range(2) for m in ROUTER})
                rec.update({f"router/{m}": 0.6 + 0.01 * step for m in ROUTER})
            lines.append(v)
    text = "".join(json.dumps(rec) + "\n" for rec in lines)
    text += "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in extra_lines)
    if end:
        text += (
            json.dumps(
                {
                    "kind": "end",
                    "step": steps[-1],
                    "tokens": steps[-1] * tokens_per_step,
                    "time": 5.0,
                    "status": end,
                    "message": "",
                }
            )
            + "\n"
        )
    (run / "log.jsonl").write_text(text)
    return run


# ------------------------------------------------------------------------------ reading
def test_read_run_basic(tmp_path):
    path = make_run(tmp_path, "a", name="qwen-rownorm")
    run = read_run(path)
    assert run.name == "qwen-rownorm" and run.status == "done"
    assert [r["step"] for r in run.train] == [10, 20, 30, 40]
    assert [r["step"] for r in run.val] == [20, 40]
    assert run.final("val/loss") == pytest.approx(6.0 - 0.4)
    assert run.tokens == 40 * 256
    xs, ys = run.series("val/loss")
    assert xs.tolist() == [20 * 256, 40 * 256] and ys.tolist() == pytest.approx([5.8, 5.6])


def test_label_falls_back_to_directory_name(tmp_path):
    run = read_run(make_run(tmp_path, "no-config-run", config=False))
    assert run.name == "no-config-run" and run.config == {}


def test_resume_later_records_win(tmp_path):
    # first timeline logs up to step 40 and is interrupted; resumed from the step-20 checkpoint it re-logs 30, 40
    resumed = [
        {"kind": "end", "step": 40, "tokens": 40 * 256, "time": 4.0, "status": "interrupted", "message": "x"},
        {"kind": "meta", "step": 20, "tokens": 20 * 256, "time": 0.0, "resumed_from": "ckpt/step_20.pt"},
        {"kind": "train", "step": 30, "tokens": 30 * 256, "time": 1.0, "loss": 1.25},
        {"kind": "train", "step": 40, "tokens": 40 * 256, "time": 2.0, "loss": 1.5},
        {"kind": "val", "step": 40, "tokens": 40 * 256, "time": 2.0, "val/loss": 2.5},
    ]
    path = make_run(tmp_path, "r", extra_lines=resumed, end="done")
    run = read_run(path)
    assert [r["step"] for r in run.train] == [10, 20, 30, 40]  # no duplicates
    assert [r["loss"] for r in run.train][2:] == [1.25, 1.5]  # the re-logged values
    assert [r["val/loss"] for r in run.val] == [pytest.approx(5.8), 2.5]
    assert run.final("val/loss") == 2.5
    assert run.status == "done"


def test_resume_drops_abandoned_timeline(tmp_path):
    # the old timeline logged step 40; after resuming from step 20 the run crashed at 30 without an end record
    extra = [
        {"kind": "meta", "step": 20, "tokens": 20 * 256, "time": 0.0, "resumed_from": "ckpt"},
        {"kind": "train", "step": 30, "tokens": 30 * 256, "time": 1.0, "loss": 1.0},
    ]
    run = read_run(make_run(tmp_path, "r", extra_lines=extra, end=None))
    assert [r["step"] for r in run.train] == [10, 20, 30]
    assert [r["step"] for r in run.val] == [20]
    assert run.status == "incomplete"


def test_truncated_last_line_is_skipped_with_warning(tmp_path):
    path = make_run(tmp_path, "t", end=None, extra_lines=['{"kind": "train", "step": 50, "tokens": 12800, "lo'])
    with pytest.warns(RunLogWarning, match="truncated last line"):
        run = read_run(path)
    assert [r["step"] for r in run.train] == [10, 20, 30, 40]
    assert run.status == "incomplete" and len(run.skipped_lines) == 1


def test_nonfinite_values_read_as_floats(tmp_path):
    extra = [{"kind": "train", "step": 50, "tokens": 50 * 256, "time": 1.0, "loss": "nan"}]
    run = read_run(make_run(tmp_path, "n", extra_lines=extra, end="nonfinite"))
    assert math.isnan(run.final("loss", "train")) and run.status == "nonfinite"


def test_read_runs_expands_parent_and_disambiguates(tmp_path):
    make_run(tmp_path / "sweep", "a", name="same")
    make_run(tmp_path / "sweep", "b", name="same")
    runs = read_runs([tmp_path / "sweep"])
    assert len(runs) == 2 and len({r.name for r in runs}) == 2
    with pytest.raises(FileNotFoundError):
        read_runs([tmp_path / "nothing-here"])


# ------------------------------------------------------------------------------ plots
def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_dense_runs_have_no_router_figure(tmp_path):
    pytest.importorskip("matplotlib")
    dirs = [make_run(tmp_path, "dense-a"), make_run(tmp_path, "dense-b", seed=1)]
    paths = plot_runs(dirs, tmp_path / "out", prefix="d-")
    names = sorted(p.name for p in paths)
    assert names == ["d-logits.png", "d-loss.png", "d-weights.png"]
    assert not (tmp_path / "out" / "d-router.png").exists()
    for p in paths:
        w, h = _png_size(p)
        assert w > 500 and h > 300


def test_plots_moe_run_has_router_figure(tmp_path):
    pytest.importorskip("matplotlib")
    dirs = [make_run(tmp_path, "dense"), make_run(tmp_path, "moe", moe=True)]
    paths = plot_runs(dirs, tmp_path / "out", log_x=True)
    assert (tmp_path / "out" / "router.png") in paths
    for p in paths:
        _png_size(p)


def test_main_plot_default_out_dir(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    first = make_run(tmp_path, "first")
    make_run(tmp_path, "second")
    assert main_plot([str(first), str(tmp_path / "second"), "--smooth", "0.5"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(p.startswith(str(first / "plots")) for p in printed)
    assert (first / "plots" / "loss.png").is_file()


def test_missing_matplotlib_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match="pip install"):
        plot_runs([make_run(tmp_path, "a")], tmp_path / "out")
    with pytest.raises(SystemExit, match="matplotlib"):
        main_plot([str(tmp_path / "a")])


# ------------------------------------------------------------------------------ table
SEED_VALS = {"rownorm": [4.0516, 4.0539, 4.0535], "hybrid": [4.0435, 4.0497, 4.0459], "adamw": [4.0862, 4.0912, 4.0941]}


def _seed_runs(tmp_path):
    dirs = []
    for cfg, vals in SEED_VALS.items():
        for seed, v in enumerate(vals):
            dirs.append(
                make_run(tmp_path, f"{cfg}-s{seed}", seed=seed, recipe=f"paper:gemma3:b-{cfg}", val_losses=[5.0, v])
            )
    return dirs


def test_strip_seed_suffix():
    assert strip_seed_suffix("rownorm-s1") == "rownorm"
    assert strip_seed_suffix("rownorm_seed12") == "rownorm"
    assert strip_seed_suffix("rownorm-2", seed=2) == "rownorm"
    assert strip_seed_suffix("rownorm-2", seed=3) == "rownorm-2"
    assert strip_seed_suffix("qwen3") == "qwen3"


def test_compare_rows_mean_std_over_three_seeds(tmp_path):
    rows = compare_rows(_seed_runs(tmp_path))
    assert [r.label for r in rows] == ["rownorm", "hybrid", "adamw"]
    by = {r.label: r for r in rows}
    row = by["rownorm"]
    assert row.n == 3 and row.seeds == [0, 1, 2]
    # hand-computed: mean (4.0516 + 4.0539 + 4.0535) / 3 = 4.0530; deviations -14e-4, 9e-4, 5e-4;
    # sample variance (1.96 + 0.81 + 0.25)e-6 / 2 = 1.51e-6
    assert row.mean == pytest.approx(4.0530, abs=1e-9)
    assert row.std == pytest.approx(math.sqrt(1.51e-6), rel=1e-6)
    assert row.best == 4.0516
    assert by["hybrid"].mean == pytest.approx(12.1391 / 3)
    assert by["adamw"].std == pytest.approx(0.0040, abs=5e-5)
    # final train loss: 7 - 0.02 * 40 + 0.01 * seed, averaged over seeds 0, 1, 2
    assert row.train_loss == pytest.approx(6.2 + 0.01)
    assert row.tokens == [40 * 256] * 3


def test_compare_table_text(tmp_path):
    table = compare_table(_seed_runs(tmp_path))
    lines = table.splitlines()
    assert lines[0].startswith("| configuration | seeds | final val/loss (mean ± std) | best")
    assert len(lines) == 2 + 3
    rownorm = next(line for line in lines if line.startswith("| rownorm "))
    assert "| 3 | 4.0530 ± 0.0012 | 4.0516 |" in rownorm
    hybrid = next(line for line in lines if line.startswith("| hybrid "))
    assert "**4.0464 ± 0.0031**" in hybrid  # best, and separated from both others by its paired interval


def test_compare_table_bolds_nothing_its_interval_does_not_separate(tmp_path):
    close = {"a": [4.00, 4.05, 4.02], "b": [4.01, 4.03, 4.03]}  # a is lower on average, not on every seed
    dirs = [
        make_run(
            tmp_path, f"{c}-s{s}", seed=s, recipe=f"paper:gemma3:b-{'i' if c == 'a' else 'ii'}", val_losses=[5.0, v]
        )
        for c, vals in close.items()
        for s, v in enumerate(vals)
    ]
    assert "**" not in compare_table(dirs)
    one_seed = [make_run(tmp_path / "one", "x", recipe="paper:gemma3:b-i", val_losses=[5.0, 3.0])]
    one_seed.append(make_run(tmp_path / "one", "y", recipe="paper:gemma3:b-ii", val_losses=[5.0, 4.0]))
    assert "**" not in compare_table(one_seed)  # one seed: no interval, no bold


def test_grouping_of_seeds(tmp_path):
    dirs = [
        make_run(tmp_path, "x-s0", seed=0, val_losses=[5.0, 4.0]),
        make_run(tmp_path, "x-s1", seed=1, val_losses=[5.0, 4.2]),
        make_run(tmp_path, "x-lr-s0", name="x-s0", seed=0, lr=0.05, val_losses=[5.0, 4.4]),  # other lr
        make_run(tmp_path, "y", recipe="paper:qwen3:b-iii", val_losses=[5.0, 4.6]),
    ]
    rows = compare_rows(dirs)
    assert [r.n for r in rows] == [2, 1, 1]
    assert rows[0].values == pytest.approx([4.0, 4.2])
    assert rows[0].std == pytest.approx(math.sqrt(0.02))
    # same name, different config: told apart by the entry that differs
    assert rows[0].label == "x [optim.overrides.embedding.lr=0.02]"
    assert rows[1].label == "x [optim.overrides.embedding.lr=0.05]"
    assert rows[1].std is None and rows[2].label == "y"
    one_seed = compare_table(dirs).splitlines()[3]
    assert "4.4000 ± -" in one_seed
    # ignoring the swept key merges the lr runs into one configuration
    assert [r.n for r in compare_rows(dirs, ignore=["optim.overrides.embedding.lr"])] == [3, 1]


def test_compare_table_other_metric_and_cli(tmp_path, capsys):
    dirs = _seed_runs(tmp_path)
    rows = compare_rows(dirs, metric="ood/loss")
    assert rows[0].mean == pytest.approx(7.5 - 0.4)
    assert main_table([str(tmp_path), "--sort"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| hybrid ") and out[-1].startswith("| adamw ")
    assert main_table([str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {d["label"] for d in data} == set(SEED_VALS)


# ------------------------------------------------------------------ a study at a glance
def _cpu_study(monkeypatch, root):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "cpu_study.py"
    spec = importlib.util.spec_from_file_location("cpu_study_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", root)
    monkeypatch.setattr(module, "OUT", root / "results" / "study")
    monkeypatch.setattr(module, "DOCS_IMG", root / "img")
    return module


def test_study_glance_draws_arms_and_claims_from_the_report_and_logs(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from equiopt.study.protocol import VERDICTS, verdict

    cpu_study = _cpu_study(monkeypatch, tmp_path)
    logs = tmp_path / "results" / "study" / "toy" / "logs"
    arm = [make_run(logs, f"a/lrx2-s{s}", seed=s).relative_to(tmp_path) for s in (10, 11)]
    base = [make_run(logs, f"b/lrx1-s{s}", seed=s).relative_to(tmp_path) for s in (10, 11)]
    report = {
        "metric": "val/loss",
        "protocol": {"name": "toy"},
        "chosen": {"toy-a": 2.0, "toy-b": 1.0},
        "paired": [
            {
                "label": "toy-a",
                "baseline": "toy-b",
                "paths": [str(p) for p in arm],
                "baseline_paths": [str(p) for p in base],
                "diffs": [-0.02, -0.01],
            }
        ],
        "verdicts": [
            {
                "arm": "toy-a",
                "baseline": "toy-b",
                "direction": "lower",
                "mean": -0.015,
                "ci": [-0.08, 0.05],
                "verdict": VERDICTS[2],
            }
        ],
    }
    (tmp_path / "results" / "study" / "toy" / "protocol-report.json").write_text(json.dumps(report))
    path = cpu_study._glance("toy")
    assert path == tmp_path / "img" / "study-toy.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    # a study whose protocol has not finished has no figure; one whose logs are gone fails
    assert cpu_study._glance("unfinished") is None
    report["paired"][0]["paths"][0] = "results/study/toy/logs/a/missing"
    (tmp_path / "results" / "study" / "toy" / "protocol-report.json").write_text(json.dumps(report))
    with pytest.raises(FileNotFoundError):
        cpu_study._glance("toy")
    # every verdict the protocols give has its colour: held, the opposite, neither
    assert cpu_study._verdict_colour(VERDICTS[0]) == "tab:green"
    assert cpu_study._verdict_colour(VERDICTS[1]) == "tab:red"
    assert cpu_study._verdict_colour(VERDICTS[2]) == "tab:gray"
    assert cpu_study._verdict_colour(verdict((-0.001, 0.001), "equal", 0.01)) == "tab:green"
    assert cpu_study._verdict_colour(verdict((0.02, 0.03), "equal", 0.01)) == "tab:red"
    assert cpu_study._verdict_colour(verdict((-0.001, 0.001), "not_higher", 0.01)) == "tab:green"
    assert cpu_study._verdict_colour(verdict((0.02, 0.03), "not_higher", 0.01)) == "tab:red"
    assert cpu_study._verdict_colour(verdict((-0.02, 0.03), "not_higher", 0.01)) == "tab:gray"


def test_study_tables_of_a_wider_grid_read_its_own_report_over_the_runs_it_took_over(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    cpu_study = _cpu_study(monkeypatch, tmp_path)
    for name, value in {
        "STUDIES": {"toy": ("toy", ["pe", "pe-scaled"])},
        "TAKEN_OVER": {"toy_wider": "toy"},
        "GLANCE_REPORTS": {"toy_wider": "protocol-wider-report.json"},
        "METRICS": {"toy": ["val/loss"]},
        "RUN_MEAN": {},
        "PAIRS": {},
        "CURVES": {"toy": ["val/loss"]},
        "SWEEPS": {},
    }.items():
        monkeypatch.setattr(cpu_study, name, value)
    logs = tmp_path / "results" / "study" / "toy" / "logs"
    vals = {("pe", 1): 5.0, ("pe", 2): 4.0, ("pe-scaled", 1): 4.5}
    for (arm, mult), v in vals.items():
        for seed in (10, 11):
            losses = [v + 1.0, v + seed / 1000] if arm == "pe" else [v + 1.0, v + 0.003 * (seed - 9)]
            lr = 0.01 * mult * (1.3 if arm == "pe-scaled" else 1.0)  # a configuration per arm and lr
            make_run(logs, f"{arm}/lrx{mult}-s{seed}", name=f"toy-{arm}-lrx{mult}-s{seed}", seed=seed,
                     val_losses=losses, lr=lr)  # fmt: skip
    # without its own report, the wider grid has no runs of its own yet
    assert cpu_study._run_dirs("toy_wider") == []
    report = {"chosen": {"toy-pe": 2.0, "toy-pe-scaled": 1.0}, "evaluation_seeds": [10, 11]}
    (tmp_path / "results" / "study" / "toy_wider").mkdir(parents=True)
    (tmp_path / "results" / "study" / "toy_wider" / "protocol-wider-report.json").write_text(json.dumps(report))
    dirs = cpu_study._run_dirs("toy_wider")
    assert [d.relative_to(logs).as_posix() for d in dirs] == [
        "pe/lrx2-s10", "pe/lrx2-s11", "pe-scaled/lrx1-s10", "pe-scaled/lrx1-s11",
    ]  # fmt: skip
    text = "\n".join(cpu_study._tables("toy_wider", dirs))
    # the baseline is toy-pe at its chosen lr, not toy-pe-scaled, whose name begins the same way
    assert "vs toy-pe-lrx2 " in text
    assert "| toy-pe-scaled-lrx1 | 2 | +0.4940 |" in text  # ((4.503 - 4.010) + (4.506 - 4.011)) / 2
    # a study's baseline among the labels: exact, or with a sweep's lr tag; never a longer name
    labels = {"toy-pe-lrx1", "toy-pe-scaled-lrx1"}
    assert cpu_study._label_of("toy-pe", labels) == "toy-pe-lrx1"
    assert cpu_study._label_of("toy-pe-scaled-lrx1", labels) == "toy-pe-scaled-lrx1"
    assert cpu_study._label_of("toy-quintic", labels) is None
