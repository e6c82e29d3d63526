"""Parallelism: the device mesh, TP/AC/compile/FSDP2 application and global grad-norm clipping.

Knows the decoders only by Llama's module names and the attention plan each block declares
as data (attention_tp_plan), and nothing of the loop.
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
from titanlite.parallel.parallelize import compute_context, parallelize_decoder, set_gradient_all_reduce
from titanlite.parallel.tensor_parallel import loss_context, tensor_parallel_problem

__all__ = [
    "ParallelDims",
    "clip_grad_norm_",
    "compute_context",
    "destroy_distributed",
    "exit_process",
    "first_error_on_any_rank",
    "init_distributed",
    "is_collective_failure",
    "loss_context",
    "parallelize_decoder",
    "pick_device",
    "set_gradient_all_reduce",
    "tensor_parallel_problem",
    "use_collective_timeout",
    "world_size_from_env",
]
