"""Parallelism: the device mesh, FSDP2/AC/compile application and global grad-norm clipping.

Knows the model only as "a decoder with a ``layers`` ModuleDict" and nothing of the loop.
"""

from titanlite.parallel.distributed import (
    destroy_distributed,
    exit_process,
    first_error_on_any_rank,
    init_distributed,
    is_collective_failure,
    pick_device,
    use_collective_timeout,
    world_size_from_env,
)
from titanlite.parallel.grad_norm import clip_grad_norm_
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.parallelize import compute_context, parallelize_decoder

__all__ = [
    "ParallelDims",
    "clip_grad_norm_",
    "compute_context",
    "destroy_distributed",
    "exit_process",
    "first_error_on_any_rank",
    "init_distributed",
    "is_collective_failure",
    "parallelize_decoder",
    "pick_device",
    "use_collective_timeout",
    "world_size_from_env",
]
