"""scripts/lr_transfer.py: the best-lr estimates and the ratio they report."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from test_train import data_dir  # noqa: F401  (a fixture: the tiny corpus of the training tests)


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "lr_transfer.py"
    spec = importlib.util.spec_from_file_location("lr_transfer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(optima: dict, noise: float, seeds: int, label="rms-lazy"):
    """Losses quadratic in log2(lr) around each size's optimum, plus per-seed noise that is
    the same at every lr of a seed (an offset) and a smaller independent part."""
    g = torch.Generator().manual_seed(0)
    grid = [0.008 * 2 ** (k / 2) for k in range(9)]
    rows = []
    for (vocab, width), best in optima.items():
        for seed in range(seeds):
            offset = float(torch.randn(1, generator=g)) * 0.02
            for lr in grid:
                loss = 5.0 + 0.01 * (math.log2(lr) - math.log2(best)) ** 2 + offset
                loss += noise * float(torch.randn(1, generator=g))
                rows.append(
                    {
                        "vocab": str(vocab),
                        "width": str(width),
                        "scale": label,
                        "lr": str(lr),
                        "seed": str(seed),
                        "val_loss": str(loss),
                    }
                )
    return rows


def test_fits_recover_each_sizes_optimum_and_the_ratio():
    lt = _script()
    optima = {(1024, 32): 0.02, (1024, 64): 0.03, (4096, 32): 0.045}
    s = lt.summarise(_rows(optima, noise=0.0, seeds=3))["rms-lazy"]
    for (vocab, width), best in optima.items():
        b = s["best"][f"v{vocab}-d{width}"]
        assert b["fit_lr"] == pytest.approx(best, rel=1e-6)
        assert b["fit5_lr"] == pytest.approx(best, rel=1e-6)
        assert b["seeds"] == 3
    assert s["fit_lr_ratio_max_over_min"] == pytest.approx(0.045 / 0.02, rel=1e-6)
    lo, mid, hi = s["fit_lr_ratio_bootstrap_2.5_50_97.5"]
    assert lo == pytest.approx(2.25, rel=1e-6) and hi == pytest.approx(2.25, rel=1e-6)  # no noise: no spread


def test_bootstrap_interval_widens_with_noise_and_keeps_seeds_paired():
    lt = _script()
    optima = {(1024, 32): 0.03, (1024, 64): 0.03}
    # seed offsets alone (the same at every lr) move no optimum: pairing keeps the ratio 1
    paired = lt.summarise(_rows(optima, noise=0.0, seeds=4))["rms-lazy"]
    assert paired["fit_lr_ratio_bootstrap_2.5_50_97.5"][2] == pytest.approx(1.0, rel=1e-6)
    noisy = lt.summarise(_rows(optima, noise=0.004, seeds=4))["rms-lazy"]
    lo, mid, hi = noisy["fit_lr_ratio_bootstrap_2.5_50_97.5"]
    assert 1.0 <= lo <= mid <= hi and hi > 1.1


def test_update_size_labels():
    lt = _script()
    assert lt.update_size("rms-lazy") == {"scale": "rms", "lazy": True}
    assert lt.update_size("rms-alpha0") == {"scale": "rms", "alpha": 0.0}
    assert lt.update_size("nu") == {"scale": "nu"}
    assert lt.update_size("row-lazy") == {"rule": "row", "eta": "rms", "lazy": True}
    with pytest.raises(SystemExit, match="unknown update size"):
        lt.update_size("rms-lazy-alpha0")


def test_head_lr_scales_inversely_with_width_and_the_config_builds():
    from types import SimpleNamespace

    from equiopt.train.config import from_dict

    lt = _script()
    args = SimpleNamespace(
        runs="runs/x",
        data="data/poetry-bpe{vocab}",
        seq_len=64,
        batch_size=16,
        steps=60,
        val_batches=8,
        head_lr=1e-3,
        head_lr_base_width=64,
    )
    lrs = {
        w: from_dict(lt.run_config(args, 1024, w, "rms-lazy", 0.032, 0), source="t").optim.overrides["lm_head"]["lr"]
        for w in (32, 64, 256)
    }
    assert lrs == {32: pytest.approx(2e-3), 64: pytest.approx(1e-3), 256: pytest.approx(2.5e-4)}
    args.head_lr_base_width, args.head_lr = None, 4e-3
    assert lt.run_config(args, 1024, 256, "rms", 0.032, 0)["optim"]["overrides"]["lm_head"]["lr"] == 4e-3


def test_noise_only_ratio_tells_a_moved_optimum_from_seed_scatter():
    lt = _script()
    same = lt.summarise(_rows({(1024, 32): 0.03, (1024, 64): 0.03, (4096, 32): 0.03}, noise=0.004, seeds=6))["rms-lazy"]
    lo, mid, hi = same["fit_lr_noise_only_ratio_2.5_50_97.5"]
    assert 1.0 <= lo <= mid <= hi
    assert lo <= same["fit_lr_ratio_max_over_min"] <= hi  # no optimum moved: the observed spread is noise
    moved = lt.summarise(_rows({(1024, 32): 0.02, (1024, 64): 0.03, (4096, 32): 0.06}, noise=0.001, seeds=6))[
        "rms-lazy"
    ]
    assert moved["fit_lr_noise_only_ratio_2.5_50_97.5"][2] < 2.0 < moved["fit_lr_ratio_bootstrap_2.5_50_97.5"][0]
    for (vocab, width), best in {(1024, 32): 0.02, (1024, 64): 0.03, (4096, 32): 0.06}.items():
        q = moved["best"][f"v{vocab}-d{width}"]["fit_lr_bootstrap_2.5_50_97.5"]
        assert q[0] <= best * 1.05 and q[2] >= best / 1.05 and q[2] / q[0] < 1.5
    exact = lt.summarise(_rows({(1024, 32): 0.02, (1024, 64): 0.03}, noise=0.0, seeds=3))["rms-lazy"]
    assert exact["best"]["v1024-d32"]["fit_lr_bootstrap_2.5_50_97.5"] == pytest.approx([0.02] * 3, rel=1e-6)
    assert exact["fit_lr_noise_only_ratio_2.5_50_97.5"] == pytest.approx([1.0] * 3, rel=1e-6)


def test_muon_lr_reaches_every_attention_and_mlp_matrix_and_nothing_else():
    from types import SimpleNamespace

    from equiopt import models
    from equiopt.roles import build_optimizer
    from equiopt.train.config import from_dict

    lt = _script()
    args = SimpleNamespace(
        runs="runs/x",
        data="data/poetry-bpe{vocab}",
        seq_len=64,
        batch_size=16,
        steps=60,
        val_batches=8,
        head_lr=1e-3,
        head_lr_base_width=None,
        muon_lr=0.0123,
    )
    cfg = from_dict(lt.run_config(args, 256, 32, "rms-lazy", 0.032, 0), source="t")
    model = models.build("qwen3", "tiny", **cfg.model.overrides)
    opt, _ = build_optimizer(model, cfg.optim.recipe, total_steps=60, overrides=cfg.optim.overrides)
    roles = {r.name: r.role for r in opt.role_table}
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    by_role = {}
    for name, p in model.named_parameters():
        by_role.setdefault(roles[name], set()).add(round(lr_of[id(p)], 9))
    for role in lt.MUON_ROLES:
        assert by_role[role] == {0.0123}, role
    assert by_role["embedding"] == {0.032}
    assert cfg.model.overrides.get("initializer_range") is None
    args.init_base_width = 64
    stds = {
        w: lt.run_config(args, 256, w, "rms-lazy", 0.032, 0)["model"]["overrides"]["initializer_range"]
        for w in (32, 256)
    }
    assert stds == {32: pytest.approx(0.02 * 2**0.5), 256: pytest.approx(0.01)}
    wide = models.build("qwen3", "tiny", **lt.run_config(args, 256, 256, "rms-lazy", 0.032, 0)["model"]["overrides"])
    assert wide.model.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(0.01, rel=0.05)
    args.muon_lr = None
    assert not set(lt.MUON_ROLES) & set(lt.run_config(args, 256, 32, "rms-lazy", 0.032, 0)["optim"]["overrides"])


def test_residual_probe_counts_the_rows_a_step_touches(data_dir, tmp_path, one_thread):
    from types import SimpleNamespace

    from equiopt.data.loader import TokenLoader

    lt = _script()
    args = SimpleNamespace(
        runs=str(tmp_path / "runs"),
        data=str(data_dir),
        seq_len=16,
        batch_size=8,
        steps=4,
        val_batches=2,
        head_lr=1e-3,
        head_lr_base_width=None,
        muon_lr=None,
    )
    before, after = lt.residual_scales(args, 384, 32, "rms-lazy", 0.05)
    loader = iter(TokenLoader(str(data_dir), 8, 16, split="train", seed=0))
    expected = sum(next(loader)[0].unique().numel() for _ in range(4)) / 4
    assert after["distinct tokens per training batch"] == pytest.approx(expected, abs=0.05)
    assert before["embedding"] == pytest.approx(0.02, rel=0.1)  # the model's init std
    assert after["embedding"] > 5 * before["embedding"]  # four steps of RMS about 0.05 each
    assert {f"{kind} {i}" for kind in ("attention", "mlp", "residual") for i in (0, 1)} <= set(after)


def test_setting_table_means_over_seeds_and_names_the_best_setting():
    lt = _script()

    def row(width, lr, seed, loss, scale="rms-lazy"):
        return {
            "vocab": "1024",
            "width": str(width),
            "scale": scale,
            "lr": str(lr),
            "seed": str(seed),
            "val_loss": str(loss),
        }

    a = [row(32, 0.0453, 0, 5.0), row(32, 0.0453, 1, 5.2), row(64, 0.0453, 0, 4.0), row(32, 0.0453, 0, 1.0, "nu")]
    b = [row(32, 0.0453, 0, 5.05), row(32, 0.0453, 1, 5.05), row(64, 0.0453, 0, float("nan")), row(64, 0.032, 0, 1.0)]
    with pytest.raises(SystemExit, match="width 64 has embedding lrs"):
        lt.setting_table([("a", a), ("b", b)], "rms-lazy")
    lines = lt.setting_table([("a", a), ("b", b)], "rms-lazy", lr=0.0453).splitlines()
    assert lines[2] == "| 1024 | 32 | 5.1000 (2) | 5.0500 (2) | b |"
    assert lines[3] == "| 1024 | 64 | 4.0000 (1) | inf (1) | a |"
    only_seed_0 = lt.setting_table([("a", a), ("b", b)], "rms-lazy", lr=0.0453, seeds={0}).splitlines()
    assert only_seed_0[2] == "| 1024 | 32 | 5.0000 (1) | 5.0500 (1) | a |"
