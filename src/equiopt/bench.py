"""Benchmarks (not tests): ``python -m equiopt.bench [--speed] [--accuracy] [--stack] [--device cuda]``.

(a) Optimizer step time of each rule as a ratio to torch's AdamW on the same parameters
    in the same process (foreach on CPU, fused on CUDA), on parameters shaped like the
    paper's (Qwen3-0.6B-style embedding 151936 x 1024, SwiGLU 3072 x 1024, OLMoE-style
    router 32 x 2048 and expert stacks), divided by ``--shrink`` (default 4 on CPU, 1 on CUDA).
(c) ``--stack``: each paper recipe's whole optimizer stack on a Qwen3-style model
    (CPU: vocabulary 32768, hidden 256, 4 layers, untied, 20 M parameters; CUDA: the
    paper's Qwen3-0.6B), as a ratio to torch's AdamW over all parameters, as a fraction
    of one forward+backward pass (B x T tokens; bf16 autocast on CUDA), and its optimizer
    state and the peak memory one step holds beyond it (:mod:`equiopt.peakmem`; the
    allocator's statistics on CUDA, the profiler's allocation events on the CPU), and the
    time its step spends in matrix products
    (profiled; the floor that only fewer FLOPs or a faster processor lowers);
    ``--gram-dtype float32,bfloat16`` times recipes with Gram maps once per ``gram_dtype``.
(d) ``--divided``: per-rank step time of each recipe's whole stack on the ``--stack``
    model under DDP-style replication, 1 process against 2 (``--worlds``) with the matrix
    maps divided among the ranks (``divide_work``) and, for reference, undivided; one
    thread per process on CPU (gloo), one GPU per process on CUDA (NCCL).
(e) ``--overlap``: per-rank step time of the ``--stack`` model (or ``--model``) sharded by
    FSDP2 over 2 and 4 gloo processes (``--worlds``), with the owner exchanges and the reduce
    maps' all-reduces waited for at once (``overlap=False``) and overlapped with the maps
    (``--cost-model owner`` or ``reduce`` picks which), the time spent inside the
    collectives of a waited step, and the share of it the overlap hides.
(f) ``--ops``: the ATen operators one step dispatches, for each recipe and for torch's
    foreach AdamW and Muon, on the Qwen3-0.6B structure at 28 and 56 layers (tiny widths).
(g) ``--roofline``: one step of each recipe counted on the meta device at real widths
    (``--model``, default Qwen3-0.6B as the H100 figures measured it) and charged at an
    H100's rates (:mod:`equiopt.roofline`), taking the choices the step takes on each of
    ``--routes`` (default cuda): FLOPs by dtype, bytes moved, operators, estimated time
    against fused AdamW and a forward+backward, peak memory beyond the state, and the
    costliest operators.
(b) Accuracy of the right-spectral map and its nuclear-norm estimate ``nu`` against
    float64, for condition numbers 1e1, 1e3, 1e5 and entry scales 1e-4 to 1, for the
    default oracle and for Algorithm 3 as the paper's code runs it (Frobenius
    normalisation, five greedy steps for l = 1e-3 with safety 1.05, symmetrised R); and
    (b2) of the right-spectral and hybrid maps with ``gram_dtype="bfloat16"`` against
    float64, for conditions 1e1-1e3 on vocabulary-, MLP- and router-shaped matrices; and
    (b3, also alone with ``--route-accuracy``) of the one-sided and hybrid maps on each
    ``route`` (Gram; direct: Polar Express on the matrix, as Muon) on the same matrices.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from . import maps
from .linalg import default_dtype, inv_sqrt, polar
from .linalg.coefficients import greedy_schedule
from .optim import EquivariantOptimizer
from .peakmem import peak_extra_bytes

RULES = [
    ("row", {"rule": "row"}),
    ("row centred", {"rule": "row", "center": True}),
    ("right", {"rule": "right"}),
    ("right centred", {"rule": "right", "center": True}),
    ("hybrid row->right", {"rule": "hybrid", "order": "row_then_right"}),
    ("right, bf16 Gram", {"rule": "right", "gram_dtype": "bfloat16"}),
    ("hybrid row->right, bf16 Gram", {"rule": "hybrid", "order": "row_then_right", "gram_dtype": "bfloat16"}),
    ("right, f32 products", {"rule": "right", "gram_dtype": "float32"}),
    ("right, bf16x6 products", {"rule": "right", "gram_dtype": "bfloat16x6"}),
    ("hybrid row->right, f32 products", {"rule": "hybrid", "order": "row_then_right", "gram_dtype": "float32"}),
    ("hybrid row->right, bf16x6 products", {"rule": "hybrid", "order": "row_then_right", "gram_dtype": "bfloat16x6"}),
    ("spectral (Muon)", {"rule": "spectral"}),
    ("left centred (router)", {"rule": "left", "center": True}),
    ("hybrid left->row centred", {"rule": "hybrid", "order": "left_then_row", "center": True}),
]

# name, stored shape, layout, rules that fit the parameter class
CASES = [
    (
        "embedding 151936x1024",
        (151936, 1024),
        "row",
        [
            "row",
            "row centred",
            "right",
            "right centred",
            "hybrid row->right",
            "right, bf16 Gram",
            "hybrid row->right, bf16 Gram",
            "right, f32 products",
            "right, bf16x6 products",
            "hybrid row->right, f32 products",
            "hybrid row->right, bf16x6 products",
        ],
    ),
    (
        "SwiGLU up 3072x1024 x20 layers",
        (20, 3072, 1024),
        "experts:row",
        ["row", "right", "hybrid row->right", "hybrid row->right, bf16 Gram", "spectral (Muon)"],
    ),
    (
        "router 32x2048 x12 layers",
        (12, 32, 2048),
        "experts:row",
        ["row centred", "left centred (router)", "hybrid left->row centred"],
    ),
    (
        "experts 32x(1024x2048) x2 layers",
        (64, 1024, 2048),
        "experts:row",
        ["row", "right", "hybrid row->right", "spectral (Muon)"],
    ),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, repeats: int, device: torch.device) -> float:
    """Median time of ``fn()`` over ``repeats`` calls, after one warm-up call (the device
    synchronised around each)."""
    return median_times({0: fn}, repeats, device)[0]


def median_times(fns: dict, repeats: int, device: torch.device, before=None) -> dict:
    """Median time of each of ``fns`` over ``repeats`` rounds in which each runs once, in
    turn (what drifts, drifts alike), after one warm-up call each; ``before()``, untimed,
    ahead of every timed call (the device synchronised around each)."""
    for fn in fns.values():
        fn()
    _sync(device)
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if before is not None:
                before()
                _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[k].append(time.perf_counter() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def time_steps(opt, params, grads, device, repeats: int) -> float:
    """Median time of one ``opt.step()`` (after a warm-up step that creates the state)."""
    for p, g in zip(params, grads):
        p.grad = g
    return median_time(opt.step, repeats, device)


_PRODUCT_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def _product_ms(opt, device: torch.device, steps: int = 3) -> float:
    """Milliseconds a step spends in matrix products (``mm``, ``bmm``, ``addmm``,
    ``baddbmm``; their own time, CPU or device), over ``steps`` profiled steps: the part of
    a step that only fewer FLOPs or a faster processor can shorten."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    opt.step()
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            opt.step()
        _sync(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total_us = sum(getattr(e, attr) for e in prof.key_averages() if e.key in _PRODUCT_OPS)
    return total_us / 1e3 / steps


def _shrunk(shape, shrink: int):
    *lead, m, n = shape
    return (*lead, max(8, m // shrink), max(8, n // shrink))


def speed(
    device: torch.device,
    shrink: int,
    repeats: int,
    dtype: torch.dtype,
    compile_step: bool | None = False,
    cases=None,
) -> dict[tuple[str, str], float]:
    """Table (a); eager steps unless ``compile_step`` (the optimizer's ``compile``: True, or
    None for its automatic choice, which on CUDA compiles each bucket's core: the fused
    vocabulary stages). Returns each ``(parameter, rule)``'s ratio to AdamW; ``cases``: only
    these parameters' names."""
    ratios: dict[tuple[str, str], float] = {}
    fused = device.type == "cuda"
    print(
        f"(a) optimizer step time / torch AdamW ({'fused' if fused else 'foreach'}), device {device}, dtype {dtype}, shapes / {shrink}"
    )
    print(f"{'parameter':36s} {'rule':30s} {'ms':>9s} {'AdamW ms':>9s} {'ratio':>7s}")
    settings = dict(RULES)
    for name, shape, layout, rules in CASES:
        if cases is not None and name not in cases:
            continue
        shape = _shrunk(shape, shrink)
        g = torch.Generator(device=device).manual_seed(0)
        params = [torch.nn.Parameter(0.02 * torch.randn(shape, generator=g, device=device, dtype=dtype))]
        grads = [1e-3 * torch.randn(shape, generator=g, device=device, dtype=dtype)]
        kwargs = {"fused": True} if fused else {"foreach": True}
        base = time_steps(torch.optim.AdamW(params, lr=1e-3, **kwargs), params, grads, device, repeats)
        for rule in rules:
            opt = EquivariantOptimizer(params, lr=1e-3, layout=layout, compile=compile_step, **settings[rule])
            t = time_steps(opt, params, grads, device, repeats)
            label = f"{name} {tuple(shape)}" if shrink > 1 else name
            print(f"{label:36s} {rule:30s} {1e3 * t:9.2f} {1e3 * base:9.2f} {t / base:7.2f}")
            ratios[(name, rule)] = t / base
    return ratios


STACK_RECIPES = [
    "paper:qwen3:a-i",
    "paper:qwen3:a-ii",
    "paper:qwen3:a-iii",
    "paper:qwen3:b-i",
    "paper:qwen3:b-ii",
    "paper:qwen3:b-iii",
]


def stack_model(device: torch.device, shape: str | None = None, structure: int | None = None):
    """The ``--stack`` model, or with ``shape`` ("VOCABxHIDDEN") a 4-layer Qwen3-style one of that
    size, or with ``structure`` (a width) Qwen3-0.6B's structure at that width (28 layers, 310
    parameters: deep and narrow, where per-parameter costs dominate)."""
    from . import models

    if structure:
        from .opcount import qwen3_structure

        return qwen3_structure(28, structure).to(device)
    if shape:
        return models.build_vocab_shaped(shape, device=device)
    if device.type == "cuda":
        return models.build("qwen3", "paper", device=device, seed=0)
    return models.build(
        "qwen3",
        "small",
        vocab_size=32768,
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=768,
        seed=0,
        device=device,
    )


def _state_mib(opt) -> float:
    return (
        sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
        / 2**20
    )


def _gram_variants(recipe: str, gram_dtypes):
    """``(label, recipe)`` for each of ``gram_dtypes`` (one, unchanged, when the recipe has no
    rule that forms a Gram): the recipe with ``gram_dtype`` set on every role whose rule takes it."""
    from .recipes import RULE_FIELDS, get_recipe

    base = get_recipe(recipe)
    gram_roles = [role for role in base.roles if "gram_dtype" in RULE_FIELDS[base.roles[role]["rule"]]]
    if not gram_roles:
        return [(recipe, recipe)]
    return [
        (
            recipe if d == "float32" else f"{recipe} ({d[:2]}16 Gram)",
            base.with_overrides({r: {"gram_dtype": d} for r in gram_roles}),
        )
        for d in gram_dtypes
    ]


def stack(
    device: torch.device,
    recipes,
    repeats: int,
    batch: int,
    seq: int,
    compile_step: bool | None,
    gram_dtypes=("float32",),
    structure: int | None = None,
    graphed: bool = False,
) -> dict:
    """Table (c); returns ``{"fwd_bwd_ms", "adamw_ms", "adamw_state_mib", "rows": [...]}``, a row
    per recipe (and Gram precision) with ``ms``, ``state_mib``, ``peak_extra_mib`` and, with
    ``graphed``, ``graphed_ms`` and ``graphed_vs_eager``."""
    from .optim import GraphedStep
    from .roles import build_optimizer

    model = stack_model(device, structure=structure)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen, device=device)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    fb = median_time(fwd_bwd, max(3, repeats // 2), device)
    grads = [p.grad.detach().clone() for p in params]
    fused = device.type == "cuda"
    adamw = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
    base = time_steps(adamw, params, grads, device, repeats)
    base_state = _state_mib(adamw)
    del adamw
    print(
        f"(c) whole optimizer stack, Qwen3-style model{' (Qwen3-0.6B structure, width ' + str(structure) + ')' if structure else ''}, "
        f"{n / 1e6:.1f} M parameters, device {device}, "
        f"torch {torch.__version__}; forward+backward B={batch} T={seq}{' (bf16 autocast)' if device.type == 'cuda' else ''}: {1e3 * fb:.1f} ms; "
        f"AdamW ({'fused' if fused else 'foreach'}): {1e3 * base:.2f} ms ({base / fb:.3f} of fwd+bwd), state {base_state:.0f} MiB"
    )
    print(
        f"{'recipe':32s} {'ms':>9s} {'/AdamW':>7s} {'/fwd+bwd':>9s} {'state MiB':>10s} {'peak extra MiB':>15s}"
        f" {'products ms':>12s} {'products/AdamW':>15s}"
    )
    out: dict = {"fwd_bwd_ms": 1e3 * fb, "adamw_ms": 1e3 * base, "adamw_state_mib": base_state, "rows": []}
    for label, recipe in (v for name in recipes for v in _gram_variants(name, gram_dtypes)):
        opt, _ = build_optimizer(model, recipe, eager_state=True)
        if compile_step is not None:
            opt.compile = compile_step
        t = time_steps(opt, params, grads, device, repeats)
        peak = peak_extra_bytes(opt.step, device) / 2**20
        products = _product_ms(opt, device)
        print(
            f"{label:32s} {1e3 * t:9.2f} {t / base:7.2f} {t / fb:9.3f} {_state_mib(opt):10.0f} {peak:15.0f}"
            f" {products:12.2f} {products / (1e3 * base):15.2f}"
        )
        row = {
            "recipe": label,
            "ms": 1e3 * t,
            "state_mib": _state_mib(opt),
            "peak_extra_mib": peak,
            "product_ms": products,
        }
        out["rows"].append(row)
        del opt
        if graphed:
            opt, _ = build_optimizer(model, recipe, eager_state=True, compile=False)
            for p, g in zip(params, grads):
                p.grad = g
            t = median_time(GraphedStep(opt), repeats, device)
            rel = graphed_vs_eager(model, params, grads, recipe)
            print(
                f"{label + ' (CUDA graph)':32s} {1e3 * t:9.2f} {t / base:7.2f} {t / fb:9.3f}   graphed vs eager {rel:.1e}"
            )
            row.update(graphed_ms=1e3 * t, graphed_vs_eager=rel)
            del opt
    return out


def graphed_vs_eager(model, params, grads, recipe, steps: int = 6) -> float:
    """Largest relative difference, over parameters, between ``steps`` eager steps and the
    same steps through :class:`~equiopt.optim.GraphedStep` (3 eager, the capture, replays),
    from the same weights: ``||W_graphed - W_eager|| / ||W_eager - W_0||``."""
    from .optim import GraphedStep
    from .roles import build_optimizer

    start = [p.detach().clone() for p in params]

    def run(graph: bool) -> list[torch.Tensor]:
        with torch.no_grad():
            for p, w in zip(params, start):
                p.copy_(w)
        opt, _ = build_optimizer(model, recipe, eager_state=True, compile=False)
        step = GraphedStep(opt) if graph else opt.step
        for p, g in zip(params, grads):
            p.grad = g
        for _ in range(steps):
            step()
        return [p.detach().clone() for p in params]

    eager, graph = run(False), run(True)
    return max(float((b - a).norm() / (a - w).norm().clamp_min(1e-30)) for a, b, w in zip(eager, graph, start))


def ops(recipes) -> None:
    """(f) ATen operators per step of each recipe and of torch's optimizers on the Qwen3-0.6B
    structure (:mod:`equiopt.opcount`), at 28 and 56 layers, with each one's five commonest."""
    from .opcount import ops_table, placed_ops_table

    print("(f) ATen operators per step, Qwen3-0.6B structure (transformers Qwen3ForCausalLM, tiny widths), CPU")
    print(f"{'optimizer':34s} {'28 layers':>10s} {'56 layers':>10s}  commonest (28 layers)")
    alone = {}
    for label, counts in ops_table(recipes):
        common = ", ".join(f"{k} {v}" for k, v in counts[28].counts.most_common(5))
        print(f"{label:34s} {counts[28].total:10d} {counts[56].total:10d}  {common}")
        alone[label] = counts[28].total
    for placement, what in (
        ("fsdp2", "sharded by FSDP2 over 2 gloo processes (every parameter a DTensor)"),
        ("hsdp", "sharded by HSDP over 4 gloo processes (2 replicas of 2-rank shards)"),
        ("ddp", "replicated over 2 gloo processes, the maps divided among them (divide_work=True)"),
    ):
        print(f"\n(f) the same {what}, rank 0;")
        print("    operators (of which kernels: all but views), and operators over one process's at 28 layers")
        print(f"{'optimizer':34s} {'28 layers':>16s} {'56 layers':>16s} {'/one process':>13s}")
        for label, found in placed_ops_table(recipes, placement=placement).items():
            cells = [f"{found[n][0]:,} ({found[n][1]:,})" for n in (28, 56)]
            print(f"{label:34s} {cells[0]:>16s} {cells[1]:>16s} {found[28][0] / alone[label]:13.2f}")


def roofline(
    recipes,
    model: str | None,
    routes,
    gram_dtype: str | None,
    tokens: int,
    json_path: str | None,
    machine="h100",
    shards: int = 1,
) -> None:
    """(g) Each recipe's step at an H100's roofline, counted on the meta device
    (:mod:`equiopt.roofline`), once per route (``shards > 1``: then rank 0 of the step
    sharded by FSDP2 over that many ranks, beside it); the tables also to ``json_path``."""
    from . import roofline as rl

    rates = rl.MACHINES[machine]
    tables = []
    runs = [(route, n) for route in routes for n in ((1, shards) if shards > 1 else (1,))]
    for i, (route, n) in enumerate(runs):
        table = rl.roofline(recipes, model or rl.DEFAULT_MODEL, route, gram_dtype, tokens, rates, shards=n)
        if i:
            print()
        rl.print_report(table)
        tables.append(table)
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump({"torch": torch.__version__, "machine": rates.__dict__, "tables": tables}, f, indent=1)


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds``: the slowest rank sets a step's time."""
    import torch.distributed as dist

    t = torch.tensor([seconds], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _per_world(worker, worlds, *args) -> dict:
    """``{world: results}``: ``worker(rank, world, rendezvous, out, *args)`` spawned on each
    process count, rank 0's results read back from ``out``."""
    import tempfile

    import torch.multiprocessing as mp

    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            out = f"{tmp}/w{world}.pt"
            mp.spawn(worker, args=(world, f"{tmp}/rdv{world}", out, *args), nprocs=world, join=True)
            table[world] = torch.load(out)
    return table


def _save_results(results: dict, rank: int, out: str) -> None:
    """Rank 0 writes ``results`` for :func:`_per_world`; every rank waits for it."""
    import torch.distributed as dist

    if rank == 0:
        torch.save(results, out)
    dist.barrier()


def _divided_worker(
    rank: int, world: int, rendezvous: str, out: str, device_type: str, recipes, repeats: int, shape: str | None
) -> None:
    import torch.distributed as dist

    from .roles import build_optimizer

    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    try:
        model = stack_model(device, shape)
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator(device=device).manual_seed(1)
        grads = [1e-3 * torch.randn(p.shape, generator=gen, device=device) for p in params]
        results = {"parameters": sum(p.numel() for p in params)}
        for p, g in zip(params, grads):
            p.grad = g
        for recipe in recipes:
            # the undivided and the divided step in alternating rounds
            divides = (False, True) if world > 1 else (False,)
            opts = {
                d: build_optimizer(model, recipe, eager_state=True, divide_work=d, compile=False)[0] for d in divides
            }
            medians = median_times({d: opts[d].step for d in divides}, repeats, device, before=dist.barrier)
            for d in divides:
                results[(recipe, d)] = _slowest(medians[d], device)
            del opts
        _save_results(results, rank, out)
    finally:
        dist.destroy_process_group()


def divided(device: torch.device, recipes, repeats: int, worlds, shape: str | None = None) -> None:
    table = _per_world(_divided_worker, worlds, device.type, recipes, repeats, shape)
    n = table[worlds[0]]["parameters"]
    print(
        f"(d) per-rank optimizer step time (ms, slowest rank) of the whole stack under replication, "
        f"Qwen3-style model {shape or 'of --stack'} ({n / 1e6:.1f} M trained parameters), "
        f"{'one thread' if device.type == 'cpu' else 'one GPU'} per process, torch {torch.__version__}"
    )
    one = min(worlds)
    others = [w for w in worlds if w != one]
    cols = [f"{w} proc" + ("" if w == one else " undivided") for w in worlds] + [f"{w} proc divided" for w in others]
    print(f"{'recipe':20s} " + " ".join(f"{c:>20s}" for c in cols) + "   divided / undivided   divided / 1 proc")
    for recipe in recipes:
        row = [table[w][(recipe, False)] for w in worlds] + [table[w][(recipe, True)] for w in others]
        same = " ".join(f"{table[w][(recipe, True)] / table[w][(recipe, False)]:.2f}" for w in others)
        alone = " ".join(f"{table[w][(recipe, True)] / table[one][(recipe, False)]:.2f}" for w in others)
        print(f"{recipe:20s} " + " ".join(f"{1e3 * t:20.2f}" for t in row) + f"   {same:>19s}   {alone:>16s}")


def _overlap_worker(
    rank: int, world: int, rendezvous: str, out: str, recipes, repeats: int, shape: str | None, cost_model: str
) -> None:
    import torch.distributed as dist

    from .roles import build_optimizer
    from .train.parallel import fsdp2_api, transformer_blocks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        fully_shard = fsdp2_api()[0]
        cpu = torch.device("cpu")
        model = stack_model(cpu, shape)
        for block in transformer_blocks(model):
            fully_shard(block)
        fully_shard(model)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.detach().clone().mul_(1e-3) for p in params]
        results = {"parameters": sum(p.numel() for p in params)}
        real = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce", "all_gather_into_tensor")}
        spent = [0.0]

        def timed(fn):
            def run(*args, **kwargs):
                start = time.perf_counter()
                work = fn(*args, **kwargs)
                spent[0] += time.perf_counter() - start
                return work

            return run

        for recipe in recipes:
            opt, _ = build_optimizer(model, recipe, eager_state=True, compile=False, cost_model=cost_model)
            for overlap in (False, True):
                opt.overlap = overlap
                dist.barrier()
                results[(recipe, overlap)] = _slowest(time_steps(opt, params, grads, cpu, repeats), cpu)
            # time inside the (synchronous) collectives of one waited step: the communication to hide
            opt.overlap = False
            for name, fn in real.items():
                setattr(dist, name, timed(fn))
            try:
                spent[0] = 0.0
                dist.barrier()
                opt.step()
            finally:
                for name, fn in real.items():
                    setattr(dist, name, fn)
            results[(recipe, "comm")] = _slowest(spent[0], cpu)
            del opt
        _save_results(results, rank, out)
    finally:
        dist.destroy_process_group()


def overlap(recipes, repeats: int, worlds, shape: str | None, cost_model: str) -> None:
    """``--overlap``: per-rank step time of FSDP2-sharded stacks with the collectives (owner
    exchanges; the reduce maps' all-reduces) waited for at once and overlapped with the
    maps, on gloo (one thread per process)."""
    print(
        f"(e) per-rank optimizer step time (ms, slowest rank), FSDP2 over all ranks, Qwen3-style model "
        f"{shape or 'of --stack'}, gloo, one thread per process, cost model {cost_model}, torch {torch.__version__}"
    )
    print(f"{'procs':>5s} {'recipe':20s} {'waited':>9s} {'overlap':>9s} {'ratio':>6s} {'comm ms':>8s} {'hidden':>7s}")
    for world, res in _per_world(_overlap_worker, worlds, recipes, repeats, shape, cost_model).items():
        for recipe in recipes:
            waited, over, comm = res[(recipe, False)], res[(recipe, True)], res[(recipe, "comm")]
            hidden = (waited - over) / comm if comm > 0 else float("nan")
            print(
                f"{world:5d} {recipe:20s} {1e3 * waited:9.2f} {1e3 * over:9.2f} {over / waited:6.2f} "
                f"{1e3 * comm:8.2f} {100 * hidden:6.0f}%"
            )


def _tall(m: int, n: int, cond: float, scale: float, gen: torch.Generator) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(m, n, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    d = (u * torch.logspace(0, -math.log10(cond), n, dtype=torch.float64)) @ v.T
    return d * (scale / d.pow(2).mean().sqrt())


def algorithm3_as_published(A: torch.Tensor, eps: float, steps: int = 5) -> torch.Tensor:
    """Algorithm 3 with the settings of the paper's code: greedy schedule for l = 1e-3 with
    safety 1.05, Frobenius normalisation ``1.02 ||A||_F + eps``, symmetrised R."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype)
    A = 0.5 * (A + A.mT) + eps * eye
    alpha = 1.02 * torch.linalg.matrix_norm(A) + eps
    y, z = A / alpha, eye.clone()
    for a, b, c in greedy_schedule(1e-3, steps, 1.0, 1.05):
        r = eye - z @ y
        r = 0.5 * (r + r.mT)
        m = (a + b + c) * eye - (b + 2 * c) * r + c * (r @ r)
        y, z = y @ m, m @ z
    return z / alpha.sqrt()


def accuracy(m: int, n: int, eps: float = 1e-8) -> None:
    print(
        f"(b) right-spectral map vs float64, tall {m} x {n}, eps {eps:g}: relative Frobenius error of "
        "D R and relative error of nu = tr(C R)"
    )
    print(f"{'cond':>6s} {'scale':>6s} | {'default U':>10s} {'default nu':>10s} | {'Alg.3 U':>10s} {'Alg.3 nu':>10s}")
    gen = torch.Generator().manual_seed(0)
    for cond in (1e1, 1e3, 1e5):
        for scale in (1e-4, 1e-3, 1e-2, 1.0):
            D = _tall(m, n, cond, scale, gen)
            C = D.T @ D
            R = inv_sqrt(C, eps, "exact")
            U, nu = D @ R, (C * R).sum()
            Df = D.float()
            Cf = Df.T @ Df
            row = []
            for Rf in (inv_sqrt(Cf, eps, "polar_express", 5), algorithm3_as_published(Cf, eps)):
                Uf, nuf = (Df @ Rf).double(), (Cf * Rf).sum().double()
                row += [float((Uf - U).norm() / U.norm()), float(abs(nuf / nu - 1))]
            print(
                f"{cond:6.0e} {scale:6.0e} | {100 * row[0]:9.2f}% {100 * row[1]:9.2f}% | {100 * row[2]:9.2f}% {100 * row[3]:9.2f}%"
            )
    print("matrix products on the n x n Gram: default 4*steps+1 = 21, Algorithm 3 4*steps = 20 (steps = 5)")


ACCURACY_GRAM_DTYPES = ("float32", "bfloat16", "bfloat16x6")


def accuracy_low() -> None:
    """The accuracy each ``gram_dtype`` keeps: right-spectral and hybrid maps against float64
    on vocabulary-, MLP- and router-shaped matrices, conditions 1e1-1e3 (``"auto"`` is held
    to 0.5 % here: the split products, ``bfloat16x6``, must stay under it)."""
    print(
        "(b2) gram_dtype: relative Frobenius error against float64 of right_spectral / hybrid (row->right, "
        "scale rms): float32; bfloat16 (operands rounded once); bfloat16x6 (split operands, six bfloat16 products)"
    )
    names = {"float32": "f32", "bfloat16": "bf16", "bfloat16x6": "bf16x6"}
    heads = [f"{fn} {names[d]}" for fn in ("right", "hybrid") for d in ACCURACY_GRAM_DTYPES]
    print(f"{'shape':>14s} {'cond':>6s} | " + " ".join(f"{h:>13s}" for h in heads))
    gen = torch.Generator().manual_seed(0)
    shapes = [("vocab", 16384, 256), ("MLP", 3072, 1024), ("router", 2048, 32)]
    for label, m, n in shapes:
        for cond in (1e1, 1e2, 1e3):
            D = _tall(m, n, cond, 1e-2, gen)
            row = []
            for fn in (maps.right_spectral, lambda d, **k: maps.hybrid(d, scale="rms", **k)):
                exact = fn(D)
                for gram_dtype in ACCURACY_GRAM_DTYPES:
                    got = fn(D.float(), gram_dtype=gram_dtype).double()
                    row.append(float((got - exact).norm() / exact.norm()))
            print(f"{label + f' {m}x{n}':>14s} {cond:6.0e} | " + " ".join(f"{100 * e:12.3f}%" for e in row))


def accuracy_routes() -> None:
    """The accuracy of each ``route`` of the one-sided and hybrid maps against float64 (the
    map with an exact eigendecomposition of the float64 Gram): the Gram route (float32
    products) and the direct route (Polar Express on the matrix in the iteration's dtype),
    beside Muon's own iteration on the same matrix in the same dtype, and in float32."""
    iteration = default_dtype("polar_express", torch.device("cpu"))
    print(
        "(b3) route: relative Frobenius error against float64 (exact eigendecomposition) of right_spectral "
        f"and hybrid (row->right), eps 1e-8; direct and Muon in {str(iteration).removeprefix('torch.')} "
        "(this CPU's iteration dtype), 5 steps; nu: relative error of the direct route's nu = tr(D^T P)"
    )
    heads = ["right gram", "right direct", "Muon", "Muon f32", "nu direct", "hybrid gram", "hybrid direct"]
    print(f"{'shape':>16s} {'cond':>6s} | " + " ".join(f"{h:>13s}" for h in heads))
    gen = torch.Generator().manual_seed(0)
    shapes = [("vocab", 16384, 256), ("MLP", 3072, 1024), ("router", 2048, 32)]
    for label, m, n in shapes:
        for cond in (1e1, 1e2, 1e3):
            D = _tall(m, n, cond, 1e-2, gen)
            Df = D.float()
            exact = maps.right_spectral(D, method="exact")
            nu = torch.linalg.svdvals(D).sum()
            direct = maps.right_spectral(Df, route="direct")
            scaled = maps.right_spectral(Df, alpha=1.0, route="direct").double()
            hybrid = maps.hybrid(D, method="exact")
            errors = [
                (maps.right_spectral(Df, route="gram"), exact),
                (direct, exact),
                (polar(Df, "polar_express", 5), exact),
                (polar(Df, "polar_express", 5, dtype=torch.float32), exact),
            ]
            row = [float((a.double() - b).norm() / b.norm()) for a, b in errors]
            row.append(float(abs((scaled * direct.double()).sum() / direct.double().square().sum() / nu - 1)))
            for route in ("gram", "direct"):
                got = maps.hybrid(Df, route=route).double()
                row.append(float((got - hybrid).norm() / hybrid.norm()))
            print(f"{label + f' {m}x{n}':>16s} {cond:6.0e} | " + " ".join(f"{100 * e:12.3f}%" for e in row))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m equiopt.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", action="store_true", help="only the step-time table")
    parser.add_argument("--accuracy", action="store_true", help="only the accuracy tables")
    parser.add_argument(
        "--route-accuracy", action="store_true", help="only the accuracy table of each route (Gram, direct)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shrink", type=int, default=None, help="divide the paper's matrix sizes by this")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tall", default="8192x1024", help="accuracy matrix size MxN (rows >= 8 cols)")
    parser.add_argument("--stack", action="store_true", help="only the whole-stack table")
    parser.add_argument("--recipes", default=",".join(STACK_RECIPES), help="comma-separated recipes for --stack")
    parser.add_argument("--batch", type=int, default=None, help="--stack batch size (default 8)")
    parser.add_argument("--seq", type=int, default=None, help="--stack sequence length (CPU 256, CUDA 1024)")
    parser.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="the optimizer's compile option for --stack (--speed: eager unless on)",
    )
    parser.add_argument(
        "--gram-dtype",
        default=None,
        help="--stack: comma-separated gram_dtype values (float32, bfloat16) each recipe with Gram maps is timed at "
        "(default float32); --roofline: one gram_dtype set on every role that takes one (default: the recipes' own)",
    )
    parser.add_argument("--json", default=None, help="--stack, --roofline: also write the figures to this JSON file")
    parser.add_argument(
        "--graphed", action="store_true", help="--stack: each recipe also through a CUDA graph (GraphedStep)"
    )
    parser.add_argument(
        "--structure",
        type=int,
        default=None,
        help="--stack on Qwen3-0.6B's structure (28 layers, 310 parameters) at this width instead",
    )
    parser.add_argument("--divided", action="store_true", help="only the per-rank DDP table (1 vs 2 processes)")
    parser.add_argument("--worlds", default="1,2", help="process counts for --divided")
    parser.add_argument(
        "--model",
        default=None,
        help="VOCABxHIDDEN: a 4-layer Qwen3-style model for --divided / --overlap / --roofline; --roofline also "
        "takes an equiopt.models preset (qwen3:paper, the default), qwen3-0.6b, or a transformers config",
    )
    parser.add_argument(
        "--overlap", action="store_true", help="only the FSDP2 overlap table (waited vs overlapped exchanges)"
    )
    parser.add_argument("--cost-model", default="owner", help="--overlap: the optimizer's cost model (default owner)")
    parser.add_argument(
        "--ops", action="store_true", help="only the ATen operators per step on the Qwen3-0.6B structure"
    )
    parser.add_argument(
        "--roofline", action="store_true", help="only the roofline of one step counted on the meta device"
    )
    parser.add_argument("--routes", default="cuda", help="--roofline: comma-separated devices whose choices to take")
    parser.add_argument(
        "--machine",
        default="h100",
        choices=["h100", "h100-measured"],
        help="--roofline: the rates charged (equiopt.roofline.MACHINES: an H100's nominal or measured ones)",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="--roofline: also rank 0 of the step sharded by FSDP2 over this many ranks (a fake process group)",
    )
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    device = torch.device(args.device)
    if args.roofline:
        roofline(
            args.recipes.split(",")
            if args.recipes != ",".join(STACK_RECIPES)
            else ["paper:qwen3:a-i", "paper:qwen3:b-ii", "equiopt:default"],
            args.model,
            args.routes.split(","),
            args.gram_dtype,
            (args.batch or 8) * (args.seq or 1024),
            args.json,
            args.machine,
            args.shards,
        )
        return
    if args.ops:
        ops(
            args.recipes.split(",")
            if args.recipes != ",".join(STACK_RECIPES)
            else ["paper:qwen3:a-i", "paper:qwen3:b-ii", "equiopt:default"]
        )
        return
    if args.overlap:
        worlds = [int(w) for w in (args.worlds if args.worlds != "1,2" else "2,4").split(",")]
        overlap(
            args.recipes.split(",")
            if args.recipes != ",".join(STACK_RECIPES)
            else ["paper:qwen3:a-i", "paper:qwen3:b-ii"],
            args.repeats or 5,
            worlds,
            args.model,
            args.cost_model,
        )
        return
    if args.divided:
        worlds = [int(w) for w in args.worlds.split(",")]
        divided(
            device, args.recipes.split(","), args.repeats or (20 if device.type == "cuda" else 5), worlds, args.model
        )
        return
    if args.stack:
        seq = args.seq or (1024 if device.type == "cuda" else 256)
        comp = {"auto": None, "on": True, "off": False}[args.compile]
        table = stack(
            device,
            args.recipes.split(","),
            args.repeats or (20 if device.type == "cuda" else 7),
            args.batch or 8,
            seq,
            comp,
            (args.gram_dtype or "float32").split(","),
            args.structure,
            args.graphed,
        )
        if args.json:
            import json

            table.update(device=str(device), torch=torch.__version__, structure=args.structure)
            with open(args.json, "w") as f:
                json.dump(table, f, indent=2)
        return
    if args.route_accuracy:
        accuracy_routes()
        return
    both = not (args.speed or args.accuracy)
    if args.speed or both:
        shrink = args.shrink or (1 if device.type == "cuda" else 4)
        repeats = args.repeats or (20 if device.type == "cuda" else 7)
        speed(device, shrink, repeats, getattr(torch, args.dtype), args.compile == "on")
        print()
    if args.accuracy or both:
        m, n = (int(v) for v in args.tall.lower().split("x"))
        accuracy(m, n)
        print()
        accuracy_low()
        print()
        accuracy_routes()


if __name__ == "__main__":
    main()
