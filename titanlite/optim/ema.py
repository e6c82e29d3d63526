"""Exponential moving average of the weights, kept shard by shard."""

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


class EMA(Stateful):
    """ema = decay * ema + (1 - decay) * weights after every optimizer step.

    Each rank averages only its own shards (the state dict's values are the sharded
    parameters), so the average costs no communication and no full copy of the model.
    Its state dict uses the model's own names, so it saves, reshards and loads like
    the model does.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        # Detached views that share storage with the parameters: they see every update.
        self.weights = {name: tensor for name, tensor in model.state_dict().items() if tensor.is_floating_point()}
        self.averages = {name: tensor.detach().clone() for name, tensor in self.weights.items()}
        # The update runs on the local shards themselves (views of the same storage): the
        # same kernels as through DTensor, without its dispatch at every step.
        self._average_list = [_local(average) for average in self.averages.values()]
        self._weight_list = [_local(self.weights[name]) for name in self.averages]

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average at the current weights (e.g. after loading weights without one)."""
        for name, average in self.averages.items():
            average.copy_(self.weights[name])

    @torch.no_grad()
    def update(self, skip: torch.Tensor) -> None:
        """One step of the average, as a single foreach update over the local shards; none
        where ``skip`` (a flag on the device, read there) is set. The host never waits for
        the device here."""
        # 0 on a skipped step: the average stays. The weight stays on the device too, as a
        # tensor, which _foreach_lerp_ takes only as a list of them, one per tensor (a single
        # tensor goes to its Python-number overload through .item(), a wait for the device).
        # Same formula, same float32 weight: the averages are bit-identical to the number's.
        # On CUDA such a list leaves the multi-tensor kernel (its weights would have to be
        # shaped like the tensors) for one lerp kernel per tensor: queued, never waited for.
        weight = (~skip).to(torch.float32) * (1.0 - self.decay)
        torch._foreach_lerp_(self._average_list, self._weight_list, [weight] * len(self._average_list))

    def state_dict(self) -> dict:
        return self.averages

    def load_state_dict(self, state_dict: dict) -> None:
        with torch.no_grad():
            for name, average in self.averages.items():
                average.copy_(state_dict[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
