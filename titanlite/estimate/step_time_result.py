"""The step-time estimate's result: what one optimizer step costs on each device, and its
few report lines (estimate.step_time computes it)."""

from dataclasses import dataclass

from titanlite.estimate.float8 import float8_note
from titanlite.estimate.hardware import Hardware


@dataclass(frozen=True)
class StepTimeEstimate:
    """What one optimizer step costs on each device. Bytes are those one device sends,
    summed over the step (all micro-batches); seconds are per step."""

    strategy: str  # "single process", "FSDP", "DDP", "HSDP", "TP", "FSDP + TP", ... (ParallelDims.strategy)
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int  # ranks each layer is split over; tokens and FLOPs below are per device
    hardware: Hardware
    efficiency: float
    # compute
    flops_per_token: int  # model FLOPs (forward + backward), what MFU counts
    recompute_flops_per_token: float  # forward FLOPs redone by activation checkpointing (the busiest pp rank's)
    tokens_per_device_per_micro_batch: float  # the data-parallel rank's tokens / tp
    tokens_per_device_per_step: float
    compute_s: float
    # communication
    all_gather_bytes: float  # FSDP parameter all-gathers (forward + backward re-gathers)
    reduce_scatter_bytes: float  # FSDP gradient reduce-scatters
    all_reduce_bytes: float  # HSDP/DDP gradient all-reduce across replicas
    tp_bytes: float  # TP's activation collectives (and the logits'), and the sum of the MoE weights' gradients
    tp_moe_gradient_bytes: float  # of tp_bytes, summing the gradients of the MoE weights every TP rank holds whole
    shard_link: str  # "intra-node", "inter-node" or "none" (a group of one)
    replicate_link: str
    tp_link: str
    all_gather_s: float
    reduce_scatter_s: float
    all_reduce_s: float
    tp_s: float
    comm_s: float  # all of it: data-parallel and TP
    exposed_comm_s: float  # communication no compute can hide (TP's, unless async, and FSDP's ends)
    overlapped: bool  # data-parallel communication assumed to run under compute
    sequence_parallel: bool
    loss_parallel: bool
    async_tp: bool
    # pipeline parallelism (pp 1: no pipeline, every figure below zero or None)
    pp: int
    schedule: str | None  # the pipeline schedule, None without PP
    microbatches: int  # pipeline micro-batches per accumulation step (1 without PP)
    bubble: float  # idle share of the pipelined step on the busiest pp rank (PipelinePlan.bubble_at)
    pp_bytes: float  # activations and their gradients the busiest rank sends to other stages
    pp_link: str
    pp_s: float
    pp_exposed_s: float  # the sends while the pipeline fills and drains, which nothing hides
    # expert parallelism (ep 1: no all-to-all; the experts' FSDP traffic is in the shard group's)
    ep: int  # ranks each MoE layer's experts are split over (all the tp ranks and a split of the shard group)
    ep_bytes: float  # the all-to-alls' bytes (token rows to their experts and back, and the counts)
    ep_link: str
    ep_s: float
    expert_shard_link: str  # the link FSDP gathers and reduces the experts over (the shard group's without EP)
    moe_flops_per_token: float  # of the device's FLOPs per token of its data-parallel rank, its MoE layers' (1/t)
    moe_tokens_per_device_per_micro_batch: float  # the tokens a device routes through each MoE layer (1/t)
    step_s: float
    # verdict
    verdict: str  # "compute-bound" or "communication-bound"
    threshold_tokens_per_device: float | None  # the compute-to-communication ratio C / W; None with no communication
    break_even_tokens_per_device: float  # per micro-batch, where compute equals the data-parallel communication
    tokens_per_second_per_device: float
    mfu_percent: float
    float8_saved_s: float = 0.0  # of the compute, what float8 takes off (included in compute_s); 0 without float8
    # context parallelism (cp 1: every figure below zero or "none"; estimate.context_parallel)
    cp: int = 1  # ranks each sequence is split over; tokens and FLOPs above are per device
    cp_bytes: float = 0.0  # the keys' and values' all-gathers and their gradients' reduce-scatters
    cp_link: str = "none"
    cp_s: float = 0.0
    cp_hidden_s: float = 0.0  # of cp_s, the forward all-gathers' time hidden behind attention on the rank's own keys
    kv_gathered_bytes: float = 0.0  # the keys and values one attention layer holds gathered per micro-batch

    def describe(self) -> str:
        """A few human-readable lines, for a command-line report."""
        hw = self.hardware
        threshold = "n/a" if self.threshold_tokens_per_device is None else f"{self.threshold_tokens_per_device:,.0f}"
        tp = f" x {self.tp} TP" if self.tp > 1 else ""
        cp = f" x {self.cp} CP" if self.cp > 1 else ""
        pp = f"PP {self.pp} ({self.schedule}, {self.microbatches} micro-batches) x " if self.pp > 1 else ""
        pipeline = (
            [
                f"pipeline bubble {self.bubble:.1%}; {self.pp_bytes / 1e9:.2f} GB sent between stages over "
                f"{self.pp_link} -> {self.pp_s * 1e3:.1f} ms ({self.pp_exposed_s * 1e3:.1f} ms exposed)"
            ]
            if self.pp > 1
            else []
        )
        experts = (
            [
                f"EP {self.ep}: all-to-all {self.ep_bytes / 1e9:.2f} GB over {self.ep_link} -> "
                f"{self.ep_s * 1e3:.1f} ms; experts gathered and reduced over {self.expert_shard_link}"
            ]
            if self.ep > 1
            else []
        )
        moe_under_tp = (
            [
                f"MoE under TP {self.tp}: {self.moe_tokens_per_device_per_micro_batch:,.0f} tokens/device/micro-batch "
                f"through each MoE layer; of the TP bytes, {self.tp_moe_gradient_bytes / 1e9:.2f} GB sum the "
                "gradients of the MoE weights every TP rank holds"
            ]
            if self.tp > 1 and self.moe_tokens_per_device_per_micro_batch
            else []
        )
        context = (
            [
                f"CP {self.cp}: keys and values all-gathered {self.kv_gathered_bytes / 2**20:,.1f} MiB per layer and "
                f"micro-batch, {self.cp_bytes / 1e9:.2f} GB over {self.cp_link} -> {self.cp_s * 1e3:.1f} ms "
                f"({self.cp_hidden_s * 1e3:.1f} ms of it behind attention on the rank's own keys)"
            ]
            if self.cp > 1
            else []
        )
        return "\n".join(
            [
                f"{self.strategy}: {pp}{self.dp_replicate} replica(s) x {self.dp_shard} shard(s){tp}{cp} "
                f"on {self.world_size} {hw.name}",
                f"compute {self.compute_s * 1e3:.1f} ms ({self.tokens_per_device_per_step:,.0f} tokens/device/step, "
                f"{self.efficiency:.0%} of {hw.peak_flops / 1e12:.0f} TFLOP/s{float8_note(self.float8_saved_s)})",
                f"all-gather {self.all_gather_bytes / 1e9:.2f} GB + reduce-scatter "
                f"{self.reduce_scatter_bytes / 1e9:.2f} GB over {self.shard_link} -> "
                f"{(self.all_gather_s + self.reduce_scatter_s) * 1e3:.1f} ms; all-reduce "
                f"{self.all_reduce_bytes / 1e9:.2f} GB over {self.replicate_link} -> {self.all_reduce_s * 1e3:.1f} ms; "
                f"TP {self.tp_bytes / 1e9:.2f} GB over {self.tp_link} -> {self.tp_s * 1e3:.1f} ms",
                *pipeline,
                *experts,
                *context,
                *moe_under_tp,
                f"{self.verdict}: {self.tokens_per_device_per_micro_batch:,.0f} tokens/device/micro-batch vs "
                f"C/W = {threshold} (break-even in this model {self.break_even_tokens_per_device:,.0f})",
                f"step {self.step_s * 1e3:.1f} ms -> {self.tokens_per_second_per_device:,.0f} tokens/s/device, "
                f"MFU {self.mfu_percent:.1f}%",
            ]
        )
