"""Fixtures shared by the test modules, and the opt-in ``slow`` marker."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """``slow`` tests run only with ``EQUIOPT_SLOW_TESTS=1`` or when ``-m`` names them."""
    if os.environ.get("EQUIOPT_SLOW_TESTS") == "1" or "slow" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="slow: minutes of multi-process runs; set EQUIOPT_SLOW_TESTS=1 or pass -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Small models step faster on one thread than on a shared, loaded pair of cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
