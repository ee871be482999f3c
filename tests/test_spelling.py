"""One spelling of centring across the public API: ``centered_input=`` in equiopt.maps,
with ``centred_input=`` kept as a deprecated alias."""

import inspect
import warnings

import pytest
import torch

from equiopt import maps

FACTORED = {
    "row_norm_factored": {},
    "one_sided_factored": {"alpha": 0.5},
    "hybrid_factored": {"order": "row_then_right"},
}


def _centred_input(seed=0):
    D = torch.randn(4, 24, 6, generator=torch.Generator().manual_seed(seed))
    return D - D.mean(dim=-2, keepdim=True)


def _same(a: maps.Factored, b: maps.Factored) -> None:
    for name, x, y in zip(maps.Factored._fields, a, b):
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x, y), f"{name} differs"


@pytest.mark.parametrize("name", sorted(FACTORED))
def test_signature_spells_centered_input(name):
    params = inspect.signature(getattr(maps, name)).parameters
    assert "centered_input" in params and "centred_input" not in params


@pytest.mark.parametrize("done", [False, True])
@pytest.mark.parametrize("name", sorted(FACTORED))
def test_alias_gives_bitwise_the_same_update(name, done):
    fn, kw = getattr(maps, name), FACTORED[name]
    D = _centred_input()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new keyword does not warn
        new = fn(D.clone(), center=True, centered_input=done, **kw)
    with pytest.warns(DeprecationWarning):
        old = fn(D.clone(), center=True, centred_input=done, **kw)
    _same(new, old)
    assert torch.equal(maps.materialize(new), maps.materialize(old))


@pytest.mark.parametrize("name", sorted(FACTORED))
def test_alias_warns_naming_the_new_keyword(name):
    fn, kw = getattr(maps, name), FACTORED[name]
    with pytest.warns(DeprecationWarning, match="centered_input") as record:
        fn(_centred_input(), center=True, centred_input=True, **kw)
    assert len(record) == 1
    assert "centred_input" in str(record[0].message)
    assert record[0].filename == __file__  # points at the caller, not at equiopt.maps


@pytest.mark.parametrize("name", sorted(FACTORED))
def test_both_spellings_raise(name):
    fn, kw = getattr(maps, name), FACTORED[name]
    with pytest.raises(TypeError, match="centered_input.*centred_input"):
        fn(_centred_input(), center=True, centered_input=True, centred_input=True, **kw)


def test_precentred_input_is_used_as_it_is():
    """``centered_input=True`` skips the centring copy: on an input with zero column means
    the update equals the one that centres it again."""
    D = _centred_input(seed=3)
    a = maps.materialize(maps.row_norm_factored(D, center=True, centered_input=True))
    b = maps.materialize(maps.row_norm_factored(D, center=True))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
