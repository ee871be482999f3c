"""A plain training loop with DDP under torchrun and equiopt (CPU with gloo, or GPUs with NCCL).

    torchrun --standalone --nproc_per_node=2 examples/torchrun_ddp.py --steps 40 --out runs/example-ddp
    python examples/torchrun_ddp.py --steps 40          # one process works too

The one line is ``equiopt.build_optimizer(ddp_model, recipe, total_steps)``: the roles
are those of the model inside DDP. Rank 0 writes a checkpoint (model, optimizer,
scheduler) at the end; DDP keeps every rank's copy identical.
"""

import argparse
import gc
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from _data import Progressions
from torch.nn.parallel import DistributedDataParallel

import equiopt


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/example-ddp")
    parser.add_argument("--recipe", default="equiopt:default")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, all ranks together")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")

    model = equiopt.models.build("qwen3", "tiny", seed=0).to(device)  # the same weights on every rank
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None) if distributed else model
    optimizer, scheduler = equiopt.build_optimizer(wrapped, args.recipe, total_steps=args.steps)

    data = Progressions(model.config.vocab_size)
    sampler = torch.utils.data.DistributedSampler(data, world, rank, seed=0) if distributed else None
    loader = torch.utils.data.DataLoader(
        data, batch_size=args.batch_size // world, sampler=sampler, shuffle=sampler is None, drop_last=True
    )
    losses, step, epoch = [], 0, 0
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            loss = wrapped(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            step += 1
            if step == args.steps:
                break
        epoch += 1

    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
            },
            Path(args.out) / "checkpoint.pt",
        )
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(
        json.dumps(
            {
                "rank": rank,
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "steps": step,
                "weights": digest[:16],
                "roles": {r.name: r.role for r in optimizer.role_table},
            }
        ),
        flush=True,
    )
    if distributed:
        dist.barrier()  # nobody tears down the group while a peer still talks
        del wrapped  # release DDP while the group is alive
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
