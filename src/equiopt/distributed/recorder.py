"""Record every torch.distributed collective issued in a block: op, bytes, dtype.

    with record_collectives() as log:
        optimizer.step()
    print(log.summary())            # {op: (count, bytes)}
    assert log.total_bytes() < vocab.numel() * 4 / 2

The block runs under a ``TorchDispatchMode`` that sees the dispatcher ops every
collective goes through, whichever way it was issued: the c10d ops ``torch.ops.c10d.*``
behind the ``torch.distributed`` functions and ``ProcessGroup`` methods (``allreduce_``,
``_allgather_base_``, ``_reduce_scatter_base_``, ``alltoall_base_``, ``send``, ``recv_``,
..., with ``async_op=True`` or not, from Python or from C++ as a DDP reducer's bucket
all-reduces), the functional collectives ``torch.ops._c10d_functional.*`` that
``torch.distributed._functional_collectives``, DTensor (``full_tensor()``,
``redistribute``, reductions to ``Partial``) and FSDP2 issue, and DTensor's
``torch.ops._dtensor.shard_dim_alltoall``. Nothing is patched. An op on a DTensor is let
through to DTensor first (the mode answers ``NotImplemented``), so the collectives it
lowers to are seen. A collective made inside another (a functional all-reduce runs a c10d
all-reduce) is counted once, the outer one; object collectives (``all_gather_object``)
are seen as the tensor collectives they make; the body of a higher-order operator
(``torch.cond``) run eagerly is not looked into. Dispatch modes are per thread: the block
sees what its thread issues (and the autograd engine's backward, which carries the mode),
not another thread of the process. ``torch.compile`` compiles as it would outside the
block and the compiled code's collectives are recorded as they run (torch >= 2.9, where a
mode can ask for this; before, Dynamo does not compile under a dispatch mode: the code
runs eagerly, and ``fullgraph=True`` fails).

``bytes`` is the message size as nccl-tests reports it: the tensor of an all-reduce,
broadcast, reduce, send or receive; the gathered output of an all-gather or gather; the
full input of a reduce-scatter, scatter or all-to-all (a barrier counts 0). ``group_size``
lets a reader derive what each rank sends (a ring all-reduce sends ``2 (n - 1) / n`` of
it, an all-gather or reduce-scatter ``(n - 1) / n``). DTensor pads uneven shards before it
gathers them; the padded size is what is counted.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveRecord", "CollectiveLog", "record_collectives"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: ``op`` (its kind), ``bytes`` (message size), ``dtype``, first tensor's ``shape``."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | reduce | gather | scatter | send | recv | barrier
    bytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] = ()
    group_size: int | None = None
    api: str = ""  # the dispatcher op, e.g. "c10d._allgather_base_" or "_c10d_functional.all_reduce"


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


# dispatcher op -> (op recorded, position of the tensor(s) sized or None, times what):
# "group" multiplies by the group's size (gather and scatter move one tensor per rank),
# "group_size" by that argument (a functional all-gather is sized by its input).
_C10D = {
    "allreduce_": ("all_reduce", 0, None),
    "allreduce_coalesced_": ("all_reduce", 0, None),
    "broadcast_": ("broadcast", 0, None),
    "reduce_": ("reduce", 0, None),
    "allgather_": ("all_gather", 0, None),
    "_allgather_base_": ("all_gather", 0, None),
    "allgather_coalesced_": ("all_gather", 0, None),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, None),
    "reduce_scatter_": ("reduce_scatter", 1, None),
    "_reduce_scatter_base_": ("reduce_scatter", 1, None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, None),
    "alltoall_": ("all_to_all", 1, None),
    "alltoall_base_": ("all_to_all", 1, None),
    "gather_": ("gather", 1, "group"),
    "scatter_": ("scatter", 0, "group"),
    "send": ("send", 0, None),
    "recv_": ("recv", 0, None),
    "recv_any_source_": ("recv", 0, None),
    "barrier": ("barrier", None, None),
    "monitored_barrier_": ("barrier", None, None),
}
_FUNCTIONAL = {
    **{
        name: ("all_reduce", 0, None)
        for name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_")
    },
    **{
        name: ("all_gather", 0, "group_size")
        for name in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")
    },
    **{
        name: ("reduce_scatter", 0, None)
        for name in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced")
    },
    "all_to_all_single": ("all_to_all", 0, None),
    "broadcast": ("broadcast", 0, None),
    "broadcast_": ("broadcast", 0, None),
    "isend": ("send", 0, None),
    "irecv": ("recv", 0, None),
}
_OPS = {f"c10d::{name}": spec for name, spec in _C10D.items()}
_OPS.update(
    {
        f"{ns}::{name}": spec
        for ns in ("_c10d_functional", "_c10d_functional_autograd")
        for name, spec in _FUNCTIONAL.items()
    }
)
_OPS["_dtensor::shard_dim_alltoall"] = ("all_to_all", 0, None)
_BATCH_P2P = "_c10d_functional::batch_p2p_ops"  # one record per send or receive it batches


def _nbytes(t: Any) -> int:
    if torch.is_tensor(t):
        return t.numel() * t.element_size()
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else 0


def _first_tensor(x: Any) -> torch.Tensor | None:
    if torch.is_tensor(x):
        return x
    for item in x if isinstance(x, (list, tuple)) else ():
        if (found := _first_tensor(item)) is not None:
            return found
    return None


def _group_size(group: Any) -> int | None:
    """Size of a c10d op's ``ProcessGroup`` (a ``ScriptObject`` to the mode) or a functional op's group name."""
    import torch.distributed as dist

    try:
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        elif isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        return int(group.size())
    except Exception:  # a group we cannot resolve: the size stays unknown
        return None


def _record(op: str, tensors: Any, group_size: int | None, times: int, api: str) -> CollectiveRecord:
    first = _first_tensor(tensors)
    return CollectiveRecord(
        op,
        _nbytes(tensors) * times,
        first.dtype if first is not None else None,
        tuple(first.shape) if first is not None else (),
        group_size,
        api,
    )


def _records(name: str, args: tuple, kwargs: dict, schema: Any) -> list[CollectiveRecord]:
    bound = dict(zip([a.name for a in schema.arguments], args), **kwargs)
    values = [bound.get(a.name) for a in schema.arguments]
    size = _group_size(bound.get("process_group", bound.get("group_name")))
    api = name.replace("::", ".")
    if name == _BATCH_P2P:
        return [
            _record("send" if kind == "isend" else "recv", t, size, 1, api)
            for kind, t in zip(bound["op_list"], bound["tensors"])
        ]
    op, index, times = _OPS[name]
    if times == "group_size":
        size = int(bound["group_size"])
    return [_record(op, values[index] if index is not None else None, size, 1 if times is None else (size or 1), api)]


class _Recorder(TorchDispatchMode):
    supports_higher_order_operators = True  # torch.cond and the like pass through (their bodies run unseen)

    def __init__(self, log: CollectiveLog, dtensor: type | None):
        super().__init__()
        self.log, self.dtensor = log, dtensor

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # torch.compile compiles as if unrecorded; the compiled code's collectives are seen as it runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)  # None for a higher-order operator
        if schema is not None and (schema.name in _OPS or schema.name == _BATCH_P2P):
            try:
                self.log.records.extend(_records(schema.name, args, kwargs, schema))
            except Exception as err:  # never let counting break the collective itself; say what was missed
                warnings.warn(
                    f"record_collectives: could not size {schema.name} ({err!r}); it is recorded with 0 bytes",
                    stacklevel=2,
                )
                op = _OPS[schema.name][0] if schema.name in _OPS else "send"
                self.log.records.append(CollectiveRecord(op, 0, None, (), None, schema.name.replace("::", ".")))
        elif self.dtensor is not None and any(issubclass(t, self.dtensor) for t in types):
            return NotImplemented  # DTensor runs first and lowers the op to collectives on plain tensors, seen here
        return func(*args, **kwargs)


@contextmanager
def record_collectives(extra_modules: tuple[Any, ...] = ()) -> Iterator[CollectiveLog]:
    """Record the collectives issued in the block into the :class:`CollectiveLog` it yields.

    Recorders nest (each sees everything issued inside it). ``extra_modules`` is accepted
    for compatibility and not needed: a function imported by name anywhere still issues
    the dispatcher ops that are recorded.
    """
    import torch.distributed as dist

    log = CollectiveLog()
    if not dist.is_available():
        yield log
        return
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 spells it torch.distributed._tensor
        from torch.distributed._tensor import DTensor
    with _Recorder(log, DTensor):
        yield log
