"""Tests for equiopt.layouts: exact round trips, orientation semantics, errors, parsing, batching."""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from equiopt.layouts import (
    Col,
    Compose,
    Experts,
    Flatten,
    Fused,
    GateUp,
    Heads,
    Layout,
    Row,
    parse_layout,
    stack_by_shape,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- helpers ---------------------------------------------------------------------------


def random_bits(shape, dtype, seed=0):
    """A tensor of random bit patterns (NaN payloads, infs and signed zeros included)."""
    g = torch.Generator().manual_seed(seed)
    ints = BITS[dtype]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=ints).view(dtype)


def make(shape, dtype, variant="contiguous", seed=0):
    """Random tensor of ``shape``, stored contiguously, transposed or strided."""
    shape = tuple(shape)
    if variant == "transposed":
        t = random_bits(shape[:-2] + (shape[-1], shape[-2]), dtype, seed).transpose(-2, -1)
    elif variant == "strided":
        t = random_bits(shape[:-1] + (2 * shape[-1],), dtype, seed)[..., ::2]
    else:
        t = random_bits(shape, dtype, seed)
    assert t.shape == shape
    assert (variant == "contiguous") == t.is_contiguous() or shape[-1] == 1 or shape[-2] == 1
    return t


def assert_bitwise(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    ints = BITS[a.dtype]
    assert torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def as_list(work):
    return work if isinstance(work, list) else [work]


def perturb_strides(w):
    """Same values, different (non-contiguous) memory layout, as a map's output may be."""
    return w.transpose(-2, -1).contiguous().transpose(-2, -1)


# -- strategies: a layout together with a stored shape that fits it ----------------------

dims = st.integers(1, 5)
head_dims = st.integers(1, 4)


@st.composite
def block_along(draw, axis):
    """A 2-D part layout for a Fused block and its size along ``axis``."""
    kind = draw(st.sampled_from(["row", "col", "heads", "gate_up"]))
    if kind == "row":
        return Row(), draw(dims)
    if kind == "col":
        return Col(), draw(dims)
    if kind == "heads":
        hd = draw(head_dims)
        return Heads(hd, axis="cols" if axis else "rows"), hd * draw(dims)
    mode = draw(st.sampled_from(["concat", "interleave"]))
    return GateUp(mode, split=draw(st.booleans()), axis=axis), 2 * draw(dims)


@st.composite
def flat_layouts(draw):
    """A 2-D layout and a stored 2-D shape."""
    kind = draw(st.sampled_from(["row", "col", "heads", "heads_cols", "gate_up", "fused", "compose"]))
    m, n = draw(dims), draw(dims)
    if kind == "row":
        return Row(), (m, n)
    if kind == "col":
        return Col(), (m, n)
    if kind == "heads":
        hd = draw(head_dims)
        return Heads(hd), (hd * m, n)
    if kind == "heads_cols":
        hd = draw(head_dims)
        return Heads(hd, axis="cols"), (m, hd * n)
    if kind == "gate_up":
        mode = draw(st.sampled_from(["concat", "interleave"]))
        split, axis = draw(st.booleans()), draw(st.sampled_from([0, 1]))
        return GateUp(mode, split, axis), ((2 * m, n) if axis == 0 else (n, 2 * m))
    if kind == "fused":
        axis = draw(st.sampled_from([0, 1]))
        blocks = draw(st.lists(block_along(axis), min_size=1, max_size=4))
        parts, sizes = zip(*blocks)
        total = sum(sizes)
        return Fused(sizes, parts, axis=axis), ((total, n) if axis == 0 else (m, total))
    # compose
    hd = draw(head_dims)
    options = [
        (Compose(Col(), Heads(hd)), (n, hd * m)),
        (Compose(Heads(hd), Col()), (hd * m, n)),
        (Compose(GateUp(draw(st.sampled_from(["concat", "interleave"]))), Heads(hd)), (2 * hd * m, n)),
        (Compose(Fused((hd * m, n), axis=1), Col()), (draw(dims), hd * m + n)),
    ]
    return draw(st.sampled_from(options))


@st.composite
def folded_layouts(draw):
    """A Flatten layout (a convolution weight, possibly grouped) and a stored shape."""
    tail = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    groups = draw(st.integers(1, 3))
    return Flatten(tail, groups), (groups * draw(dims), draw(dims)) + tail


@st.composite
def layouts_and_shapes(draw):
    """Any layout, possibly with one or two expert axes, and a stored shape."""
    layout, shape = draw(st.one_of(flat_layouts(), flat_layouts(), folded_layouts()))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        layout, shape = Experts(layout), (draw(st.integers(1, 3)),) + shape
    return layout, shape


variants = st.sampled_from(["contiguous", "transposed", "strided"])


# -- round trips ---------------------------------------------------------------------------


@FAST
@given(case=layouts_and_shapes(), dtype=st.sampled_from(DTYPES), variant=variants, seed=st.integers(0, 2**16))
def test_round_trip_is_bitwise_exact(case, dtype, variant, seed):
    layout, shape = case
    t = make(shape, dtype, variant, seed)
    original = t.clone()
    work = layout.to_work(t)
    assert isinstance(work, list) == (layout.num_blocks > 1)
    assert len(as_list(work)) == layout.num_blocks
    back = layout.from_work(work)
    assert_bitwise(back, original)
    assert_bitwise(t, original)  # to_work / from_work never write into the input
    # list API, and work whose strides changed as a map's output may
    back = layout.from_work_list([perturb_strides(w) for w in layout.to_work_list(t)])
    assert_bitwise(back, original)


@FAST
@given(case=layouts_and_shapes())
def test_work_is_a_permutation_of_the_entries(case):
    layout, shape = case
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    values = torch.cat([w.reshape(-1) for w in layout.to_work_list(t)])
    assert torch.equal(values.sort().values, t.reshape(-1))


@FAST
@given(case=layouts_and_shapes())
def test_work_shapes_match_to_work(case):
    layout, shape = case
    t = torch.zeros(shape)
    produced = [tuple(w.shape) for w in layout.to_work_list(t)]
    assert layout.work_shapes(shape) == produced
    assert layout.work_shapes(torch.Size(shape)) == produced
    assert layout.stored_shape(produced) == shape
    for w in produced:
        assert len(w) >= 2


@FAST
@given(case=layouts_and_shapes())
def test_spec_round_trip_and_value_semantics(case):
    layout, _ = case
    parsed = parse_layout(layout.spec)
    assert parsed == layout and hash(parsed) == hash(layout)
    assert parsed.spec == layout.spec
    assert eval(repr(layout)) == layout  # repr is constructor syntax
    assert parse_layout(layout) is layout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layout, shape",
    [
        (Row(), (6, 4)),
        (Col(), (6, 4)),
        (Heads(2), (6, 4)),
        (Heads(2, "cols"), (4, 6)),
        (GateUp("interleave", axis=1), (4, 6)),
        (GateUp("concat", split=False), (6, 4)),
        (Experts(GateUp("interleave", axis=1)), (3, 4, 6)),
        (Fused((4, 2, 2), Heads(2)), (8, 5)),
    ],
)
def test_round_trip_explicit_dtypes(layout, shape, dtype):
    for variant in ["contiguous", "transposed", "strided"]:
        t = make(shape, dtype, variant, seed=1)
        assert_bitwise(layout.from_work(layout.to_work(t)), t)


def test_views_where_possible():
    t = torch.randn(6, 4)
    assert Row().to_work(t) is t
    for layout in [Col(), Heads(2), Heads(2, "cols"), GateUp(), GateUp("interleave"), GateUp("interleave", False)]:
        w = layout.to_work(t)
        assert w.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), layout
    for w in Fused((2, 4)).to_work(t):
        assert w.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


# -- semantics (orientation) --------------------------------------------------------------


def test_row_and_col():
    t = torch.randn(3, 5)
    assert torch.equal(Row().to_work(t), t)
    assert torch.equal(Col().to_work(t), t.T)
    assert torch.equal(Experts(Col()).to_work(torch.stack([t, 2 * t])), torch.stack([t.T, 2 * t.T]))


def test_heads_rows_and_cols():
    hd, H = 3, 4
    t = torch.randn(H * hd, 5)
    w = Heads(hd).to_work(t)
    assert w.shape == (H, hd, 5)
    for h in range(H):
        assert torch.equal(w[h], t[h * hd : (h + 1) * hd])
    o = torch.randn(5, H * hd)
    w = Heads(hd, axis="cols").to_work(o)
    assert w.shape == (H, hd, 5)
    for h in range(H):
        assert torch.equal(w[h], o[:, h * hd : (h + 1) * hd].T)
    # cols heads = transpose, then rows heads
    assert torch.equal(w, Compose(Col(), Heads(hd)).to_work(o))


def gate_up_tensor(f, d, mode):
    """Stored (2f, d) with gate rows 100*i + j and up rows -(100*i + j) - 1."""
    base = 100 * torch.arange(f, dtype=torch.float32)[:, None] + torch.arange(d, dtype=torch.float32)
    gate, up = base, -base - 1
    if mode == "concat":
        return torch.cat([gate, up]), gate, up
    return torch.stack([gate, up], dim=1).reshape(2 * f, d), gate, up


@pytest.mark.parametrize("mode", ["concat", "interleave"])
def test_gate_up_picks_gate_and_up_rows(mode):
    f, d = 4, 3
    t, gate, up = gate_up_tensor(f, d, mode)
    if mode == "concat":
        assert torch.equal(t[:f], gate)
    else:
        assert torch.equal(t[0::2], gate) and torch.equal(t[1::2], up)
    w = GateUp(mode).to_work(t)
    assert w.shape == (2, f, d)
    assert torch.equal(w[0], gate) and torch.equal(w[1], up)
    # split=False: row i is [gate_i, up_i]
    w = GateUp(mode, split=False).to_work(t)
    assert w.shape == (f, 2 * d)
    assert torch.equal(w, torch.cat([gate, up], dim=1))
    # axis=1: the same tensor stored transposed, neurons still on the work rows
    w = GateUp(mode, axis="cols").to_work(t.T.contiguous())
    assert torch.equal(w[0], gate) and torch.equal(w[1], up)
    w = GateUp(mode, split=False, axis=1).to_work(t.T.contiguous())
    assert torch.equal(w, torch.cat([gate, up], dim=1))


def test_gate_up_modes_differ():
    t, _, _ = gate_up_tensor(3, 2, "concat")
    assert not torch.equal(GateUp("concat").to_work(t), GateUp("interleave").to_work(t))


def test_gpt_oss_and_olmoe_expert_storage():
    E, f, d = 3, 4, 2
    stored = [gate_up_tensor(f, d, "interleave") for _ in range(E)]
    # gpt-oss: (E, d, 2f) interleaved along the last dim
    gpt_oss = torch.stack([t.T for t, _, _ in stored]) + torch.arange(E)[:, None, None] * 1000
    w = Experts(GateUp("interleave", axis=1)).to_work(gpt_oss)
    assert w.shape == (E, 2, f, d)
    for e in range(E):
        assert torch.equal(w[e, 0], gpt_oss[e][:, 0::2].T)
        assert torch.equal(w[e, 1], gpt_oss[e][:, 1::2].T)
    # OLMoE-style: (E, 2f, d) concatenated
    olmoe = torch.randn(E, 2 * f, d)
    w = Experts(GateUp()).to_work(olmoe)
    assert torch.equal(w[:, 0], olmoe[:, :f]) and torch.equal(w[:, 1], olmoe[:, f:])


@pytest.mark.parametrize(
    "inner, shape",
    [
        (Row(), (3, 4)),
        (Col(), (3, 4)),
        (Heads(2), (4, 3)),
        (Heads(2, "cols"), (3, 4)),
        (GateUp("interleave"), (4, 3)),
        (GateUp(split=False, axis=1), (3, 4)),
        (Fused((1, 3), Col()), (4, 2)),
    ],
)
def test_experts_apply_inner_per_expert(inner, shape):
    E = 3
    t = torch.randn((E,) + shape)
    work = as_list(Experts(inner).to_work(t))
    for e in range(E):
        per_expert = as_list(inner.to_work(t[e]))
        assert len(per_expert) == len(work)
        for w, p in zip(work, per_expert):
            assert torch.equal(w[e], p)


def test_fused_unequal_blocks():
    q, kv, d, hd = 8, 4, 5, 2
    t = torch.randn(q + 2 * kv, d)
    work = Fused((q, kv, kv)).to_work(t)
    assert [tuple(w.shape) for w in work] == [(q, d), (kv, d), (kv, d)]
    assert torch.equal(work[0], t[:q]) and torch.equal(work[1], t[q : q + kv]) and torch.equal(work[2], t[q + kv :])
    work = Fused((q, kv, kv), parts=Heads(hd)).to_work(t)
    assert [tuple(w.shape) for w in work] == [(q // hd, hd, d), (kv // hd, hd, d), (kv // hd, hd, d)]
    assert torch.equal(work[1][1], t[q + hd : q + 2 * hd])
    # mixed parts and column blocks
    t = torch.randn(d, 6 + 3)
    work = Fused((6, 3), parts=[Heads(3, "cols"), Col()], axis=1).to_work(t)
    assert torch.equal(work[0][1], t[:, 3:6].T)
    assert torch.equal(work[1], t[:, 6:].T)


def test_single_block_fused_returns_tensor():
    t = torch.randn(4, 3)
    assert isinstance(Fused((4,)).to_work(t), torch.Tensor)
    assert isinstance(Fused((4,)).to_work_list(t), list)


# -- errors ---------------------------------------------------------------------------------

NAME = "model.layers.0.mlp.gate_up_proj"


@pytest.mark.parametrize(
    "layout, shape, detail",
    [
        (Row(), (7,), "2-D"),
        (Col(), (7,), "2-D"),
        (Row(), (2, 3, 4), "Experts"),
        (Experts(Row()), (3, 4), "3-D"),
        (Experts(Col()), (5,), "3-D"),
        (Heads(4), (6, 8), "divisible by head_dim 4"),
        (Heads(4, "cols"), (8, 6), "divisible by head_dim 4"),
        (Experts(Heads(4)), (2, 6, 8), "divisible"),
        (GateUp(), (7, 4), "odd"),
        (GateUp("interleave", axis=1), (4, 7), "odd"),
        (Experts(GateUp("interleave", axis=1)), (2, 4, 7), "odd"),
        (Fused((4, 2)), (7, 3), "sum to 6"),
        (Fused((4, 2), axis=1), (3, 7), "sum to 6"),
        (Fused((4, 2), Heads(4)), (6, 3), "block 1"),
        (Compose(Col(), Heads(4)), (3, 6), "divisible"),
        (Flatten((3, 3)), (8, 4, 3), "4-D"),
        (Flatten((3, 3)), (8, 4, 3, 5), "(3, 5) are not (3, 3)"),
        (Flatten(4, groups=3), (8, 1, 4), "divisible by groups 3"),
    ],
)
def test_clear_errors_name_the_parameter(layout, shape, detail):
    pattern = re.escape(NAME) + ".*" + re.escape(repr(layout)) + ".*" + re.escape(str(shape))
    with pytest.raises(ValueError, match=pattern):
        layout.check(shape, NAME)
    with pytest.raises(ValueError, match=re.escape(detail)):
        layout.check(shape, NAME)
    with pytest.raises(ValueError, match=re.escape(NAME)):
        layout.to_work(torch.zeros(shape), name=NAME)
    with pytest.raises(ValueError, match=re.escape(NAME)):
        layout.work_shapes(shape, NAME)
    with pytest.raises(ValueError, match="parameter"):  # default name
        layout.to_work(torch.zeros(shape))


def test_check_accepts_fitting_shapes():
    Heads(4).check((8, 3))
    Experts(GateUp("interleave", axis=1)).check(torch.Size([2, 3, 8]))


@pytest.mark.parametrize(
    "layout, good_shape, bad_work",
    [
        (Row(), (3, 4), [torch.zeros(2, 3, 4)]),
        (Heads(2), (4, 3), [torch.zeros(2, 3, 3)]),
        (GateUp(), (4, 3), [torch.zeros(3, 2, 3)]),
        (GateUp(split=False), (4, 3), [torch.zeros(2, 5)]),
        (Fused((2, 2)), (4, 3), [torch.zeros(2, 3)]),
        (Fused((2, 2)), (4, 3), [torch.zeros(2, 3), torch.zeros(2, 4)]),
        (Experts(Row()), (2, 3, 4), [torch.zeros(3, 4)]),
    ],
)
def test_from_work_rejects_wrong_shapes(layout, good_shape, bad_work):
    layout.from_work(layout.to_work(torch.zeros(good_shape)))
    with pytest.raises(ValueError, match="work shapes"):
        layout.from_work(bad_work)


def test_from_work_rejects_mixed_dtypes():
    work = Fused((2, 2)).to_work(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="dtype"):
        Fused((2, 2)).from_work([work[0], work[1].double()])


@pytest.mark.parametrize(
    "build",
    [
        lambda: Heads(0),
        lambda: Heads(2, axis="diag"),
        lambda: GateUp("zigzag"),
        lambda: GateUp(axis=2),
        lambda: Fused(()),
        lambda: Fused((2, 0)),
        lambda: Fused((2, 2), parts=[Row()]),
        lambda: Fused((2, 2), parts=Experts(Row())),
        lambda: Flatten(()),
        lambda: Flatten((3, 0)),
        lambda: Flatten(3, groups=0),
    ],
)
def test_invalid_constructor_arguments(build):
    with pytest.raises(ValueError):
        build()


def test_layouts_are_immutable_and_hashable():
    layout = Heads(128)
    with pytest.raises(AttributeError):
        layout.head_dim = 64
    assert len({Heads(128), Heads(128, "rows"), Heads(128, 0), Heads(128, "cols")}) == 2
    assert Fused((2, 2)) == Fused([2, 2], parts=[Row(), Row()])
    assert Row() != Col() and Experts(Row()) == Experts()
    assert GateUp(axis="cols") == GateUp(axis=1)
    assert isinstance(Row(), Layout)


# -- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("row", Row()),
        ("col", Col()),
        ("heads:128", Heads(128)),
        ("heads:128:cols", Heads(128, "cols")),
        ("heads_cols:128", Heads(128, "cols")),
        ("gate_up", GateUp()),
        ("gate_up:concat", GateUp("concat")),
        ("gate_up:interleave", GateUp("interleave")),
        ("gate_up:interleave:cols", GateUp("interleave", axis=1)),
        ("gate_up:concat:paired", GateUp("concat", split=False)),
        ("experts", Experts(Row())),
        ("experts:row", Experts(Row())),
        ("experts:col", Experts(Col())),
        ("experts:gate_up:interleave:cols", Experts(GateUp("interleave", axis=1))),
        ("fused:1024,512,512", Fused((1024, 512, 512))),
        ("fused:1024,512,512:heads:128", Fused((1024, 512, 512), Heads(128))),
        ("fused:1024,128:heads:128/col", Fused((1024, 128), [Heads(128), Col()])),
        ("fused_cols:4,4", Fused((4, 4), axis=1)),
        ("col>heads:64", Compose(Col(), Heads(64))),
        ("experts:(col>heads:64)", Experts(Compose(Col(), Heads(64)))),
        (" Experts : Col ", Experts(Col())),
        ("flatten:3x3", Flatten((3, 3))),
        ("flatten:4:groups=16", Flatten((4,), groups=16)),
        ("experts:flatten:2x2x2", Experts(Flatten((2, 2, 2)))),
    ],
)
def test_parse_layout(spec, expected):
    layout = parse_layout(spec)
    assert layout == expected
    assert parse_layout(layout.spec) == layout


def test_parse_layout_nested_round_trips():
    nested = [
        Compose(Compose(Col(), Heads(2)), Col()),
        Compose(Col(), Compose(Heads(2), Col())),
        Fused((4, 4), [Compose(Col(), Heads(2)), Fused((2, 2), [Row(), Col()])]),
        Experts(Experts(Fused((2, 6), [Row(), GateUp("interleave", False)]))),
    ]
    for layout in nested:
        assert parse_layout(layout.spec) == layout, layout.spec


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "rows",
        "heads",
        "heads:x",
        "heads:0",
        "heads_cols:8:rows",
        "gate_up:zigzag",
        "gate_up:cols:rows",
        "fused",
        "fused:4,x",
        "fused:4,4:row/col/row",
        "experts:nope",
        "col>",
        "(row",
        "row:1",
        "flatten",
        "flatten:3x",
        "flatten:0",
        "flatten:3:groups",
        "flatten:3:g=2",
    ],
)
def test_parse_layout_errors_list_valid_forms(spec):
    with pytest.raises(ValueError, match=r"(?s)invalid layout spec.*heads:HD.*gate_up"):
        parse_layout(spec)


def test_parse_layout_rejects_non_strings():
    with pytest.raises(TypeError):
        parse_layout(3)


# -- stack_by_shape ----------------------------------------------------------------------------


def test_stack_by_shape_groups_across_layouts_and_restores_exactly():
    E, H, f, d = 3, 2, 4, 8
    params = [
        (Row(), random_bits((f, d), torch.float32, 1)),
        (Experts(GateUp("interleave", axis=1)), random_bits((E, d, 2 * f), torch.float32, 2)),
        (Heads(f), random_bits((H * f, d), torch.float32, 3)),
        (Col(), random_bits((f, d), torch.float32, 4)),  # work (d, f): its own group
        (Row(), random_bits((f, d), torch.bfloat16, 5)),  # other dtype: its own group
    ]
    works = [w for layout, t in params for w in layout.to_work_list(t)]
    groups, restore = stack_by_shape(works)
    assert [tuple(g.shape) for g in groups] == [(1 + 2 * E + H, f, d), (1, d, f), (1, f, d)]
    assert [g.dtype for g in groups] == [torch.float32, torch.float32, torch.bfloat16]
    assert restore.keys[0][:2] == (f, d)
    # the batch of the first group holds every member in order
    assert_bitwise(groups[0][0], works[0])
    assert_bitwise(groups[0][1 : 1 + 2 * E], works[1].reshape(2 * E, f, d))
    back = restore(groups)
    assert len(back) == len(works)
    for b, w in zip(back, works):
        assert_bitwise(b, w)
    # full trip back to every parameter
    for (layout, t), b in zip(params, back):
        assert_bitwise(layout.from_work(b), t)


@FAST
@given(
    cases=st.lists(layouts_and_shapes(), min_size=1, max_size=6),
    dtype=st.sampled_from(DTYPES),
    variant=variants,
)
def test_stack_by_shape_round_trip_property(cases, dtype, variant):
    tensors = [make(shape, dtype, variant, seed=i) for i, (_, shape) in enumerate(cases)]
    works = [w for (layout, _), t in zip(cases, tensors) for w in layout.to_work_list(t)]
    groups, restore = stack_by_shape(works)
    keys = {tuple(w.shape[-2:]) for w in works}
    assert len(groups) == len(keys)
    assert sum(g.shape[0] for g in groups) == sum(w[..., 0, 0].numel() for w in works)
    back = restore([g.clone() for g in groups])
    for b, w in zip(back, works):
        assert_bitwise(b, w)
    # the results of a map come back to the right parameter
    scaled = restore([g * 2 for g in groups])
    for s, w in zip(scaled, works):
        torch.testing.assert_close(s, w * 2, rtol=0, atol=0, equal_nan=True)


def test_stack_by_shape_errors():
    with pytest.raises(ValueError, match="rows, cols"):
        stack_by_shape([torch.zeros(3)])
    groups, restore = stack_by_shape([torch.zeros(2, 3), torch.zeros(4, 2, 3)])
    assert len(groups) == 1 and groups[0].shape == (5, 2, 3)
    with pytest.raises(ValueError, match="group results"):
        restore([])
    with pytest.raises(ValueError, match="expected"):
        restore([torch.zeros(4, 2, 3)])
    assert stack_by_shape([])[0] == []


def test_flatten_is_a_convolution_weight_as_its_patch_matrix():
    conv = torch.nn.Conv2d(4, 6, (3, 2), groups=2, bias=False)
    w = conv.weight.detach()  # (6, 2, 3, 2)
    whole, grouped = Flatten((3, 2)).to_work(w), Flatten((3, 2), groups=2).to_work(w)
    assert whole.shape == (6, 12) and grouped.shape == (2, 3, 12)
    assert whole.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    x = torch.randn(1, 4, 3, 2)  # one patch: the output is each group's block times its flattened inputs
    y = conv(x).reshape(6)
    for g in range(2):
        patch = x[0, 2 * g : 2 * g + 2].reshape(12)
        torch.testing.assert_close(y[3 * g : 3 * g + 3], grouped[g] @ patch)
        torch.testing.assert_close(grouped[g], whole[3 * g : 3 * g + 3])
