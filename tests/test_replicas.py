"""The replica check (equiopt.diagnostics.check_replicas) on two gloo ranks: tensor
parallelism on a Qwen3 leaves q_norm / k_norm replicated with per-rank gradients."""

import pytest
import torch


def _worker(rank, world):
    from replica_model import backward, model_and_batch, shard_attention

    from equiopt.diagnostics import check_replicas

    model, ids = model_and_batch()
    # replicated everywhere (as under DDP): nothing differs, weights or gradients
    backward(model, ids, all_reduce=True)
    clean = check_replicas(model)
    # a rank that drifted: named
    with torch.no_grad():
        model.model.norm.weight.add_(float(rank))
    drifted = check_replicas(model, grads=False)
    with torch.no_grad():
        model.model.norm.weight.sub_(float(rank))
    # tensor parallelism on the attention projections: q_norm / k_norm stay plain and replicated
    model.zero_grad(set_to_none=True)
    shard_attention(model)
    backward(model, ids)
    trapped = check_replicas(model)
    from equiopt.roles import verify_roles

    report = verify_roles(model, checks=[], replicas=True)
    replica = [c for c in report if c.kind == "replica"]
    assert len(replica) == 1 and not replica[0].passed and not report.ok
    assert sorted(replica[0].names) == sorted(trapped)
    return clean, drifted, trapped


@pytest.mark.slow
def test_check_replicas_names_what_differs_across_ranks(gloo):
    pytest.importorskip("transformers")
    results = gloo(_worker, 2)
    assert results[0] == results[1]  # every rank gets the same answer
    clean, drifted, trapped = results[0]
    assert clean == []
    assert drifted == ["model.norm.weight"]
    # exactly the q / k norms' gradients (their weights are still equal, and every sharded
    # projection is a DTensor with nothing replicated)
    assert sorted(trapped) == sorted(
        f"model.layers.{i}.self_attn.{k}_norm.weight (grad)" for i in range(2) for k in ("q", "k")
    ), trapped


def test_check_replicas_needs_torch_distributed():
    from equiopt.diagnostics import check_replicas

    with pytest.raises(ValueError, match="torch.distributed"):
        check_replicas(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_equiopt_roles_check_replicas_under_torchrun(torchrun):
    """``torchrun -m equiopt roles module:builder --check-replicas``: exit 0 and "equal" for a
    replicated model; exit 1 naming the q / k norms' gradients under tensor parallelism."""
    pytest.importorskip("transformers")
    import subprocess

    from _launch import torchrun_command

    done = torchrun("-m", "equiopt", "roles", "replica_model:replicated", "--check-replicas")
    assert "every replicated parameter and gradient equal on every rank" in done.stdout
    command, env = torchrun_command("-m", "equiopt", "roles", "replica_model:tensor_parallel", "--check-replicas")
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0, run.stdout[-2000:]
    assert "model.layers.0.self_attn.q_norm.weight (grad) differs across ranks" in run.stdout, run.stdout[-3000:]
