"""The one way the tests start processes: gloo ranks spawned by Python, ``torchrun``, or a
subprocess started with the session (:func:`background`).

``run_gloo(fn, world, *args, directory=...)`` runs ``fn(rank, world, *args)`` on ``world``
spawned processes joined in one gloo process group and returns what each rank returned
(``torch.save``-able values). ``fn`` must be importable (a module-level function of a test
module). Every rank, as torchrun would set it up: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in
its environment, one thread, a ``file://`` rendezvous in ``directory`` (no TCP port that
another job on the machine could take first). After ``fn`` returns, every rank drops what
still refers to the group (``gc.collect``), waits for the others (``barrier``) and only then
destroys the group: a rank that tears gloo down while another still talks on it, or a
tensor on a mesh that outlives its group, aborts the process.

When a rank raises, the others get ``grace`` seconds to finish or fail too (a peer waiting
in a collective never returns), then are stopped; the test fails with every rank's
traceback, and the Python stack of each rank that had to be stopped (or that was still
running at ``timeout``), so that a hang says where each rank waits.

``run_torchrun(*argv, nproc=2)`` runs ``torchrun --standalone --nproc_per_node=nproc argv``
(``--standalone``: a rendezvous on a port the OS picks) and fails with the tail of its
output; ``torchrun_command`` gives the command line and environment for tests that drive
the process themselves. The ``gloo`` and ``torchrun`` fixtures of ``conftest.py`` wrap both
and mark their tests ``distributed``.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch

TIMEOUT = 900  # seconds for a whole gloo launch: minutes under a loaded, shared CPU
GRACE = 10  # seconds the other ranks get to finish or fail once one rank failed


def _rank_main(fn, rank, world, directory, args):
    directory = Path(directory)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    stacks = open(directory / f"rank{rank}.stack", "w")
    if hasattr(signal, "SIGUSR1"):  # the launcher asks a rank it is about to stop where it waits
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{directory / 'rendezvous'}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save(result, directory / f"rank{rank}.result")
        del result
        gc.collect()  # no tensor that refers to the group may outlive it
        dist.barrier()  # and no rank may destroy it while another still talks on it
        dist.destroy_process_group()
    except BaseException:
        (directory / f"rank{rank}.traceback").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # no teardown: the peers may be waiting in a collective


def _describe(fn):
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def run_gloo(fn, world, *args, directory, timeout=TIMEOUT, grace=GRACE):
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; the list of their return values."""
    directory = Path(tempfile.mkdtemp(prefix="gloo-", dir=directory))
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world, str(directory), args), name=f"rank {rank}")
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    start = time.monotonic()
    first_failure, failed = None, []  # the ranks in the order their failures were seen
    stopped, timed_out = [], False
    try:
        while True:
            failed += [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0) and rank not in failed]
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            now = time.monotonic()
            if first_failure is None and failed:
                first_failure = now
            if first_failure is not None and now - first_failure > grace:
                stopped = alive
                break
            if now - start > timeout:
                stopped, timed_out = alive, True
                break
            wait([p.sentinel for p in alive], timeout=0.5)
    finally:
        survivors = [p for p in procs if p.exitcode is None]
        if survivors and hasattr(signal, "SIGUSR1"):
            for p in survivors:
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(1)
        for p in survivors:
            p.kill()
        for p in procs:
            p.join(30)
    if not timed_out and all(p.exitcode == 0 for p in procs):
        return [torch.load(directory / f"rank{rank}.result", weights_only=False) for rank in range(world)]

    failed += [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0) and rank not in failed]
    lines, details = [], []
    for rank in [*failed[:1], *(r for r in range(world) if r not in failed[:1])]:  # the first failure first
        p = procs[rank]
        tb = directory / f"rank{rank}.traceback"
        if p in stopped:
            why = (
                f"still running after {timeout} s"
                if timed_out
                else f"stopped: still running {grace} s after another rank failed"
            )
            stack = (directory / f"rank{rank}.stack").read_text().strip()
            lines.append(f"  rank {rank}: {why}")
            details.append(f"----- rank {rank}: where it was when stopped -----\n{stack or '(no Python stack)'}")
        elif tb.exists():
            lines.append(f"  rank {rank}: raised" + (" (the first rank to fail)" if failed[:1] == [rank] else ""))
            details.append(f"----- rank {rank}: traceback -----\n{tb.read_text().rstrip()}")
        elif p.exitcode and p.exitcode < 0:
            lines.append(
                f"  rank {rank}: killed by {_signal_name(p.exitcode)}, no Python traceback "
                "(its stderr is in the captured output)"
            )
        elif p.exitcode:
            lines.append(
                f"  rank {rank}: exited with code {p.exitcode}, no Python traceback "
                "(its stderr is in the captured output)"
            )
        else:
            lines.append(f"  rank {rank}: finished")
    head = f"{world} gloo ranks of {_describe(fn)} failed ({directory}):"
    pytest.fail("\n".join([head, *lines, "", *details]), pytrace=False)


def torchrun_command(*argv, nproc=2, env=None):
    """``(command, environment)`` of ``torchrun --standalone --nproc_per_node=nproc *argv``:
    this interpreter, this ``sys.path``, one thread per rank, ``env`` on top."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *map(str, argv),
    ]
    return command, environment


def _tail(text, n=6000):
    text = text or ""
    return text if len(text) <= n else "..." + text[-n:]


def run_torchrun(*argv, nproc=2, timeout=600, env=None):
    """Run ``torchrun`` to the end; its ``CompletedProcess`` (text ``stdout``/``stderr``), or a
    failure with the tail of both (each rank's traceback is on its stderr)."""
    command, environment = torchrun_command(*argv, nproc=nproc, env=env)
    shown = "torchrun --nproc_per_node={} {}".format(nproc, " ".join(map(str, argv)))
    proc = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # its own process group: a timeout stops the workers too
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"`{shown}` still running after {timeout} s\n----- stdout -----\n{_tail(out)}\n"
            f"----- stderr -----\n{_tail(err)}",
            pytrace=False,
        )
    done = subprocess.CompletedProcess(command, proc.returncode, out, err)
    if done.returncode != 0:
        pytest.fail(
            f"`{shown}` exited with code {done.returncode}\n----- stdout -----\n{_tail(out)}\n"
            f"----- stderr -----\n{_tail(err)}",
            pytrace=False,
        )
    return done


def background(start):
    """Mark a test whose work is one subprocess: ``start()`` returns it (a ``Popen`` with its
    output piped) and is called when the session's tests are collected (conftest), so it
    runs beside the tests before it; the test takes it with the ``started`` fixture."""

    def mark(fn):
        fn.background = start
        return fn

    return mark
