"""Record every torch.distributed collective issued in a block: op, bytes, dtype.

    with record_collectives() as log:
        optimizer.step()
    print(log.summary())            # {op: (count, bytes)}
    assert log.total_bytes() < vocab.numel() * 4 / 2

Three entry points are wrapped while the block runs, so eager c10d calls, functional
collectives and DTensor redistributions are all seen:

- the c10d functions (``torch.distributed.all_reduce``, ``all_gather_into_tensor``,
  ``broadcast``, ...), in ``torch.distributed`` and every ``torch.distributed.*`` module
  (or ``extra_modules``) that imported them by name;
- the functional-collective ops ``torch.ops._c10d_functional.*`` (and their autograd
  variants), which ``torch.distributed._functional_collectives`` and DTensor issue
  (``full_tensor()``, ``redistribute``, reductions to ``Partial``);
- DTensor's own ``torch.ops._dtensor.shard_dim_alltoall``.

A collective made inside another recorded one (``all_gather_object`` calls
``all_gather``) is counted once, at the outermost call; object collectives
(``*_object*``) are not wrapped, so their tensor collectives are what is recorded.

``bytes`` is the message size as nccl-tests reports it: the tensor of an all-reduce,
broadcast, reduce, send or receive; the gathered output of an all-gather or gather; the
full input of a reduce-scatter, scatter or all-to-all. ``group_size`` lets a reader
derive what each rank sends (a ring all-reduce sends ``2 (n - 1) / n`` of it, an
all-gather or reduce-scatter ``(n - 1) / n``). DTensor pads uneven shards before it
gathers them; the padded size is what is counted. FSDP2's parameter all-gathers and
gradient reduce-scatters go through the c10d functions and are seen; collectives issued
from C++ (a DDP reducer's bucket all-reduces) and functions imported by name into a
module outside ``torch.distributed`` before the block (unless passed as
``extra_modules``) are not.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["CollectiveRecord", "CollectiveLog", "record_collectives"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: ``op`` (its kind), ``bytes`` (message size), ``dtype``, first tensor's ``shape``."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | reduce | gather | scatter | send | recv | barrier
    bytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] = ()
    group_size: int | None = None
    api: str = ""  # the function or op called, e.g. "all_gather_into_tensor" or "_c10d_functional.all_reduce"


@dataclass
class CollectiveLog:
    """The records of one :func:`record_collectives` block, in issue order."""

    records: list[CollectiveRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[CollectiveRecord]:
        return iter(self.records)

    def total_bytes(self, op: str | None = None) -> int:
        """Sum of ``bytes`` (of one op only, if given; names as recorded, e.g. ``"all_reduce"``)."""
        return sum(r.bytes for r in self.records if op is None or r.op == op)

    def ops(self) -> list[str]:
        return [r.op for r in self.records]

    def summary(self) -> dict[str, tuple[int, int]]:
        """``{op: (count, bytes)}``."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in self.records:
            out[r.op][0] += 1
            out[r.op][1] += r.bytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def clear(self) -> None:
        self.records.clear()


# --------------------------------------------------------------------- byte counts
def _nbytes(t: Any) -> int:
    if torch.is_tensor(t):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _first_tensor(x: Any) -> torch.Tensor | None:
    if torch.is_tensor(x):
        return x
    if isinstance(x, (list, tuple)):
        for item in x:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _group_size(group: Any) -> int | None:
    import torch.distributed as dist

    try:
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(group).size()
        if group is not None and callable(getattr(group, "size", None)):
            return int(group.size())
        return dist.get_world_size(group)
    except Exception:  # a group we cannot resolve: the size stays unknown
        return None


def _canonical(api: str) -> str:
    """``all_gather_into_tensor`` -> ``all_gather``, ``all_reduce_coalesced_`` -> ``all_reduce``, ``isend`` -> ``send``."""
    name = api.rstrip("_")
    for suffix in ("_coalesced", "_out", "_into_tensor", "_tensor", "_single"):
        name = name.replace(suffix, "")
    return {"isend": "send", "irecv": "recv"}.get(name, name)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


# c10d functions: name -> (index/name of the tensor(s) sized, multiplier kind, index/name of the group)
# "world" multiplies by the group size (gather of one tensor per rank into a list).
_C10D: dict[str, tuple[tuple[int, str], str, tuple[int, str]]] = {
    "all_reduce": ((0, "tensor"), "one", (2, "group")),
    "all_reduce_coalesced": ((0, "tensors"), "one", (2, "group")),
    "broadcast": ((0, "tensor"), "one", (2, "group")),
    "reduce": ((0, "tensor"), "one", (3, "group")),
    "all_gather": ((0, "tensor_list"), "one", (2, "group")),
    "all_gather_into_tensor": ((0, "output_tensor"), "one", (2, "group")),
    "all_gather_single": ((0, "output_tensor"), "one", (2, "group")),  # torch >= 2.13's name
    "all_gather_coalesced": ((0, "output_tensor_lists"), "one", (2, "group")),
    "reduce_scatter": ((1, "input_list"), "one", (3, "group")),
    "reduce_scatter_tensor": ((1, "input"), "one", (3, "group")),
    "reduce_scatter_single": ((1, "input"), "one", (3, "group")),
    "all_to_all": ((1, "input_tensor_list"), "one", (2, "group")),
    "all_to_all_single": ((1, "input"), "one", (4, "group")),
    "gather": ((0, "tensor"), "world", (3, "group")),
    "scatter": ((0, "tensor"), "world", (3, "group")),
    "send": ((0, "tensor"), "one", (2, "group")),
    "recv": ((0, "tensor"), "one", (2, "group")),
    "isend": ((0, "tensor"), "one", (2, "group")),
    "irecv": ((0, "tensor"), "one", (2, "group")),
    "barrier": ((-1, ""), "none", (0, "group")),
}

# functional ops (torch.ops._c10d_functional / _c10d_functional_autograd):
# name -> (tensor arg index, multiplier: "one" or index of a group_size argument, group argument index)
_FUNCTIONAL: dict[str, tuple[int, Any, int]] = {
    "all_reduce": (0, "one", 2),
    "all_reduce_": (0, "one", 2),
    "all_reduce_coalesced": (0, "one", 2),
    "all_reduce_coalesced_": (0, "one", 2),
    "all_gather_into_tensor": (0, 1, 2),
    "all_gather_into_tensor_out": (0, 1, 2),
    "all_gather_into_tensor_coalesced": (0, 1, 2),
    "reduce_scatter_tensor": (0, "one", 3),
    "reduce_scatter_tensor_out": (0, "one", 3),
    "reduce_scatter_tensor_coalesced": (0, "one", 3),
    "all_to_all_single": (0, "one", 3),
    "broadcast": (0, "one", 2),
    "broadcast_": (0, "one", 2),
}


# ------------------------------------------------------------------------ patching
_local = threading.local()
_active: list[CollectiveLog] = []
_lock = threading.Lock()


def _depth() -> int:
    return getattr(_local, "depth", 0)


def _emit(record: CollectiveRecord) -> None:
    for log in list(_active):
        log.records.append(record)


def _call_recorded(make_record: Callable[[], CollectiveRecord], fn: Callable, args: tuple, kwargs: dict):
    if not _active or _depth():
        return fn(*args, **kwargs)
    try:
        record = make_record()
    except Exception as err:  # never let counting break the collective itself; say what was missed
        warnings.warn(f"record_collectives: could not size a collective ({err!r}); it is recorded with 0 bytes")
        record = getattr(make_record, "fallback", None)
    _local.depth = _depth() + 1
    try:
        return fn(*args, **kwargs)
    finally:
        _local.depth -= 1
        if record is not None:
            _emit(record)


def _c10d_wrapper(name: str, fn: Callable) -> Callable:
    (t_index, t_name), mult, (g_index, g_name) = _C10D[name]

    def record(args, kwargs) -> CollectiveRecord:
        tensors = _arg(args, kwargs, t_index, t_name) if t_index >= 0 else None
        size = _group_size(_arg(args, kwargs, g_index, g_name))
        nbytes = _nbytes(tensors)
        if mult == "world":
            nbytes *= size or 1
        first = _first_tensor(tensors)
        return CollectiveRecord(_canonical(name), nbytes, first.dtype if first is not None else None,
                                tuple(first.shape) if first is not None else (), size, name)

    def wrapper(*args, **kwargs):
        make = lambda: record(args, kwargs)  # noqa: E731
        make.fallback = CollectiveRecord(_canonical(name), 0, None, (), None, name)
        return _call_recorded(make, fn, args, kwargs)

    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper._equiopt_recorder = True
    return wrapper


class _RecordingOp:
    """Stands in for an ``OpOverloadPacket`` in its ``torch.ops`` namespace; attributes pass through."""

    def __init__(self, packet: Any, name: str, source: str, spec: tuple[int, Any, int]):
        # source: "namespace.op", what CollectiveRecord.api reports
        self._packet, self._name, self._source, self._spec = packet, name, source, spec

    def __getattr__(self, item: str) -> Any:
        return getattr(self._packet, item)

    def __call__(self, *args, **kwargs):
        make = lambda: self._record(args, kwargs)  # noqa: E731
        make.fallback = CollectiveRecord(_canonical(self._name), 0, None, (), None, self._source)
        return _call_recorded(make, self._packet, args, kwargs)

    def _record(self, args: tuple, kwargs: dict) -> CollectiveRecord:
        if kwargs:  # put keyword arguments in their schema positions
            names = [a.name for a in self._packet.default._schema.arguments]
            args = tuple(args) + tuple(kwargs[n] for n in names[len(args):] if n in kwargs)
        t_index, mult, g_index = self._spec
        tensors = args[t_index]
        nbytes = _nbytes(tensors)
        size = _group_size(args[g_index]) if len(args) > g_index else None
        if mult != "one":
            size = int(args[mult])
            nbytes *= size
        first = _first_tensor(tensors)
        return CollectiveRecord(_canonical(self._name), nbytes, first.dtype if first is not None else None,
                                tuple(first.shape) if first is not None else (), size, self._source)


def _c10d_modules(extra: tuple[Any, ...]) -> list[Any]:
    mods = [m for n, m in list(sys.modules.items()) if m is not None and (n == "torch.distributed" or n.startswith("torch.distributed."))]
    return mods + [m for m in extra if m not in mods]


@contextmanager
def record_collectives(extra_modules: tuple[Any, ...] = ()) -> Iterator[CollectiveLog]:
    """Record the collectives issued in the block into the :class:`CollectiveLog` it yields.

    Recorders nest (each sees everything issued inside it). ``extra_modules``: modules
    outside ``torch.distributed`` that imported c10d functions by name (the outermost
    recorder's are the ones patched).
    """
    import torch.distributed as dist

    log = CollectiveLog()
    if not dist.is_available():
        yield log
        return
    import torch.distributed.distributed_c10d as c10d

    with _lock:
        first = not _active
        _active.append(log)
    undo: list[tuple[Any, str, Any]] = []
    try:
        if first:
            originals = {name: getattr(c10d, name) for name in _C10D if hasattr(c10d, name)}
            wrappers = {name: _c10d_wrapper(name, fn) for name, fn in originals.items()}
            by_id = {id(fn): (fn, wrappers[name]) for name, fn in originals.items()}
            for module in _c10d_modules(tuple(extra_modules)):
                for attr, value in list(vars(module).items()):
                    hit = by_id.get(id(value))
                    if hit is not None and value is hit[0]:
                        undo.append((module, attr, value))
                        setattr(module, attr, hit[1])
            for ns_name, table in (("_c10d_functional", _FUNCTIONAL), ("_c10d_functional_autograd", _FUNCTIONAL),
                                   ("_dtensor", {"shard_dim_alltoall": (0, "one", 3)})):
                namespace = getattr(torch.ops, ns_name)
                for op, spec in table.items():
                    try:
                        packet = getattr(namespace, op)
                    except (AttributeError, RuntimeError):
                        continue
                    name = "all_to_all" if op == "shard_dim_alltoall" else op
                    undo.append((namespace, op, packet))
                    setattr(namespace, op, _RecordingOp(packet, name, f"{ns_name}.{op}", spec))
        yield log
    finally:
        for target, attr, value in reversed(undo):
            setattr(target, attr, value)
        with _lock:
            _active.remove(log)
