"""Configs and models for the paper's architectures, from transformers' own classes."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .presets import FAMILY_SPECS, SIZES, Family

__all__ = ["FAMILIES", "SIZES", "config", "build", "build_vocab_shaped", "init_weights", "count_parameters"]

FAMILIES: tuple[str, ...] = tuple(FAMILY_SPECS)

# Keyword arguments every config accepts besides its fields.
_GENERIC_EXTRAS = ("attn_implementation",)


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("equiopt.models needs transformers (pip install 'equiopt[hf]')") from exc
    return transformers


def _family(name: str) -> Family:
    key = str(name).strip().lower().replace("-", "_")
    if key not in FAMILY_SPECS:
        raise ValueError(f"unknown model family {name!r}; valid families: {', '.join(FAMILIES)}")
    return FAMILY_SPECS[key]


def _check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    return size


def _classes(fam: Family):
    tf = _transformers()
    try:
        return getattr(tf, fam.config_class), getattr(tf, fam.model_class)
    except AttributeError as exc:
        raise ImportError(
            f"transformers {tf.__version__} has no {fam.config_class}/{fam.model_class}; "
            f"the {fam.name!r} family needs a newer transformers"
        ) from exc


@functools.cache
def _known_fields(name: str, config_cls) -> frozenset[str]:
    """Names a config of this family accepts: its fields, aliases and legacy keywords."""
    fam = FAMILY_SPECS[name]
    params = inspect.signature(config_cls.__init__).parameters.values()
    known = {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    known |= set(config_cls().to_dict())
    known |= set(getattr(config_cls, "attribute_map", {}) or {})
    known |= set(fam.extra_fields) | set(_GENERIC_EXTRAS)
    return frozenset(known)


def _default_attn_implementation(model_cls) -> str:
    # gpt-oss's attention sinks are not expressible with torch SDPA, and its
    # class says so (``_supports_sdpa = False``); it runs the eager kernel.
    return "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"


def _config_kwargs(fam: Family, size: str, overrides: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    # Aliases (gpt-oss ``num_experts`` for ``num_local_experts``) replace the
    # preset's canonical field instead of competing with it.
    overrides = {aliases.get(k, k): v for k, v in overrides.items()}
    kwargs = {**fam.common, **fam.sizes[size], **overrides}
    vocab = int(kwargs["vocab_size"])
    for key in ("bos_token_id", "eos_token_id"):
        # A family's special-token ids only mean something with its vocabulary.
        token = kwargs.get(key)
        if key not in overrides and isinstance(token, int) and token >= vocab:
            kwargs[key] = None
    if kwargs.get("tie_word_embeddings"):
        raise ValueError(
            "equiopt.models builds untied input/output embeddings (the embedding and the "
            "LM head are different matrices with different optimizers); "
            "tie_word_embeddings=True is not supported"
        )
    if "sliding_window_pattern" in kwargs:
        # Gemma 3's local/global pattern: every p-th layer is global (full) attention.
        period = int(kwargs.pop("sliding_window_pattern"))
        if period < 1:
            raise ValueError(f"sliding_window_pattern must be >= 1, got {period}")
        if "layer_types" not in overrides:
            n = int(kwargs["num_hidden_layers"])
            kwargs["layer_types"] = [
                "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)
            ]
    return kwargs


def config(name: str, size: str = "tiny", **overrides: Any):
    """Return the transformers config of family ``name`` at ``size``, without building.

    Args:
        name: one of :data:`FAMILIES` (``qwen3``, ``gemma3``, ``olmoe``, ``gpt_oss``).
        size: one of :data:`SIZES` (``tiny``, ``small``, ``medium``, ``paper``).
        **overrides: any field of the family's config (``vocab_size=50304``,
            ``num_hidden_layers=4``, ``final_logit_softcapping=30.0``,
            ``router_aux_loss_coef=0.01``, ...), plus ``attn_implementation``.
            For gemma3, ``sliding_window_pattern=p`` makes every p-th layer full
            attention (the layer pattern follows ``num_hidden_layers``).

    Raises:
        ValueError: unknown family, size or config field, or ``tie_word_embeddings=True``.
    """
    fam = _family(name)
    _check_size(size)
    config_cls, model_cls = _classes(fam)
    known = _known_fields(fam.name, config_cls)
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, sorted(known), n=3)
            hints.append(f"{k!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise ValueError(f"unknown config field(s) for {fam.name} ({config_cls.__name__}): {'; '.join(hints)}")
    aliases = dict(getattr(config_cls, "attribute_map", {}) or {})
    kwargs = _config_kwargs(fam, size, overrides, aliases)
    kwargs.setdefault("attn_implementation", _default_attn_implementation(model_cls))
    return config_cls(**kwargs)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _no_init_weights():
    """transformers' context that skips its own (and torch's) weight init, if available."""
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4.x
        except ImportError:  # pragma: no cover
            return contextlib.nullcontext()
    return no_init_weights()


def _is_bias(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf.endswith("_bias")


def _is_sink(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "sinks"


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


@torch.no_grad()
def init_weights(model: nn.Module, std: float | None = None, seed: int | None = None) -> nn.Module:
    """Initialise ``model`` in place the way the paper does.

    * every matrix (2-D) and fused expert tensor (3-D) weight, embeddings, LM head
      and routers included: ``N(0, std)`` (``std`` defaults to the config's
      ``initializer_range``, 0.02);
    * biases, including expert biases stored as ``(E, n)`` matrices: zero;
    * gpt-oss attention-sink logits: ``N(0, std)``, as the class does;
    * RMSNorm weights: left as they are; a freshly built model has them at the
      class's identity value (1, or 0 for Gemma's ``(1 + weight)`` norms);
    * buffers (rotary tables, Gemma's embedding scale) and any other vector
      parameter: the transformers class's own ``_init_weights``.

    ``seed`` makes the result reproducible on a given device without touching the
    caller's random state.  Parameters on the meta device are left alone.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    if not params:
        return model
    if std is None:
        std = float(getattr(getattr(model, "config", None), "initializer_range", None) or 0.02)
    devices = sorted({p.device for _, p in params if p.device.type == "cuda"}, key=str)
    fork = torch.random.fork_rng(devices=devices, device_type="cuda") if seed is not None else contextlib.nullcontext()
    with fork:
        if seed is not None:
            torch.manual_seed(seed)
        own_init = getattr(model, "_init_weights", None)
        if own_init is not None:
            for module in model.modules():
                if _is_norm(module):
                    continue
                other_vectors = any(
                    p.ndim < 2 and not (_is_bias(n) or _is_sink(n)) for n, p in module.named_parameters(recurse=False)
                )
                has_buffers = any(True for _ in module.buffers(recurse=False))
                if other_vectors or has_buffers:
                    own_init(module)
        for name, p in params:
            if _is_bias(name):
                p.zero_()
            elif _is_sink(name) or p.ndim >= 2:
                p.normal_(mean=0.0, std=std)
    return model


def build(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build one of the paper's architectures as a transformers causal LM.

    Args:
        name: ``qwen3`` (``Qwen3ForCausalLM``), ``gemma3`` (``Gemma3ForCausalLM``
            with a ``Gemma3TextConfig``, text only), ``olmoe`` (``OlmoeForCausalLM``)
            or ``gpt_oss`` (``GptOssForCausalLM``).
        size: ``tiny`` (tests), ``small`` (CPU demos), ``medium`` (one GPU) or
            ``paper`` (the paper's exact architecture and parameter count).
        device: where to allocate.  ``"meta"`` allocates nothing and skips init
            (for counting and inspecting).
        dtype: floating dtype of the parameters (default: torch's default, fp32).
            Rotary tables stay in fp32.
        seed: seed for the initialisation (reproducible on a given device).
        **overrides: config fields, see :func:`config`.

    Returns:
        the model, in training mode, with untied input/output embeddings and every
        matrix initialised from ``N(0, 0.02)`` (see :func:`init_weights`).
    """
    cfg = config(name, size, **overrides)
    _, model_cls = _classes(_family(name))
    device = torch.device(device)
    with _default_dtype(dtype), device, _no_init_weights():
        model = model_cls(cfg)
    if device.type != "meta":
        init_weights(model, seed=seed)
    model.train()
    return model


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters, each shared tensor counted once; works on meta."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def build_vocab_shaped(shape: str, device: str | torch.device = "cpu", seed: int | None = 0) -> torch.nn.Module:
    """A 4-layer Qwen3-style model whose vocabulary matrices are ``shape`` ("VOCABxHIDDEN", e.g.
    ``"151936x1024"``) and whose MLP width is three times the hidden size: the benches' model
    for a vocabulary-heavy step at a real vocabulary and width."""
    vocab, hidden = (int(v) for v in shape.lower().split("x"))
    return build(
        "qwen3",
        "small",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=4,
        intermediate_size=3 * hidden,
        seed=seed,
        device=device,
    )
