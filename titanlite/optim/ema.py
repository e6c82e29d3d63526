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
        # The update runs on the local shards themselves (views of the same storage), one
        # multi-tensor call per (device, dtype), the grouping the fused kernel requires.
        self._groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for name, average in self.averages.items():
            local = _local(average)
            averages, weights = self._groups.setdefault((local.device, local.dtype), ([], []))
            averages.append(local)
            weights.append(_local(self.weights[name]))

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average at the current weights (e.g. after loading weights without one)."""
        for name, average in self.averages.items():
            average.copy_(self.weights[name])

    @torch.no_grad()
    def update(self, skip: torch.Tensor) -> None:
        """One step of the average over the local shards, none where ``skip`` (a flag on the
        device, read there) is set. The host never waits for the device here.

        The step is SGD's without momentum, taken on the averages with the weights as their
        "gradients": with weight decay -1 the gradient becomes weights - average, and a
        learning rate of -(1 - decay) adds (1 - decay) of it, lerp's formula for a weight
        below 0.5. Torch's fused SGD is the one multi-tensor update that takes a skip flag
        on the device: found_inf, which its CUDA kernel (multi_tensor_apply over all the
        tensors, aten/src/ATen/native/cuda/FusedSgdKernel.cu) reads in the kernel and its
        CPU one reads in memory, leaving every tensor as it was when the flag is 1. The
        foreach lerp would take its weight only as a host number (a wait for the flag) or
        as one tensor per tensor, which on CUDA leaves the multi-tensor kernel for one
        launch per tensor. The weights are only read (no grad_scale is given) and no
        temporary is made."""
        found_inf = skip.to(torch.float32)  # 1.0 where the step is skipped
        for (device, _), (averages, weights) in self._groups.items():
            # A shard kept elsewhere (CPU offload) needs the flag beside it: that copy from
            # the accelerator waits for it, as the offloaded optimizer step does anyway.
            torch._fused_sgd_(
                averages,
                weights,
                [],
                weight_decay=-1.0,
                momentum=0.0,
                lr=-(1.0 - self.decay),
                dampening=0.0,
                nesterov=False,
                maximize=False,
                is_first_step=False,
                found_inf=found_inf.to(device),
            )

    def state_dict(self) -> dict:
        return self.averages

    def load_state_dict(self, state_dict: dict) -> None:
        with torch.no_grad():
            for name, average in self.averages.items():
                average.copy_(state_dict[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
