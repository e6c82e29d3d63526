"""The training loss: one definition for the trainer (and its held-out evaluation) and the memory
estimator; and its value over the global batch, for the log."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) next-token loss; the caller divides by the global token count.
    The float32 copy of the logits is one of the step's largest activations."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def global_loss(loss_share: torch.Tensor, ranks_per_dp_rank: int = 1, stages: int = 1) -> tuple[float, float]:
    """The loss over the global batch, and the largest of the data-parallel ranks' own mean
    losses, from this rank's share of the global mean (a collective on every rank). Every
    data-parallel rank holds the same number of tokens, so its mean is its share times their
    number. The ``ranks_per_dp_rank`` tensor-parallel ranks of one data-parallel rank hold the
    same share and are adjacent in rank order (the mesh's last dimension): one of each counts.
    With ``stages`` pipeline stages (the mesh's first dimension) only the ranks of the stage
    that computes the loss hold a share; the others hold zero."""
    if not dist.is_initialized():
        return loss_share.item(), loss_share.item()
    shares = [torch.zeros_like(loss_share) for _ in range(dist.get_world_size())]
    dist.all_gather(shares, loss_share)
    shares = torch.stack(shares).view(stages, -1).sum(0)[::ranks_per_dp_rank]
    return shares.sum().item(), (shares.max() * len(shares)).item()


def training_loss(compiled: bool):
    """The loss a run trains with: cross_entropy_sum, through torch.compile where ``compiled``
    (compile.enable with "loss" in compile.components)."""
    return torch.compile(cross_entropy_sum) if compiled else cross_entropy_sum
