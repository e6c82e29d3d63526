"""Process-group start-up and the choice of device."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def world_size_from_env() -> int:
    """The world size torchrun announces (1 when started without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device() -> torch.device:
    """CUDA (this process's local GPU) when there is one, otherwise the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_seconds: int) -> None:
    """Join the process group when launched with more than one rank: NCCL for GPUs,
    gloo for CPUs (and for CPU tensors on GPU machines, which checkpointing uses)."""
    if world_size_from_env() == 1:
        return
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        timeout=timedelta(seconds=timeout_seconds),
        device_id=device if device.type == "cuda" else None,
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
