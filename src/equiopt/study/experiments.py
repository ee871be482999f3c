"""The paper's pre-training experiments as run configs, at three scales.

Every experiment of the paper's section 4 and appendix "Experimental Details" is one
:class:`Experiment` (a recipe plus the model and objective switches it changes), and
:func:`run_config` turns it into a validated-config dict at one of three scales:

``paper``
    the paper's model (``size="paper"``) and protocol: its "Training configurations"
    table per model (:data:`PROTOCOLS`): context 1024, global batch = per-device batch x
    8 data-parallel ranks, the paper's step count and validation steps, bf16 autocast,
    FineWeb-Edu-10B tokenised with the model's own tokenizer.
``gpu``
    the downsized ``medium`` model (100-230 M parameters, GPT-2 vocabulary of 50,304
    rows) on FineWeb-Edu with the GPT-2 tokenizer: 10,000 steps of 32 x 1024 tokens on
    one GPU.
``cpu``
    the ``small`` model with a 4,096-token vocabulary on the Gutenberg poetry corpus (a
    byte-level BPE trained on it), State of the Union addresses as out-of-domain
    validation: 400 steps of 32 x 128 tokens, minutes on a laptop.

The optimizer hyperparameters are the paper's (the recipes ``paper:<model>:<config>``)
at the paper scale exactly; the downsized scales change what does not carry over to a
smaller model (:data:`DOWNSIZED`, :func:`downsized_overrides`) and nothing else.
``configs/generate.py`` writes these dicts as the TOML files under ``configs/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..recipes import get_recipe

__all__ = [
    "Protocol",
    "PROTOCOLS",
    "Experiment",
    "EXPERIMENTS",
    "SCALES",
    "TOKENIZERS",
    "experiments",
    "run_config",
    "data_dir",
    "DOWNSIZED",
    "downsized_overrides",
]


@dataclass(frozen=True)
class Protocol:
    """One "Training configurations for ..." table of the paper's appendix."""

    table: str  # the table's label in the paper
    seq_len: int  # context length
    per_device_batch: int  # sequences per device and step
    data_parallel: int  # devices (8 H200 in every experiment)
    steps: int  # training steps
    val_steps: int  # validation steps, each a global batch
    train_tokens: int  # as printed: steps x global batch x context
    val_tokens: int  # as printed: validation steps x global batch x context

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step over all ranks (our ``[data].batch_size``)."""
        return self.per_device_batch * self.data_parallel


PROTOCOLS: dict[str, Protocol] = {
    "qwen3": Protocol("table:config_qwen3", 1024, 28, 8, 30_000, 46, 6_881_280_000, 10_551_296),
    "gemma3": Protocol("table:config_gemma3", 1024, 18, 8, 50_000, 71, 7_372_800_000, 10_469_376),
    "olmoe": Protocol("table:config_olmoe", 1024, 20, 8, 30_000, 64, 4_915_200_000, 10_485_760),
    "gpt_oss": Protocol("table:config_gpt_oss", 1024, 8, 8, 60_000, 160, 3_932_160_000, 10_485_760),
}

# The tokenizer whose vocabulary the paper-size model's embedding has (data prepare's
# --tokenizer); the gpu and cpu scales share one tokenizer across families.
TOKENIZERS: dict[str, str] = {
    "qwen3": "qwen",  # 151,643 ids + specials <= 151,936 rows
    "gemma3": "hf:google/gemma-3-1b-pt",  # 262,144
    "olmoe": "hf:allenai/OLMoE-1B-7B-0924",  # GPT-NeoX BPE, 50,280 <= 50,304
    "gpt_oss": "hf:openai/gpt-oss-20b",  # o200k_harmony, 201,088
}

SCALES = ("paper", "gpu", "cpu")
CPU_VOCAB = 4096  # the cpu scale's byte-level BPE on the poetry corpus
SOFTCAP = 30.0  # Gemma 2/3's final-logit soft-cap c (subsubsec:gemma_logit_softcapping)
AUX_LOSS = 0.01  # load-balancing weight of the gpt-oss diagnostics with auxiliary losses
Z_LOSS = 0.001  # router z-loss weight, same experiments


#: What the ``gpu`` and ``cpu`` scales change, per role, where the paper's setting for that
#: role is HybridPolarGradM with the paper's ``nu^alpha`` (``alpha = 1``).
#:
#: Embedding: that update takes per-entry steps of about ``lr sqrt(width)`` (the paper's lr
#: 1.0: 14 per step at the cpu width 192, where the weights start at 0.02; the embedding's
#: weight RMS reached 96 after 10 steps and the validation loss 27.6 at step 50), so the
#: downsized configs use the scale-transferable update size ``scale = "rms"`` (a step of
#: RMS ``lr``) with the lr measured by ``scripts/lr_transfer.py`` (``results/lr_transfer``):
#: with ``scale = "rms"`` the best embedding lr at widths 32-256 and vocabularies 1,024 and
#: 4,096 lay between 0.016 and 0.045 (parabola fits, 60-step runs, 3-4 seeds); 0.02 is taken
#: from the lower part of that range because the downsized runs are longer (400 and 10,000
#: steps).
#:
#: SwiGLU (``mlp_in``, ``mlp_out``): the paper's lr 0.02 with ``nu^alpha`` took their weight
#: RMS from 0.02 to 6.3-6.7 in 50 steps of every cpu (b) config. With ``scale = "rms"`` a
#: 150-step sweep of the cpu (b)(i) config (``results/config_check/README.md``, one seed)
#: gave validation loss 5.166 / 5.169 / 5.231 / 5.297 at lr 0.001 / 0.002 / 0.004 / 0.008
#: (Muon's (a)(i) 5.183); 0.001 and 0.002 tie within seed noise (0.02), 0.002 is better
#: out of domain (5.548 vs 5.606) and ends with the same SwiGLU weight RMS as Muon (0.08),
#: so 0.002. Neither lr has been tuned at the gpu scale; the LM head keeps the paper's setting
#: (its weights stay below RMS 1.5 in the cpu checks).
DOWNSIZED: dict[str, dict[str, Any]] = {
    "embedding": {"scale": "rms", "lr": 0.02},
    "mlp_in": {"scale": "rms", "lr": 0.002},
    "mlp_out": {"scale": "rms", "lr": 0.002},
}


def downsized_overrides(experiment: Experiment) -> dict[str, dict[str, Any]]:
    """The experiment's optimizer overrides at a downsized scale: its own, plus
    :data:`DOWNSIZED` for each role whose recipe setting is the paper's alpha > 0 hybrid."""
    recipe = get_recipe(experiment.recipe)
    if experiment.optim_overrides:
        recipe = recipe.with_overrides(experiment.optim_overrides)
    out = {role: dict(v) for role, v in experiment.optim_overrides.items()}
    for role, change in DOWNSIZED.items():
        st = recipe.settings(role)
        if st["rule"] == "hybrid" and st.get("alpha", 0) > 0 and st.get("scale", "nu") == "nu":
            out.setdefault(role, {}).update(change)
    return out


@dataclass(frozen=True)
class Experiment:
    """One run of the paper: a recipe and the switches the experiment flips."""

    family: str
    name: str
    recipe: str
    description: str
    optim_overrides: dict = field(default_factory=dict)
    model_overrides: dict = field(default_factory=dict)
    aux_loss: float = 0.0
    z_loss: float = 0.0


def _dense(family: str) -> list[Experiment]:
    out = []
    for group, mlp in (("a", "Muon"), ("b", "HybridPolarGradM")):
        for config, emb in (("i", "RowNormM"), ("ii", "HybridPolarGradM"), ("iii", "AdamW")):
            name = f"{group}-{config}"
            out.append(
                Experiment(
                    family,
                    name,
                    f"paper:{family}:{name}",
                    f"({group})({config}): {mlp} on SwiGLU MLPs, {emb} on embedding and LM head",
                )
            )
    return out


def _gemma3() -> list[Experiment]:
    """Tables (a)/(b) without soft-capping (the main runs) and the logit-growth study.

    The logit study (subsubsec:gemma_logit_softcapping) runs (b)(i) and (b)(ii), and the
    same with AdamW on the LM head at its (b)(iii) settings, each without and with
    final-logit soft-capping (c = 30); we ship every (a)/(b) config in both settings.
    """
    head_adamw = {"lm_head": dict(get_recipe("paper:gemma3:b-iii").roles["lm_head"])}
    base = _dense("gemma3")
    base += [
        Experiment(
            "gemma3",
            f"{cfg}-head-adamw",
            f"paper:gemma3:{cfg}",
            f"logit study: ({cfg[0]})({cfg[2:]}) with AdamW on the LM head as in (b)(iii)",
            head_adamw,
        )
        for cfg in ("b-i", "b-ii")
    ]
    capped = [
        Experiment(
            e.family,
            f"{e.name}-softcap",
            e.recipe,
            f"{e.description}; final-logit soft-cap c = {SOFTCAP:g}",
            e.optim_overrides,
            {"final_logit_softcapping": SOFTCAP},
        )
        for e in base
    ]
    return base + capped


def _moe(family: str, routers: bool) -> list[Experiment]:
    names = {
        "i": "RowNormM router",
        "ii": "LeftPolarGradM router",
        "iii": "AdamW router",
        "iv": "AdamW on embedding, LM head and router",
    }
    out = [Experiment(family, n, f"paper:{family}:{n}", f"({n}): {what}") for n, what in names.items()]
    if not routers:
        return out  # OLMoE: the paper removes both auxiliary router losses
    out += [
        Experiment(family, f"router-{n}", f"paper:{family}:router-{n}", f"router ablation: {n}")
        for n in ("row", "left-centered", "left-uncentered", "hybrid", "adamw")
    ]
    aux = [
        Experiment(
            e.family,
            f"{e.name}-aux",
            e.recipe,
            f"{e.description}; load-balancing loss {AUX_LOSS:g} and router z-loss {Z_LOSS:g} in the objective",
            e.optim_overrides,
            e.model_overrides,
            AUX_LOSS,
            Z_LOSS,
        )
        for e in out
    ]
    return out + aux


EXPERIMENTS: dict[str, list[Experiment]] = {
    "qwen3": _dense("qwen3"),
    "gemma3": _gemma3(),
    "olmoe": _moe("olmoe", routers=False),
    "gpt_oss": _moe("gpt_oss", routers=True),
}


def experiments(family: str | None = None) -> list[Experiment]:
    """All experiments, or one family's."""
    if family is None:
        return [e for fam in EXPERIMENTS.values() for e in fam]
    if family not in EXPERIMENTS:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(EXPERIMENTS)}")
    return list(EXPERIMENTS[family])


def data_dir(scale: str, family: str) -> str:
    """Where ``configs/README.md``'s prepare commands put each scale's shards."""
    if scale == "paper":
        return f"data/fineweb-edu-{family}"  # tokenised with TOKENIZERS[family]
    if scale == "gpu":
        return "data/fineweb-edu-gpt2"
    return "data/poetry-bpe4096"


def run_config(experiment: Experiment, scale: str) -> dict[str, Any]:
    """The run config of ``experiment`` at ``scale`` as a dict :func:`from_dict` accepts."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    fam, model_over = experiment.family, dict(experiment.model_overrides)
    run = {"name": f"{fam}-{experiment.name}", "out_dir": f"runs/{scale}/{fam}/{experiment.name}", "seed": 0}
    if scale == "paper":
        p = PROTOCOLS[fam]
        size, data = "paper", {"seq_len": p.seq_len, "batch_size": p.batch_size}
        train = {
            "steps": p.steps,
            "log_every": 10,
            "val_every": 500,
            "val_batches": p.val_steps,
            "checkpoint_every": 1000,
        }
    elif scale == "gpu":
        size, data = "medium", {"seq_len": 1024, "batch_size": 32}
        train = {"steps": 10_000, "log_every": 10, "val_every": 250, "val_batches": 40, "checkpoint_every": 1000}
    else:
        run["device"] = "cpu"
        size, data = "small", {"ood_val": "data/sotu-bpe4096", "seq_len": 128, "batch_size": 32}
        model_over["vocab_size"] = CPU_VOCAB
        train = {"steps": 400, "log_every": 10, "val_every": 50, "val_batches": 8, "checkpoint_every": 100}
    if experiment.aux_loss:
        train["aux_loss"] = experiment.aux_loss
    if experiment.z_loss:
        train["z_loss"] = experiment.z_loss
    optim: dict[str, Any] = {"recipe": experiment.recipe}
    overrides = experiment.optim_overrides if scale == "paper" else downsized_overrides(experiment)
    if overrides:
        optim["overrides"] = overrides
    return {
        "run": run,
        "model": {"family": fam, "size": size, **({"overrides": model_over} if model_over else {})},
        "data": {"train": data_dir(scale, fam), **data},
        "optim": optim,
        "train": train,
    }
