import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equiopt as eo
from equiopt.roles import assign_roles
from equiopt.roles.verify import CHECK_KINDS, RoleCheck, RoleReport, verify_roles

FAMILIES = ["qwen3", "gemma3", "olmoe", "gpt_oss"]
EXPECTED_KINDS = {
    "qwen3": {"neuron", "shift", "vocab"},
    "gemma3": {"neuron", "shift", "vocab"},
    "olmoe": {"neuron", "expert", "shift", "vocab"},
    "gpt_oss": {"neuron", "expert", "shift", "vocab"},
}
_MODELS: dict = {}


def tiny(family):
    """One tiny model per family for the whole file (verify_roles restores weights)."""
    if family not in _MODELS:
        _MODELS[family] = eo.models.build(family, "tiny", seed=0)
    return _MODELS[family]


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_bitwise_equal(model, saved):
    current = dict(model.named_parameters())
    assert current.keys() == saved.keys()
    for name, p in current.items():
        a, b = p.detach().reshape(-1), saved[name].reshape(-1)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} not restored bit for bit"


def checks(report, kind, pattern):
    """Checks of ``kind`` that involve a parameter matching ``pattern``."""
    return [c for c in report if c.kind == kind and any(re.search(pattern, n) for n in c.names)]


# ---------------------------------------------------------------- real families


@pytest.mark.parametrize("family", FAMILIES)
def test_inferred_roles_pass_on_tiny_models(family):
    model = tiny(family)
    report = verify_roles(model)
    assert isinstance(report, RoleReport) and all(isinstance(c, RoleCheck) for c in report)
    assert report.ok, str(report)
    assert report.failures == []
    assert report.kinds() == EXPECTED_KINDS[family]
    layers = model.config.num_hidden_layers
    assert len([c for c in report if c.kind == "neuron"]) == layers  # one MLP block per layer
    for c in report:
        assert c.passed and c.max_change <= c.tolerance
        assert 0 < c.tolerance < 1e-3  # float32: tolerance far below a broken symmetry's change
    table = assign_roles(model)
    mlp = {r.name for r in table if r.role in ("mlp_in", "mlp_out")}
    assert mlp == {n for c in report if c.kind == "neuron" for n in c.names if n in mlp}
    lm = checks(report, "shift", r"^lm_head\.weight$")
    assert len(lm) == 1
    if "expert" in EXPECTED_KINDS[family]:
        routers = [r.name for r in table if r.role == "router"]
        assert len(routers) == layers
        for name in routers:
            (expert,) = checks(report, "expert", re.escape(name))
            assert any("experts.gate_up_proj" in n for n in expert.names)
            assert any("experts.down_proj" in n for n in expert.names)
            assert len(checks(report, "shift", re.escape(name))) == 1
        assert all("per-expert" in c.detail for c in report if c.kind == "neuron")
    text = str(report)
    assert "all passed" in text and "FAIL" not in text
    for kind in EXPECTED_KINDS[family]:
        assert kind in text


def test_gpt_oss_biases_move_with_neurons_and_experts():
    model = tiny("gpt_oss")
    report = verify_roles(model)
    assert report.ok, str(report)
    (neuron,) = checks(report, "neuron", r"layers\.0\.")
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in neuron.names
    assert "model.layers.0.mlp.experts.down_proj_bias" not in neuron.names  # indexes the hidden size
    (expert,) = checks(report, "expert", r"layers\.0\.")
    for suffix in ("router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"):
        assert f"model.layers.0.mlp.{suffix}" in expert.names
    # the same with non-zero (trained-like) biases: the interleaved bias must follow its neurons
    saved = snapshot(model)
    try:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        report = verify_roles(model, fill_zeros=False, checks=["neuron", "expert"])
        assert report.ok, str(report)
        assert report.kinds() == {"neuron", "expert"}
        assert not any("filled" in note for note in report.notes)
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(saved[name])


# ---------------------------------------------------------- planted wrong roles


def test_up_proj_marked_attention_breaks_the_neuron_check():
    report = verify_roles(tiny("qwen3"), rules={r"layers\.0\.mlp\.up_proj": "attention"})
    assert not report.ok
    (bad,) = checks(report, "neuron", r"layers\.0\.mlp\.")
    assert not bad.passed and bad.max_change > 100 * bad.tolerance
    assert "model.layers.0.mlp.up_proj.weight" not in bad.names
    assert "up_proj.weight" in bad.detail and "not permuted" in bad.detail
    assert report.failures == [bad]  # layer 1 and the head are fine
    assert "FAIL" in str(report)


@pytest.mark.parametrize("family", ["qwen3", "olmoe"])
def test_q_proj_marked_mlp_in_fails(family):
    report = verify_roles(tiny(family), rules={r"q_proj": "mlp_in"})
    assert not report.ok
    bad = checks(report, "neuron", r"q_proj")
    assert len(bad) == tiny(family).config.num_hidden_layers
    assert all(not c.passed for c in bad)
    assert all(c.passed for c in report if c not in bad)  # the real MLP blocks still pass


def test_interleave_layout_forced_on_concatenated_experts_fails():
    report = verify_roles(tiny("olmoe"), rules={r"experts\.gate_up_proj$": ("mlp_in", "experts:gate_up:interleave")})
    assert not report.ok
    bad = [c for c in report if not c.passed]
    assert bad and all(c.kind == "neuron" and any("gate_up_proj" in n for n in c.names) for c in bad)
    assert all(c.passed for c in report if c.kind in ("expert", "shift", "vocab"))


def test_concat_layout_forced_on_interleaved_experts_fails():
    report = verify_roles(
        tiny("gpt_oss"),
        checks=["neuron"],
        rules={r"layers\.1\.mlp\.experts\.gate_up_proj$": ("mlp_in", "experts:gate_up:concat:cols")},
    )
    (bad,) = report.failures
    assert bad.kind == "neuron" and "model.layers.1.mlp.experts.gate_up_proj" in bad.names


def test_gate_proj_marked_lm_head_fails_its_shift_check():
    report = verify_roles(tiny("qwen3"), rules={r"layers\.0\.mlp\.gate_proj": "lm_head"})
    assert not report.ok
    (shift,) = checks(report, "shift", r"layers\.0\.mlp\.gate_proj")
    assert not shift.passed
    (real_head,) = checks(report, "shift", r"^lm_head\.weight$")
    assert real_head.passed
    assert any(not c.passed for c in checks(report, "vocab", r"gate_proj"))


def test_gate_proj_marked_router_fails_expert_and_shift_checks():
    report = verify_roles(tiny("gemma3"), rules={r"layers\.1\.mlp\.gate_proj": "router"})
    (expert,) = [c for c in report if c.kind == "expert"]
    assert not expert.passed and "no expert tensors" in expert.detail
    assert not checks(report, "shift", r"gate_proj")[0].passed


def test_raise_on_failure_lists_the_failures():
    with pytest.raises(ValueError, match=r"neuron check failed on .*layers\.0\.mlp"):
        verify_roles(tiny("qwen3"), rules={r"layers\.0\.mlp\.up_proj": "attention"}, raise_on_failure=True)
    verify_roles(tiny("qwen3"), raise_on_failure=True)  # passes quietly


def test_softcapping_breaks_the_head_shift_quotient():
    model = eo.models.build("gemma3", "tiny", seed=0, final_logit_softcapping=0.5)
    report = verify_roles(model, checks=["shift"])
    (shift,) = report
    assert not shift.passed


# ------------------------------------------------------------ restoring state


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
def test_weights_and_training_flags_restored(family):
    model = tiny(family)
    saved = snapshot(model)
    model.train()
    model.model.layers[0].eval()  # a mixed pattern of flags must come back as it was
    flags = {n: m.training for n, m in model.named_modules()}
    for rules in (
        None,
        {r"gate_up_proj$": ("mlp_in", "experts:gate_up:interleave:cols")},
        {r"layers\.0\..*q_proj\.weight": "lm_head"},
    ):
        if family == "olmoe" and rules is not None and "gate_up_proj$" in rules:
            rules = {r"gate_up_proj$": ("mlp_in", "experts:gate_up:interleave")}
        verify_roles(model, rules=rules)
        assert_bitwise_equal(model, saved)
        assert {n: m.training for n, m in model.named_modules()} == flags
    model.eval()


def test_restored_when_the_forward_raises():
    model = tiny("qwen3")
    saved = snapshot(model)
    model.train()
    calls = []

    def flaky(m, ids):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return m(input_ids=ids).logits

    with pytest.raises(RuntimeError, match="boom"):
        verify_roles(model, forward_fn=flaky)
    assert_bitwise_equal(model, saved)
    assert all(m.training for m in model.modules())
    model.eval()


def test_zero_filled_parameters_are_restored_and_reported():
    model = eo.models.build("qwen3", "tiny", seed=0)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
    saved = snapshot(model)
    report = verify_roles(model)
    assert report.ok, str(report)
    assert_bitwise_equal(model, saved)
    assert any("2 all-zero parameter(s) filled" in note and "lm_head.weight" in note for note in report.notes)
    assert "filled" in str(report)
    # without filling, a wrong role next to a zero output projection cannot be seen ...
    rules = {r"layers\.0\.mlp\.up_proj": "attention"}
    assert verify_roles(model, rules=rules, fill_zeros=False, checks=["neuron"]).ok
    # ... with it, it is reported
    assert not verify_roles(model, rules=rules, checks=["neuron"]).ok
    assert_bitwise_equal(model, saved)


# ------------------------------------------------------------- plain modules


class SwiGLU(nn.Module):
    def __init__(self, d, f, scale=False):
        super().__init__()
        self.w_gate = nn.Linear(d, f)
        self.w_up = nn.Linear(d, f)
        self.w_down = nn.Linear(f, d)
        self.scale = nn.Parameter(torch.rand(f) + 0.5) if scale else None

    def forward(self, x):
        h = F.silu(self.w_gate(x)) * self.w_up(x)
        return self.w_down(h if self.scale is None else h * self.scale)


class Toy(nn.Module):
    def __init__(self, vocab=40, d=16, f=24, scale=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.ffn = SwiGLU(d, f, scale)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens)
        h = h + self.ffn(self.norm(h))
        return {"scores": self.head(self.norm(h))}


TOY_RULES = {
    r"^tok\.weight$": "embedding",
    r"ffn\.w_(gate|up)\.weight$": ("mlp_in", "row"),
    r"ffn\.w_down\.weight$": ("mlp_out", "col"),
    r"^head\.weight$": "lm_head",
}


def toy_forward(model, ids):
    return model(ids)["scores"]


def test_plain_module_with_rules_and_forward_fn():
    torch.manual_seed(0)
    model = Toy()
    saved = snapshot(model)
    report = verify_roles(model, rules=TOY_RULES, forward_fn=toy_forward, input_ids=torch.randint(0, 40, (3, 7)))
    assert report.ok, str(report)
    assert report.kinds() == {"neuron", "shift", "vocab"}
    (neuron,) = [c for c in report if c.kind == "neuron"]
    # dense biases: gate/up biases index the neurons and move, the down bias indexes d
    assert set(neuron.names) == {
        "ffn.w_gate.weight",
        "ffn.w_gate.bias",
        "ffn.w_up.weight",
        "ffn.w_up.bias",
        "ffn.w_down.weight",
    }
    assert report.input_shape == (3, 7)
    assert_bitwise_equal(model, saved)
    # a wrong layout on the down projection (work rows = hidden, not neurons) is caught
    wrong = [(r"ffn\.w_down\.weight$", ("mlp_out", "row")), *TOY_RULES.items()]
    with pytest.raises(ValueError, match="neuron check failed"):
        verify_roles(model, rules=wrong, forward_fn=toy_forward, raise_on_failure=True)
    # so is a transposed layout on the head (work rows = hidden, not vocabulary)
    wrong = [(r"^head\.weight$", ("lm_head", "col")), *TOY_RULES.items()]
    report = verify_roles(model, rules=wrong, forward_fn=toy_forward)
    assert {c.kind for c in report.failures} == {"shift", "vocab"}
    assert_bitwise_equal(model, saved)


def test_plain_module_unmatched_neuron_tensor_is_reported():
    torch.manual_seed(0)
    model = Toy(scale=True)
    report = verify_roles(model, rules=TOY_RULES, forward_fn=toy_forward)
    (neuron,) = [c for c in report if c.kind == "neuron"]
    assert not neuron.passed
    assert "ffn.scale" in neuron.detail and "not permuted" in neuron.detail
    assert [c.kind for c in report.failures] == ["neuron"]


def test_plain_module_needs_forward_fn_for_unusual_outputs():
    model = Toy()
    with pytest.raises(TypeError, match="forward_fn"):
        verify_roles(model, rules=TOY_RULES)


def test_argument_validation():
    model = tiny("qwen3")
    table = assign_roles(model)
    with pytest.raises(ValueError, match="either"):
        verify_roles(model, table=table, rules={"x": "matrix"})
    with pytest.raises(ValueError, match="unknown check"):
        verify_roles(model, checks=["heads"])
    report = verify_roles(model, table=table, checks=["shift"], seed=3)
    assert report.kinds() == {"shift"} and set(CHECK_KINDS) >= report.kinds()


def test_plain_module_with_tied_head_checks_both_vocabulary_sides():
    torch.manual_seed(0)
    model = Toy()
    model.head.weight = model.tok.weight
    rules = {k: v for k, v in TOY_RULES.items() if "head" not in k}
    table = assign_roles(model, rules=rules)
    assert table.tied_embeddings
    report = verify_roles(model, table=table, forward_fn=toy_forward)
    assert report.ok, str(report)
    (vocab,) = [c for c in report if c.kind == "vocab"]
    assert vocab.names == ("tok.weight",) and "output permuted" in vocab.detail
    # the same table without the tie recorded would claim an input-only vocabulary: caught
    untied = type(table)(list(table), tied_embeddings=False)
    assert not verify_roles(model, table=untied, forward_fn=toy_forward, checks=["vocab"]).ok


def test_float64_model_uses_a_float64_tolerance():
    model = eo.models.build("qwen3", "tiny", seed=0).double()
    report = verify_roles(model)
    assert report.ok, str(report)
    assert report.dtype == torch.float64
    assert all(c.tolerance < 1e-7 for c in report)
    assert not verify_roles(model, rules={r"layers\.1\.mlp\.up_proj": "attention"}, checks=["neuron"]).ok


def test_entry_modules_keep_their_import_paths():
    """roles.infer and roles.verify are the entry modules: the names other modules import
    from them are the ones in roles.inference and roles.checks."""
    from equiopt.roles import checks, infer, inference, verify
    from equiopt.roles.infer import _CONVS, input_embedding, rule_table

    assert infer.assign_roles is eo.roles.assign_roles and verify.verify_roles is eo.roles.verify_roles
    assert infer.RoleInferenceError is inference.errors.RoleInferenceError is eo.roles.RoleInferenceError
    assert infer.ModelDims is eo.roles.ModelDims and infer.model_dims is eo.roles.model_dims
    assert (
        verify.RoleReport is checks.report.RoleReport and verify.DEFAULT_TOLERANCES is checks.report.DEFAULT_TOLERANCES
    )
    assert _CONVS is inference.storage._CONVS and input_embedding is inference.embeddings.input_embedding
    assert rule_table is inference.rules.rule_table
    runner = object.__new__(verify._Runner)  # one method a kind, in the order of CHECK_KINDS
    assert tuple(runner.checks()) == CHECK_KINDS
