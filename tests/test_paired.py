"""Paired comparisons against a baseline and resumable lr sweeps (on synthetic run logs)."""

import json
import math
from pathlib import Path

import pytest

from equiopt.study.paired import (
    decided_verdict,
    is_decided,
    paired_rows,
    paired_table,
    sign_flip_p,
    sweep,
    sweep_report,
    t_quantile,
)
from equiopt.study.protocol import verdict


def write_run(
    path: Path,
    name: str,
    seed: int,
    val: float,
    recipe: str = "paper:qwen3:a-i",
    status: str = "done",
    extra: dict | None = None,
):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"run": {"name": name, "seed": seed, "out_dir": str(path)}, "optim": {"recipe": recipe, **(extra or {})}}
    (path / "config.json").write_text(json.dumps(cfg))
    recs = [
        {"kind": "meta", "step": 0, "tokens": 0},
        {"kind": "train", "step": 10, "tokens": 100, "loss": val + 0.1},
        {"kind": "val", "step": 10, "tokens": 100, "val/loss": val},
        {"kind": "end", "step": 10, "tokens": 100, "status": status},
    ]
    (path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_t_quantiles_match_tables():
    for df, want in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423), (1000, 1.9623)):
        assert abs(t_quantile(0.975, df) - want) < 1e-3
    assert abs(t_quantile(0.025, 4) + 2.7764) < 1e-3


def test_sign_flip_p_matches_hand_counts():
    # five differences of one sign: only all + and all - are as extreme, 2 of 32 assignments
    assert sign_flip_p([1, 2, 3, 4, 5]) == pytest.approx(0.0625)
    assert sign_flip_p([-0.07, -0.06, -0.08, -0.05, -0.07]) == pytest.approx(0.0625)
    # [1, -2, 3, 4, 5]: sum 11 of 15; as extreme when the flipped magnitudes sum to <= 2: {}, {1}, {2}
    # on each side, 6 of 32
    assert sign_flip_p([1, -2, 3, 4, 5]) == pytest.approx(6 / 32)
    # [-1, 2, 3]: sum 4 of 6; {} and {1} on each side, 4 of 8
    assert sign_flip_p([-1, 2, 3]) == pytest.approx(0.5)
    # [3, -3, 1, 1]: sum 2 of 8; every assignment with |sum| >= 2, counted by enumeration below
    import itertools

    d = [3, -3, 1, 1]
    count = sum(abs(sum(s * abs(x) for s, x in zip(signs, d))) >= 2 for signs in itertools.product((1, -1), repeat=4))
    assert count == 12 and sign_flip_p(d) == pytest.approx(12 / 16)
    assert sign_flip_p([0.0, 0.0, 0.0]) == 1.0  # no difference at all
    assert sign_flip_p([]) is None and sign_flip_p([1.0, float("nan")]) is None
    # seven pairs of one sign can go below 0.05: 2 / 128
    assert sign_flip_p([0.1, 0.2, 0.1, 0.3, 0.2, 0.1, 0.2]) == pytest.approx(2 / 128)
    # beyond 20 pairs: sampled, near the exact floor 2 / 2**22
    assert sign_flip_p([1.0] * 22) < 1e-4


def test_a_verdict_is_decided_only_where_the_interval_and_the_exact_test_agree():
    ci = (0.0575, 0.0797)  # excludes 0 by far: Qwen3 (a)(i) - (iii) at 150 steps
    interval = verdict(ci, "lower")
    assert interval == "reverses"
    # five seeds, all of one sign: p = 0.0625 >= 0.05, so not decided
    text = decided_verdict(interval, sign_flip_p([0.064, 0.056, 0.079, 0.071, 0.073]), 5)
    assert text == "not decided: interval on the other side of 0 (normal theory); exact test cannot decide at n = 5"
    assert not is_decided(text)
    assert decided_verdict("reproduces", 0.0625, 5).startswith("not decided: interval on the paper's side of 0")
    assert decided_verdict("differs", 0.0625, 5).startswith("not decided: interval excludes 0")
    # enough seeds to go below the level, but a mixed sign keeps p above it
    mixed = decided_verdict("reverses", 0.1875, 8)
    assert mixed.endswith("exact test does not decide (sign-flip p = 0.1875)") and not is_decided(mixed)
    # both agree: decided
    assert decided_verdict("reverses", 2 / 128, 7) == "reverses" and is_decided("reverses")
    assert decided_verdict("reverses", 0.03, 7, level=0.01).startswith("not decided")  # a protocol's own level
    # verdicts that claim no difference are left as they are
    for v in ("inconclusive at this scale", "equivalent (within +-0.01)", "no harm (below +0.005)"):
        assert decided_verdict(v, 0.5, 5) == v and not is_decided(v)


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
    # diffs -0.10, -0.08, +0.02, -0.09: as extreme as |sum| 0.25 when flipping 0.02 alone or nothing, 4 of 16
    assert r.sign_flip_p == pytest.approx(4 / 16)
    table = paired_table(rows)
    assert "3 of 4" in table and f"{mean:+.4f}" in table and "0: -0.1000" in table
    assert "exact sign-flip p" in table and "| 0.2500 |" in table
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
        p.write_text(
            f'[run]\nname = "{arm}"\nout_dir = "{tmp_path / "runs" / arm}"\n[model]\nfamily = "qwen3"\n'
            f'[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n'
        )
        configs.append(str(p))
    calls = []

    def fake_train(cfg, progress=False):
        calls.append(cfg.run.name)
        arm = cfg.run.name.split("-")[0]
        lr = cfg.optim.overrides["attention"]["lr"]
        val = 5.0 + math.log2(lr / optimum[arm]) ** 2 / 10 + 0.001 * cfg.run.seed - (0.05 if arm == "b" else 0.0)
        write_run(cfg.out_path, cfg.run.name, cfg.run.seed, val, extra={"overrides": cfg.optim.overrides})

    mults = [0.25, 1.0, 4.0]
    with pytest.raises(ValueError, match="also tuning seeds"):  # tuning on the judging seeds is refused
        sweep(configs, mults, seeds=[0, 1], roles=["attention"], train_fn=fake_train, progress=False)
    assert not calls
    arms = sweep(
        configs, mults, seeds=[0, 1], roles=["attention"], train_fn=fake_train, progress=False, allow_overlap=True
    )
    assert len(calls) == 2 * 3 * 2
    assert arms[0].base_lrs == {"attention": 0.02}
    # resumable: nothing retrains
    again = sweep(
        configs,
        mults,
        seeds=[0, 1],
        roles=["attention"],
        train_fn=lambda *a, **k: 1 / 0,
        progress=False,
        allow_overlap=True,
    )
    assert again[1].runs == arms[1].runs
    report = tmp_path / "report" / "report.md"
    text = sweep_report(arms, baseline="a", out=report, command="equiopt compare a.toml b.toml --sweep-lr 0.25,1,4")
    assert text.startswith("**Seed overlap: evaluation seed(s) 0, 1 also chose the learning rates")
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


def test_sweep_tunes_on_its_tuning_seeds_then_judges_on_the_evaluation_seeds_only(tmp_path):
    # arm 'a' is best at 0.02 (multiplier 1); tuning seed 0 alone decides, seeds 1-2 run only there
    p = tmp_path / "a.toml"
    p.write_text(
        f'[run]\nname = "a"\nout_dir = "{tmp_path / "runs" / "a"}"\n[model]\nfamily = "qwen3"\n'
        f'[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n'
    )
    calls = []

    def fake_train(cfg, progress=False):
        lr = cfg.optim.overrides["attention"]["lr"]
        calls.append((round(lr / 0.02, 6), cfg.run.seed))
        # seeds 1 and 2 would prefer multiplier 4 if they were looked at: they must not be
        val = 5.0 + math.log2(lr / 0.02) ** 2 / 10 - (1.0 if cfg.run.seed and lr > 0.05 else 0.0)
        write_run(cfg.out_path, cfg.run.name, cfg.run.seed, val)

    arms = sweep(
        [str(p)],
        [0.25, 1.0, 4.0],
        seeds=[1, 2],
        roles=["attention"],
        train_fn=fake_train,
        progress=False,
        tune_seeds=[0],
    )
    assert calls == [(0.25, 0), (1.0, 0), (4.0, 0), (1.0, 1), (1.0, 2)]
    assert sorted(arms[0].runs[1.0]) == [0, 1, 2] and sorted(arms[0].runs[4.0]) == [0]
    assert arms[0].tune_seeds == [0] and arms[0].eval_seeds == [1, 2]
    text = sweep_report(arms, baseline="a")
    assert "Tuning seeds: 0; evaluation seeds: 1, 2" in text and "Seed overlap" not in text
    assert "| a | 1 **(chosen)** |" in text
    assert "| a | 1 | 5.0000 | 0.0000 | 1: 5.0000, 2: 5.0000 |" in text  # judged on seeds 1, 2, not seed 0
    with pytest.raises(ValueError, match="evaluation seed\\(s\\) 1 are also tuning seeds"):
        sweep([str(p)], [1.0], seeds=[1, 3], roles=["attention"], train_fn=fake_train, progress=False, tune_seeds=2)


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
    cli.main(
        [
            "compare",
            "cfg/a.toml",
            "cfg/b.toml",
            "--seeds",
            "3",
            "--baseline",
            "cfg/a.toml",
            "--report",
            str(report),
            "--out",
            str(tmp_path / "plots"),
        ]
    )
    out = capsys.readouterr().out
    assert "2 of 3" in out and "mean diff in val/loss vs a" in out
    text = report.read_text()
    assert "equiopt compare cfg/a.toml" in text and "2 of 3" in text and str(tmp_path / "runs" / "b-s2") in text


# ------------------------------------------------------------- runs done and time left
RUN_LINE = r"\[(\d+)/(\d+) runs\] (done|reused): (\S+) \(([^)]*)\)(; ~(.+) left)?"


def _run_lines(err: str):
    import re

    lines = [ln for ln in err.splitlines() if ln.startswith("[")]
    matches = [re.fullmatch(RUN_LINE, ln) for ln in lines]
    assert all(matches), lines
    return [(int(m[1]), int(m[2]), m[3], m[4], m[7]) for m in matches]


def test_run_progress_counts_runs_and_estimates_from_trained_runs_only(monkeypatch):
    import io

    from equiopt.study.paired import RunProgress

    monkeypatch.delenv("RANK", raising=False)
    now = [0.0]
    out = io.StringIO()
    runs = RunProgress(5, stream=out, clock=lambda: now[0])
    lines = []
    for name, seconds, reused in (
        ("a", 60, False),
        ("b", 1, True),
        ("c", 60, False),
        ("d", 180, False),
        ("e", 60, False),
    ):
        now[0] += seconds
        lines.append(runs.done(name, reused))
    assert lines == [
        "[1/5 runs] done: a (60 s); ~4 min left",
        "[2/5 runs] reused: b (already finished); ~3 min left",
        "[3/5 runs] done: c (60 s); ~2 min left",
        "[4/5 runs] done: d (3 min); ~2 min left",
        "[5/5 runs] done: e (60 s)",
    ]
    assert out.getvalue().splitlines() == lines
    # runs side by side: the line shows the run's own time, the estimate the time between runs done
    side = RunProgress(4, stream=io.StringIO(), clock=lambda: now[0])
    now[0] += 20
    assert side.done("f", seconds=240) == "[1/4 runs] done: f (4 min); ~60 s left"
    # nothing trained yet: no estimate
    assert RunProgress(2, stream=io.StringIO()).done("x", reused=True) == "[1/2 runs] reused: x (already finished)"
    # only the main process reports
    quiet = io.StringIO()
    monkeypatch.setenv("RANK", "1")
    RunProgress(1, stream=quiet).done("y")
    monkeypatch.delenv("RANK")
    RunProgress(1, stream=quiet, enabled=False).done("y")
    assert quiet.getvalue() == ""


def test_run_progress_is_a_tqdm_bar_on_a_terminal(monkeypatch):
    import io

    pytest.importorskip("tqdm")
    from equiopt.study.paired import RunProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("RANK", raising=False)
    term = Terminal()
    runs = RunProgress(3, stream=term)
    for name in ("a", "b", "c"):
        runs.done(name)
    text = term.getvalue()
    assert "runs: 3/3" in text and "done: c" in text and "[3/3 runs]" not in text


def test_sweep_shows_runs_done_of_total_and_resumes_as_reused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    configs = []
    for arm in ("a", "b"):
        p = tmp_path / f"{arm}.toml"
        p.write_text(
            f'[run]\nname = "{arm}"\nout_dir = "{tmp_path / "runs" / arm}"\n[model]\nfamily = "qwen3"\n'
            f'[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n'
        )
        configs.append(str(p))

    def fake_train(cfg, progress=False):
        write_run(cfg.out_path, cfg.run.name, cfg.run.seed, 5.0 + cfg.optim.overrides["attention"]["lr"])

    # 2 arms x (2 multipliers on seed 0 + seeds 1, 2 at the chosen 0.5) = 8 runs
    names = [f"{arm}-{tag}" for arm in ("a", "b") for tag in ("lrx0.5-s0", "lrx2-s0", "lrx0.5-s1", "lrx0.5-s2")]
    sweep(configs, [0.5, 2.0], seeds=[1, 2], roles=["attention"], train_fn=fake_train, tune_seeds=[0])
    lines = _run_lines(capsys.readouterr().err)
    assert [(i, n, kind, name) for i, n, kind, name, _ in lines] == [
        (i + 1, 8, "done", nm) for i, nm in enumerate(names)
    ]
    assert all(left for *_, left in lines[:-1]) and lines[-1][4] is None
    # resumed: every run is reused, and with nothing trained there is no estimate
    (tmp_path / "runs" / "b" / "lrx2-s0" / "log.jsonl").unlink()
    sweep(configs, [0.5, 2.0], seeds=[1, 2], roles=["attention"], train_fn=fake_train, tune_seeds=[0])
    lines = _run_lines(capsys.readouterr().err)
    kinds = [(i, kind, name, left is not None) for i, _, kind, name, left in lines]
    assert kinds == [
        (1, "reused", names[0], False),
        (2, "reused", names[1], False),
        (3, "reused", names[2], False),
        (4, "reused", names[3], False),
        (5, "reused", names[4], False),
        (6, "done", names[5], True),
        (7, "reused", names[6], True),
        (8, "reused", names[7], False),
    ]


def test_cli_compare_shows_runs_done_of_total(tmp_path, monkeypatch, capsys):
    import os

    from equiopt import cli

    monkeypatch.delenv("RANK", raising=False)
    for seed in (0, 1):  # arm a finished in an earlier invocation: reused
        write_run(tmp_path / "runs" / f"a-s{seed}", f"a-s{seed}", seed, 5.0, recipe="paper:qwen3:a-i")
        os.utime(tmp_path / "runs" / f"a-s{seed}" / "log.jsonl", (1e9, 1e9))

    def fake_run_seed(config, sets, seed, force):
        arm = Path(config).stem
        out = tmp_path / "runs" / f"{arm}-s{seed}"
        if not (out / "log.jsonl").exists():
            write_run(out, f"{arm}-s{seed}", seed, 4.9 + seed, recipe="paper:qwen3:a-ii")
        return [str(out)]

    monkeypatch.setattr(cli, "_run_seed", fake_run_seed)
    cli.main(["compare", "cfg/a.toml", "cfg/b.toml", "--seeds", "2", "--out", str(tmp_path / "plots")])
    lines = _run_lines(capsys.readouterr().err)
    assert [(i, n, kind, name, left is not None) for i, n, kind, name, left in lines] == [
        (1, 4, "reused", "a-s0", False),
        (2, 4, "reused", "a-s1", False),
        (3, 4, "done", "b-s0", True),
        (4, 4, "done", "b-s1", False),
    ]
