"""Fixtures shared by the test modules, the process launchers, and the markers.

Markers (declared in pyproject.toml):

- ``distributed``: starts processes (gloo ranks or torchrun); given to every test that uses
  the ``gloo`` or ``torchrun`` fixture below, and to the soak test.
- ``slow``: runs by default and in CI but takes long (a few seconds to minutes each on
  2 cores); ``-m "not slow"`` leaves them out.
- ``soak``: opt-in, skipped unless ``EQUIOPT_SLOW_TESTS=1`` or ``-m`` asks for ``soak``.
- ``network``: opt-in, downloads; ``EQUIOPT_NETWORK_TESTS=1``.
- ``torchtitan``: skipped where torchtitan is not installed.

A test whose work is one long subprocess (a cold compile) may start it when the session
begins, beside the other tests (``_launch.background``), and read its result when it runs.

See tests/README.md for the commands.
"""

import os
import subprocess

import pytest
import torch
from _launch import run_gloo, run_torchrun

LAUNCHERS = {"gloo", "torchrun"}  # the fixtures that start processes: their tests are ``distributed``

# Without a CUDA device the fused stages' Triton kernels run under Triton's interpreter
# (tests/test_fused_kernels.py). It is chosen when triton is first imported, which any test
# that compiles may do first: so here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _asks_for_soak(markexpr):
    """Whether ``-m`` names ``soak`` positively: the expression holds for a test marked only
    ``soak`` and not for an unmarked one (so ``-m "not slow"`` does not opt in)."""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
        return expr.evaluate(lambda name, **kw: name == "soak") and not expr.evaluate(lambda name, **kw: False)
    except Exception:  # a private pytest API: fall back to the word itself
        return "soak" in markexpr.split()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    distributed = pytest.mark.distributed
    for item in items:
        if LAUNCHERS & set(getattr(item, "fixturenames", ())):
            item.add_marker(distributed)
    if os.environ.get("EQUIOPT_SLOW_TESTS") == "1" or _asks_for_soak(config.getoption("markexpr", "")):
        return
    skip = pytest.mark.skip(reason="soak: opt-in, minutes to half an hour; set EQUIOPT_SLOW_TESTS=1 or pass -m soak")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@pytest.fixture
def gloo(tmp_path):
    """``gloo(fn, world, *args)``: ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks
    (``_launch.run_gloo``: file rendezvous under ``tmp_path``, every rank's traceback on
    failure); returns the list of the ranks' return values."""

    def launch(fn, world, *args, **kw):
        return run_gloo(fn, world, *args, directory=tmp_path, **kw)

    return launch


@pytest.fixture
def torchrun():
    """``torchrun(*argv, nproc=2, timeout=600, env=None)``: ``torchrun --standalone`` run to
    the end (``_launch.run_torchrun``); its ``CompletedProcess``, or a failure with its output."""
    return run_torchrun


@pytest.fixture
def one_thread():
    """Small models step faster on one thread than on a shared, loaded pair of cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_BACKGROUND: dict[str, subprocess.Popen] = {}


def pytest_collection_finish(session):
    for item in session.items:
        start = getattr(getattr(item, "function", None), "background", None)
        if start is not None and item.get_closest_marker("skip") is None:
            _BACKGROUND[item.nodeid] = start()


def pytest_sessionfinish(session, exitstatus):
    for proc in _BACKGROUND.values():  # (a test that did not run: its process is stopped)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    _BACKGROUND.clear()


@pytest.fixture
def started(request):
    """The process ``_launch.background`` started for this test (started now if it was not)."""
    proc = _BACKGROUND.pop(request.node.nodeid, None)
    return proc if proc is not None else request.node.function.background()
