"""Learning-rate transfer of the embedding's HybridPolarGradM across width and vocabulary.

Small Qwen3-style models (2 layers, widths and vocabularies given on the command line)
train on the poetry corpus tokenised with a byte-level BPE of each vocabulary size
(``equiopt data``, see configs/README.md). Every run uses the recipe
``paper:qwen3:a-ii`` (Muon on attention and MLPs, HybridPolarGradM row-norm/right-spectral
with alpha = 1 on the embedding) with one change that keeps the embedding alone under
test: the LM head uses the paper's (a)(iii) head settings (AdamW, lr 1e-3), and the
AdamW warm-up is shortened to fit the short runs. For each size, the embedding's lr is
swept on a grid for each update size in ``--scales``: ``nu`` (the paper's nu^alpha),
``rms`` (the scale-transferable option ``scale = "rms"``, with the recipe's alpha = 1) and
``rms-alpha0`` (``scale = "rms"`` without the rho^alpha factor). The final validation loss of every run is
written to ``results.csv``; ``summary.json`` has the best lr per size and, per update size,
the statistic that answers "does it transfer": the regression exponents of log2(best lr) on
log2(width) and log2(vocabulary), with seed-bootstrap intervals and an equivalence verdict
against +-0.1 (ratios of extremes are kept for reference: they grow with the number of sizes
and with the seed noise).

The rest of the model can be put in a width-transferable setting: ``--head-lr`` with
``--head-lr-base-width`` (the head's lr as 1 / width), ``--init-base-width`` (init std as
1 / sqrt(width)), ``--muon-lr``. ``--residual`` and ``--stale-rows`` measure one run
instead of sweeping; ``--table`` puts sweeps of another setting side by side.

Resumable: a run whose row is already in ``results.csv`` is skipped. One run at a time,
one thread.

    PYTHONPATH=src python3 scripts/lr_transfer.py --out results/lr_transfer
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import torch

FIELDS = [
    "vocab",
    "width",
    "scale",
    "lr",
    "seed",
    "steps",
    "val_loss",
    "train_loss",
    "emb_weight_rms",
    "emb_update_rms",
    "status",
    "seconds",
]


def model_overrides(vocab: int, width: int) -> dict:
    heads = 4
    return {
        "vocab_size": vocab,
        "hidden_size": width,
        "intermediate_size": 3 * width,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": width // heads,
    }


UPDATE_SIZES = ("nu", "rms", "rms-alpha0", "nu-lazy", "rms-lazy", "row-lazy")
TITLES = {
    "nu": "paper: nu^alpha (alpha = 1)",
    "rms": 'scale = "rms" (alpha = 1)',
    "rms-alpha0": 'scale = "rms", alpha = 0',
    "nu-lazy": "paper's nu^alpha, lazy = True",
    "rms-lazy": 'scale = "rms", lazy = True',
    "row-lazy": 'RowNormM (eta = "rms"), lazy = True',
}


def update_size(label: str) -> dict:
    """Embedding settings of an update-size label ``<scale>[-alpha<a>][-lazy]``: ``nu`` (the
    paper's), ``rms`` (the scale-transferable size with the recipe's alpha = 1),
    ``rms-alpha0`` (it without the rho^alpha factor), and with ``-lazy`` the rows without
    a gradient in the step are not updated (``lazy = True``); ``row-lazy`` replaces the
    hybrid by its first stage alone (RowNormM with rows of unit RMS, ``eta = "rms"``), the
    control without the right-spectral stage."""
    if label not in UPDATE_SIZES:
        raise SystemExit(f"unknown update size {label!r}; valid: {', '.join(UPDATE_SIZES)}")
    if label == "row-lazy":
        return {"rule": "row", "eta": "rms", "lazy": True}
    scale, *rest = label.split("-")
    out: dict = {"scale": scale}
    for part in rest:
        if part == "lazy":
            out["lazy"] = True
        else:
            out["alpha"] = float(part.removeprefix("alpha"))
    return out


def head_lr(args, width: int) -> float:
    """The LM head's AdamW lr: ``--head-lr`` (1e-3), or with ``--head-lr-base-width W`` that
    times W / width, so that the head's logit change per step does not grow with width (an
    Adam step moves each weight by about lr, and a logit sums ``width`` of them: muP's
    1 / fan_in rule for Adam on an output layer)."""
    if args.head_lr_base_width is None:
        return args.head_lr
    return args.head_lr * args.head_lr_base_width / width


def init_std(args, width: int) -> dict:
    """With ``--init-base-width W``: every weight matrix drawn with std 0.02 sqrt(W / width)
    instead of 0.02 at every width, so that a hidden layer's output at initialisation does
    not grow with width (the 1 / sqrt(fan_in) rule of muP and of PyTorch's default; the
    embedding and the LM head follow it too, as the model's one ``initializer_range``)."""
    base = getattr(args, "init_base_width", None)
    return {} if base is None else {"initializer_range": 0.02 * (base / width) ** 0.5}


MUON_ROLES = ("attention", "mlp_in", "mlp_out")


def run_config(args, vocab: int, width: int, scale: str, lr: float, seed: int) -> dict:
    name = f"v{vocab}-d{width}-{scale}-lr{lr:g}-s{seed}"
    muon = {} if getattr(args, "muon_lr", None) is None else {role: {"lr": args.muon_lr} for role in MUON_ROLES}
    return {
        "run": {"name": name, "out_dir": str(Path(args.runs) / name), "seed": seed, "device": "cpu"},
        "model": {
            "family": "qwen3",
            "size": "tiny",
            "overrides": {**model_overrides(vocab, width), **init_std(args, width)},
        },
        "data": {"train": args.data.format(vocab=vocab), "seq_len": args.seq_len, "batch_size": args.batch_size},
        "optim": {
            "recipe": "paper:qwen3:a-ii",
            "overrides": {
                "embedding": {"lr": lr, **update_size(scale)},
                "lm_head": {"rule": "adamw", "lr": head_lr(args, width), "betas": [0.9, 0.95], "weight_decay": 0.0},
                "vector": {"schedule": {"kind": "warmup_cosine", "warmup_steps": max(1, args.steps // 10)}},
                **muon,
            },
        },
        "train": {
            "steps": args.steps,
            "log_every": args.steps,
            "val_every": args.steps,
            "val_batches": args.val_batches,
            "checkpoint_every": 0,
            "tensorboard": False,
        },
    }


def last_train_metrics(out_dir: Path) -> dict:
    found = {}
    path = out_dir / "log.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "train":
                found = rec
    return found


def one_run(args, vocab, width, scale, lr, seed) -> dict:
    from equiopt.train.config import from_dict
    from equiopt.train.loop import NonFiniteLossError, train

    cfg = from_dict(run_config(args, vocab, width, scale, lr, seed), source="lr_transfer")
    start = time.time()
    try:
        result = train(cfg, progress=False)
        status, val = result["status"], result.get("val/loss", float("nan"))
    except NonFiniteLossError:
        status, val = "nonfinite", float("nan")
    tr = last_train_metrics(cfg.out_path)
    return {
        "vocab": vocab,
        "width": width,
        "scale": scale,
        "lr": lr,
        "seed": seed,
        "steps": args.steps,
        "val_loss": val,
        "train_loss": tr.get("loss", float("nan")),
        "emb_weight_rms": tr.get("weight_rms/embedding", float("nan")),
        "emb_update_rms": tr.get("update_rms/embedding", float("nan")),
        "status": status,
        "seconds": round(time.time() - start, 1),
    }


def stale_rows(args, vocab: int, width: int, label: str, lr: float, seed: int = 0) -> list[dict]:
    """Train one run and group the embedding's rows by how many steps ago their token was
    last in a batch: rows, median count of batches seen, median norm of the momentum and
    of the weights at the end (what ``lazy`` is about: rows that keep moving unseen)."""
    from equiopt.train.config import from_dict
    from equiopt.train.loop import Trainer

    cfg = from_dict(run_config(args, vocab, width, label, lr, seed), source="lr_transfer --stale-rows")
    trainer = Trainer(cfg, progress=False)
    weight = trainer.model.get_input_embeddings().weight
    last = torch.full((weight.shape[0],), -1)
    count = torch.zeros(weight.shape[0])
    step = [0]

    def seen(grad):
        rows = grad.ne(0).any(dim=1)
        last[rows] = step[0]
        count[rows] += 1
        step[0] += 1

    weight.register_hook(seen)
    trainer.run()
    momentum = trainer.optimizer.state[weight]["momentum_buffer"].norm(dim=1)
    norms = weight.detach().norm(dim=1)
    age = step[0] - 1 - last
    out = []
    for lo, hi in ((0, 1), (1, 5), (5, 20), (20, step[0] + 1), (None, None)):
        rows = (last < 0) if lo is None else (age >= lo) & (age < hi) & (last >= 0)
        if rows.any():
            out.append(
                {
                    "last seen (steps ago)": "never" if lo is None else f"{lo}-{hi - 1}",
                    "rows": int(rows.sum()),
                    "median batches seen": float(count[rows].median()),
                    "median momentum norm": float(momentum[rows].median()),
                    "median weight norm": float(norms[rows].median()),
                }
            )
    return out


def residual_scales(args, vocab: int, width: int, label: str, lr: float, seed: int = 0) -> list[dict]:
    """Train one run and measure what the residual stream is made of, before and after
    training, on the first validation batch: the RMS of the embedding's output, of each
    layer's attention and MLP outputs and of the residual after each layer; and the mean
    number of distinct tokens in a training batch (the rows an embedding step updates)."""
    from equiopt.train.config import from_dict
    from equiopt.train.loop import Trainer

    cfg = from_dict(run_config(args, vocab, width, label, lr, seed), source="lr_transfer --residual")
    trainer = Trainer(cfg, progress=False)
    model = trainer.model
    distinct = []
    model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, inp: distinct.append(int(inp[0].unique().numel())) if model.training else None
    )

    def measure(when: str) -> dict:
        found, hooks = {"when": when}, []

        def keep(name):
            def hook(_m, _inp, out):
                found[name] = round(float((out[0] if isinstance(out, tuple) else out).float().pow(2).mean().sqrt()), 4)

            return hook

        hooks.append(model.get_input_embeddings().register_forward_hook(keep("embedding")))
        for i, layer in enumerate(model.model.layers):
            hooks += [
                layer.self_attn.register_forward_hook(keep(f"attention {i}")),
                layer.mlp.register_forward_hook(keep(f"mlp {i}")),
                layer.register_forward_hook(keep(f"residual {i}")),
            ]
        inputs, _ = next(iter(trainer.val))
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(inputs)
        model.train(was_training)
        for h in hooks:
            h.remove()
        return found

    before = measure("init")
    result = trainer.run()
    after = measure("end")
    after["val_loss"] = round(float(result.get("val/loss", float("nan"))), 4)
    after["distinct tokens per training batch"] = round(sum(distinct) / max(1, len(distinct)), 1)
    return [before, after]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def key(row) -> tuple:
    return (
        int(row["vocab"]),
        int(row["width"]),
        row["scale"],
        float(f"{float(row['lr']):.6g}"),
        int(row["seed"]),
        int(row["steps"]),
    )


def _vertex(lrs: list[float], means: list[float], i: int, half: int = 1) -> float | None:
    """The minimum of the least-squares parabola in log2(lr) through the grid's best point
    ``i`` and up to ``half`` neighbours on each side (``half = 1``: the parabola through
    three points); None at the grid's edge, with a non-finite point, or without a minimum."""
    if i == 0 or i == len(lrs) - 1:
        return None
    lo, hi = max(0, i - half), min(len(lrs), i + half + 1)
    if not all(math.isfinite(m) for m in means[lo:hi]):
        return None
    import numpy as np

    a, b, _ = np.polyfit([math.log2(v) for v in lrs[lo:hi]], means[lo:hi], 2)
    return float(2 ** (-b / (2 * a))) if a > 0 else None


def _best(grid: list[float], means: list[float], half: int = 1) -> tuple[int, float]:
    """Index of the best grid point and the best lr estimate: the parabola vertex, or the
    grid point where there is no vertex (grid edge, non-finite neighbour)."""
    i = min(range(len(grid)), key=lambda j: means[j])
    fit = _vertex(grid, means, i, half)
    return i, grid[i] if fit is None else fit


def _bootstrap(sizes: dict, half: int = 1, draws: int = 2000, seed: int = 0) -> dict | None:
    """Seed bootstrap of the fitted best lrs: each size's seeds are resampled with
    replacement (a resampled seed brings its whole curve, so the lrs of one seed stay
    paired) and the best lr refitted. Returns 2.5 / 50 / 97.5 % points of

    - ``ratio``: max / min of the best lrs over sizes;
    - ``noise_only_ratio``: the same after each size's draws are moved to one common
      optimum (divided by their own median), so that only each size's seed scatter is
      left: the ratio that noise alone gives when no optimum moves. The max / min of
      noisy estimates is biased upward; an observed ratio inside this interval is not
      told apart from no movement at all;
    - ``by_size``: each size's best lr."""
    import numpy as np

    rng = np.random.default_rng(seed)
    curves = {}
    for size, by_lr in sizes.items():
        grid = sorted(by_lr)
        common = sorted(set.intersection(*(set(by_lr[lr]) for lr in grid)))
        if len(common) < 2:
            return None
        curves[size] = (grid, np.array([[by_lr[lr][s] for lr in grid] for s in common]))
    logs = {}
    for size, (grid, losses) in curves.items():
        picks = (losses[rng.integers(0, len(losses), len(losses))].mean(axis=0) for _ in range(draws))
        logs[size] = np.log2([_best(grid, list(m), half)[1] for m in picks])
    table = np.array(list(logs.values()))
    centred = table - np.median(table, axis=1, keepdims=True)

    def points(x):
        return [float(q) for q in np.percentile(x, [2.5, 50, 97.5])]

    return {
        "ratio": points(2 ** (table.max(0) - table.min(0))),
        "noise_only_ratio": points(2 ** (centred.max(0) - centred.min(0))),
        "by_size": {size: points(2**v) for size, v in logs.items()},
        "log2_draws": logs,
    }


# An exponent within +-0.1 changes the best lr by at most 2^0.1 = 7 % per doubling of the size.
TRANSFER_MARGIN = 0.1


def _transfer_verdict(ci: list[float]) -> str:
    lo, hi = ci
    if -TRANSFER_MARGIN <= lo and hi <= TRANSFER_MARGIN:
        return f"transfers (the 95 % interval lies within +-{TRANSFER_MARGIN:g})"
    if lo > TRANSFER_MARGIN or hi < -TRANSFER_MARGIN:
        return f"does not transfer (the 95 % interval lies beyond +-{TRANSFER_MARGIN:g})"
    return f"inconclusive (the 95 % interval crosses +-{TRANSFER_MARGIN:g})"


def slopes(log2_best: dict, draws: dict | None) -> dict:
    """Least-squares exponents of the best lr in width and vocabulary:
    ``log2(best lr) = a + b log2(width) + c log2(vocab)`` over the sizes (a term is left out
    when only one width or one vocabulary was run). ``b = c = 0`` is perfect transfer; each
    exponent comes with the 2.5 / 97.5 % points of its seed bootstrap (the same draws as the
    ratio's) and an equivalence verdict against +-:data:`TRANSFER_MARGIN`.

    ``log2_best``: ``{(vocab, width): log2 of the fitted best lr}``; ``draws``: the same keys,
    each an array of bootstrap draws (or None)."""
    import numpy as np

    sizes = sorted(log2_best)
    terms = [("width", 1), ("vocab", 0)]
    used = [(name, k) for name, k in terms if len({s[k] for s in sizes}) > 1]
    if not used:
        return {}
    X = np.array([[1.0] + [math.log2(s[k]) for _, k in used] for s in sizes])
    if np.linalg.matrix_rank(X) < X.shape[1]:
        return {}
    point = np.linalg.lstsq(X, np.array([log2_best[s] for s in sizes]), rcond=None)[0]
    boot = None
    if draws is not None and all(s in draws for s in sizes):
        Y = np.array([draws[s] for s in sizes])
        boot = np.linalg.lstsq(X, Y, rcond=None)[0]
    out = {}
    for j, (name, _) in enumerate(used, start=1):
        entry = {"slope": float(point[j])}
        if boot is not None:
            ci = [float(q) for q in np.percentile(boot[j], [2.5, 97.5])]
            entry.update({"ci_95": ci, "verdict": _transfer_verdict(ci)})
        out[name] = entry
    return out


def _shared_lr(best: dict) -> dict | None:
    """The one lr of the grid shared by every size whose worst loss above that size's best
    mean is smallest: what using a transferred lr costs instead of tuning each size."""
    shared = set.intersection(*(set(map(float, b["mean_val_loss_by_lr"])) for b in best.values()))
    if not shared:
        return None

    def regrets(lr):
        return {k: b["mean_val_loss_by_lr"][str(lr)] - b["best_val_loss"] for k, b in best.items()}

    lr = min(sorted(shared), key=lambda x: max(regrets(x).values()))
    r = regrets(lr)
    return {"lr": lr, "worst_regret": max(r.values()), "mean_regret": sum(r.values()) / len(r), "regret_by_size": r}


def summarise(rows: list[dict]) -> dict:
    """Best lr per (update size, model size) by mean final validation loss over seeds
    (non-finite = +inf), on the grid and as the vertex of a parabola in log2(lr) through
    the best point and its neighbours; how far each moves across sizes (max / min), and a
    seed-bootstrap interval of the fitted ratio."""
    table: dict = {}
    for r in rows:
        v = float(r["val_loss"])
        v = v if math.isfinite(v) else math.inf
        table.setdefault(r["scale"], {}).setdefault((int(r["vocab"]), int(r["width"])), {}).setdefault(
            float(r["lr"]), {}
        )[int(r["seed"])] = v
    out = {}
    for scale, sizes in table.items():
        best = {}
        for (vocab, width), by_lr in sorted(sizes.items()):
            grid = sorted(by_lr)
            means = [sum(by_lr[lr].values()) / len(by_lr[lr]) for lr in grid]
            i, _ = _best(grid, means)
            best[f"v{vocab}-d{width}"] = {
                "vocab": vocab,
                "width": width,
                "seeds": min(len(v) for v in by_lr.values()),
                "best_lr": grid[i],
                "best_val_loss": means[i],
                "at_grid_edge": i in (0, len(grid) - 1),
                "fit_lr": _vertex(grid, means, i),
                "fit5_lr": _vertex(grid, means, i, half=2),
                "mean_val_loss_by_lr": dict(zip(map(str, grid), means)),
            }
        boot, boot5 = _bootstrap(sizes), _bootstrap(sizes, half=2)
        log2_best = {
            (b["vocab"], b["width"]): math.log2(b["fit_lr"] if b["fit_lr"] is not None else b["best_lr"])
            for b in best.values()
        }
        exponents = slopes(log2_best, boot and boot.pop("log2_draws"))
        if boot5:
            boot5.pop("log2_draws")
        for (vocab, width), q in (boot["by_size"] if boot else {}).items():
            best[f"v{vocab}-d{width}"]["fit_lr_bootstrap_2.5_50_97.5"] = q
        lrs = [b["best_lr"] for b in best.values()]
        fits = [b["fit_lr"] for b in best.values() if b["fit_lr"] is not None]
        fits5 = [b["fit5_lr"] for b in best.values() if b["fit5_lr"] is not None]
        out[scale] = {
            "best": best,
            "best_lr_ratio_max_over_min": max(lrs) / min(lrs),
            "fit_lr_ratio_max_over_min": (max(fits) / min(fits)) if len(fits) == len(lrs) else None,
            "fit5_lr_ratio_max_over_min": (max(fits5) / min(fits5)) if len(fits5) == len(lrs) else None,
            "fit_lr_ratio_bootstrap_2.5_50_97.5": boot and boot["ratio"],
            "fit5_lr_ratio_bootstrap_2.5_50_97.5": boot5 and boot5["ratio"],
            "fit_lr_noise_only_ratio_2.5_50_97.5": boot and boot["noise_only_ratio"],
            "shared_lr": _shared_lr(best),
            "slopes": exponents,
        }
    return out


def setting_table(
    sources: list[tuple[str, list[dict]]], label: str, lr: float | None = None, seeds: set[int] | None = None
) -> str:
    """Markdown table of the mean final validation loss (over seeds; their count in
    brackets) per model size (rows) and per setting (columns: one ``results.csv`` each, as
    ``(name, rows)``), for update size ``label`` at the embedding lr ``lr`` (None: each
    source must hold one lr per size), and the best setting per size. For sweeps of
    another setting (the LM head's lr, the Muon lr) at one embedding lr."""
    means: dict = {}
    for name, rows in sources:
        found: dict = {}
        for r in rows:
            if r["scale"] != label or (lr is not None and not math.isclose(float(r["lr"]), lr, rel_tol=1e-4)):
                continue
            if seeds is not None and int(r["seed"]) not in seeds:
                continue
            v = float(r["val_loss"])
            found.setdefault((int(r["vocab"]), int(r["width"])), {}).setdefault(float(r["lr"]), []).append(
                v if math.isfinite(v) else math.inf
            )
        for size, by_lr in found.items():
            if len(by_lr) > 1:
                raise SystemExit(
                    f"{name}: vocab {size[0]} width {size[1]} has embedding lrs {sorted(by_lr)}; "
                    f"pick one with --table-lr"
                )
            (vals,) = by_lr.values()
            means.setdefault(size, {})[name] = (sum(vals) / len(vals), len(vals))
    names = [n for n, _ in sources]
    lines = ["| vocab | width | " + " | ".join(names) + " | best |", "|---|---|" + "---|" * (len(names) + 1)]
    for (vocab, width), cells in sorted(means.items()):
        row = [f"{cells[n][0]:.4f} ({cells[n][1]})" if n in cells else "-" for n in names]
        best = min(cells, key=lambda n: cells[n][0])
        lines.append(f"| {vocab} | {width} | " + " | ".join(row) + f" | {best} |")
    return "\n".join(lines) + "\n"


def markdown(summary: dict) -> str:
    lines = [
        "| update size | vocab | width | seeds | best lr on the grid | parabola-fit best lr (3 points) | "
        "its seed bootstrap: 95 % interval | (5 points) | best mean val loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scale in UPDATE_SIZES:
        if scale not in summary:
            continue
        for b in summary[scale]["best"].values():
            fit = f"{b['fit_lr']:.3g}" if b["fit_lr"] is not None else "-"
            fit5 = f"{b['fit5_lr']:.3g}" if b.get("fit5_lr") is not None else "-"
            edge = " (grid edge)" if b["at_grid_edge"] else ""
            q = b.get("fit_lr_bootstrap_2.5_50_97.5")
            interval = f"[{q[0]:.3g}, {q[2]:.3g}]" if q else "-"
            lines.append(
                f"| {scale} | {b['vocab']} | {b['width']} | {b['seeds']} | {b['best_lr']:g}{edge} | {fit} | {interval} | {fit5} | "
                f"{b['best_val_loss']:.4f} |"
            )
    lines += [
        "",
        "Transfer as a slope: the least-squares exponents `b`, `c` of `log2(best lr) = a + b log2(width) + "
        "c log2(vocab)` over the sizes (parabola-fit best lrs; `b = c = 0` is perfect transfer), with seed-"
        f"bootstrap 95 % intervals and an equivalence verdict against +-{TRANSFER_MARGIN:g}:",
        "",
        "| update size | exponent in width | 95 % interval | verdict | exponent in vocabulary | 95 % interval | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for scale in UPDATE_SIZES:
        if scale not in summary:
            continue
        cells = []
        for name in ("width", "vocab"):
            e = summary[scale].get("slopes", {}).get(name)
            if e is None:
                cells += ["-", "-", "-"]
                continue
            ci = e.get("ci_95")
            cells += [f"{e['slope']:+.3f}", f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "-", e.get("verdict", "-")]
        lines.append(f"| {scale} | " + " | ".join(cells) + " |")
    lines.append("")
    for scale in UPDATE_SIZES:
        if scale in summary:
            s = summary[scale]
            fit, fit5 = s["fit_lr_ratio_max_over_min"], s.get("fit5_lr_ratio_max_over_min")
            boot, boot5 = s.get("fit_lr_ratio_bootstrap_2.5_50_97.5"), s.get("fit5_lr_ratio_bootstrap_2.5_50_97.5")
            lines.append(
                f"- `{scale}`: best lr max/min across sizes = {s['best_lr_ratio_max_over_min']:.3g} on the grid"
                + (f", {fit:.3g} from the 3-point parabola fits" if fit else "")
                + (f", {fit5:.3g} from the 5-point least-squares fits" if fit5 else "")
                + "".join(
                    f"; seed bootstrap of the {n}-point ratio: median {b[1]:.3g}, 95 % interval "
                    f"[{b[0]:.3g}, {b[2]:.3g}]"
                    for n, b in ((3, boot), (5, boot5))
                    if b
                )
            )
            noise = s.get("fit_lr_noise_only_ratio_2.5_50_97.5")
            if noise:
                lines.append(
                    f"  - noise alone (every size's bootstrap moved to one common optimum) gives a 3-point "
                    f"ratio of {noise[1]:.3g} [{noise[0]:.3g}, {noise[2]:.3g}]"
                )
            shared = s.get("shared_lr")
            if shared:
                lines.append(
                    f"  - one lr for every size: {shared['lr']:g} costs at most {shared['worst_regret']:.4f} "
                    f"(mean {shared['mean_regret']:.4f}) in final loss against each size's best grid point"
                )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Final validation loss (mean over seeds, from :func:`summarise`) minus each size's best
    mean, against the embedding lr: one panel per update size, one curve per model size
    (the same colour in every panel), a star at the best grid point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = [u for u in UPDATE_SIZES if u in summary]
    all_sizes = sorted({(b["vocab"], b["width"]) for u in scales for b in summary[u]["best"].values()})
    colours = {size: f"C{k}" for k, size in enumerate(all_sizes)}
    ncols = min(3, len(scales))
    nrows = -(-len(scales) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(scales) :]:
        ax.set_visible(False)
    for ax, scale in zip(axes.flat, scales):
        for b in summary[scale]["best"].values():
            if not math.isfinite(b["best_val_loss"]):
                continue
            size = (b["vocab"], b["width"])
            lrs = sorted(map(float, b["mean_val_loss_by_lr"]))
            ys = [b["mean_val_loss_by_lr"][str(lr)] - b["best_val_loss"] for lr in lrs]
            ls = "-" if b["vocab"] == max(v for v, _ in all_sizes) else "--"
            ax.plot(
                lrs,
                ys,
                ls,
                marker="o",
                markersize=3,
                color=colours[size],
                label=f"vocab {b['vocab']}, width {b['width']}",
            )
            ax.plot([b["best_lr"]], [0.0], "*", color=colours[size], markersize=12, markeredgecolor="k")
        ax.set_xscale("log")
        ax.set_ylim(-0.005, 0.08)
        ax.set_xlabel("embedding learning rate")
        ax.set_ylabel("final validation loss - best of the size")
        rule = "" if scale == "row-lazy" else "HybridPolarGradM, "
        ax.set_title(f"embedding: {rule}{TITLES[scale]}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/lr_transfer")
    p.add_argument("--runs", default="runs/lr_transfer", help="run directories (logs; not committed)")
    p.add_argument("--data", default="data/poetry-bpe{vocab}")
    p.add_argument("--widths", default="32,64,128")
    p.add_argument("--vocabs", default="1024,4096")
    p.add_argument("--scales", default="rms,nu", help=f"update sizes: {', '.join(UPDATE_SIZES)}")
    p.add_argument("--grid-rms", default="0.004,0.008,0.016,0.032,0.064,0.128")
    p.add_argument("--grid-nu", default="0.001,0.002,0.004,0.008,0.016,0.032")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--head-lr", type=float, default=1e-3, help="the LM head's AdamW lr (default 1e-3)")
    p.add_argument(
        "--head-lr-base-width",
        type=int,
        default=None,
        help="scale the LM head's AdamW lr by this width / the model's width (default: the same at every width)",
    )
    p.add_argument(
        "--init-base-width",
        type=int,
        default=None,
        help="draw the weights with std 0.02 x sqrt(this / width) (default: 0.02 at every width)",
    )
    p.add_argument(
        "--muon-lr",
        type=float,
        default=None,
        help="the Muon lr of the attention and MLP matrices (default: the recipe's 0.02)",
    )
    p.add_argument("--plot-only", action="store_true")
    p.add_argument(
        "--table",
        nargs="+",
        metavar="NAME=RESULTS_CSV",
        help="instead of sweeping: print the mean final loss per size of each results.csv, side by side "
        "(one column per setting), for --scales (one label) at --table-lr and the --seeds given",
    )
    p.add_argument("--table-lr", type=float, default=None, help="the embedding lr the --table rows are taken at")
    p.add_argument(
        "--residual",
        metavar="VOCAB,WIDTH,LABEL,LR",
        help="instead of sweeping: train one run and print the RMS of the embedding's and each block's "
        "output in the residual stream, before and after",
    )
    p.add_argument(
        "--stale-rows",
        metavar="VOCAB,WIDTH,LABEL,LR",
        help="instead of sweeping: train one run and print its embedding rows grouped by when they were last seen",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.table:
        pairs = [item.split("=", 1) for item in args.table]
        if any(len(pair) != 2 for pair in pairs):
            raise SystemExit("--table takes NAME=RESULTS_CSV pairs")
        sources = [(name, read_rows(Path(path))) for name, path in pairs]
        seeds = None if args.seeds == "all" else {int(x) for x in args.seeds.split(",")}
        print(setting_table(sources, args.scales, args.table_lr, seeds), end="")
        return 0
    for probe, option in ((stale_rows, args.stale_rows), (residual_scales, args.residual)):
        if option:
            vocab, width, label, lr = option.split(",")
            for row in probe(args, int(vocab), int(width), label, float(lr)):
                print(json.dumps(row))
            return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    rows = read_rows(csv_path)
    done = {key(r) for r in rows}
    if not args.plot_only:
        grids = {label: args.grid_nu if label.startswith("nu") else args.grid_rms for label in UPDATE_SIZES}
        for seed in [int(s) for s in args.seeds.split(",")]:
            for vocab in [int(v) for v in args.vocabs.split(",")]:
                for width in [int(w) for w in args.widths.split(",")]:
                    for scale in args.scales.split(","):
                        for lr in [float(x) for x in grids[scale].split(",")]:
                            k = (vocab, width, scale, float(f"{lr:.6g}"), seed, args.steps)
                            if k in done:
                                continue
                            row = one_run(args, vocab, width, scale, lr, seed)
                            print(json.dumps(row), flush=True)
                            new = not csv_path.exists()
                            with csv_path.open("a", newline="") as f:
                                w = csv.DictWriter(f, fieldnames=FIELDS)
                                if new:
                                    w.writeheader()
                                w.writerow(row)
                            rows.append({k2: str(v) for k2, v in row.items()})
                            done.add(k)
    summary = summarise(rows)
    summary["command"] = "PYTHONPATH=src python3 scripts/lr_transfer.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, out / "lr_vs_loss.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "command"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
