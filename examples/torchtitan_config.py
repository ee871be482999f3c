"""torchtitan config-registry functions that train with equiopt.

torchtitan (>= 0.3) takes any importable module of config functions. From a checkout
of this repository, with torchtitan installed (``pip install 'equiopt[titan]'``) and
its test assets for the debug model (``tests/assets/tokenizer`` of torchtitan's
repository, or point ``hf_assets_path`` at your tokenizer)::

    PYTHONPATH=examples torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module torchtitan_config --config llama3_8b_equiopt

torchtitan's command-line overrides work as usual (``--training.steps 1000``,
``--parallelism.tensor_parallel_degree 2``, ...). The recipe, its per-role learning
rates and the role rules travel in ``config.optimizer``; torchtitan's ``lr_scheduler``
(warm-up and decay) multiplies every role's rate. ``equiopt roles
torchtitan:llama3:8B`` prints the role and rule of every parameter beforehand.

``python examples/torchtitan_config.py`` prints the optimizer configs without training.
"""

# first: on a machine without triton (CPU-only torch) it lets torchtitan's models import
from equiopt.integrations.torchtitan import OPTIMIZER_NAME, equiopt_config  # isort: skip
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug


def llama3_debugmodel_equiopt():
    """torchtitan's Llama 3 debug model with equiopt's default recipe (Muon on the hidden
    matrices, row-normalised embedding, centred row-normalised head, AdamW on vectors)."""
    config = llama3_debugmodel()
    config.optimizer = equiopt_config(recipe="equiopt:default")
    return config


def llama3_8b_equiopt():
    """Llama 3 8B with the paper's hybrid updates on the embedding, head and MLP
    (the Qwen3 table's (b)(ii) row), and a smaller weight decay on the attention."""
    config = llama3_8b()
    config.optimizer = equiopt_config(recipe="paper:qwen3:b-ii", overrides={"attention": {"weight_decay": 1e-4}})
    return config


def qwen3_moe_debug_equiopt():
    """torchtitan's Qwen3 MoE debug model: expert stacks (E, F, D) and the router get
    their own rules (left-spectral, centred, on the router); the norms stay on torchtitan's
    AdamW, to show a config that mixes optimizers."""
    config = qwen3_moe_debug()
    config.optimizer = equiopt_config(
        recipe="paper:olmoe:ii",
        param_groups=[
            ParamGroupConfig(
                pattern=r"norm\.weight$",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.0},
            ),
            ParamGroupConfig(pattern=r".*", optimizer_name=OPTIMIZER_NAME),
        ],
    )
    return config


if __name__ == "__main__":
    for make in (llama3_debugmodel_equiopt, llama3_8b_equiopt, qwen3_moe_debug_equiopt):
        print(f"{make.__name__}: {make().optimizer}")
