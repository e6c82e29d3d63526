"""The routed experts: n_experts SwiGLU feed-forwards with stacked weights, run on the rows
sorted by expert as one grouped GEMM or a loop over the experts; and the conversion from and
to the per-expert weights Hugging Face checkpoints keep."""

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.init import fill_trunc_normal_
from titanlite.models.moe.args import MoEArgs

# torch's CUDA kernel (GroupMM.cu) takes fewer groups than this, one group per local expert.
_CUDA_GROUP_LIMIT = 1024


@lru_cache
def _cuda_has_grouped_mm(device_index: int) -> bool:
    # torch documents grouped GEMM for CUDA devices of compute capability 8.0 and above. Its
    # kernel runs on 9.0 and 10.x; on the others torch falls back to one matmul per group,
    # reading the offsets on the host (GroupedBlas.cpp): still one call, no Python loop.
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can multiply x [rows, in] by weight [E, out, in]: both
    bfloat16 (the only dtype of its compile-time rules, even though the CPU kernel also takes
    float32), on the CPU or a capable CUDA device, with rows of a multiple of 16 bytes."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if x.shape[-1] % 8 or weight.shape[-2] % 8:
        return False
    if x.device.type == "cuda":
        return _cuda_has_grouped_mm(x.device.index or 0) and weight.shape[0] < _CUDA_GROUP_LIMIT  # cuda-only
    return x.device.type == "cpu"


def to_compute_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the dtype autocast computes matmuls in on its device, where autocast is on;
    else as it is. Autocast casts the arguments of the operators on its lists only, and grouped
    GEMM is not on the CPU's: cast here, tokens and stacked weights reach it in bf16 under
    autocast as they do under FSDP's bf16 param dtype. The cast is differentiable: float32
    parameters get float32 gradients."""
    if not tensor.is_floating_point() or not torch.is_autocast_enabled(tensor.device.type):
        return tensor
    return tensor.to(torch.get_autocast_dtype(tensor.device.type))


def expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """x [rows, in], sorted by expert with counts[e] rows for expert e, times each expert's
    weight[e] [out, in] transposed: [rows, out]. ``grouped`` runs one grouped GEMM; otherwise a
    loop over experts runs one matmul each (exact, any dtype, but it reads the counts on the host)."""
    if not grouped:
        return _linear_per_expert(x, weight, counts)
    if x.shape[0] == 0:
        # No rows for any expert (an expert-parallel rank whose experts received none): no
        # kernel to run, but an empty product that still ties the weights to the graph, so
        # that they get a zero gradient as on the ranks whose experts had rows.
        return F.linear(x, weight[0])
    # Where each expert's rows end, int32 as the kernel takes them; an empty expert repeats
    # the previous offset. No padding per expert: the CUDA kernel checks a group's size only
    # in operand layouts that neither this call nor its backward makes (GroupMMCommon.cuh),
    # and row-major rows of 16-byte multiples start every group on an aligned address.
    offsets = counts.cumsum(0).to(torch.int32)
    return torch._grouped_mm(_aligned_for_cuda(x), _aligned_for_cuda(weight).transpose(-2, -1), offs=offsets)


def _aligned_for_cuda(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied if it is on a CUDA device and starts off a 16-byte boundary (a view
    into a larger buffer): the CUDA kernel reads its operands through TMA, which needs aligned
    addresses, and refuses others; the CPU kernel does not ask (GroupedMMUtils.h). A compiled
    graph needs no such copy: Inductor clones its misaligned inputs itself."""
    if tensor.device.type != "cuda" or torch.compiler.is_compiling():
        return tensor
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()  # cuda-only


# Eager also inside a compiled block (which breaks its graph here): the split sizes are read
# on the host, and the compiler cannot size the pieces from values it does not know.
@torch.compiler.disable
def _linear_per_expert(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return linear_by_sizes(x, weight, counts.tolist())


def linear_by_sizes(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The per-expert loop given the rows of each expert as numbers (sizes[e] for expert e)."""
    rows = x.split(sizes)
    # unbind, not weight[e]: each index's backward fills a zero tensor the size of the whole
    # stacked weight (cost growing with the square of the expert count); unbind's stacks once.
    return torch.cat([F.linear(expert_rows, w) for w, expert_rows in zip(weight.unbind(0), rows, strict=True)])


def swiglu_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    use_grouped_mm: bool | None,
) -> torch.Tensor:
    """Each expert's SwiGLU on its rows of x [rows, dim] (sorted by expert, counts[e] rows for
    expert e, of the len(counts) experts whose weights are stacked in w1, w2, w3): [rows, dim].
    ``use_grouped_mm`` None: grouped GEMM wherever it fits; False: always the loop. Under
    autocast, tokens and weights are cast to its dtype first (to_compute_dtype)."""
    x, w1, w2, w3 = (to_compute_dtype(tensor) for tensor in (x, w1, w2, w3))
    # w1 fitting means dim and hidden_dim both do, and so w2 and w3 fit too.
    grouped = use_grouped_mm is not False and grouped_mm_fits(x, w1)
    hidden = F.silu(expert_linear(x, w1, counts, grouped)) * expert_linear(x, w3, counts, grouped)
    return expert_linear(hidden, w2, counts, grouped)


class GroupedExperts(nn.Module):
    """n_experts SwiGLU feed-forwards, w2(silu(w1 x) * w3 x), their weights stacked: w1 and
    w3 [n_experts, hidden_dim, dim], w2 [n_experts, dim, hidden_dim] ([out, in] per expert,
    as nn.Linear and transformers' per-expert checkpoints keep them)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(args.n_experts, args.hidden_dim, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.dim, args.hidden_dim))
        self.w3 = nn.Parameter(torch.empty(args.n_experts, args.hidden_dim, args.dim))
        self.use_grouped_mm: bool | None = None  # None: wherever grouped_mm_fits; False: always the loop

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [rows, dim] sorted by expert, counts [n_experts] rows per expert -> [rows, dim]."""
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3, self.use_grouped_mm)

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        fill_trunc_normal_(self.w1, std=0.02, generator=generator)
        fill_trunc_normal_(self.w2, std=out_std, generator=generator)
        fill_trunc_normal_(self.w3, std=out_std, generator=generator)


# --- Hugging Face's per-expert weights ----------------------------------------------

# transformers checkpoints save each expert's projections apart:
# {prefix}.{e}.gate_proj.weight [hidden, dim] (w1), up_proj (w3), down_proj [dim, hidden] (w2).
HF_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def stack_hf_experts(hf_state: dict[str, torch.Tensor], prefix: str, n_experts: int) -> dict[str, torch.Tensor]:
    """{"w1", "w2", "w3"}: the stacked weights of the experts saved under ``prefix`` (for
    example "model.layers.3.mlp.experts"); a KeyError names the first key that is missing."""
    stacked = {}
    for ours, theirs in HF_EXPERT_NAMES.items():
        keys = [f"{prefix}.{e}.{theirs}.weight" for e in range(n_experts)]
        missing = next((key for key in keys if key not in hf_state), None)
        if missing is not None:
            raise KeyError(f"expert weight '{missing}' is missing ({n_experts} experts expected under '{prefix}')")
        stacked[ours] = torch.stack([hf_state[key] for key in keys])
    return stacked


def unstack_hf_experts(stacked: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The per-expert keys and tensors of ``stacked`` {"w1", "w2", "w3"}; the tensors are views
    into the stacked ones (clone them before saving with safetensors, which refuses shared memory)."""
    return {
        f"{prefix}.{e}.{theirs}.weight": expert
        for ours, theirs in HF_EXPERT_NAMES.items()
        for e, expert in enumerate(stacked[ours].unbind(0))
    }
