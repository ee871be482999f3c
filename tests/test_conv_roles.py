"""Parameters users bring: convolution weights (Conv1d/2d/3d, grouped and depthwise, a ViT
patch embedding, a Mamba-style depthwise conv1d) get role ``matrix`` and a ``flatten``
layout, ``verify_roles`` checks their channels, a step maps them with the polar factor of
their ``(out, in x kernel)`` momentum, and any other tensor of more than two axes is an
error that proposes the ``rules=`` entry."""

import re

import pytest
import torch
from torch import nn

import equiopt as eo
from equiopt.layouts import Experts, Flatten, Row
from equiopt.roles import RoleInferenceError
from equiopt.roles.verify import verify_roles


class ConvNet(nn.Module):
    """Every kind of convolution, and a linear head."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(3, 8, 5, padding=2)
        self.c2 = nn.Conv2d(8, 16, (3, 3), padding=1)
        self.grouped = nn.Conv2d(16, 32, 3, groups=4, padding=1, bias=False)
        self.depthwise = nn.Conv2d(32, 32, 3, groups=32, padding=1)
        self.up = nn.ConvTranspose2d(32, 12, 2, stride=2, groups=2)
        self.c3 = nn.Conv3d(1, 6, (2, 3, 3), padding=1)
        self.head = nn.Linear(12 + 6, 10)

    def forward(self, x):  # x: (N, 3, 36)
        h = torch.relu(self.c1(x)).unflatten(-1, (6, 6))  # (N, 8, 6, 6)
        h = self.depthwise(torch.relu(self.grouped(torch.relu(self.c2(h)))))
        h = self.up(h).mean((-2, -1))  # (N, 12)
        v = self.c3(x[:, :1].reshape(-1, 1, 4, 3, 3)).mean((-3, -2, -1))  # (N, 6)
        return self.head(torch.cat([h, v], -1))


class PatchEmbed(nn.Module):
    def __init__(self, dim, patch, channels=3):
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class TinyViT(nn.Module):
    """A ViT as timm and most vision code write it: conv patch embedding, class token and
    position embeddings stored with a leading axis of 1."""

    def __init__(self, dim=32, heads=4, patch=4, image=16, classes=10):
        super().__init__()
        self.patch_embed = PatchEmbed(dim, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, 4 * dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.patch_embed(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.head(h[:, 0])


class MambaStyleMixer(nn.Module):
    """in_proj -> causal depthwise conv1d -> SiLU -> out_proj, as in Mamba's mixer."""

    def __init__(self, dim=16, inner=32, kernel=4):
        super().__init__()
        self.in_proj = nn.Linear(dim, inner)
        self.conv1d = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.out_proj = nn.Linear(inner, dim)

    def forward(self, x):  # (B, T, dim)
        h = self.in_proj(x).transpose(1, 2)
        h = self.conv1d(h)[..., : x.shape[1]]
        return x + self.out_proj(torch.nn.functional.silu(h).transpose(1, 2))


class MambaStyleLM(nn.Module):
    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([MambaStyleMixer(dim) for _ in range(2)])
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def _rows(model):
    return {r.name: r for r in eo.assign_roles(model)}


# ------------------------------------------------------------------------ roles and layouts
def test_convolutions_are_matrices_of_out_by_in_times_kernel():
    rows = _rows(ConvNet())
    want = {
        "c1.weight": (Flatten((5,)), [(8, 15)]),
        "c2.weight": (Flatten((3, 3)), [(16, 72)]),
        "grouped.weight": (Flatten((3, 3), groups=4), [(4, 8, 36)]),  # block diagonal: one block per group
        "depthwise.weight": (Flatten((3, 3), groups=32), [(32, 1, 9)]),  # one row per channel
        "up.weight": (Flatten((2, 2), groups=2), [(2, 16, 24)]),  # transposed: rows = input channels
        "c3.weight": (Flatten((2, 3, 3)), [(6, 18)]),
    }
    for name, (layout, work) in want.items():
        r = rows[name]
        assert (r.role, r.layout, r.work_shapes) == ("matrix", layout, work), name
    assert "rows = output channels" in rows["c2.weight"].reason and "depthwise" in rows["depthwise.weight"].reason
    assert "rows = input channels" in rows["up.weight"].reason
    assert all(rows[f"{m}.bias"].role == "vector" for m in ("c1", "c2", "depthwise", "up", "c3"))
    assert (rows["head.weight"].role, rows["head.weight"].layout) == ("matrix", Row())


def test_vit_patch_embedding_class_token_and_position_embeddings():
    rows = _rows(TinyViT())
    proj = rows["patch_embed.proj.weight"]
    assert (proj.role, proj.layout, proj.work_shapes) == ("matrix", Flatten((4, 4)), [(32, 48)])
    assert rows["cls_token"].role == "vector" and rows["cls_token"].layout is None
    pos = rows["pos_embed"]
    assert (pos.role, pos.layout, pos.work_shapes) == ("matrix", Experts(Row()), [(1, 17, 32)])
    assert rows["attn.qkv.weight"].role == "attention" and rows["mlp.fc1.weight"].role == "mlp_in"


def test_mamba_style_depthwise_conv1d():
    rows = _rows(MambaStyleLM())
    conv = rows["layers.0.conv1d.weight"]
    assert (conv.role, conv.layout, conv.work_shapes) == ("matrix", Flatten((4,), groups=32), [(32, 1, 4)])
    assert rows["embed.weight"].role == "embedding" and rows["lm_head.weight"].role == "lm_head"


def test_transformers_vit_and_mamba_build_and_step():
    transformers = pytest.importorskip("transformers")
    vit = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=4,
            num_labels=5,
        )
    )
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(
            vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, intermediate_size=32, conv_kernel=4
        )
    )
    rows = _rows(vit)
    assert rows["vit.embeddings.patch_embeddings.projection.weight"].layout == Flatten((4, 4))
    assert rows["vit.embeddings.position_embeddings"].layout == Experts(Row())
    assert rows["vit.embeddings.cls_token"].role == "vector"
    assert _rows(mamba)["backbone.layers.0.mixer.conv1d.weight"].layout == Flatten((4,), groups=32)
    for model, batch in (
        (vit, {"pixel_values": torch.randn(2, 3, 16, 16)}),
        (mamba, {"input_ids": torch.randint(0, 64, (2, 8))}),
    ):
        optimizer, _ = eo.build_optimizer(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        out = model(**batch)
        out.logits.float().square().mean().backward()
        optimizer.step()
        for name, p in model.named_parameters():
            if p.ndim > 2 and p.grad is not None and p.grad.abs().sum() > 0:
                assert torch.isfinite(p).all() and not torch.equal(p, before[name]), name


# --------------------------------------------------------------- a step: the polar factor
def _polar(m):
    u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
    return u @ vh


@pytest.mark.parametrize(
    "model_fn, x_fn",
    [
        (ConvNet, lambda: torch.randn(2, 3, 36)),
        (TinyViT, lambda: torch.randn(2, 3, 16, 16)),
        (MambaStyleLM, lambda: torch.randint(0, 50, (2, 7))),
    ],
)
def test_a_step_moves_conv_weights_by_the_polar_factor_of_their_momentum(model_fn, x_fn):
    torch.manual_seed(0)
    model = model_fn()
    lr, beta = 0.05, 0.9
    overrides = {
        "matrix": {
            "method": "exact",
            "nesterov": False,
            "lr_scale": "none",
            "weight_decay": 0.0,
            "beta": beta,
            "lr": lr,
        }
    }
    optimizer, _ = eo.build_optimizer(model, "equiopt:default", overrides=overrides)
    convs = {r.name: r for r in optimizer.role_table if isinstance(r.layout, Flatten)}
    assert convs
    params = dict(model.named_parameters())
    momentum = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in convs}
    for _ in range(2):  # the second step goes through the momentum
        optimizer.zero_grad()
        model(x_fn()).float().square().mean().backward()
        for name in convs:  # full rank, so that the polar factor is unique (pooled models give low-rank ones)
            params[name].grad = torch.randn_like(params[name])
        before = {n: params[n].detach().clone() for n in convs}
        optimizer.step()
        for name, row in convs.items():
            g = params[name].grad.double()
            momentum[name] = beta * momentum[name] + (1 - beta) * g
            k = row.layout.tail
            blocks = row.layout.groups
            work = momentum[name].reshape(params[name].shape[0], -1)  # (out, in x kernel), computed here directly
            work = work.reshape(blocks, -1, work.shape[-1])  # one block per group
            want = before[name].double() - lr * _polar(work).reshape(params[name].shape)
            assert params[name].shape[2:] == k
            torch.testing.assert_close(params[name].double(), want, rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(params[name], before[name]), name
    # a depthwise filter's update is its momentum row, normalised
    for name, row in convs.items():
        if row.layout.groups == params[name].shape[0] and params[name].shape[1] == 1:
            step = (params[name].detach() - before[name]).reshape(params[name].shape[0], -1).double()
            torch.testing.assert_close(step.norm(dim=1), torch.full((step.shape[0],), lr, dtype=torch.float64))


# ----------------------------------------------------------------------------- verify_roles
def test_verify_roles_checks_convolution_channels():
    torch.manual_seed(0)
    model = ConvNet()
    x = torch.randn(2, 3, 36)
    report = verify_roles(model, input_ids=x, forward_fn=lambda m, ids: m(ids))
    conv = [c for c in report if c.kind == "conv"]
    assert {c.names[0] for c in conv} == {
        "c1.weight",
        "c2.weight",
        "grouped.weight",
        "depthwise.weight",
        "up.weight",
        "c3.weight",
    }
    assert report.ok, report.format()
    assert all(c.max_change <= c.tolerance and "moved one at a time" in c.detail for c in conv)
    assert "1 matrix parameter(s) not checked (no permutation check for this role)" in report.notes  # the head
    # a layout whose rows are not the channels fails, by name
    table = eo.assign_roles(model, rules={r"^c1\.weight$": ("matrix", "experts:col")})
    bad = verify_roles(model, table, input_ids=x, forward_fn=lambda m, ids: m(ids))
    failed = [c for c in bad.failures if c.kind == "conv"]
    assert [c.names for c in failed] == [("c1.weight",)] and "not the 8 output channels" in failed[0].detail
    # the Mamba-style depthwise conv1d and a ViT patch embedding, inside real forwards
    lm = MambaStyleLM()
    report = verify_roles(lm)
    assert report.ok and {c.names[0] for c in report if c.kind == "conv"} == {
        "layers.0.conv1d.weight",
        "layers.1.conv1d.weight",
    }
    vit = TinyViT()
    report = verify_roles(vit, input_ids=torch.randn(2, 3, 16, 16), forward_fn=lambda m, ids: m(ids))
    assert report.ok and [c.names for c in report if c.kind == "conv"] == [("patch_embed.proj.weight",)]


# ------------------------------------------------------------ other tensors of more axes
class Odd(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.table = nn.Parameter(torch.randn(*shape))
        self.lm_head = nn.Linear(8, 10)


@pytest.mark.parametrize("shape, fold, work", [((4, 5, 6), "6", "(4, 30)"), ((3, 4, 5, 6), "5x6", "(3, 120)")])
def test_other_tensors_of_more_axes_are_an_error_that_proposes_the_rule(shape, fold, work):
    model = Odd(shape)
    with pytest.raises(RoleInferenceError) as err:
        eo.build_optimizer(model)
    text = str(err.value)
    assert f"'table' (shape {shape})" in text and f"a {len(shape)}-D tensor outside any recognised block" in text
    assert f"rules={{'table': ('matrix', 'flatten:{fold}')}}" in text and f"one {work} work matrix" in text
    assert "{'table': 'vector'}" in text and ("experts:row" in text) == (len(shape) == 3)
    # the proposed entry works as written
    rule = re.search(r"rules=(\{'table': \('matrix', 'flatten:[0-9x]+'\)\})", text).group(1)
    optimizer, _ = eo.build_optimizer(model, rules=eval(rule))
    row = optimizer.role_table.row("table")
    assert row.layout == Flatten(shape[2:]) and row.work_shapes == [(shape[0], int(work.split(", ")[1][:-1]))]
    model.table.grad = torch.randn(shape)
    before = model.table.detach().clone()
    optimizer.step()
    assert not torch.equal(model.table, before)
    # a role named without a layout folds the trailing axes too
    assert eo.assign_roles(model, rules={"table": "matrix"}).row("table").layout == Flatten(shape[2:])


def test_a_tensor_of_more_axes_inside_attention_gets_the_same_proposal():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(8, 8)
            self.rel_pos = nn.Parameter(torch.zeros(2, 3, 4))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.self_attention = Attn()

    with pytest.raises(
        RoleInferenceError,
        match=re.escape("'self_attention.rel_pos' (shape (2, 3, 4))")
        + ".*"
        + re.escape(r"rules={'self_attention\\.rel_pos': ('matrix', 'flatten:4')}"),
    ):
        eo.assign_roles(Model(), dims={"heads": 2})
