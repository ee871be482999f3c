"""The quintic polar iterations run a batch a chunk at a time (``polar.CHUNK_BYTES``): the
same factor bit for bit as the whole batch at once, while a step holds the result and one
chunk's iterates, not two iterates of the whole batch."""

import importlib

import pytest
import torch

from equiopt.linalg import polar
from equiopt.linalg.device_choices import decide_as
from equiopt.roofline import RooflineCounter

polar_module = importlib.import_module("equiopt.linalg.polar")  # the package exports the function


@pytest.mark.parametrize("batch,cap", [(1, 1), (5, 1), (5, 2), (7, 3), (4, 4), (6, 100)])
def test_chunks_cover_the_batch_in_slices_of_equal_size_within_the_cap(batch, cap):
    matrix = 1000
    old = polar_module.CHUNK_BYTES
    try:
        polar_module.CHUNK_BYTES = cap * matrix
        parts = polar_module.chunks(batch, matrix)
    finally:
        polar_module.CHUNK_BYTES = old
    covered = [i for p in parts for i in range(batch)[p]]
    assert covered == list(range(batch))
    sizes = [p.stop - p.start for p in parts]
    assert all(s <= max(cap, 1) for s in sizes)
    assert len(parts) == -(-batch // max(cap, 1))
    assert max(sizes) - min(sizes) <= max(sizes) - sizes[-1] <= len(parts)


@pytest.mark.parametrize("method", ["polar_express", "newton_schulz", "newton_schulz_torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(5, 12, 20), (2, 3, 20, 12)], ids=["wide", "tall"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_chunked_batch_equals_the_whole_batch_bit_for_bit(monkeypatch, method, dtype, shape, device):
    X = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    with decide_as(device):
        whole = polar(X, method=method, dtype=dtype, narrow=True)
        matrix = 12 * 20 * whole.element_size()
        monkeypatch.setattr(polar_module, "CHUNK_BYTES", 2 * matrix)  # slices of 2 (or 3) matrices
        chunked = polar(X, method=method, dtype=dtype, narrow=True)
    assert chunked.dtype == whole.dtype and chunked.shape == X.shape
    assert torch.equal(chunked, whole)
    assert torch.isfinite(whole).all()


def test_the_iteration_holds_the_result_and_one_chunks_iterates(monkeypatch):
    # 32 matrices of 256 x 1024 on the meta device, iterated in bfloat16 as on CUDA
    batch, m, n = 32, 256, 1024
    X = torch.empty(batch, m, n, device="meta")
    iterate, gram = batch * m * n * 2, batch * m * m * 2

    def peak(cap: int) -> int:
        monkeypatch.setattr(polar_module, "CHUNK_BYTES", cap)
        with decide_as("cuda"), RooflineCounter() as counter:
            polar(X, dtype=torch.bfloat16, narrow=True)
        return counter.peak_bytes

    small = 4096  # the norms
    # the whole batch at once: the normalised input, its successor and a Gram
    whole = 2 * iterate + gram
    assert whole <= peak(iterate) <= whole + small
    # in quarters: the result, a spare quarter the iterates alternate with, a quarter's two Grams
    quarters = iterate + (iterate + 2 * gram) // 4
    assert quarters <= peak(iterate // 4) <= quarters + small


@pytest.mark.parametrize("method", ["polar_express", "newton_schulz", "newton_schulz_torch", "exact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(7, 12, 20), (7, 20, 12)], ids=["wide", "tall"])
def test_the_iterations_say_which_factors_are_finite(monkeypatch, method, dtype, shape):
    """``polar(finite=...)``: each matrix's flag equals whether its factor is free of NaN and
    Inf, over chunks of the batch, with NaN, +Inf and a huge finite entry in the inputs (the
    quintic iterations read it from their last small factor, the others from the result)."""
    X = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    if method != "exact":  # (an SVD refuses what is not finite)
        X[1, 2, 3] = float("nan")
        X[3, 0, 0] = float("inf")
        X[5, 1, 1] = 3e38  # finite, its square is not: the norm overflows, the factor is 0
    monkeypatch.setattr(polar_module, "CHUNK_BYTES", 3 * 12 * 20 * 4)
    with decide_as("cuda"):  # (bfloat16 iterations as a GPU runs them, emulated)
        flags = torch.ones(7, dtype=torch.bool)
        flags[::2] = False  # (every flag is written)
        factor = polar(X, method=method, dtype=dtype, narrow=True, finite=flags)
    expected = torch.isfinite(factor.double()).flatten(1).all(dim=1)
    assert flags.tolist() == expected.tolist()
    assert expected[[0, 2, 4, 6]].all() and expected[[1, 3]].any() == (method == "exact")
