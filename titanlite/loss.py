"""The training loss: one definition for the trainer (and its held-out evaluation) and the memory
estimator; and its value over the global batch, for the log."""

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanlite.parallel.moe_tensor_parallel import SumOverRanks

IGNORED_LABEL = -100  # cross_entropy's default ignore_index: such tokens count in neither loss


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) next-token loss; the caller divides by the global token count.
    The float32 copy of the logits is one of the step's largest activations."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def cross_entropy_and_z_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_sum, and the sum of logsumexp(logits)^2 over the same target tokens: the
    output z-loss before its coefficient. Under loss parallel (logits split by vocabulary, a
    DTensor) each rank takes the logsumexp over its slice, then over the ranks: exact, and no
    rank gathers the logits."""
    if isinstance(logits, DTensor):
        return cross_entropy_sum(logits, labels).full_tensor(), _z_sum(_split_log_sum_exp(logits), labels)
    return _CrossEntropyAndZ.apply(logits.float(), labels)


class _CrossEntropyAndZ(torch.autograd.Function):
    """Both sums from one log_softmax, the values F.cross_entropy's and the logsumexp's bit for
    bit; the backward makes the one [batch, seq, vocab] gradient both losses share, in place:
    softmax x (g_ce + 2 g_z logsumexp), less g_ce at each target. (Through autograd, taking the
    logsumexp from the log-probabilities fills a zero gradient of that size per term and adds
    them: the loss's forward and backward took twice as long.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits, dim=-1)  # what F.cross_entropy computes first
        cross_entropy = F.nll_loss(log_probs.flatten(0, 1), labels.flatten(), reduction="sum")
        # Every entry of logits - log_probs is the token's logsumexp.
        log_sum_exp = logits[..., 0] - log_probs[..., 0]
        ctx.save_for_backward(log_probs, log_sum_exp, labels)  # what F.cross_entropy keeps, and [batch, seq]
        return cross_entropy, _z_sum(log_sum_exp, labels)

    @staticmethod
    def backward(ctx, grad_cross_entropy: torch.Tensor, grad_z: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, log_sum_exp, labels = ctx.saved_tensors
        kept = (labels != IGNORED_LABEL).to(log_probs.dtype)
        # d(logsumexp)/d(logits) is the softmax; d(-log_probs[target]) adds -1 at the target.
        per_token = (grad_cross_entropy + 2 * grad_z * log_sum_exp) * kept
        grad = log_probs.exp().mul_(per_token.unsqueeze(-1))
        targets = labels.where(labels != IGNORED_LABEL, 0).unsqueeze(-1)
        return grad.scatter_add_(-1, targets, (-grad_cross_entropy * kept).unsqueeze(-1)), None


def _z_sum(log_sum_exp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (log_sum_exp.square() * (labels != IGNORED_LABEL)).sum()


def _split_log_sum_exp(logits: DTensor) -> torch.Tensor:
    """logsumexp over the last dimension of logits split along it: [batch, seq], alike on every
    rank of the split, from one max and one sum over them. (Loss parallel's own log_softmax
    backward assumes the nll_loss after it, so the z-loss cannot go through it.)"""
    (split_dim,) = [dim for dim, placement in enumerate(logits.placements) if placement.is_shard()]
    group = logits.device_mesh.get_group(split_dim)
    local = logits.to_local().float()
    peak = local.detach().amax(-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    # Every rank's loss is the whole loss: the sum's gradient passes to each slice unchanged.
    sums = SumOverRanks([group])((local - peak).exp().sum(-1))
    return peak.squeeze(-1) + sums.log()


class TrainingLoss:
    """What the trainer backpropagates for a micro-batch: its summed cross-entropy, plus
    ``z_loss_coef`` x its summed z-loss, divided by the group's target tokens (so that the
    micro-batches' and ranks' shares add up to the global mean). The z-loss terms of the step
    add up on the device for the log (take_z_share), each kept with the loss it went into, so
    that a pipeline can leave out the losses its schedule did not count (count_only)."""

    def __init__(self, z_loss_coef: float, group_tokens: int, compiled: bool, device: torch.device):
        self.cross_entropy_sum = training_loss(compiled)
        self.z_loss_coef, self.group_tokens = z_loss_coef, group_tokens
        self.device = device
        # Compiled only without loss parallel: the split logsumexp's collectives stay eager.
        self.both_sums = torch.compile(cross_entropy_and_z_sums) if compiled else cross_entropy_and_z_sums
        self.z_shares: list[tuple[weakref.ref, torch.Tensor]] = []  # (the loss returned, its z term)
        self.counted: list[torch.Tensor] = []  # the z terms count_only kept, this step's so far

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.z_loss_coef == 0:
            return self.cross_entropy_sum(logits, labels) / self.group_tokens
        both_sums = cross_entropy_and_z_sums if isinstance(logits, DTensor) else self.both_sums
        cross_entropy, z_sum = both_sums(logits, labels)
        z_share = self.z_loss_coef * z_sum / self.group_tokens
        loss = cross_entropy / self.group_tokens + z_share
        self.z_shares.append((weakref.ref(loss), z_share.detach()))
        return loss

    def count_only(self, losses: list[torch.Tensor]) -> None:
        """Keep the z terms of the losses since the last call that are in ``losses``, forget the others:
        torch's pipeline schedule also runs the loss on its first step (and after evaluation)
        to infer the stages' gradient shapes, on outputs of uninitialised inputs. (A weak
        reference: that loss and its graph are freed as the schedule drops them.)"""
        counted = {id(loss) for loss in losses}
        self.counted += [z for ref, z in self.z_shares if id(ref()) in counted]
        self.z_shares = []

    def take_z_share(self) -> torch.Tensor:
        """This rank's share of the z-loss term of the step since the last call (0 without
        a z-loss, or on a pipeline stage without the loss), and start the next step's."""
        share = torch.zeros((), device=self.device)
        for z_share in self.counted + [z for _, z in self.z_shares]:  # in call order, as the losses add up
            share += z_share
        self.z_shares, self.counted = [], []
        return share


def global_loss_on_device(loss_share: torch.Tensor, ranks_per_dp_rank: int = 1) -> torch.Tensor:
    """The loss over the global batch as a tensor alike on every rank, from this rank's share
    (see global_loss): one all-reduce, and the host does not wait for it."""
    if not dist.is_initialized():
        return loss_share
    total = loss_share.detach().clone()
    dist.all_reduce(total)
    return total / ranks_per_dp_rank


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
