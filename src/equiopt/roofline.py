"""An optimizer step at an accelerator's roofline, counted on the meta device
(``python -m equiopt.bench --roofline``).

The step runs on the meta device (real widths, no memory, no arithmetic) under a
``TorchDispatchMode`` that records, for every ATen operator it dispatches: the FLOPs of
matrix products by the dtype of their operands, the bytes it reads (each distinct input
tensor once, broadcast axes once) and writes (its outputs, or the arguments it mutates),
and the Python function of equiopt that dispatched it (its *stage*). Each operator that
runs a kernel (all but views, allocations and host-side records) is charged

    ``max(FLOPs / product rate of its dtype, bytes / memory bandwidth) + launch``

with the constants of :data:`H100`. Inside
:func:`~equiopt.linalg.device_choices.decide_as` the meta device takes the choices the
step takes on that device (``"cuda"``: bfloat16 polar iterations, ``gram_dtype="auto"`` as
split bfloat16 products for matrices of 512 and more, one-operator float32-output
products).

The same mode follows memory: every storage an operator creates (not a view of an input)
is held from its creation until the last tensor on it is gone, and the largest sum of
those alive at once is the step's peak beyond what existed before it (its state, the
weights, the gradients and the buffers made at earlier steps).
"""

from __future__ import annotations

import math
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .linalg.device_choices import decide_as
from .opcount import VIEW_OPS

__all__ = [
    "H100",
    "H100_MEASURED",
    "MACHINES",
    "Machine",
    "OpCost",
    "RooflineCounter",
    "count_step",
    "fused_adamw_step",
    "meta_model",
    "roofline",
    "fwd_bwd_seconds",
    "DEFAULT_MODEL",
    "QWEN3_0_6B",
    "print_report",
]

#: The model the H100 figures were measured on (results/gpu): Qwen3-0.6B's widths, 20
#: layers, untied embeddings, 625.8 M parameters.
DEFAULT_MODEL = "qwen3:paper"

#: ``Qwen/Qwen3-0.6B``'s own config (28 layers, tied embedding, 596.0 M parameters), by name
#: without a download.
QWEN3_0_6B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}


@dataclass(frozen=True)
class Machine:
    """The constants of a roofline: achieved (not peak) rates of one accelerator.

    ``bfloat16_flops``: dense bfloat16 (and float16) tensor-core products, FLOP/s.
    ``float32_flops``: strict float32 products (TF32 off, torch's default), FLOP/s.
    ``float64_flops``: float64 products, FLOP/s.
    ``bandwidth``: memory bytes read plus written per second.
    ``launch_s``: seconds added per operator that runs a kernel (launch and dispatch, eager).
    ``link_bandwidth``: bytes a rank sends per second in a collective (NVLink within a node).
    ``fwd_bwd_mfu``: the fraction of ``bfloat16_flops`` a forward+backward of ``6 N`` FLOPs
    per token achieves (for the ratio of a step to a forward+backward).
    """

    name: str
    bfloat16_flops: float
    float32_flops: float
    float64_flops: float
    bandwidth: float
    launch_s: float
    fwd_bwd_mfu: float
    link_bandwidth: float = 450e9

    def product_rate(self, dtype: torch.dtype) -> float:
        """FLOP/s of a matrix product whose operands are ``dtype``."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.bfloat16_flops
        return self.float64_flops if dtype == torch.float64 else self.float32_flops

    def seconds(self, flops: float, dtype: torch.dtype | None, nbytes: float) -> float:
        """One kernel's time: the slower of its products and its memory traffic, plus a launch."""
        compute = flops / self.product_rate(dtype) if flops and dtype is not None else 0.0
        return max(compute, nbytes / self.bandwidth) + self.launch_s


#: One H100 SXM 80GB (HBM3). Rates as achieved by large cuBLAS products and streaming
#: kernels (the data sheet's peaks are 989 TFLOP/s bfloat16 dense, 67 TFLOP/s float32 and
#: 3.35 TB/s); 5 us per eager operator; 450 GB/s sent per rank over NVLink (half of the
#: 900 GB/s both ways of the data sheet). ``fwd_bwd_mfu`` is what the H100 measured for
#: Qwen3-0.6B (the ``qwen3:paper`` preset, 625.8 M parameters), 8 x 1024 tokens under
#: bfloat16 autocast: 169.2 ms (results/gpu/figures.json), that is
#: ``6 * 625.8e6 * 8192 / (0.1692 s * 700e12)``.
H100 = Machine(
    name="H100 SXM 80GB (nominal)",
    bfloat16_flops=700e12,
    float32_flops=55e12,
    float64_flops=55e12,
    bandwidth=2.8e12,
    launch_s=5e-6,
    fwd_bwd_mfu=0.2597,
)

#: The same H100 with the rates its own measurements imply (results/gpu, commit bbb07aa,
#: eager: fused AdamW's bytes, a-i's bfloat16 and b-ii's float32 products over their measured
#: times); results/roofline/README.md has the figures and how close the counted steps come.
H100_MEASURED = Machine(
    name="H100 SXM 80GB (measured)",
    bfloat16_flops=550e12,
    float32_flops=47.5e12,
    float64_flops=47.5e12,
    bandwidth=2.1e12,
    launch_s=5e-6,
    fwd_bwd_mfu=0.3305,
)

#: By name, for ``bench --roofline --machine``.
MACHINES = {"h100": H100, "h100-measured": H100_MEASURED}

_PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot"})
# operators that alias, allocate or run on the host only: no kernel
_FREE = VIEW_OPS | frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "promote_types",
        "result_type",
        "_record_function_enter",
        "_record_function_enter_new",
        "_record_function_exit",
    }
)
# collectives (c10d's operators): what a rank sends is counted apart, at the link's rate.
# Those whose schema puts the output first and the input second:
_INPUT_SECOND = frozenset(
    {
        "allgather_",
        "_allgather_base_",
        "allgather_into_tensor_coalesced_",
        "reduce_scatter_",
        "_reduce_scatter_base_",
        "reduce_scatter_tensor_coalesced_",
        "alltoall_",
        "alltoall_base_",
        "gather_",
        "scatter_",
    }
)
_COLLECTIVES = _INPUT_SECOND | frozenset({"allreduce_", "broadcast_", "reduce_", "send", "recv_"})
# operators whose first argument is written and not read
_OVERWRITE = frozenset({"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_", "normal_", "uniform_"})
# mutable arguments (by position) an operator actually writes, where its schema marks more
_WRITES: dict[str, tuple | Callable[[tuple], tuple]] = {
    "_fused_adamw_": (0, 2, 3, 4),
    "_fused_adam_": (0, 2, 3, 4),
    # equiopt::momentum_stage without a direction writes the momentum alone (and its sums)
    "momentum_stage": lambda args: (
        ((1, 2) if len(args) < 7 or args[6] else (2,)) + ((7,) if len(args) > 7 and args[7] is not None else ())
    ),
    # equiopt::factor_add_'s place is workspace of its CPU implementation
    "factor_add_": (0,),
}
# arguments an operator writes without reading them, by the arguments it was given
_UNREAD: dict[str, Callable[[tuple], list]] = {
    # equiopt::momentum_stage given gradients of its own overwrites the scratch with them
    "momentum_stage": lambda args: ([args[1]] if args and args[0] else []) + [t for t in args[7:8] if t is not None],
    "factor_add_": lambda args: [args[4]],
}

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_SELF = os.path.abspath(__file__)


def _footprint(t: torch.Tensor) -> int:
    """Bytes a kernel touches to read or write ``t`` once: broadcast (stride 0) axes count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _key(t: torch.Tensor) -> tuple:
    return (StorageWeakRef(t.untyped_storage()).cdata, t.storage_offset(), tuple(t.shape), t.stride())


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _product_flops(name: str, args: tuple) -> tuple[float, torch.dtype | None]:
    """FLOPs (a multiply and an add each) of a matrix product and its operands' dtype."""
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    if name in ("dot", "vdot"):
        return 2.0 * a.numel(), a.dtype
    if name in ("mv", "addmv"):
        return 2.0 * a.numel(), a.dtype
    batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1], a.dtype


def _stage() -> str:
    """The innermost equiopt function (``module.function``) on the Python stack, outside this module."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and path != _SELF:
            module = frame.f_globals.get("__name__", "?").removeprefix("equiopt.")
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside equiopt)"


@dataclass
class OpCost:
    """One dispatched operator: its name, stage, product FLOPs and their dtype, bytes read
    and written, whether it runs a kernel, and its charged seconds."""

    name: str
    stage: str
    flops: float
    dtype: torch.dtype | None
    read: int
    written: int
    kernel: bool
    seconds: float

    @property
    def bytes(self) -> int:
        return self.read + self.written


class RooflineCounter(TorchDispatchMode):
    """Records an :class:`OpCost` for every operator dispatched while active (``ops``), the
    peak bytes of the storages created meanwhile that were alive at once (``peak_bytes``),
    and the bytes the rank hands to collectives (``sent``; a collective is no kernel here:
    its time is ``sent / link_bandwidth``, :attr:`link_seconds`, apart from :attr:`seconds`)."""

    def __init__(self, machine: Machine = H100):
        super().__init__()
        self.machine = machine
        self.ops: list[OpCost] = []
        self.peak_bytes = 0
        self._alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self._held = 0
        self.sent = 0
        self.collectives = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._alive.items() if ref.expired()]:
            self._held -= self._alive.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._sweep()
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = _tensors((args, kwargs))
        if name in _COLLECTIVES:
            self.collectives += 1
            # what the rank hands over: the input (after the output where the schema puts it first)
            given = args[1] if name in _INPUT_SECOND and len(args) > 1 else args[0] if args else ()
            self.sent += sum(_footprint(t) for t in _tensors(given))
            self.ops.append(OpCost(name, _stage(), 0.0, None, 0, 0, False, 0.0))
            return out
        kernel = name not in _FREE
        read = written = 0
        flops, dtype = 0.0, None
        if kernel:
            schema = func._schema.arguments
            mutable = [
                i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write and i < len(args)
            ]
            writes = _WRITES.get(name, mutable)
            mutable = list(writes(args) if callable(writes) else writes)
            targets = _tensors([args[i] for i in mutable]) + _tensors(kwargs.get("out"))
            skip = {_key(t) for t in _tensors(args[0])} if name in _OVERWRITE and args else set()
            skip |= {_key(t) for t in _tensors(kwargs.get("out"))}
            if name in _UNREAD:
                skip |= {_key(t) for t in _tensors(_UNREAD[name](args))}
            seen: dict[tuple, int] = {}
            for t in inputs:
                k = _key(t)
                if k not in skip:
                    seen.setdefault(k, _footprint(t))
            read = sum(seen.values())
            written_tensors = targets if targets else _tensors(out)
            written = sum({_key(t): _footprint(t) for t in written_tensors}.values())
            if name.removesuffix("_") in _PRODUCTS:
                flops, dtype = _product_flops(name.removesuffix("_"), args)
        seconds = self.machine.seconds(flops, dtype, read + written) if kernel else 0.0
        self.ops.append(OpCost(name, _stage(), flops, dtype, read, written, kernel, seconds))
        known = {StorageWeakRef(t.untyped_storage()).cdata for t in inputs}
        for t in _tensors(out):
            ref = StorageWeakRef(t.untyped_storage())
            if ref.cdata not in known and ref.cdata not in self._alive:
                size = t.untyped_storage().nbytes()
                self._alive[ref.cdata] = (ref, size)
                self._held += size
        self.peak_bytes = max(self.peak_bytes, self._held)
        return out

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.ops)

    @property
    def link_seconds(self) -> float:
        """Seconds the rank spends sending what it hands to collectives, at the link's rate."""
        return self.sent / self.machine.link_bandwidth

    @property
    def kernels(self) -> int:
        """Operators that run a kernel (all but views, allocations and host-side records)."""
        return sum(o.kernel for o in self.ops)

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.ops)

    def flops_by_dtype(self) -> dict[str, float]:
        """Product FLOPs by operand dtype (``"bfloat16"``, ``"float32"``, ...)."""
        out: dict[str, float] = defaultdict(float)
        for o in self.ops:
            if o.flops:
                out[str(o.dtype).removeprefix("torch.")] += o.flops
        return dict(out)

    def top(self, n: int = 10, by: str = "op+stage") -> list[dict]:
        """The ``n`` costliest groups of kernels, grouped ``by`` ``"op"``, ``"stage"`` or
        ``"op+stage"``: ``{"name", "seconds", "flops", "bytes", "count"}`` each, costliest first."""
        groups: dict[str, dict] = {}
        for o in self.ops:
            if not o.kernel:
                continue
            label = {"op": o.name, "stage": o.stage}.get(by, f"{o.name} @ {o.stage}")
            g = groups.setdefault(label, {"name": label, "seconds": 0.0, "flops": 0.0, "bytes": 0, "count": 0})
            g["seconds"] += o.seconds
            g["flops"] += o.flops
            g["bytes"] += o.bytes
            g["count"] += 1
        return sorted(groups.values(), key=lambda g: -g["seconds"])[:n]


def count_step(step: Callable[[], object], warmup: int = 1, machine: Machine = H100) -> RooflineCounter:
    """The roofline of one call of ``step`` after ``warmup`` calls (so state and buffers exist)."""
    for _ in range(warmup):
        step()
    with RooflineCounter(machine) as counter:
        step()
    return counter


def fused_adamw_step(params: Iterable[torch.Tensor]) -> Callable[[], None]:
    """A step of ``torch.optim.AdamW(fused=True)`` on ``params`` as torch dispatches it on
    CUDA (its step counters' foreach add, then one ``_fused_adamw_``), with zero state
    made here; on the meta device, where ``torch.optim.AdamW`` refuses ``fused=True``."""
    ps = [p.detach() for p in params]
    grads = [torch.empty_like(p) if p.grad is None else p.grad for p in ps]
    exp_avgs = [torch.zeros_like(p) for p in ps]
    exp_avg_sqs = [torch.zeros_like(p) for p in ps]
    steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in ps]

    def step() -> None:
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            ps,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=1e-2,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    return step


def meta_model(name: str = DEFAULT_MODEL) -> torch.nn.Module:
    """A causal LM on the meta device: an :mod:`equiopt.models` preset ``"family:size"``
    (``qwen3:paper`` is Qwen3-0.6B at its widths, 20 layers, untied), ``"qwen3-0.6b"``
    (:data:`QWEN3_0_6B`), ``"VOCABxHIDDEN"`` (4 Qwen3 layers of that size), or a
    transformers config (a local path or a cached hub name)."""
    from . import models

    if name.lower() in ("qwen3-0.6b", "qwen/qwen3-0.6b"):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        with torch.device("meta"):
            return Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B))
    if ":" in name and name.split(":")[0] in models.FAMILIES:
        family, size = name.split(":", 1)
        return models.build(family, size, device="meta")
    if "x" in name and all(part.isdigit() for part in name.lower().split("x")):
        return models.build_vocab_shaped(name, device="meta", seed=None)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _with_gram_dtype(recipe: str, gram_dtype: str):
    """``recipe`` with ``gram_dtype`` on every role whose rule takes it (unchanged if none does)."""
    from .recipes import RULE_FIELDS, get_recipe

    base = get_recipe(recipe)
    roles = [r for r in base.roles if "gram_dtype" in RULE_FIELDS[base.roles[r]["rule"]]]
    return base.with_overrides({r: {"gram_dtype": gram_dtype} for r in roles}) if roles else base


def fwd_bwd_seconds(n_params: int, tokens: int, machine: Machine = H100) -> float:
    """A forward+backward's estimated time: ``6 * n_params * tokens`` FLOPs at
    ``machine.fwd_bwd_mfu`` of its bfloat16 rate."""
    return 6.0 * n_params * tokens / (machine.bfloat16_flops * machine.fwd_bwd_mfu)


def _summary(counter: RooflineCounter, top: int) -> dict:
    return {
        "ms": 1e3 * counter.seconds,
        "flops": counter.flops_by_dtype(),
        "gb": counter.bytes / 1e9,
        "kernels": counter.kernels,
        "operators": len(counter.ops),
        "peak_extra_mib": counter.peak_bytes / 2**20,
        "sent_gb": counter.sent / 1e9,
        "link_ms": 1e3 * counter.link_seconds,
        "collectives": counter.collectives,
        "top": counter.top(top),
        "top_stages": counter.top(top, by="stage"),
    }


def roofline(
    recipes: Iterable[str],
    model: torch.nn.Module | str = DEFAULT_MODEL,
    route: str = "cuda",
    gram_dtype: str | None = None,
    tokens: int = 8 * 1024,
    machine: Machine = H100,
    top: int = 10,
    shards: int = 1,
) -> dict:
    """Counts one step of each recipe (and of fused AdamW) on ``model``'s parameters on the
    meta device, taking the choices of ``route`` (a device type, :func:`decide_as`);
    ``gram_dtype`` set on every role that takes one, or None for the recipes' own.
    ``shards > 1``: the model ``fully_shard``-ed over that many ranks (every decoder layer
    and the root, as torchtitan does; a fake process group, :func:`equiopt.planning.fake_world`)
    and rank 0's step counted, what it hands to collectives apart (``sent_gb``, ``link_ms``).

    Returns ``{"model", "route", "gram_dtype", "params", "state_mib", "fwd_bwd_ms",
    "placement", "adamw": summary, "recipes": {name: summary}}``; a summary holds ``ms``,
    ``flops`` by dtype, ``gb`` moved, ``kernels``, ``operators``, ``peak_extra_mib``,
    ``sent_gb``, ``link_ms``, ``collectives``, ``state_mib`` (a recipe's), ``over_adamw``,
    ``over_fwd_bwd`` and the ``top`` operators and stages.
    """
    if shards > 1:
        import torch.distributed as dist

        from .planning import fake_world, shard_model

        fake_world(shards)
        try:
            net = meta_model(model) if isinstance(model, str) else model
            shard_model(net, {"dp_shard": shards})
            table = roofline(recipes, net, route, gram_dtype, tokens, machine, top)
        finally:
            dist.destroy_process_group()
        table["model"] = model if isinstance(model, str) else type(model).__name__
        table["placement"] = f"FSDP2 over {shards} ranks, rank 0"
        return table
    from .roles import build_optimizer

    label = model if isinstance(model, str) else type(model).__name__
    net = meta_model(model) if isinstance(model, str) else model
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.empty_like(p)
    n = sum(p.numel() for p in params)
    fb = fwd_bwd_seconds(n, tokens, machine)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # (a rank's shards)
    adamw = _summary(count_step(fused_adamw_step(local), machine=machine), top)
    adamw["over_fwd_bwd"] = adamw["ms"] / (1e3 * fb)
    out: dict = {
        "model": label,
        "route": route,
        "gram_dtype": gram_dtype,
        "machine": machine.name,
        "params": n,
        "tokens": tokens,
        "fwd_bwd_ms": 1e3 * fb,
        "adamw": adamw,
        "placement": "one process",
        "recipes": {},
    }
    with decide_as(route):
        for name in recipes:
            recipe = name if gram_dtype is None else _with_gram_dtype(name, gram_dtype)
            opt, _ = build_optimizer(net, recipe, eager_state=True, compile=False)
            s = _summary(count_step(opt.step, machine=machine), top)
            s["state_mib"] = _state_bytes(opt) / 2**20
            s["over_adamw"] = s["ms"] / adamw["ms"]
            s["over_fwd_bwd"] = s["ms"] / (1e3 * fb)
            out["recipes"][name] = s
            del opt
    return out


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage once."""
    sizes: dict[int, int] = {}
    for st in opt.state.values():
        for t in st.values():
            if torch.is_tensor(t):
                t = t.to_local() if hasattr(t, "to_local") else t  # (a rank's shard of a DTensor's)
                sizes.setdefault(StorageWeakRef(t.untyped_storage()).cdata, t.untyped_storage().nbytes())
    return sum(sizes.values())


def _links(s: dict) -> str:
    """A sharded step's columns: the GB its rank hands to collectives and their time at the link's rate."""
    return f" {s['sent_gb']:8.2f} {s['link_ms']:8.2f}"


def _flops_text(flops: dict[str, float]) -> str:
    def amount(v: float) -> str:
        return f"{v / 1e12:.2f} T" if v >= 1e10 else f"{v / 1e9:.2f} G"

    return ", ".join(f"{amount(v)} {k}" for k, v in sorted(flops.items())) or "none"


def print_report(table: dict, file=None) -> None:
    """Prints :func:`roofline`'s table: a line per recipe, then each recipe's costliest operators."""
    fb = table["fwd_bwd_ms"]
    a = table["adamw"]
    print(
        f"roofline of one step on the meta device, rates of an {table['machine']}, {table['route']}'s choices"
        f"{', gram_dtype=' + table['gram_dtype'] if table['gram_dtype'] else ''}; model {table['model']} "
        f"({table['params'] / 1e6:.1f} M parameters); forward+backward of {table['tokens']} tokens "
        f"{fb:.1f} ms (estimated); fused AdamW {a['ms']:.2f} ms, {a['gb']:.1f} GB"
        f"{'' if table.get('placement', 'one process') == 'one process' else '; ' + table['placement']}",
        file=file,
    )
    sharded = table.get("placement", "one process") != "one process"
    links_head = f" {'sent GB':>8s} {'link ms':>8s}" if sharded else ""
    print(
        f"{'recipe':22s} {'ms':>7s} {'/AdamW':>7s} {'/fwd+bwd':>9s} {'GB':>6s} {'kernels':>8s} {'ops':>6s}"
        f" {'state MiB':>10s} {'peak extra MiB':>15s}{links_head}  products (FLOP)",
        file=file,
    )
    for name, s in table["recipes"].items():
        print(
            f"{name:22s} {s['ms']:7.1f} {s['over_adamw']:7.2f} {s['over_fwd_bwd']:9.3f} {s['gb']:6.1f}"
            f" {s['kernels']:8d} {s['operators']:6d} {s['state_mib']:10.0f} {s['peak_extra_mib']:15.0f}"
            f"{_links(s) if sharded else ''}  {_flops_text(s['flops'])}",
            file=file,
        )
    for name, s in table["recipes"].items():
        print(f"\n{name}: the ten costliest operators (operator @ stage)", file=file)
        print(f"  {'ms':>7s} {'GB':>6s} {'TFLOP':>6s} {'count':>6s}  operator @ stage", file=file)
        for g in s["top"]:
            print(
                f"  {1e3 * g['seconds']:7.2f} {g['bytes'] / 1e9:6.2f} {g['flops'] / 1e12:6.2f} {g['count']:6d}"
                f"  {g['name']}",
                file=file,
            )
