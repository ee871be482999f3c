"""Coordinate check: is a recipe width-stable before anyone sweeps it?

The muP-style check (Yang et al., "Tensor Programs V"): train the same architecture at
several widths for a few steps with the same recipe and learning rates, and look at the
size of what each parameter role produces and how far each step moves it. A
width-stable recipe keeps both flat in width; a quantity that grows or shrinks with width
means the recipe's learning rate for that role would have to be retuned at every size.

Per role (:data:`equiopt.recipes.ROLES`) and width this records, averaged over the last
``tail`` steps:

- ``act_rms``: the RMS of the outputs of the modules holding the role's parameters (the
  embedding's output, each projection's output, the LM head's logits, the router's
  logits, the norms' outputs), measured in the forward pass of each step;
- ``act_change_rms``: the RMS of how far those outputs have moved since initialisation, on
  one fixed probe batch (muP's "coordinate change": what a width-stable learning rate
  keeps flat);
- ``update_rms``: the RMS of the role's weight change per step, over all its entries (for
  information: a spectral update keeps its operator norm, not its entries, fixed, so its
  entry RMS falls as ``1 / sqrt(width)`` by design);
- ``weight_rms``: the RMS of the role's weights after the last step.

Each series gets its exponent in width: the least-squares slope of ``log2(value)`` on
``log2(width)`` (0: flat; 0.5: grows as ``sqrt(width)``). A role whose activation or
activation-change exponent exceeds ``tolerance`` in size is flagged. The models are the family's at the
given size with ``hidden_size``, the MLP (and expert) widths and the number of attention
heads scaled together (head width fixed); the tokens are random (a fixed generator), so
the check needs no data. ``init_base_width`` draws every weight with std
``0.02 sqrt(init_base_width / width)`` (muP's ``1 / sqrt(fan_in)``) instead of 0.02.

    equiopt coord-check qwen3:small --recipe equiopt:default --widths 64,128,256,512
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["width_overrides", "coord_check", "coord_table", "exponent", "plot_coord_check"]

QUANTITIES = ("act_rms", "act_change_rms", "update_rms", "weight_rms")
FLAGGED = ("act_rms", "act_change_rms")


def width_overrides(family: str, size: str, width: int) -> dict[str, Any]:
    """Config overrides that scale ``family:size`` to ``hidden_size = width``: the MLP and
    expert widths in proportion, the attention heads in proportion (head width and the
    query/key-value grouping kept, at least one head)."""
    from .. import models

    base = models.config(family, size)
    scale = width / base.hidden_size
    out: dict[str, Any] = {"hidden_size": width}
    for key in ("intermediate_size", "moe_intermediate_size"):
        value = getattr(base, key, None)
        if isinstance(value, int) and value > 0:
            out[key] = max(1, round(value * scale))
    heads, kv = base.num_attention_heads, getattr(base, "num_key_value_heads", None) or base.num_attention_heads
    group = max(1, heads // kv)
    new_kv = max(1, round(kv * scale))
    out["num_attention_heads"] = new_kv * group
    out["num_key_value_heads"] = new_kv
    return out


def exponent(widths: Sequence[int], values: Sequence[float]) -> float | None:
    """Least-squares slope of ``log2(value)`` on ``log2(width)`` (None without two positive values)."""
    pts = [(math.log2(w), math.log2(v)) for w, v in zip(widths, values) if v is not None and v > 0 and math.isfinite(v)]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else None


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


def _first_tensor(out: Any) -> torch.Tensor | None:
    if torch.is_tensor(out):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    logits = getattr(out, "logits", None)
    return logits if torch.is_tensor(logits) else None


def _role_modules(model: torch.nn.Module, table) -> dict[str, list[torch.nn.Module]]:
    """The modules that own each role's parameters (the parameter's direct parent)."""
    modules = dict(model.named_modules())
    out: dict[str, list[torch.nn.Module]] = {}
    for row in table:
        owner = modules.get(row.name.rpartition(".")[0])
        if owner is not None and all(owner is not m for m in out.get(row.role, [])):
            out.setdefault(row.role, []).append(owner)
    return out


def _one_width(
    family: str,
    size: str,
    width: int,
    recipe,
    steps: int,
    batch: int,
    seq: int,
    seed: int,
    device: torch.device,
    init_base_width: int | None,
    tail: int,
) -> dict[str, dict[str, float]]:
    from .. import models
    from ..diagnostics.weights import WeightTracker
    from ..roles import build_optimizer

    overrides = width_overrides(family, size, width)
    if init_base_width is not None:
        overrides["initializer_range"] = 0.02 * math.sqrt(init_base_width / width)
    model = models.build(family, size, seed=seed, device=device, **overrides)
    opt, sched = build_optimizer(model, recipe, total_steps=None)
    table = opt.role_table
    sums: dict[str, dict[str, list[float]]] = {}
    current: dict[str, list[float]] = {}

    captured: dict[int, torch.Tensor] = {}

    def hook_for(role: str, module: torch.nn.Module):
        def hook(_module, _inputs, output):
            t = _first_tensor(output)
            if t is None or not t.is_floating_point() or not t.numel():
                return
            if torch.is_grad_enabled():
                current.setdefault(role, []).append(_rms(t))
            else:  # the probe pass
                captured[id(module)] = t.detach().float().clone()

        return hook

    modules = _role_modules(model, table)
    handles = [m.register_forward_hook(hook_for(role, m)) for role, ms in modules.items() for m in ms]
    tracker = WeightTracker({role: [(r.name, r.param) for r in rows] for role, rows in table.by_role().items() if rows})
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.config.vocab_size
    probe = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed + 1)).to(device)

    def probe_outputs() -> dict[int, torch.Tensor]:
        captured.clear()
        with torch.no_grad():
            model(input_ids=probe)
        return dict(captured)

    try:
        initial = probe_outputs()
        for step in range(steps):
            ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
            current.clear()
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            if not torch.isfinite(loss):
                raise FloatingPointError(f"width {width}: the loss is {float(loss)} at step {step}")
            loss.backward()
            tracker.snapshot()
            opt.step()
            sched.step()
            if step >= steps - tail:
                stats = tracker.update_stats()
                for role, values in current.items():
                    sums.setdefault(role, {}).setdefault("act_rms", []).append(sum(values) / len(values))
                for role, s in stats.items():
                    sums.setdefault(role, {}).setdefault("update_rms", []).append(s["update_rms"])
                    sums[role]["weight_rms"] = [s["weight_rms"]]
                now = probe_outputs()
                for role, ms in modules.items():
                    moved = [_rms(now[id(m)] - initial[id(m)]) for m in ms if id(m) in now and id(m) in initial]
                    if moved:
                        sums.setdefault(role, {}).setdefault("act_change_rms", []).append(sum(moved) / len(moved))
    finally:
        for h in handles:
            h.remove()
    return {role: {q: sum(v) / len(v) for q, v in qs.items()} for role, qs in sums.items()}


def coord_check(
    model: str,
    recipe: str = "equiopt:default",
    widths: Sequence[int] = (64, 128, 256, 512),
    steps: int = 10,
    batch: int = 4,
    seq: int = 64,
    seed: int = 0,
    device: str | torch.device = "cpu",
    init_base_width: int | None = None,
    tail: int = 3,
    tolerance: float = 0.25,
) -> dict[str, Any]:
    """Train ``model`` (``FAMILY[:SIZE]``) at each width and measure every role (see the module docstring).

    Args:
        model: ``FAMILY[:SIZE]`` of :mod:`equiopt.models` (size ``small`` by default).
        recipe: the recipe (name, TOML path or Recipe), the same lrs at every width.
        widths: the hidden sizes, at least two.
        steps: optimizer steps per width (the last ``tail`` are averaged).
        batch, seq: the random-token batch.
        seed: initialisation and tokens.
        device: where to train.
        init_base_width: draw weights with std ``0.02 sqrt(init_base_width / width)``.
        tail: how many of the last steps are averaged.
        tolerance: the size of exponent beyond which a role is flagged.

    Returns:
        ``{"model", "recipe", "widths", "steps", "roles": {role: {quantity: [value per
        width]}}, "exponents": {role: {quantity: slope}}, "flagged": [...]}``.

    Raises:
        ValueError: fewer than two widths, or ``tail`` outside ``1..steps``.
    """
    family, _, size = model.partition(":")
    size = size or "small"
    widths = sorted({int(w) for w in widths})
    if len(widths) < 2:
        raise ValueError(f"coord-check needs at least two widths, got {widths}")
    if not 1 <= tail <= steps:
        raise ValueError(f"tail must be between 1 and steps ({steps}), got {tail}")
    device = torch.device(device)
    per_width = [
        _one_width(family, size, w, recipe, steps, batch, seq, seed, device, init_base_width, tail) for w in widths
    ]
    roles = sorted({r for d in per_width for r in d})
    series = {role: {q: [d.get(role, {}).get(q) for d in per_width] for q in QUANTITIES} for role in roles}
    exps = {role: {q: exponent(widths, vals) for q, vals in qs.items()} for role, qs in series.items()}
    flagged = [
        f"{role} {q} ~ width^{e:+.2f}"
        for role, qs in exps.items()
        for q, e in qs.items()
        if q in FLAGGED and e is not None and abs(e) > tolerance
    ]
    name = recipe if isinstance(recipe, str) else getattr(recipe, "name", str(recipe))
    return {
        "model": f"{family}:{size}",
        "recipe": name,
        "widths": widths,
        "steps": steps,
        "tail": tail,
        "batch": [batch, seq],
        "init_base_width": init_base_width,
        "tolerance": tolerance,
        "roles": series,
        "exponents": exps,
        "flagged": flagged,
    }


def coord_table(result: dict[str, Any]) -> str:
    """Markdown: per role and quantity, the value at each width and the exponent in width."""
    widths = result["widths"]
    head = ["role", "quantity", *(f"d={w}" for w in widths), "exponent"]
    lines = [
        f"Coordinate check: {result['model']}, recipe {result['recipe']}, {result['steps']} steps "
        f"(mean of the last {result['tail']}), batch {result['batch'][0]} x {result['batch'][1]} random tokens"
        + (f", init std 0.02 sqrt({result['init_base_width']} / width)" if result["init_base_width"] else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * len(head)) + "|",
    ]
    for role, qs in result["roles"].items():
        for q, vals in qs.items():
            e = result["exponents"][role][q]
            cells = ["-" if v is None else f"{v:.3g}" for v in vals]
            lines.append(f"| {role} | {q} | " + " | ".join(cells) + f" | {'-' if e is None else f'{e:+.2f}'} |")
    lines.append("")
    if result["flagged"]:
        lines.append(f"Not width-stable (|exponent| > {result['tolerance']:g}): " + "; ".join(result["flagged"]) + ".")
    else:
        lines.append(
            f"Every role's activation and update RMS is flat in width (|exponent| <= {result['tolerance']:g})."
        )
    return "\n".join(lines) + "\n"


def plot_coord_check(result: dict[str, Any], path: str | Path) -> Path | None:
    """One panel per quantity, one line per role, log-log against width; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    widths = result["widths"]
    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(4.5 * len(QUANTITIES), 4))
    for ax, q in zip(axes, QUANTITIES):
        for role, qs in result["roles"].items():
            pts = [(w, v) for w, v in zip(widths, qs[q]) if v is not None and v > 0]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=role)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (hidden size)")
        ax.set_title(q.replace("_", " "))
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['model']}, {result['recipe']}: flat lines are width-stable")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(result: dict[str, Any], out: str | Path) -> list[Path]:
    """``coord_check.md``, ``coord_check.json`` and (with matplotlib) ``coord_check.png`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "coord_check.md", out / "coord_check.json"]
    written[0].write_text(coord_table(result))
    written[1].write_text(json.dumps(result, indent=2) + "\n")
    png = plot_coord_check(result, out / "coord_check.png")
    return written + ([png] if png else [])
