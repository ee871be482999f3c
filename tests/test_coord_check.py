"""equiopt coord-check: width scaling of the models, exponents, and what the check measures."""

import math

import pytest

from equiopt import models
from equiopt.study.coord_check import coord_check, coord_table, exponent, width_overrides, write_outputs


def test_width_overrides_scale_mlp_and_heads_with_the_width():
    base = models.config("qwen3", "small")
    o = width_overrides("qwen3", "small", 2 * base.hidden_size)
    assert o["intermediate_size"] == 2 * base.intermediate_size
    assert o["num_key_value_heads"] == 2 * base.num_key_value_heads
    assert o["num_attention_heads"] // o["num_key_value_heads"] == base.num_attention_heads // base.num_key_value_heads
    moe = width_overrides("olmoe", "tiny", 2 * models.config("olmoe", "tiny").hidden_size)
    assert moe["intermediate_size"] == 2 * models.config("olmoe", "tiny").intermediate_size


def test_exponent_recovers_a_power_law():
    widths = [32, 64, 128, 256]
    assert exponent(widths, [3.0 * w**0.5 for w in widths]) == pytest.approx(0.5)
    assert exponent(widths, [0.7] * 4) == pytest.approx(0.0)
    assert exponent([32], [1.0]) is None


def test_init_std_as_one_over_sqrt_fan_in_flattens_the_hidden_outputs(tmp_path):
    # At std 0.02 a projection's output RMS is 0.02 sqrt(width) times its normalised input's:
    # exponent 1/2 in width. With std 0.02 sqrt(32 / width) it is flat. The check must see both.
    kw = dict(widths=[32, 128], steps=2, batch=2, seq=16, tail=1)
    plain = coord_check("qwen3:tiny", "equiopt:default", **kw)
    scaled = coord_check("qwen3:tiny", "equiopt:default", init_base_width=32, **kw)
    assert plain["exponents"]["mlp_in"]["act_rms"] == pytest.approx(0.5, abs=0.1)
    assert abs(scaled["exponents"]["mlp_in"]["act_rms"]) < 0.1
    assert any(f.startswith("mlp_in act_rms") for f in plain["flagged"])
    for role, qs in plain["roles"].items():
        for q, vals in qs.items():
            assert all(v is not None and math.isfinite(v) for v in vals), (role, q)
    assert plain["roles"]["embedding"]["act_change_rms"][0] > 0  # training moved the embedding's output
    text = coord_table(plain)
    assert "| mlp_in | act_rms |" in text and "Not width-stable" in text
    paths = write_outputs(plain, tmp_path)
    assert (tmp_path / "coord_check.json").exists() and paths[0].read_text() == text


def test_coord_check_refuses_a_single_width():
    with pytest.raises(ValueError, match="at least two widths"):
        coord_check("qwen3:tiny", widths=[64])
