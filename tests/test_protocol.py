"""Study protocols: parsing with clear errors, the hash in the report, seed-overlap refusal, verdicts."""

import hashlib
import json
import math
from pathlib import Path

import pytest
from test_paired import write_run

from equiopt.study.protocol import load_protocol, verdict

CONFIG = '[run]\nname = "{name}"\nout_dir = "{out}"\n[model]\nfamily = "qwen3"\n[data]\ntrain = "nowhere"\n[optim]\nrecipe = "paper:qwen3:a-i"\n'
# a warm-up within a tenth of the toy runs' 7 steps (equiopt.study.guards)
CONFIG += 'overrides = {{ vector = {{ schedule = {{ kind = "constant" }} }} }}\n'


def _configs(tmp_path, names=("base", "arm")):
    paths = []
    for name in names:
        p = tmp_path / f"{name}.toml"
        p.write_text(CONFIG.format(name=name, out=tmp_path / "runs" / name))
        paths.append(str(p))
    return paths


def _protocol(
    tmp_path,
    configs,
    tuning='[tuning]\nmultipliers = [0.5, 2]\nroles = ["attention"]\nseeds = [100]\n',
    evaluation="seeds = [0, 1, 2]",
    claims=True,
):
    text = (
        "[study]\n"
        'name = "toy"\n'
        'question = "Does arm beat base?"\n'
        f"configs = {json.dumps(configs)}\n"
        'baseline = "base"\n'
        'set = { "train.steps" = 7 }\n'
        f"{tuning}"
        f"[evaluation]\n{evaluation}\n"
        '[analysis]\nstatistic = "paired difference, 95 % t interval"\ndecision = "interval side of 0"\n'
    )
    if claims:
        text += '[[claims]]\narm = "arm"\nsays = "arm is lower"\npaper = "3.1 vs 3.2"\ndirection = "lower"\n'
    p = tmp_path / "protocol.toml"
    p.write_text(text)
    return p


def test_verdict_follows_the_side_of_zero_the_interval_lies_on():
    assert verdict((-0.03, -0.01), "lower") == "reproduces"
    assert verdict((0.01, 0.03), "lower") == "reverses"
    assert verdict((-0.01, 0.02), "lower") == "inconclusive at this scale"
    assert verdict((0.01, 0.03), "higher") == "reproduces"
    assert verdict(None, "lower") == "inconclusive at this scale"
    assert verdict((-0.004, 0.003), "equal", 0.005) == "equivalent (within +-0.005)"
    assert verdict((-0.004, 0.007), "equal", 0.005) == "inconclusive"
    assert verdict((0.001, 0.003), "equal", 0.005) == "equivalent (within +-0.005)"  # small but bounded
    assert verdict((0.004, 0.009), "equal", 0.005) == "differs"
    with pytest.raises(ValueError, match="margin"):
        verdict((0.0, 1.0), "equal")
    # non-inferiority: only the upper end of the interval against the margin matters
    assert verdict((-0.02, 0.004), "not_higher", 0.005) == "no harm (below +0.005)"
    assert verdict((0.001, 0.004), "not_higher", 0.005) == "no harm (below +0.005)"  # worse, but by less
    assert verdict((-0.001, 0.006), "not_higher", 0.005) == "inconclusive"
    assert verdict((0.006, 0.02), "not_higher", 0.005) == "harms (above +0.005)"
    assert verdict(None, "not_higher", 0.005) == "inconclusive"
    with pytest.raises(ValueError, match="margin"):
        verdict((0.0, 1.0), "not_higher")
    with pytest.raises(ValueError, match="direction"):
        verdict((0.0, 1.0), "smaller")


def test_protocol_is_parsed_hashed_and_checked(tmp_path):
    p = _protocol(tmp_path, _configs(tmp_path))
    proto = load_protocol(p)
    assert proto.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    assert proto.tune_seeds == [100] and proto.eval_seeds == [0, 1, 2] and proto.multipliers == [0.5, 2.0]
    assert proto.sets == {"train.steps": 7} and proto.claims[0].direction == "lower"
    # overlapping seeds are refused unless allowed
    p = _protocol(tmp_path, _configs(tmp_path), evaluation="seeds = [100, 1]")
    with pytest.raises(ValueError, match="evaluation seed\\(s\\) 100 are also tuning seeds"):
        load_protocol(p)
    assert load_protocol(p, allow_overlap=True).eval_seeds == [100, 1]
    # without a grid, the seeds the configs' lrs were tuned on are checked the same way
    p = _protocol(tmp_path, _configs(tmp_path), tuning="", evaluation="seeds = [0, 1]\ntuned_on = [1]")
    with pytest.raises(ValueError, match="also tuning seeds"):
        load_protocol(p)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.replace('name = "toy"\n', ""), "field 'name'"),
        (lambda t: t.replace("seeds = [0, 1, 2]", "seeds = []"), "evaluation\\], field 'seeds'"),
        (lambda t: t.replace("seeds = [0, 1, 2]", "seeds = [0, 0]"), "repeated seeds"),
        (lambda t: t.replace("multipliers = [0.5, 2]", "multipliers = [0, 2]"), "field 'multipliers'"),
        (lambda t: t.replace('direction = "lower"', 'direction = "down"'), "claims\\[0\\], field 'direction'"),
        (lambda t: t + "[extra]\n", "unknown section"),
        (lambda t: t.replace("[analysis]\n", "[analysis]\nhypothesis = 1\n"), "unknown field\\(s\\) hypothesis"),
        (lambda t: t.replace("[analysis]\n", "[analysis]\nlevel = 5\n"), "field 'level'"),
        (lambda t: t.replace('"base.toml"', '"missing.toml"').replace("base.toml", "missing.toml"), "does not exist"),
    ],
)
def test_protocol_errors_name_the_section_and_field(tmp_path, edit, match):
    p = _protocol(tmp_path, _configs(tmp_path))
    p.write_text(edit(p.read_text()))
    with pytest.raises(ValueError, match=match):
        load_protocol(p)


def test_compare_runs_a_protocols_sweep_and_reports_hash_and_verdicts(tmp_path, monkeypatch, capsys):
    import equiopt.train.loop as loop
    from equiopt import cli

    monkeypatch.delenv("RANK", raising=False)
    trained = []

    def fake_train(cfg, progress=False):
        trained.append((cfg.run.name, cfg.train.steps))
        arm = cfg.run.name.split("-")[0]
        lr = cfg.optim.overrides["attention"]["lr"]
        val = 5.0 + abs(math.log2(lr / 0.02)) / 10 - (0.05 if arm == "arm" else 0.0) + 0.001 * (cfg.run.seed % 7)
        write_run(cfg.out_path, cfg.run.name, cfg.run.seed, val)

    monkeypatch.setattr(loop, "train", fake_train)
    p = _protocol(tmp_path, _configs(tmp_path))
    report = tmp_path / "report" / "study.md"
    cli.main(["compare", "--protocol", str(p), "--report", str(report)])
    # grid on tuning seed 100 only, then evaluation seeds 0-2 at the chosen multiplier; every run 7 steps
    assert {s for _, s in trained} == {7}
    assert sorted(n for n, _ in trained if n.endswith("-s100")) == sorted(
        f"{a}-lrx{m}-s100" for a in ("base", "arm") for m in ("0.5", "2")
    )
    assert len(trained) == 2 * (2 + 3)
    text = report.read_text()
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    assert f"SHA-256 `{sha}`" in text and "Question: Does arm beat base?" in text
    assert "Tuning seeds: 100; evaluation seeds: 0, 1, 2" in text
    assert "| arm vs base: arm is lower | 3.1 vs 3.2 | -0.0500 [" in text
    # the interval lies below 0, but with 3 seeds the exact sign-flip p is at least 2 / 8: not decided
    undecided = "not decided: interval on the paper's side of 0 (normal theory); exact test cannot decide at n = 3"
    assert f"| 0.2500 | {undecided} |" in text and "exact sign-flip p is below 0.05" in text
    data = json.loads(report.with_suffix(".json").read_text())
    assert data["protocol"]["sha256"] == sha and data["evaluation_seeds"] == [0, 1, 2]
    assert data["verdicts"][0]["interval_verdict"] == "reproduces" and data["verdicts"][0]["verdict"] == undecided
    assert data["verdicts"][0]["sign_flip_p"] == pytest.approx(0.25) and data["paired"][0]["seeds"] == [0, 1, 2]
    # the protocol fixes what it runs: flags that would change it are refused
    with pytest.raises(SystemExit, match="the protocol fixes --seeds"):
        cli.main(["compare", "--protocol", str(p), "--seeds", "5"])


def test_compare_refuses_overlapping_seeds_unless_allowed_and_then_says_so_first(tmp_path, monkeypatch, capsys):
    from equiopt import cli

    vals = {"base": [5.0, 5.1, 5.2], "arm": [4.9, 5.0, 5.1]}

    def fake_run_seed(config, sets, seed, force):
        arm = Path(config).stem
        out = tmp_path / "runs" / f"{arm}-s{seed}"
        write_run(
            out, f"{arm}-s{seed}", seed, vals[arm][seed], recipe=f"paper:qwen3:{'a-i' if arm == 'base' else 'a-ii'}"
        )
        return [str(out)]

    monkeypatch.setattr(cli, "_run_seed", fake_run_seed)
    p = _protocol(tmp_path, _configs(tmp_path), tuning="", evaluation="seeds = [0, 1, 2]\ntuned_on = [0]")
    with pytest.raises(SystemExit, match="also tuning seeds"):
        cli.main(["compare", "--protocol", str(p), "--out", str(tmp_path / "plots")])
    report = tmp_path / "r.md"
    cli.main(
        [
            "compare",
            "--protocol",
            str(p),
            "--allow-seed-overlap",
            "--report",
            str(report),
            "--out",
            str(tmp_path / "plots"),
        ]
    )
    text = report.read_text()
    assert text.startswith("**Seed overlap: evaluation seed(s) 0 also tuned the learning rates")
    assert "| arm vs base: arm is lower | 3.1 vs 3.2 |" in text


def test_sweep_flags_need_disjoint_seeds(tmp_path, monkeypatch):
    from equiopt import cli

    configs = _configs(tmp_path)
    with pytest.raises(SystemExit, match="also tuning seeds"):
        cli.main(["compare", *configs, "--baseline", "base", "--sweep-lr", "1,2", "--seeds", "3", "--tune-seeds", "1"])
    with pytest.raises(SystemExit, match="give the evaluation seeds too"):
        cli.main(["compare", *configs, "--baseline", "base", "--sweep-lr", "1,2", "--tune-seeds", "100"])
    with pytest.raises(SystemExit):
        cli.main(["compare", *configs, "--seeds", "1,1"])


def test_per_config_grids_and_claims_against_another_arm(tmp_path, monkeypatch):
    import equiopt.train.loop as loop
    from equiopt import cli

    monkeypatch.delenv("RANK", raising=False)
    trained = []

    def fake_train(cfg, progress=False):
        trained.append(cfg.run.name)
        arm = cfg.run.name.split("-")[0]
        shift = {"base": 0.0, "arm": -0.05, "other": 0.02}[arm]
        write_run(cfg.out_path, cfg.run.name, cfg.run.seed, 5.0 + shift + 0.001 * (cfg.run.seed % 5))

    monkeypatch.setattr(loop, "train", fake_train)
    configs = _configs(tmp_path, ("base", "arm", "other"))
    p = _protocol(
        tmp_path,
        configs,
        tuning=f'[tuning]\nmultipliers = [1]\nroles = ["attention"]\nseeds = [100]\ngrids = {{ "{configs[1]}" = [0.5, 1, 2] }}\n',
    )
    p.write_text(
        p.read_text()
        + '[[claims]]\narm = "other"\nbaseline = "arm"\nsays = "other beats arm"\npaper = "-"\ndirection = "lower"\n'
    )
    report = tmp_path / "r.md"
    cli.main(["compare", "--protocol", str(p), "--report", str(report)])
    assert sorted(n for n in trained if n.startswith("arm-") and n.endswith("s100")) == [
        "arm-lrx0.5-s100",
        "arm-lrx1-s100",
        "arm-lrx2-s100",
    ]
    assert [n for n in trained if n.startswith("base-") and n.endswith("s100")] == ["base-lrx1-s100"]
    text = report.read_text()
    assert "| other vs arm: other beats arm | - | +0.0700 [" in text
    assert "| not decided: interval on the other side of 0 (normal theory); exact test cannot decide at n = 3 |" in text
    p.write_text(p.read_text().replace(f'grids = {{ "{configs[1]}"', 'grids = { "elsewhere.toml"'))
    with pytest.raises(ValueError, match="'elsewhere.toml' is not one of \\[study\\] configs"):
        load_protocol(p)
