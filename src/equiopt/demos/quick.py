"""A short demonstration: one small language-model-shaped problem, several optimizer stacks.

The model is a one-block "bigram transformer" with the parameter classes of the paper
(embedding, SwiGLU gate/up/down, untied LM head) trained on tokens drawn from a random
teacher. Each stack puts a rule on each class; the demo prints the final loss of each,
and for the symmetry-compatible stack what every map did to its parameter: update RMS,
how horizontal the LM-head update is, and the measured equivariance error of the map.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import maps
from ..diagnostics import check_equivariance
from ..optim import EquivariantOptimizer


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, ff: int = 96):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.RMSNorm(d) if hasattr(nn, "RMSNorm") else nn.LayerNorm(d)
        self.gate = nn.Linear(d, ff, bias=False)
        self.up = nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        for module in (self.embed, self.gate, self.up, self.down, self.head):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = self.norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(x)


def teacher_batches(vocab: int, batch: int, steps: int, seed: int = 0):
    """Next-token pairs from a fixed random bigram teacher with a Zipf-like marginal."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(vocab, vocab, generator=g)
    prior = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    probs = torch.softmax(logits, -1)
    for _ in range(steps):
        x = torch.multinomial(torch.softmax(prior, 0), batch, replacement=True, generator=g)
        y = torch.multinomial(probs[x], 1, generator=g).squeeze(-1)
        yield x, y


def stacks(model: TinyLM) -> dict[str, list[dict]]:
    """Param groups per optimizer stack (what a recipe produces from roles)."""
    emb, head = [model.embed.weight], [model.head.weight]
    gate_up, down, vec = [model.gate.weight, model.up.weight], [model.down.weight], list(model.norm.parameters())
    return {
        "AdamW everywhere": [{"params": emb + head + gate_up + down + vec, "rule": "adamw", "lr": 3e-3}],
        "Muon + AdamW emb/head": [
            {"params": gate_up + down, "rule": "spectral", "lr": 0.02},
            {"params": emb + head + vec, "rule": "adamw", "lr": 3e-3},
        ],
        "symmetry-compatible": [
            {"params": emb, "rule": "row", "lr": 0.01, "names": ["embed"]},
            {
                "params": head,
                "rule": "hybrid",
                "order": "row_then_right",
                "center": True,
                "alpha": 0.0,
                "lr": 0.01,
                "names": ["head"],
            },
            {
                "params": gate_up,
                "rule": "hybrid",
                "order": "row_then_right",
                "alpha": 0.0,
                "lr": 0.01,
                "names": ["gate", "up"],
            },
            {"params": down, "rule": "right", "layout": "col", "lr": 0.01, "names": ["down"]},
            {"params": vec, "rule": "adamw", "lr": 3e-3, "names": ["norm"]},
        ],
    }


MAP_CHECKS = [
    ("embed", "row_norm", lambda D: maps.row_norm(D), "lpro"),
    (
        "head",
        "hybrid row->right, centred",
        lambda D: maps.hybrid(D, "row_then_right", alpha=0.0, center=True),
        "router",
    ),
    ("gate/up", "hybrid row->right", lambda D: maps.hybrid(D, "row_then_right", alpha=0.0), "lpro"),
    ("down (transpose)", "right_spectral", lambda D: maps.right_spectral(D), "lpro"),
]


def main(steps: int = 300, vocab: int = 256, batch: int = 512, seed: int = 0) -> dict[str, float]:
    print(
        f"equiopt demo: TinyLM (vocab {vocab}, d 32, SwiGLU 96), {steps} steps of batch {batch} on a random bigram teacher\n"
    )
    results = {}
    for name in stacks(TinyLM(vocab)):
        torch.manual_seed(seed)
        model = TinyLM(vocab)
        opt = EquivariantOptimizer(stacks(model)[name])
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        start = time.perf_counter()
        loss = torch.tensor(float("nan"))
        for x, y in teacher_batches(vocab, batch, steps, seed):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        results[name] = float(loss.detach())
        print(f"{name:24s} final loss {results[name]:.4f}   ({time.perf_counter() - start:.1f} s)")
        if name == "symmetry-compatible":
            last = {k: v.detach() for k, v in model.named_parameters()}
            head_update = last["head.weight"] - before["head.weight"]
            print("  what each map did (whole run):")
            for key in ("embed.weight", "head.weight", "gate.weight", "up.weight", "down.weight"):
                delta = last[key] - before[key]
                print(
                    f"    {key:12s} RMS {before[key].pow(2).mean().sqrt():.4f} -> {last[key].pow(2).mean().sqrt():.4f}, "
                    f"total update RMS {delta.pow(2).mean().sqrt():.4f}"
                )
            share = head_update.sum(0).norm() / head_update.norm()
            print(f"    LM-head update is horizontal: |1^T dW| / |dW| = {share:.1e} (a shared logit shift would be 1)")
    print("\n  equivariance error of each map under its group (float32 oracles, worst of 3 draws):")
    for who, label, fn, group in MAP_CHECKS:
        shape = (vocab, 32) if who in ("embed", "head") else (96, 32)
        err = check_equivariance(lambda D: fn(D.float()).double(), group, shape)
        print(f"    {who:18s} {label:28s} group {group:7s} {err:.1e}")
    adam = check_equivariance(lambda D: D / (D.abs() + 1e-8), "lpro", (vocab, 32))
    print(f"    {'(for contrast)':18s} {'Adam first step':28s} group lpro    {adam:.1e}")
    return results


if __name__ == "__main__":
    main()
