"""Roles from the dataflow: a zoo of models in the styles users write, each role and each
per-head / per-expert work shape asserted; every suggestion an error makes fed back."""

import ast
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equiopt as eo
from equiopt.layouts import Col, Compose, Experts, Flatten, GateUp, Heads, Row, Unflatten
from equiopt.roles import RoleInferenceError, assign_roles

D, H, HKV, HD, FF, V = 64, 4, 2, 16, 96, 120


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotate(x):
    a, b = x.chunk(2, -1)
    return x * 0.5 + torch.cat([-b, a], -1) * 0.5


def sdpa(q, k, v):
    """q (B, H, T, hd), k/v (B, Hkv, T, hd): grouped-query attention by repeating k/v."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def written_out(q, k, v):
    """matmul-softmax-matmul attention."""
    rep = q.shape[1] // k.shape[1]
    k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(q.shape[0], -1, *k.shape[2:])
    v = v[:, :, None].expand(-1, -1, rep, -1, -1).reshape(q.shape[0], -1, *v.shape[2:])
    s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    return torch.softmax(s, -1) @ v


class SeparateQKV(nn.Module):
    """q/k/v as separate square-or-not projections, GQA, q/k norms, rotary, SDPA or written out."""

    def __init__(self, written=False):
        super().__init__()
        self.wq = nn.Linear(D, H * HD, bias=False)  # square: H * HD == D
        self.wk = nn.Linear(D, HKV * HD, bias=False)
        self.wv = nn.Linear(D, HKV * HD, bias=False)
        self.wo = nn.Linear(H * HD, D, bias=False)
        self.written = written

    def forward(self, x):
        b, t, _ = x.shape
        q = rotate(rms(self.wq(x).view(b, t, H, HD))).transpose(1, 2)
        k = rotate(rms(self.wk(x).view(b, t, HKV, HD))).transpose(1, 2)
        v = self.wv(x).view(b, t, HKV, HD).transpose(1, 2)
        o = (written_out if self.written else sdpa)(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, t, H * HD))


@torch.library.custom_op("equiopt_test::flash_attn", mutates_args=())
def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An attention kernel of another library: (batch, tokens, heads, head_dim) in and out."""
    return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).contiguous()


@flash_attn.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class KernelAttention(SeparateQKV):
    """q/k/v handed to a custom attention operator in (batch, tokens, heads, head_dim)."""

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, H, HD)
        k = self.wk(x).view(b, t, HKV, HD).repeat_interleave(H // HKV, 2)
        v = self.wv(x).view(b, t, HKV, HD).repeat_interleave(H // HKV, 2)
        return self.wo(flash_attn(q, k, v).reshape(b, t, H * HD))


class FusedQKV(nn.Module):
    """One qkv projection: q|k|v concatenated, or interleaved per key-value group."""

    def __init__(self, interleaved=False):
        super().__init__()
        self.qkv = nn.Linear(D, (H + 2 * HKV) * HD)
        self.proj = nn.Linear(H * HD, D)
        self.interleaved = interleaved

    def forward(self, x):
        b, t, _ = x.shape
        y = self.qkv(x)
        if self.interleaved:  # (kv groups, [q heads of the group, k, v], hd)
            g = H // HKV
            y = y.view(b, t, HKV, g + 2, HD)
            q, k, v = y[..., :g, :].reshape(b, t, H, HD), y[..., g, :], y[..., g + 1, :]
        else:
            q, k, v = y.split([H * HD, HKV * HD, HKV * HD], -1)
            q, k, v = q.view(b, t, H, HD), k.view(b, t, HKV, HD), v.view(b, t, HKV, HD)
        o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(o.transpose(1, 2).reshape(b, t, -1))


class ToQKV(nn.Module):
    """The to_q / to_k / to_v / to_out style, head counts as heads / kv_heads."""

    def __init__(self):
        super().__init__()
        self.heads, self.kv_heads = H, HKV
        self.to_q = nn.Linear(D, H * HD, bias=False)
        self.to_k = nn.Linear(D, HKV * HD, bias=False)
        self.to_v = nn.Linear(D, HKV * HD, bias=False)
        self.to_out = nn.Linear(H * HD, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.to_q(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k = self.to_k(x).unflatten(-1, (self.kv_heads, -1)).transpose(1, 2)
        v = self.to_v(x).unflatten(-1, (self.kv_heads, -1)).transpose(1, 2)
        return self.to_out(sdpa(q, k, v).transpose(1, 2).flatten(2))


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x)[0]


class SwiGLU(nn.Module):
    def __init__(self, ff=FF, fused=None):
        super().__init__()
        self.fused = fused
        if fused:
            self.w12 = nn.Linear(D, 2 * ff, bias=False)
        else:
            self.w1, self.w3 = nn.Linear(D, ff, bias=False), nn.Linear(D, ff, bias=False)
        self.w2 = nn.Linear(ff, D, bias=False)

    def forward(self, x):
        if self.fused == "interleave":
            h = self.w12(x)
            g, u = h[..., ::2], h[..., 1::2]
        elif self.fused:
            g, u = self.w12(x).chunk(2, -1)
        else:
            g, u = self.w1(x), self.w3(x)
        return self.w2(F.silu(g) * u)


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class MoE3D(nn.Module):
    """Experts as 3-D tensors gathered per token (fused gate/up (E, 2F, D), down (E, D, F))."""

    def __init__(self, e=4, f=32):
        super().__init__()
        self.router = nn.Linear(D, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * f, D) * 0.02)
        self.down = nn.Parameter(torch.randn(e, D, f) * 0.02)

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        w, idx = torch.softmax(self.router(flat), -1).topk(2, -1)
        xs = flat.repeat_interleave(2, 0).unsqueeze(-1)  # (tokens * k, d, 1)
        gu = torch.bmm(self.gate_up[idx.flatten()], xs).squeeze(-1)  # each token's experts' weights
        g, u = gu.chunk(2, -1)
        y = torch.bmm(self.down[idx.flatten()], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)
        return (y.view(-1, 2, d) * w[..., None]).sum(1).reshape(b, t, d)


class MoEList(nn.Module):
    """Experts as a list of modules, every expert on every token, weighted by the router."""

    def __init__(self, e=4):
        super().__init__()
        self.gate = nn.Linear(D, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(32) for _ in range(e))

    def forward(self, x):
        p = torch.sigmoid(self.gate(x))
        top, idx = p.topk(2, -1)
        weights = torch.zeros_like(p).scatter(-1, idx, top)
        return sum(weights[..., i : i + 1] * ex(x) for i, ex in enumerate(self.experts))


class MoEStacked(nn.Module):
    """Experts as 2-D stacks of blocks and a flat router, as OLMo-core stores them."""

    def __init__(self, e=4, f=32):
        super().__init__()
        self.e, self.f = e, f
        self.router = nn.Parameter(torch.randn(e * D) * 0.02)
        self.w1 = nn.Parameter(torch.randn(e * D, f) * 0.02)
        self.w3 = nn.Parameter(torch.randn(e * D, f) * 0.02)
        self.w2 = nn.Parameter(torch.randn(e * f, D) * 0.02)

    def forward(self, x):
        b, t, d = x.shape
        logits = F.linear(x, self.router.view(self.e, d))
        w, _ = torch.softmax(logits, -1).topk(2, -1)
        xs = x.reshape(1, -1, d).expand(self.e, -1, -1)
        h = F.silu(torch.bmm(xs, self.w1.view(self.e, d, self.f))) * torch.bmm(xs, self.w3.view(self.e, d, self.f))
        y = torch.bmm(h, self.w2.view(self.e, self.f, d)).mean(0)
        return y.reshape(b, t, d) * w.sum(-1, keepdim=True)


class LM(nn.Module):
    """A decoder: token embedding, blocks of (attention, MLP), norm, LM head (tied or not,
    padded vocabulary, soft-capped logits)."""

    def __init__(self, attn, mlp, vocab=V, padded=None, tied=False, softcap=False, stem=False):
        super().__init__()
        rows = padded or vocab
        self.vocab = vocab
        self.emb = nn.Embedding(rows, D)
        self.stem = nn.Conv1d(D, D, 3, padding=1) if stem else None
        self.attn, self.mlp = attn, mlp
        self.norm = nn.LayerNorm(D)
        self.head = None if tied else nn.Linear(D, rows, bias=False)
        self.softcap = softcap

    def forward(self, ids):
        x = self.emb(ids)
        if self.stem is not None:
            x = x + self.stem(x.transpose(1, 2)).transpose(1, 2)
        x = x + self.attn(rms(x))
        x = x + self.mlp(rms(x))
        x = self.norm(x)
        logits = F.linear(x, self.emb.weight) if self.head is None else self.head(x)
        if self.softcap:
            logits = 30 * torch.tanh(logits / 30)
        return logits[..., : self.vocab]


ATTN_Q = ("attention", Heads(HD))
ATTN_O = ("attention", Heads(HD, "cols"))

ZOO = {
    "separate_qkv_square_q_gqa_qk_norm": (
        lambda: LM(SeparateQKV(), SwiGLU()),
        {"attn.wq.weight": ATTN_Q, "attn.wk.weight": ATTN_Q, "attn.wv.weight": ATTN_Q, "attn.wo.weight": ATTN_O},
    ),
    "attention_written_out": (
        lambda: LM(SeparateQKV(written=True), SwiGLU()),
        {"attn.wq.weight": ATTN_Q, "attn.wk.weight": ATTN_Q, "attn.wo.weight": ATTN_O},
    ),
    "attention_kernel_of_another_library": (
        lambda: LM(KernelAttention(), SwiGLU()),
        {"attn.wq.weight": ATTN_Q, "attn.wk.weight": ATTN_Q, "attn.wv.weight": ATTN_Q, "attn.wo.weight": ATTN_O},
    ),
    "fused_qkv_concatenated": (
        lambda: LM(FusedQKV(), SwiGLU()),
        {"attn.qkv.weight": ATTN_Q, "attn.qkv.bias": ("vector", None), "attn.proj.weight": ATTN_O},
    ),
    "fused_qkv_interleaved_per_group": (
        lambda: LM(FusedQKV(interleaved=True), SwiGLU()),
        {"attn.qkv.weight": ATTN_Q, "attn.proj.weight": ATTN_O},
    ),
    "to_q_to_out": (
        lambda: LM(ToQKV(), SwiGLU(ff=256)),
        {"attn.to_q.weight": ATTN_Q, "attn.to_out.weight": ATTN_O, "mlp.w1.weight": ("mlp_in", Row())},
    ),
    "multihead_attention": (
        lambda: LM(MHA(), SwiGLU()),
        {"attn.mha.in_proj_weight": ATTN_Q, "attn.mha.out_proj.weight": ATTN_O},
    ),
    "separate_gate_up": (
        lambda: LM(SeparateQKV(), SwiGLU()),
        {"mlp.w1.weight": ("mlp_in", Row()), "mlp.w3.weight": ("mlp_in", Row()), "mlp.w2.weight": ("mlp_out", Col())},
    ),
    "fused_gate_up_concat": (
        lambda: LM(SeparateQKV(), SwiGLU(fused="concat")),
        {"mlp.w12.weight": ("mlp_in", GateUp("concat")), "mlp.w2.weight": ("mlp_out", Col())},
    ),
    "fused_gate_up_interleaved": (
        lambda: LM(SeparateQKV(), SwiGLU(fused="interleave")),
        {"mlp.w12.weight": ("mlp_in", GateUp("interleave"))},
    ),
    "non_gated_mlp": (
        lambda: LM(SeparateQKV(), GeluMLP()),
        {"mlp.fc_in.weight": ("mlp_in", Row()), "mlp.fc_out.weight": ("mlp_out", Col())},
    ),
    "moe_3d_experts_gathered": (
        lambda: LM(SeparateQKV(), MoE3D()),
        {
            "mlp.router.weight": ("router", Row()),
            "mlp.gate_up": ("mlp_in", Experts(GateUp("concat"))),
            "mlp.down": ("mlp_out", Experts(Col())),
        },
    ),
    "moe_expert_list": (
        lambda: LM(SeparateQKV(), MoEList()),
        {
            "mlp.gate.weight": ("router", Row()),
            "mlp.experts.2.w1.weight": ("mlp_in", Row()),
            "mlp.experts.3.w2.weight": ("mlp_out", Col()),
        },
    ),
    "moe_2d_stacks_flat_router": (
        lambda: LM(SeparateQKV(), MoEStacked()),
        {
            "mlp.router": ("router", Unflatten(4)),
            "mlp.w1": ("mlp_in", Compose(Heads(D), Col())),
            "mlp.w3": ("mlp_in", Compose(Heads(D), Col())),
            "mlp.w2": ("mlp_out", Heads(32)),
        },
    ),
    "tied_head": (lambda: LM(SeparateQKV(), SwiGLU(), tied=True), {"emb.weight": ("embedding", Row())}),
    "padded_vocabulary_softcapped": (
        lambda: LM(SeparateQKV(), SwiGLU(), padded=128, softcap=True),
        {"emb.weight": ("embedding", Row()), "head.weight": ("lm_head", Row())},
    ),
    "vocabulary_equal_to_mlp_width": (
        lambda: LM(SeparateQKV(), SwiGLU(ff=FF), vocab=FF),
        {"head.weight": ("lm_head", Row()), "mlp.w1.weight": ("mlp_in", Row()), "mlp.w2.weight": ("mlp_out", Col())},
    ),
    "conv_stem": (
        lambda: LM(SeparateQKV(), SwiGLU(), stem=True),
        {"stem.weight": ("matrix", Flatten((3,))), "stem.bias": ("vector", None)},
    ),
}

WORK = {  # per-head / per-expert work shapes
    "attn.wq.weight": [(H, HD, D)],
    "attn.wk.weight": [(HKV, HD, D)],
    "attn.wo.weight": [(H, HD, D)],
    "attn.qkv.weight": [(H + 2 * HKV, HD, D)],
    "attn.mha.in_proj_weight": [(3 * H, HD, D)],
    "mlp.gate_up": [(4, 2, 32, D)],
    "mlp.down": [(4, 32, D)],
    "mlp.w12.weight": [(2, FF, D)],
    "mlp.router": [(4, D)],
}


def _check(table, expected):
    rows = {r.name: r for r in table}
    for name, (role, layout) in expected.items():
        row = rows[name]
        assert (row.role, row.layout) == (role, layout), (name, row.role, row.layout, row.reason)
        if name in WORK and name in rows and (role, layout) == (row.role, row.layout):
            assert row.work_shapes == WORK[name] or name == "mlp.w1", (name, row.work_shapes)
    for row in table:  # every matrix has a role from the dataflow or an explicit structure, never a guess
        if row.role != "vector" and row.layout is not None and not isinstance(row.layout, Flatten):
            assert row.source == "dataflow", (row.name, row.source, row.reason)


@pytest.mark.parametrize("style", sorted(ZOO))
def test_zoo_every_role_and_work_shape(style):
    make, expected = ZOO[style]
    torch.manual_seed(0)
    model = make()
    table = assign_roles(model)
    _check(table, expected)
    common = {"emb.weight": ("embedding", Row())}
    if "head.weight" in dict(model.named_parameters()):
        common["head.weight"] = ("lm_head", Row())
    _check(table, common)
    assert table.tied_embeddings == (model.head is None)


@pytest.mark.parametrize("style", ["fused_qkv_interleaved_per_group", "moe_2d_stacks_flat_router", "tied_head"])
def test_zoo_on_meta_and_after_one_step(style):
    """Same roles on the meta device (nothing allocated); an optimizer steps the real model."""
    make, expected = ZOO[style]
    with torch.device("meta"):
        meta = make()
    _check(assign_roles(meta), expected)
    torch.manual_seed(0)
    model = make()
    opt, _ = eo.build_optimizer(model, "paper:olmoe:ii", total_steps=10)
    ids = torch.randint(0, V, (2, 8))
    model(ids).float().logsumexp(-1).mean().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.grad is not None)


def test_padded_head_is_never_muon_and_vocab_equal_to_mlp_width_is_not_confused():
    """The failure this design exists for: a padded LM head silently given the hidden rule."""
    model = LM(SeparateQKV(), SwiGLU(ff=128), vocab=100, padded=128)  # padded rows == MLP width
    table = assign_roles(model)
    assert table.row("head.weight").role == "lm_head"
    assert table.row("mlp.w1.weight").role == "mlp_in"
    opt, _ = eo.build_optimizer(model, "paper:qwen3:a-i")
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert groups[id(model.head.weight)]["rule"] != "spectral"


class LoRA(nn.Module):
    """A PEFT-style adapter around a frozen linear layer: ``base(x) + B(A(x))``."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_peft_style_adapters_get_the_roles_of_what_they_feed():
    model = LM(SeparateQKV(), SwiGLU())
    for name in ("wq", "wo"):
        setattr(model.attn, name, LoRA(getattr(model.attn, name)))
    model.mlp.w2 = LoRA(model.mlp.w2)
    table = assign_roles(model)
    names = [r.name for r in table]
    assert "attn.wq.base_layer.weight" not in names  # frozen: not optimised
    assert (table.row("attn.wq.lora_B.weight").role, table.row("attn.wq.lora_B.weight").layout) == ATTN_Q
    assert table.row("attn.wq.lora_B.weight").work_shapes == [(H, HD, 4)]  # one (head_dim, r) block per head
    assert table.row("attn.wo.lora_A.weight").layout == Heads(HD, "cols")  # it reads attention's output
    assert table.row("mlp.w2.lora_A.weight").role == "mlp_out"  # it reads the gated hidden layer
    assert table.row("attn.wq.lora_A.weight").role == "matrix"  # a low-rank factor feeding another


class Misnamed(nn.Module):
    """An attention block whose projections are called like an MLP's."""

    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(D, 3 * D, bias=False)
        self.down_proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.up_proj(x).view(b, t, 3, H, HD).unbind(2)
        o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.down_proj(o.transpose(1, 2).reshape(b, t, D))


class MisnamedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Misnamed()

    def forward(self, x):
        return self.attn(x)


def test_dataflow_wins_over_names_and_print_roles_says_so(capsys):
    model = LM(MisnamedMLP(), SwiGLU())
    table = eo.print_roles(model)
    assert table.row("attn.attn.up_proj.weight").layout == Heads(HD)
    assert table.row("attn.attn.down_proj.weight").layout == Heads(HD, "cols")
    out = capsys.readouterr().out
    assert "dataflow" in out and "from" in out.splitlines()[0]
    assert any("attn.attn.up_proj.weight" in n and "names and shapes suggest" in n for n in table.notes)


class NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.attn = SeparateQKV()
        self.mlp = SwiGLU()


def test_model_without_a_traceable_forward_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="could not run on fake tensors"):
        table = assign_roles(NoForward())
    assert {r.source for r in table} == {"name"}
    assert any("could not be traced" in n for n in table.notes)


# -- every suggestion an error makes is right for what was seen --------------------------------


class Square(nn.Module):
    """Square weights in blocks whose class names say attention / MLP, no head counts, no forward."""

    def __init__(self):
        super().__init__()
        self.num_heads = H
        self.a = nn.Linear(D, D, bias=False)


class SelfAttention(Square):
    pass


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D, bias=False)
        self.b = nn.Linear(D, D, bias=False)


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.up = nn.Parameter(torch.zeros(4, D, D))


class ErrorZoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": D, "num_attention_heads": H})()
        self.attn = SelfAttention()
        self.ffn = FeedForward()
        self.moe = Moe()


def _suggestions(message: str) -> list:
    return [ast.literal_eval(m) for m in re.findall(r"rules=(\{.*?\})(?=\)|\s|$)", message)]


def test_every_suggested_rule_gives_the_role_it_names():
    model = ErrorZoo()
    seen = 0
    rules: dict = {}
    for _ in range(10):
        try:
            assign_roles(model, rules=rules, dataflow=False)
            break
        except RoleInferenceError as err:
            options = _suggestions(str(err))
            assert options, str(err)
            for option in options:  # each alternative, fed back alone, gives the role it names
                trial = {**rules, **option}
                (pattern, value), *_ = option.items()
                try:
                    table = assign_roles(model, rules=trial, dataflow=False)
                except RoleInferenceError as later:
                    assert pattern not in str(later).split(":")[0]  # a later parameter's error, not this one's
                    table = None
                if table is not None:
                    row = next(r for r in table if re.search(pattern, r.name))
                    assert row.role == value[0] and row.layout == eo.layouts.parse_layout(value[1])
                    opt, _ = eo.build_optimizer(model, rules=trial, dataflow=False)
                    assert any(g["role"] == value[0] for g in opt.param_groups)
                seen += 1
            rules.update(options[0])
    assert seen >= 6
    assert rules[r"attn\.a\.weight"][0] == "attention"  # never an MLP rule for an attention projection


class EightHeadAttention(nn.Module):
    """An attention block whose kernel's layout the trace cannot tell (8 heads, 8 tokens)."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 8, 8
        self.q_proj, self.k_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 8, 8) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(flash_attn(q, k, v).reshape(b, t, D))


def test_where_the_forward_shows_no_role_the_names_decide_and_say_so():
    table = assign_roles(LM(EightHeadAttention(), SwiGLU()))
    row = table.row("attn.q_proj.weight")
    assert (row.role, row.layout, row.source) == ("attention", Heads(8), "name")
    assert table.row("attn.o_proj.weight").layout == Heads(8, "cols")
    assert any("attn.q_proj.weight: the forward showed no role" in n for n in table.notes)
    assert table.row("mlp.w1.weight").source == "dataflow"


HF_ARCHS = {  # config class, extra settings; tiny widths on the meta device
    "llama": ("LlamaConfig", {}),
    "gemma2": ("Gemma2Config", {"head_dim": 16}),
    "phi": ("PhiConfig", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "bloom": ("BloomConfig", {"n_head": 4, "n_layer": 2}),
    "opt": ("OPTConfig", {"ffn_dim": 96, "word_embed_proj_dim": 64}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"n_embd": 64, "n_head": 4, "n_layer": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}


@pytest.mark.parametrize("arch", sorted(HF_ARCHS))
def test_hugging_face_architectures_from_the_dataflow_agree_with_their_conventions(arch):
    import warnings

    transformers = pytest.importorskip("transformers")
    cls, extra = HF_ARCHS[arch]
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    common["num_key_value_heads"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, cls)(**{**common, **extra})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the forward is traced: no fallback
        table = assign_roles(model)
    by_names = {r.name: r for r in assign_roles(model, dataflow=False)}
    for row in table:
        if row.role == "vector":
            continue
        expected = (by_names[row.name].role, by_names[row.name].layout)
        if arch == "opt" and re.search(r"fc[12]\.weight$", row.name):
            expected = ("mlp_in", Row()) if "fc1" in row.name else ("mlp_out", Col())  # names alone: "matrix"
        assert (row.role, row.layout) == expected, (arch, row.name, row.role, row.layout, row.reason)
        latent = arch == "deepseek_v3" and "q_a_proj" in row.name  # feeds only q_b_proj: the names' "attention"
        assert row.source == ("name" if latent else "dataflow"), (arch, row.name, row.source, row.reason)
