"""Paired comparisons against a baseline and resumable lr sweeps (on synthetic run logs)."""

import json
import math
from pathlib import Path

import pytest

from equiopt.study.paired import paired_rows, paired_table, sweep, sweep_report, t_quantile


def write_run(path: Path, name: str, seed: int, val: float, recipe: str = "paper:qwen3:a-i", status: str = "done",
              extra: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"run": {"name": name, "seed": seed, "out_dir": str(path)}, "optim": {"recipe": recipe, **(extra or {})}}
    (path / "config.json").write_text(json.dumps(cfg))
    recs = [{"kind": "meta", "step": 0, "tokens": 0}, {"kind": "train", "step": 10, "tokens": 100, "loss": val + 0.1},
            {"kind": "val", "step": 10, "tokens": 100, "val/loss": val}, {"kind": "end", "step": 10, "tokens": 100,
                                                                          "status": status}]
    (path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_t_quantiles_match_tables():
    for df, want in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423), (1000, 1.9623)):
        assert abs(t_quantile(0.975, df) - want) < 1e-3
    assert abs(t_quantile(0.025, 4) + 2.7764) < 1e-3


def test_paired_differences_ci_and_sign_counts(tmp_path):
    base = [5.00, 5.10, 4.95, 5.05]
    arm = [4.90, 5.02, 4.97, 4.96]  # better on 3 of 4 seeds
    for s, (b, a) in enumerate(zip(base, arm)):
        write_run(tmp_path / f"adamw-s{s}", f"adamw-s{s}", s, b, recipe="paper:qwen3:a-iii")
        write_run(tmp_path / f"row-s{s}", f"row-s{s}", s, a, recipe="paper:qwen3:a-i")
    rows = paired_rows([tmp_path], baseline="adamw")
    assert len(rows) == 1
    r = rows[0]
    diffs = [a - b for a, b in zip(arm, base)]
    assert r.label == "row" and r.baseline == "adamw" and r.seeds == [0, 1, 2, 3]
    assert r.diffs == pytest.approx(diffs)
    mean = sum(diffs) / 4
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3)
    half = 3.1824 * sd / 2  # t_{0.975, 3} s / sqrt(4)
    assert r.mean == pytest.approx(mean)
    assert r.ci[0] == pytest.approx(mean - half, abs=1e-4) and r.ci[1] == pytest.approx(mean + half, abs=1e-4)
    assert (r.better, r.worse) == (3, 1)
    table = paired_table(rows)
    assert "3 of 4" in table and f"{mean:+.4f}" in table and "0: -0.1000" in table
    with pytest.raises(ValueError, match="baseline"):
        paired_rows([tmp_path], baseline="sgd")


def test_unpaired_and_diverged_seeds_are_left_out_and_named(tmp_path):
    for s in range(3):
        write_run(tmp_path / f"base-s{s}", f"base-s{s}", s, 5.0, recipe="paper:qwen3:a-iii")
    write_run(tmp_path / "arm-s0", "arm-s0", 0, 4.9)
    write_run(tmp_path / "arm-s1", "arm-s1", 1, float("nan"), status="nonfinite")
    write_run(tmp_path / "arm-s5", "arm-s5", 5, 4.8)
    (r,) = paired_rows([tmp_path], baseline="base")
    assert r.seeds == [0] and r.ci is None and set(r.unpaired) == {1, 5}
    assert "unpaired" in paired_table([r])


def test_sweep_is_resumable_tunes_each_arm_and_reports(tmp_path):
    # fake training: loss = (log2(lr / best))^2 / 10 + 5 + seed noise; arm 'b' has its optimum 4x lower
    optimum = {"a": 0.02, "b": 0.005}
    configs = []
    for arm in ("a", "b"):
        p = tmp_path / f"{arm}.toml"
        p.write_text(f'[run]\nname = "{arm}"\nout_dir = "{tmp_path / "runs" / arm}"\n[model]\nfamily = "qwen3"\n'
                     f'[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n')
        configs.append(str(p))
    calls = []

    def fake_train(cfg, progress=False):
        calls.append(cfg.run.name)
        arm = cfg.run.name.split("-")[0]
        lr = cfg.optim.overrides["attention"]["lr"]
        val = 5.0 + math.log2(lr / optimum[arm]) ** 2 / 10 + 0.001 * cfg.run.seed - (0.05 if arm == "b" else 0.0)
        write_run(cfg.out_path, cfg.run.name, cfg.run.seed, val, extra={"overrides": cfg.optim.overrides})

    mults = [0.25, 1.0, 4.0]
    arms = sweep(configs, mults, seeds=[0, 1], roles=["attention"], train_fn=fake_train, progress=False)
    assert len(calls) == 2 * 3 * 2
    assert arms[0].base_lrs == {"attention": 0.02}
    # resumable: nothing retrains
    again = sweep(configs, mults, seeds=[0, 1], roles=["attention"], train_fn=lambda *a, **k: 1 / 0, progress=False)
    assert again[1].runs == arms[1].runs
    report = tmp_path / "report" / "report.md"
    text = sweep_report(arms, baseline="a", out=report, command="equiopt compare a.toml b.toml --sweep-lr 0.25,1,4")
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["chosen"] == {"a": 1.0, "b": 0.25}
    (pair,) = data["paired"]
    assert pair["label"] == "b" and pair["better"] == 2 and pair["diffs"] == pytest.approx([-0.05, -0.05])
    assert "**(chosen)** (at the grid's edge: widen it)" in text  # b's best is the smallest multiplier
    assert str(arms[1].runs[0.25][0]) in text  # every value names the run directory that logged it
    assert (tmp_path / "report" / "report.png").exists() and (tmp_path / "report" / "report-paired.png").exists()
    assert "](report.png)" in text and "](report-paired.png)" in text
    # a second report in the same directory keeps its own figures
    sweep_report(arms, baseline="b", out=tmp_path / "report" / "other.md")
    assert (tmp_path / "report" / "other.png").exists() and (tmp_path / "report" / "report.png").exists()


def test_sweep_tunes_on_the_first_seeds_then_runs_the_rest_at_the_chosen_multiplier(tmp_path):
    # arm 'a' is best at 0.02 (multiplier 1); seed 0 alone decides, seeds 1-2 run only there
    p = tmp_path / "a.toml"
    p.write_text(f'[run]\nname = "a"\nout_dir = "{tmp_path / "runs" / "a"}"\n[model]\nfamily = "qwen3"\n'
                 f'[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n')
    calls = []

    def fake_train(cfg, progress=False):
        lr = cfg.optim.overrides["attention"]["lr"]
        calls.append((round(lr / 0.02, 6), cfg.run.seed))
        # seeds 1 and 2 would prefer multiplier 4 if they were looked at: they must not be
        val = 5.0 + math.log2(lr / 0.02) ** 2 / 10 - (1.0 if cfg.run.seed and lr > 0.05 else 0.0)
        write_run(cfg.out_path, cfg.run.name, cfg.run.seed, val)

    arms = sweep([str(p)], [0.25, 1.0, 4.0], seeds=[0, 1, 2], roles=["attention"], train_fn=fake_train,
                 progress=False, tune_seeds=1)
    assert calls == [(0.25, 0), (1.0, 0), (4.0, 0), (1.0, 1), (1.0, 2)]
    assert sorted(arms[0].runs[1.0]) == [0, 1, 2] and sorted(arms[0].runs[4.0]) == [0]
    text = sweep_report(arms, baseline="a")
    assert "Tuning seeds: 0; seeds 1, 2 ran at each arm's chosen multiplier only" in text
    assert "| a | 1 **(chosen)** |" in text
    with pytest.raises(ValueError, match="tune_seeds"):
        sweep([str(p)], [1.0], seeds=[0, 1], roles=["attention"], train_fn=fake_train, progress=False, tune_seeds=3)


def test_cli_compare_with_baseline_writes_a_paired_report(tmp_path, monkeypatch, capsys):
    from equiopt import cli

    vals = {"a": [5.0, 5.1, 5.2], "b": [4.9, 5.0, 5.3]}

    def fake_run_seed(config, sets, seed, force):
        arm = Path(config).stem
        out = tmp_path / "runs" / f"{arm}-s{seed}"
        write_run(out, f"{arm}-s{seed}", seed, vals[arm][seed], recipe=f"paper:qwen3:{'a-i' if arm == 'a' else 'a-ii'}")
        return [str(out)]

    monkeypatch.setattr(cli, "_run_seed", fake_run_seed)
    report = tmp_path / "cmp" / "report.md"
    cli.main(["compare", "cfg/a.toml", "cfg/b.toml", "--seeds", "3", "--baseline", "cfg/a.toml",
              "--report", str(report), "--out", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert "2 of 3" in out and "mean diff in val/loss vs a" in out
    text = report.read_text()
    assert "equiopt compare cfg/a.toml" in text and "2 of 3" in text and str(tmp_path / "runs" / "b-s2") in text
