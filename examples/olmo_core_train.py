"""A tiny OLMoE-style model trained by OLMo-core's own train loop, with equiopt's optimizer.

    python examples/olmo_core_train.py --steps 3                     # CPU: dense llama_like
    torchrun --standalone --nproc_per_node=2 examples/olmo_core_train.py --steps 3
    python examples/olmo_core_train.py --moe --steps 20              # needs CUDA (see below)

The one line is ``optim=EquioptConfig(recipe="paper:olmoe:ii")`` in OLMo-core's
``TransformerTrainModuleConfig``, in place of ``AdamWConfig(...)``; everything else is
OLMo-core's: its ``TransformerConfig``, its ``NumpyFSLDatasetConfig`` and data loader (over a
small token file this script writes with numpy), its ``CosWithWarmup`` scheduler, its
``TrainerConfig``.

``--moe`` (the default where CUDA is available) trains ``TransformerConfig.llama_like_moe``
(4 experts, 2 per token). Its forward needs CUDA: OLMo-core's ``ParallelMLP`` sends tokens to
their experts with ``olmo_core.ops.moe.gather`` / ``binned_gather`` (and back with ``scatter``
/ ``binned_scatter``), whose kernels (``olmo_core.kernels.moe``) are Triton kernels, which run
on CUDA only; on a CPU the op stops at ``assert kernels is not None``. (``grouped_gemm``, for the
dropless MLP, is optional: without it OLMo-core loops over the experts.) Without CUDA the
script trains the dense ``TransformerConfig.llama_like`` of the same widths. Building the
optimizer needs no CUDA for either model: the roles come from the model's forward traced on
fake tensors, where the experts run without the dispatch.

Under ``torchrun`` OLMo-core places the model with its own FSDP (``--dp fsdp``, the default) or
DDP (``--dp ddp``); on a CPU the process group is gloo.
"""

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.distributed.utils import get_rank, get_world_size, is_distributed
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import CosWithWarmup
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig
from olmo_core.utils import seed_all

from equiopt.integrations.olmo_core import EquioptConfig

VOCAB = 512  # a multiple of 128, as OLMo-core pads its vocabularies
SEQ = 64


def write_tokens(path: Path, n_tokens: int = 1 << 15, seed: int = 0) -> Path:
    """Learnable synthetic documents (arithmetic progressions modulo the vocabulary, each
    ended by the EOS token ``0``) as the flat uint16 array OLMo-core's numpy datasets read."""
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < n_tokens:
        length = int(rng.integers(SEQ // 2, 2 * SEQ))
        start, stride = int(rng.integers(1, VOCAB)), int(rng.integers(1, 5))
        docs.append(np.append(1 + (start + stride * np.arange(length)) % (VOCAB - 1), 0))
        total += length + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    np.concatenate(docs).astype(np.uint16).tofile(path)
    return path


@dataclass
class Losses(Callback):
    """Keeps the train loss OLMo-core logs at each step (reduced over the ranks)."""

    values: list = field(default_factory=list)

    def log_metrics(self, step: int, metrics: dict) -> None:
        if "train/CE loss" in metrics:
            self.values.append(float(metrics["train/CE loss"]))


def model_config(moe: bool) -> TransformerConfig:
    shape = dict(d_model=64, vocab_size=VOCAB, n_layers=2, n_heads=4)
    if moe:  # OLMoE-style: every block's MLP is 4 experts, 2 per token
        return TransformerConfig.llama_like_moe(**shape, num_experts=4, top_k=2, expert_hidden_size=32)
    return TransformerConfig.llama_like(**shape, n_kv_heads=2, qk_norm=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--recipe", default="paper:olmoe:ii")
    parser.add_argument("--moe", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available())
    parser.add_argument("--out", default="runs/example-olmo-core", help="token file, dataset cache, trainer folder")
    parser.add_argument("--dp", choices=["fsdp", "ddp"], default="fsdp", help="OLMo-core's data parallelism (2+ ranks)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, all ranks together")
    args = parser.parse_args(argv)
    if args.moe and not torch.cuda.is_available():
        parser.error("--moe needs CUDA: OLMo-core's token dispatch to experts (olmo_core.ops.moe) runs Triton kernels")

    out = Path(args.out)
    tokens = out / "tokens.npy"
    if get_rank() == 0:
        write_tokens(tokens)
    if is_distributed():
        torch.distributed.barrier()

    train_module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=args.batch_size // get_world_size() * SEQ,
        max_sequence_length=SEQ,
        optim=EquioptConfig(recipe=args.recipe),  # the equiopt line, in place of AdamWConfig(...)
        scheduler=CosWithWarmup(warmup_steps=max(1, args.steps // 10)),
        max_grad_norm=1.0,
        dp_config=TransformerDataParallelConfig(name=DataParallelType[args.dp]) if get_world_size() > 1 else None,
    )
    dataset = NumpyFSLDatasetConfig(
        paths=[str(tokens)],
        sequence_length=SEQ,
        tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0),
        work_dir=str(out / "dataset-cache"),
    ).build()
    seed_all(0)
    model = model_config(args.moe).build(init_device="meta")
    train_module = train_module_config.build(model)
    loader = NumpyDataLoaderConfig(global_batch_size=args.batch_size * SEQ, seed=0).build(
        dataset, dp_process_group=train_module.dp_process_group
    )
    trainer = TrainerConfig(
        save_folder=str(out / "run"),
        save_overwrite=True,
        max_duration=Duration.steps(args.steps),
        metrics_collect_interval=1,
        no_checkpoints=True,
    ).build(train_module, loader)
    losses = Losses()
    trainer.add_callback("losses", losses)
    trainer.fit()

    result = {
        "model": "llama_like_moe" if args.moe else "llama_like",
        "world": get_world_size(),
        "steps": trainer.global_step,
        "losses": losses.values,
        "roles": sorted({group["role"] for group in train_module.optim.param_groups}),
    }
    if get_rank() == 0:
        print(json.dumps(result))
    return result, train_module


if __name__ == "__main__":
    # OLMo-core's environment: logging, and under torchrun the process group. Its default
    # backend ("cpu:gloo,cuda:nccl") sets a CUDA device, which a CPU-only torch cannot: gloo there.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    backend = ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo") if launched else None
    prepare_training_environment(seed=0, backend=backend)
    try:
        main()
    finally:
        teardown_training_environment()
