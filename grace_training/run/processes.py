"""What the trainer needs to run as several processes (accelerate: DDP over gloo on CPUs, DDP or
FSDP2 on GPUs): launch checks, and gathering tensors and metrics across processes. On one process
every function here is the identity."""

from __future__ import annotations

import os

import torch

from grace_training.config.train_config import ConfigError, LaunchError, TrainConfig

# How :func:`reduce_metrics` combines a metric over processes (default: mean; ``time/*``: max).
_REDUCTIONS = {
    **dict.fromkeys(
        [
            "loss",
            "loss/policy",
            "loss/contrastive",
            "clip_fraction",
            "kl",
            "text_kl",
            "rollout/count",
            "throughput/generated_tokens",
            "throughput/generated_tokens_per_s",
            "throughput/tokens_per_s",
            "time/step_cpu_s",  # the CPU cost of the step, every process's
        ],
        "sum",
    ),
    "rollout/positive_length_max": "max",
}


def processes_without_a_gpu() -> bool:
    """Several processes (torchrun, ``accelerate launch --multi_gpu``) and no CUDA or XPU device:
    accelerate must be told ``cpu=True`` to join them over gloo instead of running each alone."""
    from accelerate.utils import is_xpu_available

    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return several and not torch.cuda.is_available() and not is_xpu_available()


def check_sharding(accelerator, config: TrainConfig) -> None:
    """Sharding that would not run what was asked for, refused before the model loads.

    - FSDP asked for (``accelerate launch`` with an FSDP config) but not set up: accelerate 1.x
      promotes a run to FSDP only from a GPU-type process group; on CPU it runs plain DDP over
      gloo, replicating the weights the user meant to shard.
    - FSDP with HF rollouts on several processes: every forward of a sharded model gathers its
      weights from all processes, and each process decodes its own rows until they end, so the
      processes would make different numbers of forwards and wait for each other forever.
    """
    from accelerate.utils import DistributedType

    wanted = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    sharded = accelerator.distributed_type == DistributedType.FSDP
    if wanted and not sharded:
        raise LaunchError(
            f"an FSDP launch, but accelerate set up {accelerator.distributed_type.value} (FSDP needs CUDA GPUs "
            "under accelerate); on CPU launch with --multi_gpu instead (DDP over gloo)"
        )
    if sharded and accelerator.num_processes > 1 and config.rollout_backend == "hf":
        raise ConfigError(
            "rollout_backend: hf cannot run under FSDP on several processes (each process decodes its own "
            "rollouts, a different number of sharded forwards); use rollout_backend: vllm, or DDP",
            key="rollout_backend",
        )


def gather(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` from every process, concatenated in process order (itself on one process)."""
    world = accelerator.num_processes
    if world == 1:
        return tensor
    if tensor.numel() == 0:  # (B, 0, …) negatives: NCCL's gather cannot reshape an empty result
        return tensor.new_zeros((tensor.shape[0] * world, *tensor.shape[1:]))
    flag = tensor.dtype == torch.bool  # gloo has no bool all-gather
    gathered = accelerator.gather((tensor.to(torch.uint8) if flag else tensor).to(accelerator.device))
    return (gathered.bool() if flag else gathered).to(tensor.device)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sums every process's gradient for this process's rows.

    Written here rather than taken from ``torch.distributed.nn``: its gloo backward sends the
    incoming gradients as they lie in memory, and a gradient that arrives strided (after an einsum)
    comes back scrambled. An all-reduce of the whole contiguous gradient, then this process's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.rows = dist.get_rank(), tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


class _SumWithGrad(torch.autograd.Function):
    """All-reduce (sum) whose backward sums the processes' gradients of the result."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = tensor.contiguous().clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


def gather_with_grad(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the same shape on every process) from every process, concatenated in process order,
    with gradient: what another process's loss asks of this process's rows flows back to them."""
    if accelerator is None or accelerator.num_processes == 1:
        return tensor
    if torch.is_grad_enabled() and not tensor.requires_grad:
        # The backward is a collective too: a process whose rows need no gradient (no hard negative
        # in its share) must still take part in it, or the processes' backward collectives pair wrongly.
        tensor = tensor.detach().requires_grad_()
    return _GatherWithGrad.apply(tensor)


def gather_rows_with_grad(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """:func:`gather_with_grad` for a different number of rows on each process (hard negatives: a
    triplet may have fewer): padded to the most for the collective, the padding dropped after."""
    if accelerator is None or accelerator.num_processes == 1:
        return tensor
    counts = [int(n) for n in per_process(accelerator, float(len(tensor)))]
    most = max(counts)
    if most == 0:
        return tensor
    padded = torch.cat([tensor, tensor.new_zeros((most - len(tensor), *tensor.shape[1:]))]) if len(tensor) < most else tensor
    gathered = gather_with_grad(accelerator, padded)
    return torch.cat([gathered[p * most : p * most + n] for p, n in enumerate(counts)])


def sum_with_grad(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over processes, with gradient (every process's loss then holds the global sum)."""
    if accelerator is None or accelerator.num_processes == 1:
        return tensor
    return _SumWithGrad.apply(tensor)


def per_process(accelerator, value: float) -> list[float]:
    """``value`` of every process, in process order."""
    local = torch.tensor([[value]], dtype=torch.float64)
    return gather(accelerator, local)[:, 0].tolist()


def sum_over_processes(accelerator, *values: float) -> list[float]:
    """Each value summed over processes (one gather for all of them)."""
    local = torch.tensor([values], dtype=torch.float64)
    return gather(accelerator, local).sum(0).tolist()


def reduce_metrics(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Combine each process's metrics into the global batch's (a no-op on one process).

    Counts, losses (already divided by the global token count) and throughputs add up; maxima
    and times take the slowest or largest; the rest are means, exact because every process holds
    as many instances and positive rollouts (ratios over negatives, whose numbers differ, are
    computed from global sums in :func:`grace_training.algorithms.grpo.metrics.step_metrics`).
    """
    if accelerator.num_processes == 1:
        return metrics
    keys = list(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    everywhere = gather(accelerator, values[None]).cpu()  # (processes, keys)
    combined = {}
    for column, key in enumerate(keys):
        how = _REDUCTIONS.get(key) or ("max" if key.startswith("time/") else "mean")
        combined[key] = float(getattr(everywhere[:, column], how)())
    return combined
