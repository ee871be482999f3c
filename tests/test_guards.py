"""equiopt.study.guards and equiopt.study.twofactor: designs that cannot mislead."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from equiopt.study.guards import (
    design_problems,
    hidden_rms_change,
    hidden_training_problem,
    hold_untrained,
    runs_pending,
    shared_multiplier_problems,
    source_problems,
    warmup_problems,
)
from equiopt.study.paired import sweep
from equiopt.study.protocol import load_protocol
from equiopt.study.twofactor import gap_lines, hidden_lines, sweep_two

ROOT = Path(__file__).resolve().parents[1]


def write_run(path: Path, seed: int, val: float, hidden_rms=(0.02, 0.08), vals=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"run": {"name": path.name, "seed": seed, "out_dir": str(path)}}))
    recs = [{"kind": "meta", "step": 0, "tokens": 0}]
    for step, rms in zip((10, 20), hidden_rms):
        recs.append({"kind": "train", "step": step, "loss": val, "weight_rms/attention": rms, "weight_rms/mlp_in": rms})
    for step, v in (vals or {20: val}).items():
        recs.append({"kind": "val", "step": step, "val/loss": v})
    recs.append({"kind": "end", "step": 20, "status": "done"})
    (path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def config(path: Path, name: str, steps: int = 150, extra: str = "", header: str = "") -> str:
    path.write_text(
        f'{header}[run]\nname = "{name}"\nout_dir = "{path.parent / "runs" / name}"\n[model]\nfamily = "qwen3"\n'
        f'[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n{extra}[train]\nsteps = {steps}\n'
    )
    return str(path)


def protocol(tmp_path: Path, configs: list[str], tuning: str) -> Path:
    p = tmp_path / "protocol.toml"
    listed = ", ".join(f'"{c}"' for c in configs)
    p.write_text(
        f'[study]\nname = "t"\nquestion = "q"\nconfigs = [{listed}]\nbaseline = "a"\n'
        f"{tuning}\n[evaluation]\nseeds = [10, 11]\n"
    )
    return p


# ------------------------------------------------------------------ (a) warm-up
def test_a_warmup_longer_than_a_tenth_of_the_run_is_found(tmp_path):
    long = config(tmp_path / "a.toml", "a", steps=150)
    (problem,) = warmup_problems(long)
    assert "'vector' warms up for 100 of 150 steps" in problem and "warmup_steps = 15" in problem
    short = config(
        tmp_path / "b.toml",
        "b",
        steps=150,
        extra='overrides = { vector = { schedule = { kind = "warmup_cosine", warmup_steps = 15 } } }\n',
    )
    assert warmup_problems(short) == []
    assert warmup_problems(long, {"train.steps": 1000}) == []  # 100 of 1,000: a tenth


def test_a_compare_refuses_a_long_warmup_before_any_run(tmp_path, capsys):
    from equiopt.cli import main

    p = protocol(
        tmp_path, [config(tmp_path / "a.toml", "a")], '[tuning]\nmultipliers = [1]\nroles = ["attention"]\nseeds = [0]'
    )
    with pytest.raises(SystemExit, match="(?s)refused before any run.*warms up for 100 of 150"):
        main(["compare", "--protocol", str(p)])
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ (b) source
def test_b_a_study_config_that_lost_its_sources_override_is_found(tmp_path):
    src = tmp_path / "configs" / "cpu" / "fam"
    src.mkdir(parents=True)
    config(src / "a-ii.toml", "a-ii", steps=400, extra='overrides = { embedding = { scale = "rms", lr = 0.02 } }\n')
    header = "# CPU-scale study config: configs/cpu/fam/a-ii.toml with 150 steps, no checkpoints.\n"
    lost = config(
        tmp_path / "lost.toml", "x", header=header, extra='overrides = { "*" = { polar_dtype = "float32" } }\n'
    )
    problems = source_problems(lost, tmp_path)
    assert len(problems) == 2 and any(
        "optim.overrides.embedding.scale = 'rms'" in p and "missing" in p for p in problems
    )
    kept = config(
        tmp_path / "kept.toml",
        "x",
        header=header,
        extra='overrides = { "*" = { polar_dtype = "float32" }, embedding = { scale = "rms", lr = 0.02 } }\n',
    )
    assert source_problems(kept, tmp_path) == []  # steps and an added precision pin are the study's own
    changed = config(
        tmp_path / "changed.toml", "x", header=header, extra='overrides = { embedding = { scale = "rms", lr = 1.0 } }\n'
    )
    (p,) = source_problems(changed, tmp_path)
    assert "optim.overrides.embedding.lr = 1.0 where its source" in p


def test_b_the_gpu_studys_a_ii_config_is_found_and_the_cpu_ones_pass():
    problems = source_problems(ROOT / "results/study/qwen3_gpu/configs/a-ii.toml", ROOT)
    assert any("optim.overrides.embedding.scale" in p for p in problems)
    for arm in ("a-i", "a-ii", "a-iii"):
        assert source_problems(ROOT / f"results/study/qwen3_a_heldout/configs/{arm}.toml", ROOT) == []


# ------------------------------------------------------------------ (c) hidden layers training
def test_c_hidden_weights_that_barely_move_are_found(tmp_path):
    write_run(tmp_path / "still", 0, 5.0, hidden_rms=(0.020, 0.0208))
    write_run(tmp_path / "moving", 0, 5.0, hidden_rms=(0.020, 0.08))
    assert hidden_rms_change(tmp_path / "still")["attention"] == pytest.approx(0.04)
    assert "barely train" in hidden_training_problem("a", [tmp_path / "still"], 0.1)
    assert hidden_training_problem("a", [tmp_path / "moving"], 0.1) is None


def test_c_a_sweep_holds_the_evaluation_runs_of_an_arm_whose_hidden_layers_do_not_train(tmp_path):
    calls = []

    def fake_train(cfg, progress=False):
        calls.append(cfg.run.name)
        still = cfg.run.name.startswith("b")
        write_run(cfg.out_path, cfg.run.seed, 5.0, hidden_rms=(0.02, 0.0201 if still else 0.05))

    configs = [config(tmp_path / "a.toml", "a"), config(tmp_path / "b.toml", "b")]
    p = protocol(tmp_path, configs, '[tuning]\nmultipliers = [1]\nroles = ["attention"]\nseeds = [0]')
    held: dict[str, str] = {}
    sweep(
        configs,
        [1.0],
        [10, 11],
        roles=["attention"],
        train_fn=fake_train,
        progress=False,
        tune_seeds=[0],
        hold=hold_untrained(load_protocol(p), held),
    )
    assert sorted(calls) == ["a-lrx1-s0", "a-lrx1-s10", "a-lrx1-s11", "b-lrx1-s0"]
    assert list(held) == ["b"] and "barely train" in held["b"]


# ------------------------------------------------------------------ (d) one multiplier, several roles
def test_d_one_multiplier_over_embedding_and_head_needs_a_reason(tmp_path):
    c = config(tmp_path / "a.toml", "a", extra='overrides = { vector = { schedule = { kind = "constant" } } }\n')
    shared = '[tuning]\nmultipliers = [1, 2]\nroles = ["embedding", "lm_head"]\nseeds = [0]'
    (problem,) = design_problems(load_protocol(protocol(tmp_path, [c], shared)))
    assert "shared_because" in problem and "embedding, lm_head" in problem
    reasoned = shared + '\nshared_because = "the recipe fixes their ratio"'
    assert design_problems(load_protocol(protocol(tmp_path, [c], reasoned))) == []
    assert shared_multiplier_problems(["attention", "mlp_in", "mlp_out"]) == []
    assert shared_multiplier_problems(None)  # every role


# ------------------------------------------------------------------ old protocols keep their reports
def test_an_old_protocol_whose_runs_have_all_finished_loads_with_warnings():
    p = load_protocol(ROOT / "results/study/qwen3_a_heldout/protocol.toml")
    problems = design_problems(p, p.sets, ROOT)
    assert problems and not runs_pending(p, p.sets)


# ------------------------------------------------------------------ two-factor tuning
def test_two_factor_tuning_extends_an_edge_and_evaluates_at_both_choices(tmp_path):
    calls = []

    def fake_train(cfg, progress=False):
        o = cfg.optim.overrides
        h, m = o["attention"]["lr"] / 0.02, o["embedding"]["lr"] / 0.5
        calls.append((round(h, 6), round(m, 6), cfg.run.seed))
        val = 5.0 + math.log2(h / 0.4) ** 2 / 10 + math.log2(m / 2) ** 2 / 10 + 0.001 * cfg.run.seed
        write_run(cfg.out_path, cfg.run.seed, val, vals={10: val + 0.1, 20: val})

    c = config(tmp_path / "a.toml", "a")
    kw = dict(progress=False, train_fn=fake_train)
    arms = sweep_two(
        [c], {c: [1, 2, 4]}, ["embedding", "lm_head"], ["attention", "mlp_in", "mlp_out"], {c: [0.5, 1, 2]},
        [10, 11], [0], extend=1, **kw,
    )  # fmt: skip
    (a,) = arms
    assert a.hidden_grid == [0.25, 0.5, 1, 2] and (a.hidden, a.first) == (0.5, 2.0) and not a.held
    assert calls[:4] == [(0.5, 2, 0), (1, 2, 0), (2, 2, 0), (0.25, 2, 0)]
    assert calls[4:] == [(0.5, 1, 0), (0.5, 4, 0), (0.5, 2, 10), (0.5, 2, 11)]
    assert (tmp_path / "runs" / "a" / "hx0.5-lrx2-s10" / "log.jsonl").exists()
    n = len(calls)
    sweep_two(
        [c], {c: [1, 2, 4]}, ["embedding", "lm_head"], ["attention", "mlp_in", "mlp_out"], {c: [0.5, 1, 2]},
        [10, 11], [0], extend=1, **kw,
    )  # fmt: skip
    assert len(calls) == n  # resumable: every choice replayed from the logs
    assert "**(chosen)**" in "\n".join(hidden_lines(arms, [0], "val/loss"))
    gap = "\n".join(gap_lines(arms + arms, [("a", "a")], [10, 11]))
    assert "| 10 | 2 | +0.0000 |" in gap and "| 20 | 2 |" in gap
    held = sweep_two(
        [c], {c: [1, 2, 4]}, ["embedding", "lm_head"], ["attention"], {c: [0.5, 1, 2]}, [10, 11], [0], extend=0, **kw
    )[0]
    assert held.held and "edge" in held.held and held.first is not None


def test_protocol_reads_a_hidden_grid(tmp_path):
    c = config(tmp_path / "a.toml", "a")
    p = protocol(
        tmp_path,
        [c],
        '[tuning]\nmultipliers = [1, 2]\nroles = ["embedding", "lm_head"]\nseeds = [0]\nextend = 2\n'
        'shared_because = "r"\n[tuning.hidden]\nroles = ["attention"]\nmultipliers = [0.5, 1]\n',
    )
    pr = load_protocol(p)
    assert pr.hidden == {"roles": ["attention"], "grids": {c: [0.5, 1.0]}} and pr.extend == 2
    assert pr.shared_because == "r" and pr.min_hidden_rms_change == 0.1
