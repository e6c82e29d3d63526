"""What torch.compile changes in a step's memory, for the estimate, which runs the step eagerly
on fake tensors (compiling would cost minutes and fake tensors cannot run the compiled code).

Read from the CUDA caching allocator's history of an eager and a compiled step of the same 1 B
Llama (docs/performance.md, "GPU memory against the estimator"): what each holds at the
compiled step's peak, block by block.

* The compiled loss (``compile.components`` with "loss") never makes the float32 copy of the
  logits, nor the float32 log-probabilities and gradients eager cross-entropy keeps: in its
  forward it writes one buffer shaped and typed like the logits, which it keeps for backward
  and which its backward turns, in place, into the logits' gradient. The simulation runs
  ``compiled_loss``, which allocates exactly that, instead of the eager loss.
* A compiled block (``compile.components`` with "model") that activation checkpointing leaves
  whole keeps less for its backward than the same block run eagerly. Under autocast (a
  single data-parallel rank: bf16 matmuls over float32 weights and a float32 residual
  stream) the fused graph recomputes instead of keeping: each RMSNorm's float32 output (4
  bytes x dim a token, twice), all but one of the bf16 copies the projections reading it make
  (eager makes one per projection: three for wq, wk, wv, two for w1, w3; 2 bytes x dim each),
  the float32 sum between attention and feed-forward (4 x dim) and the SiLU's output (2 x
  ffn_hidden); and it keeps the queries and keys before RoPE, which eager does not (2 x dim +
  2 x kv_dim). Net, per token: 16 x dim + 2 x ffn_hidden - 2 x kv_dim bytes less
  (``compiled_block_saving``): 48,128 of 129,152 for check1b (dim 2048, ffn_hidden 8192,
  kv_dim 512), the measured difference of the two steps' tensors to within a few percent.
  Blocks under activation checkpointing keep their input only (or, per op, the matmul and
  attention outputs the policy names) either way.
* Eager autocast keeps the bf16 copy of every weight it casts until it exits, after the
  loss. A compiled block casts inside its graph and keeps copies only for its backward, and a
  checkpointed one recomputes them there: a compiled checkpointed block holds its linear
  layers' weights x 2 bytes less from the end of its forward until autocast exits (0.9 GiB
  for check1b's 8 checkpointed blocks).

The block terms are counted only where they were measured: Llama blocks (attention and SwiGLU
feed-forward as titanlite.models.llama defines them) under autocast without tensor
parallelism. Under FSDP the parameters arrive in bf16
and the residual stream is bf16 too, so eager keeps other tensors; there, and for other
blocks, the estimate keeps the eager blocks' figure, an over-estimate of a compiled step.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from titanlite.config import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.models.llama.model import Attention, FeedForward, TransformerBlock


@dataclass(frozen=True)
class CompiledParts:
    """Which parts of the step the run compiles, as the simulation needs to know."""

    loss: bool = False
    blocks: bool = False

    @classmethod
    def of(cls, job_config: JobConfig) -> "CompiledParts":
        compile_ = job_config.compile
        return cls(
            loss=compile_.enable and "loss" in compile_.components,
            blocks=compile_.enable and "model" in compile_.components,
        )


class _CompiledCrossEntropy(torch.autograd.Function):
    """The allocations of the compiled summed cross-entropy, for fake tensors only: its value
    is no loss (see the module docstring for what it allocates)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(torch.empty_like(logits))
        return torch.zeros((), dtype=torch.float32, device=labels.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (buffer,) = ctx.saved_tensors
        return buffer, None  # the kept buffer becomes the gradient: nothing new is allocated


def compiled_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the compiled titanlite.loss.cross_entropy_sum allocates, on fake tensors."""
    return _CompiledCrossEntropy.apply(logits, labels)


def _measured_kind(block: nn.Module) -> bool:
    """Whether ``block`` (unwrapped from its checkpoint wrapper) is a block of the kind the
    terms were measured on: titanlite.models.llama's, with its attention and SwiGLU."""
    block = getattr(block, "_checkpoint_wrapped_module", block)
    return (
        type(block) is TransformerBlock
        and type(block.attention) is Attention
        and type(block.feed_forward) is FeedForward
    )


def compiled_block_saving(block: nn.Module, tokens: int) -> int:
    """Bytes a compiled ``block``, run whole under autocast, keeps less than eager for its
    backward, for ``tokens`` tokens (the module docstring derives it); 0 for a block of
    another kind."""
    if not _measured_kind(block):
        return 0
    dim = block.attention.wq.in_features
    kv_dim = block.attention.wk.out_features
    hidden = block.feed_forward.w1.out_features
    return tokens * (16 * dim + 2 * hidden - 2 * kv_dim)


class HeldSavings:
    """How many bytes compiled blocks would not be holding at each moment of an eager step
    (``bytes``). A whole block's saving counts from the end of its forward until its backward
    begins (when the gradient of its output arrives): when either kind of block holds its
    saved tensors. A checkpointed block's 16-bit weight copies count from the end of its
    forward until the compute context (autocast) exits: eager autocast keeps a copy of every
    weight it casts until then; a compiled block casts inside its graph and keeps copies only
    where its backward needs them, which a checkpointed block recomputes."""

    def __init__(self, whole: list[tuple[nn.Module, int]], checkpointed: list[tuple[nn.Module, int]]):
        self.bytes = 0
        self._weight_copies = 0
        hooks = [(block, self._until_backward(saving)) for block, saving in whole]
        hooks += [(block, self._until_autocast_exits(copies)) for block, copies in checkpointed]
        for block, hook in hooks:
            block.register_forward_hook(hook)

    def _until_backward(self, saving: int):
        def after_forward(module, inputs, output):
            if saving and torch.is_grad_enabled() and output.requires_grad:
                self.bytes += saving
                output.register_hook(lambda grad: self._release(saving))

        return after_forward

    def _until_autocast_exits(self, copies: int):
        def after_forward(module, inputs, output):
            if torch.is_grad_enabled():
                self.bytes += copies
                self._weight_copies += copies

        return after_forward

    def _release(self, saving: int) -> None:
        self.bytes -= saving

    def compute_context_exited(self) -> None:
        """Autocast has exited: its eager weight copies are gone too."""
        self.bytes -= self._weight_copies
        self._weight_copies = 0


def held_savings(
    model: nn.Module, parts: CompiledParts, compute_dtype: str, parallel_dims, tokens: int
) -> HeldSavings | None:
    """What ``model``'s compiled blocks keep less than eager ones (each block seeing ``tokens``
    tokens per call), where it was measured: under autocast (no FSDP, which casts the
    parameters itself; a 16-bit ``compute_dtype``), without tensor parallelism, for blocks
    of the measured kind; None where nothing is. See the module docstring."""
    autocast = not parallel_dims.fsdp_applied and DTYPES[compute_dtype] != torch.float32
    layers = getattr(model, "layers", None)
    if not (parts.blocks and autocast and parallel_dims.tp == 1 and layers is not None):
        return None
    measured = [block for block in layers.values() if _measured_kind(block)]
    whole = [block for block in measured if not isinstance(block, CheckpointWrapper)]
    checkpointed = [block for block in measured if isinstance(block, CheckpointWrapper)]
    copy_bytes = torch.empty((), dtype=DTYPES[compute_dtype]).element_size()
    return HeldSavings(
        [(block, compiled_block_saving(block, tokens)) for block in whole],
        [(block, copy_bytes * _matmul_weights(block)) for block in checkpointed],
    )


def _matmul_weights(block: nn.Module) -> int:
    """Elements of the linear layers' weights in ``block``: what autocast casts."""
    return sum(module.weight.numel() for module in block.modules() if isinstance(module, nn.Linear))
