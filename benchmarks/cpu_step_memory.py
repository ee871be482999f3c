"""What one optimizer step holds at its peak, and which operators made it, on the CPU.

    python benchmarks/cpu_step_memory.py [--layers 2] [--vocab 1024] [--recipes paper:qwen3:a-i,paper:qwen3:b-ii]

A transformers ``Qwen3ForCausalLM`` at Qwen3-0.6B's widths (hidden 1024, SwiGLU 3072, 16 query
and 8 key-value heads of 128, tied embedding) with ``--layers`` layers and a ``--vocab``
vocabulary, random gradients; per recipe, after a first step: the peak memory of the next
step beyond what it began with (:func:`equiopt.peakmem.peak_extra_bytes`), and the tensors
alive at that peak, summed by the operator that allocated them (from the profiler's trace).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter

import torch

MIB = 2**20


def live_at_peak(fn) -> tuple[int, Counter]:
    """The peak (bytes) of ``fn()``'s allocations and what was alive then, by operator."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    ops = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in trace if e.get("cat") == "cpu_op")
    events = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"]) for e in trace if e.get("name") == "[memory]")

    def innermost(ts: float) -> str:
        found = "?"
        for start, end, name in ops:
            if start > ts:
                break
            if ts <= end:
                found = name
        return found

    live: dict[int, tuple[int, str]] = {}
    held = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ts, nbytes, addr in events:
        held += nbytes
        if nbytes > 0:
            live[addr] = (nbytes, innermost(ts))
        else:
            live.pop(addr, None)
        if held > peak:
            peak, at_peak = held, dict(live)
    by_op: Counter = Counter()
    for nbytes, name in at_peak.values():
        by_op[name] += nbytes
    return peak, by_op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--recipes", default="paper:qwen3:a-i,paper:qwen3:b-ii,equiopt:default")
    args = ap.parse_args()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from equiopt.roles import build_optimizer

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    model = Qwen3ForCausalLM(config)
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn_like(p)
    print(f"Qwen3 at 0.6B's widths, {args.layers} layers, vocabulary {args.vocab}, torch {torch.__version__}")
    for recipe in args.recipes.split(","):
        opt, _ = build_optimizer(model, recipe, eager_state=True, compile=False)
        opt.step()
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
        peak, by_op = live_at_peak(opt.step)
        alive = ", ".join(f"{name} {nbytes / MIB:.0f}" for name, nbytes in by_op.most_common(5) if nbytes >= MIB)
        print(
            f"{recipe}: state {state / MIB:.0f} MiB, peak extra {peak / MIB:.0f} MiB; alive at the peak (MiB): {alive}"
        )
        del opt


if __name__ == "__main__":
    main()
