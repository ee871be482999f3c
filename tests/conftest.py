"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Small models step faster on one thread than on a shared, loaded pair of cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
