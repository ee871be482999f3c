"""Final-logit, router and weight diagnostics: hand-computed values and agreement checks."""

import math
from collections import namedtuple

import pytest
import torch
from torch import nn

from equiopt.diagnostics.logits import LOGIT_METRIC_KEYS, logit_metrics, sample_positions, softcap
from equiopt.diagnostics.router import (
    ROUTER_METRIC_KEYS,
    RouterLogitsRecorder,
    collect_router_logits,
    expert_load,
    load_balancing_loss,
    router_metrics,
    z_loss,
)
from equiopt.diagnostics.weights import WEIGHT_STAT_KEYS, WeightTracker


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def close(a, b, rel=1e-6, abs=1e-9):
    return a == pytest.approx(b, rel=rel, abs=abs)


# ------------------------------------------------------------------ final logits
def test_logit_metrics_hand_computed():
    z = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    m = logit_metrics(z)
    assert set(m) == set(LOGIT_METRIC_KEYS)
    # ||z_t||^2 / v: 0 and 30/4; centred: 0 and (2.25+.25+.25+2.25)/4 = 1.25; mean logits 0 and 2.5
    assert close(m["raw_rms"], math.sqrt((0 + 30 / 4) / 2))
    assert close(m["centered_rms"], math.sqrt((0 + 1.25) / 2))
    assert close(m["shift_rms"], math.sqrt(2.5**2 / 2))
    lse1 = math.log(sum(math.exp(i) for i in range(1, 5)))
    assert close(m["max_lse"], lse1)
    assert close(m["mean_lse"], (math.log(4) + lse1) / 2)
    assert m["max_abs"] == 4.0
    assert m["num_positions"] == 2.0


def test_centered_rms_ignores_per_position_shift_raw_rms_grows():
    z = randn(6, 5, 50, seed=1)
    shift = 10.0 + 3.0 * randn(6, 5, 1, seed=2)
    a, b = logit_metrics(z), logit_metrics(z + shift)
    assert close(b["centered_rms"], a["centered_rms"], rel=1e-5)
    assert b["raw_rms"] > 5 * a["raw_rms"]
    assert b["shift_rms"] > 5 * a["shift_rms"]
    for m in (a, b):  # raw^2 = centred^2 + shift^2
        assert close(m["raw_rms"] ** 2, m["centered_rms"] ** 2 + m["shift_rms"] ** 2, rel=1e-5)
    # log-sum-exp moves with the shift
    lse = torch.logsumexp((z + shift).double(), dim=-1)
    assert close(b["max_lse"], float(lse.max()), rel=1e-5)
    assert close(b["mean_lse"], float(lse.mean()), rel=1e-5)


def test_logit_metrics_chunks_bf16_and_mask():
    z = 4 * randn(3, 7, 33, seed=3)
    ref = logit_metrics(z.double())
    chunked = logit_metrics(z, chunk_elements=40)  # one position per chunk
    for key in LOGIT_METRIC_KEYS:
        assert close(chunked[key], ref[key], rel=1e-5), key
    zb = z.bfloat16()
    got = logit_metrics(zb, chunk_elements=100)
    want = logit_metrics(zb.double())  # the bf16 values, measured exactly
    for key in LOGIT_METRIC_KEYS:
        assert close(got[key], want[key], rel=1e-5), key
    mask = randn(3, 7, seed=4) > 0
    masked = logit_metrics(z, mask)
    sub = logit_metrics(z[mask])
    for key in LOGIT_METRIC_KEYS:
        assert close(masked[key], sub[key], rel=1e-6), key
    assert masked["num_positions"] == float(mask.sum())
    empty = logit_metrics(z, torch.zeros(3, 7, dtype=torch.bool))
    assert empty["num_positions"] == 0.0 and math.isnan(empty["raw_rms"])


def test_softcap_bounds_values_and_identity():
    z = torch.linspace(-500, 500, 1001)
    assert softcap(z, None) is z
    out = softcap(z, 30.0)
    assert out.abs().max() <= 30.0
    assert torch.all(out[1:] >= out[:-1])  # monotone
    torch.testing.assert_close(softcap(-z, 30.0), -out)  # odd
    assert close(float(softcap(torch.tensor(30.0), 30)), 30 * math.tanh(1.0))
    small = torch.tensor([1e-3, -2e-3])
    torch.testing.assert_close(softcap(small, 30.0), small, rtol=1e-6, atol=0)
    assert softcap(z.bfloat16(), 30).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        softcap(z, 0.0)


def test_sample_positions_reproducible_distinct_and_masked():
    g = lambda: torch.Generator().manual_seed(7)
    a, b = sample_positions((4, 9), 10, g()), sample_positions((4, 9), 10, g())
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b))
    flat = a[0] * 9 + a[1]
    assert flat.numel() == 10 and flat.unique().numel() == 10
    assert torch.all(flat[1:] > flat[:-1])
    h = randn(4, 9, 5, seed=5)
    assert h[a].shape == (10, 5)
    assert not torch.equal(sample_positions((4, 9), 10, torch.Generator().manual_seed(8))[1], a[1])
    allpos = sample_positions((4, 9), 100, g())
    assert allpos[0].numel() == 36
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[1, 2:5] = True
    mask[3, 0] = True
    picked = sample_positions((4, 9), 3, g(), mask=mask)
    assert picked[0].numel() == 3 and bool(mask[picked].all())
    assert sample_positions((4, 9), 10, g(), mask=mask)[0].numel() == 4


# ------------------------------------------------------------------ router metrics
def balanced_logits(E=4, reps=3):
    """Every cyclic shift of one logit vector: each expert is in the top-k equally often and P is uniform."""
    base = torch.arange(E, dtype=torch.float32)
    rows = [torch.roll(base, s) for s in range(E)]
    return torch.stack(rows * reps)


def test_balanced_router_metrics():
    E, k = 4, 2
    logits = balanced_logits(E)
    m = router_metrics([logits], top_k=k)
    assert set(ROUTER_METRIC_KEYS) <= set(m)
    layer = m["per_layer"][0]
    assert layer["load"] == pytest.approx([0.25] * 4) and layer["prob"] == pytest.approx([0.25] * 4)
    assert close(m["lb_loss"], 1.0)
    assert close(float(load_balancing_loss(logits, k)), 1.0)
    assert close(m["load_entropy"], math.log(E))
    assert close(m["load_entropy_norm"], 1.0)
    assert close(m["load_cv"], 0.0, abs=1e-12)
    assert m["dead_fraction"] == 0.0
    assert close(m["max_load"], 0.25) and close(m["max_load_ratio"], 1.0)
    assert m["num_tokens"] == 12.0


def test_all_to_one_expert_router_metrics():
    E = 4
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]]).repeat(10, 1)
    m = router_metrics(logits, top_k=1)
    P0 = math.exp(2) / (math.exp(2) + 3)
    assert m["per_layer"][0]["load"] == [1.0, 0.0, 0.0, 0.0]
    assert close(m["per_layer"][0]["prob"][0], P0)
    assert close(m["lb_loss"], E * P0)
    assert close(float(load_balancing_loss(logits, 1)), E * P0)
    assert m["dead_fraction"] == (E - 1) / E
    assert m["max_load"] == 1.0 and m["max_load_ratio"] == float(E)
    assert close(m["load_entropy"], 0.0, abs=1e-12)
    assert close(m["load_cv"], math.sqrt(E - 1))  # population std of (1,0,0,0) / (1/4)
    assert close(m["z_loss"], math.log(math.exp(2) + 3) ** 2)
    # logit scale: mean of z^2 = 4/4 = 1; centred logits (1.5, -.5, -.5, -.5), mean square 0.75
    assert close(m["logit_rms"], 1.0) and close(m["logit_rms_centered"], math.sqrt(0.75))


def test_z_loss_of_zero_logits_and_gradient():
    for E in (2, 4, 7):
        zeros = torch.zeros(5, E)
        assert close(float(z_loss(zeros)), math.log(E) ** 2)
        assert close(router_metrics([zeros], top_k=1)["z_loss"], math.log(E) ** 2)
    z = randn(6, 5, seed=6).requires_grad_()
    loss = z_loss([z])
    loss.backward()
    lse = torch.logsumexp(z.detach(), dim=-1, keepdim=True)
    expected = 2 * lse * torch.softmax(z.detach(), dim=-1) / z.shape[0]  # d/dz mean_t lse_t^2
    torch.testing.assert_close(z.grad, expected)


def test_router_logit_scale_is_shift_aware():
    z = randn(20, 8, seed=9)
    a = router_metrics(z, top_k=2)
    b = router_metrics(z + 5.0 * randn(20, 1, seed=10), top_k=2)
    assert close(b["logit_rms_centered"], a["logit_rms_centered"], rel=1e-5)
    assert b["logit_rms"] > 2 * a["logit_rms"]
    # load and P are shift invariant, z-loss is not
    assert b["per_layer"][0]["load"] == a["per_layer"][0]["load"]
    assert close(b["lb_loss"], a["lb_loss"], rel=1e-5)
    assert b["z_loss"] > a["z_loss"]


def test_router_shapes_mask_and_layer_mean():
    B, T, E, k = 2, 6, 5, 2
    layers = [randn(B, T, E, seed=s) * (s + 1) for s in range(3)]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0
    mask[1, 5:] = 0
    m3 = router_metrics(layers, k, mask)
    m2 = router_metrics([t.reshape(B * T, E) for t in layers], k, mask)
    sub = router_metrics([t[mask.bool()] for t in layers], k)
    for key in ROUTER_METRIC_KEYS:
        assert close(m3[key], m2[key], rel=1e-6) and close(m3[key], sub[key], rel=1e-6), key
        per = [d[key] for d in m3["per_layer"]]
        assert close(m3[key], sum(per) / len(per), rel=1e-9), key
    assert m3["num_layers"] == 3 and m3["num_tokens"] == float(mask.sum())
    for t, d in zip(layers, m3["per_layer"]):
        f, P = expert_load(t, k, mask)
        assert sum(d["load"]) == pytest.approx(1.0) and sum(d["prob"]) == pytest.approx(1.0)
        assert d["load"] == pytest.approx(f.tolist()) and d["prob"] == pytest.approx(P.tolist())
    assert close(float(load_balancing_loss(layers, k, mask)), m3["lb_loss"], rel=1e-6)
    assert close(float(z_loss(layers, mask)), m3["z_loss"], rel=1e-6)
    assert close(float(load_balancing_loss(layers, k, mask, "sum")), 3 * m3["lb_loss"], rel=1e-6)
    with pytest.raises(ValueError):
        router_metrics(layers, k, torch.ones(B, T + 1))
    with pytest.raises(ValueError):
        router_metrics(layers, E + 1)


def test_load_balancing_loss_differentiates_through_P_only():
    z = randn(30, 6, seed=11).requires_grad_()
    k = 2
    loss = load_balancing_loss(z, k)
    loss.backward()
    f, _ = expert_load(z.detach(), k)
    zz = z.detach().clone().requires_grad_()
    (6 * torch.sum(f * torch.softmax(zz, dim=-1).mean(0))).backward()
    torch.testing.assert_close(z.grad, zz.grad)
    assert z.grad.abs().sum() > 0


def hf_lb():
    pytest.importorskip("transformers")
    from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

    return load_balancing_loss_func


@pytest.mark.parametrize("masked", [False, True])
def test_matches_hf_load_balancing_loss_up_to_top_k_and_pooling(masked):
    hf = hf_lb()
    B, T, E, k = 3, 8, 6, 2
    layers = tuple(randn(B * T, E, seed=20 + s) * (1 + s) for s in range(3))
    mask = None
    if masked:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, 5:] = 0
        mask[2, 2:] = 0
    want = hf(layers, E, k, mask)
    # Hugging Face: f sums to top_k (counts / tokens) and layers are pooled
    got = load_balancing_loss(layers, k, mask, layer_reduction="pooled")
    torch.testing.assert_close(got * k, want, rtol=1e-6, atol=1e-7)
    one = load_balancing_loss(layers[1], k, mask)
    torch.testing.assert_close(one * k, hf((layers[1],), E, k, mask), rtol=1e-6, atol=1e-7)
    # the per-layer mean (default, the paper's per-layer diagnostic) is a different number
    assert abs(float(load_balancing_loss(layers, k, mask)) - float(got)) > 1e-4
    # gpt-oss uses the same function
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func as gpt_oss_lb

    torch.testing.assert_close(gpt_oss_lb(layers, E, k, mask), want)


def tiny_olmoe():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.OlmoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.OlmoeForCausalLM(cfg).eval()
    with torch.no_grad():  # weights of a fresh OLMoE router are zero; make routing non-trivial
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def test_collect_router_logits_tiny_olmoe_and_hook_recorder():
    model = tiny_olmoe()
    B, T = 2, 7
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    logits = collect_router_logits(model, ids, mask)
    assert len(logits) == 2
    assert all(t.shape == (B * T, 4) and not t.requires_grad for t in logits)
    gates = [layer.mlp.gate for layer in model.model.layers]
    with RouterLogitsRecorder(gates) as rec:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    for a, b in zip(logits, rec.router_logits):
        torch.testing.assert_close(a, b)
    m = router_metrics(logits, top_k=2, attention_mask=mask)
    assert m["num_layers"] == 2 and m["num_tokens"] == float(mask.sum())
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    torch.testing.assert_close(out.aux_loss, 2 * load_balancing_loss(logits, 2, mask, "pooled"))


def test_collect_router_logits_tiny_gpt_oss():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(0, 0.5)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    logits = collect_router_logits(model, ids)
    assert len(logits) == 2 and all(t.shape == (10, 4) for t in logits)
    assert router_metrics(logits, top_k=2)["num_tokens"] == 10.0


def test_router_logits_recorder_on_plain_linear():
    gate = nn.Linear(8, 3)
    other = nn.Linear(8, 3)
    x1, x2 = randn(2, 4, 8, seed=30), randn(5, 8, seed=31)
    with RouterLogitsRecorder({"gate": gate, "other": other}) as rec:
        y1, y2 = gate(x1), gate(x2)
        with pytest.raises(RuntimeError):
            rec.router_logits  # "other" never ran
        other(x2)
        got = rec.router_logits
        torch.testing.assert_close(got[0], torch.cat([y1.reshape(-1, 3), y2]).detach())
        assert not got[0].requires_grad
        rec.clear()
        gate(x2)
        other(x2)
        assert rec.router_logits[0].shape == (5, 3)
    gate(x1)  # hooks removed
    assert rec.router_logits[0].shape == (5, 3)
    with RouterLogitsRecorder(gate, detach=False) as rec:
        gate(x2)
    assert rec.router_logits[0].requires_grad
    load_balancing_loss(rec.router_logits, 1).backward()
    assert gate.weight.grad is not None


def test_collect_router_logits_rejects_dense_model():
    class Dense(nn.Module):
        def forward(self, input_ids, output_router_logits=False, use_cache=False):
            return {"logits": input_ids.float()}

    with pytest.raises(ValueError):
        collect_router_logits(Dense(), torch.zeros(1, 3, dtype=torch.long))


# ------------------------------------------------------------------ weights
def test_weight_tracker_matches_manual_computation():
    torch.manual_seed(0)
    emb = nn.Parameter(randn(10, 4, seed=40))
    q = nn.Parameter(randn(4, 4, seed=41))
    o = nn.Parameter(randn(4, 4, seed=42))
    g = nn.Parameter(torch.ones(4))
    roles = {"embedding": [("emb", emb)], "attention": [("q", q), ("o", o), ("q_again", q)], "vector": [("g", g)]}
    for offload in (False, True):
        tracker = WeightTracker(roles, offload=offload)
        with pytest.raises(RuntimeError):
            tracker.update_stats()
        tracker.snapshot()
        before = {n: p.detach().clone() for n, p in [("emb", emb), ("q", q), ("o", o), ("g", g)]}
        with torch.no_grad():
            emb.add_(0.01 * randn(10, 4, seed=43))
            q.mul_(0.9)
            o.add_(0.1)
        stats = tracker.update_stats()
        assert not tracker.has_snapshot
        assert set(stats) == set(roles) and all(set(d) == set(WEIGHT_STAT_KEYS) for d in stats.values())

        def rms(ts):
            return math.sqrt(sum(float((t.detach().double() ** 2).sum()) for t in ts) / sum(t.numel() for t in ts))

        att = stats["attention"]
        assert att["numel"] == 32  # q counted once
        assert close(att["weight_rms"], rms([q, o]), rel=1e-6)
        assert close(att["update_rms"], rms([q - before["q"], o - before["o"]]), rel=1e-6)
        assert close(att["update_to_weight"], att["update_rms"] / att["weight_rms"], rel=1e-12)
        assert close(stats["embedding"]["update_rms"], rms([emb - before["emb"]]), rel=1e-5)
        assert close(stats["vector"]["weight_rms"], 1.0) and stats["vector"]["update_rms"] == 0.0
        assert tracker.weight_stats()["attention"]["weight_rms"] == att["weight_rms"]
    flat = WeightTracker.flatten(stats)
    assert flat["weights/attention/update_rms"] == att["update_rms"] and "weights/attention/numel" not in flat


def test_weight_tracker_from_assignments_and_cumulative_interval():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    Row = namedtuple("Row", "name role")
    rows = [Row("0.weight", "embedding"), Row("1.weight", "matrix"), Row("1.bias", "vector")]
    tracker = WeightTracker.from_assignments(model, rows)
    assert set(tracker.roles) == {"embedding", "matrix", "vector"}
    tracker.snapshot()
    w0 = model[1].weight.detach().clone()
    for _ in range(3):
        with torch.no_grad():
            model[1].weight.add_(0.05)
        mid = tracker.update_stats(release=False)
    assert tracker.has_snapshot
    assert close(mid["matrix"]["update_rms"], float((model[1].weight.detach() - w0).pow(2).mean().sqrt()), rel=1e-5)
    assert close(mid["matrix"]["update_rms"], 0.15, rel=1e-5)


# ------------------------------------------------------------------ distributed reduction
def _dist_worker(rank, world, logits, router):
    lm = logit_metrics(logits[rank::world], all_reduce=True)
    rm = router_metrics([r[rank::world] for r in router], top_k=2, all_reduce=True)
    # a row-sharded DTensor parameter (FSDP2 style): norms are reduced over the mesh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(24.0).reshape(6, 4)
    p = nn.Parameter(distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)]))
    tracker = WeightTracker({"matrix": [("p", p)]})
    tracker.snapshot()
    with torch.no_grad():
        p.mul_(2.0)
    ws = tracker.update_stats()["matrix"]
    return rank, lm, {k: rm[k] for k in ROUTER_METRIC_KEYS}, ws


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_all_reduce_gives_metrics_of_the_union(gloo):
    logits = 3 * randn(10, 17, seed=50)
    router = [randn(12, 5, seed=51), randn(12, 5, seed=52) * 4]
    results = gloo(_dist_worker, 2, logits, router)
    want_l = logit_metrics(logits)
    want_r = router_metrics(router, top_k=2)
    full_rms = math.sqrt(sum(i * i for i in range(24)) / 24)
    for _, lm, rm, ws in results:
        for key in LOGIT_METRIC_KEYS:
            assert close(lm[key], want_l[key], rel=1e-5), key
        for key in ROUTER_METRIC_KEYS:
            assert close(rm[key], want_r[key], rel=1e-5), key
        assert ws["numel"] == 24
        assert close(ws["weight_rms"], 2 * full_rms, rel=1e-6) and close(ws["update_rms"], full_rms, rel=1e-6)
