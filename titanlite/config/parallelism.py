"""The [parallelism], [activation_checkpoint] and [compile] sections: what parallelize applies
to the model (the parallel layout, recomputation in backward, torch.compile), with the
pipeline schedules' names."""

from dataclasses import dataclass
from typing import Literal

from titanlite.config.ranges import MINUS_ONE_OR_POSITIVE, POSITIVE_OR_UNSET, Range, at_least, ranged, subset_of

# Context parallelism's ways of sharing keys and values: all-gather only (torchtitan's alltoall
# ring is not built).
ROTATE_METHODS = Range(
    "'allgather' (titanlite has no alltoall ring for context parallelism)", lambda v: v == "allgather"
)


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = ranged(MINUS_ONE_OR_POSITIVE, default=1)
    """Number of model replicas (DDP across them; HSDP when the shard degree is also above 1)."""

    data_parallel_shard_degree: int = ranged(MINUS_ONE_OR_POSITIVE, default=-1)
    """Number of ranks each replica is sharded over (FSDP); -1 uses all ranks left after replication."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (FULL_SHARD), never (SHARD_GRAD_OP) or default (always, except the
    root)."""

    tensor_parallel_degree: int = ranged(at_least(1), default=1)
    """Ranks each layer's matrices are split over (tensor parallelism, within a node); it must divide the attention
    heads, the key/value heads, the FFN size and the world size. Data parallelism takes the ranks left over."""

    enable_sequence_parallel: bool = True
    """With tensor parallelism: split the norms' and residuals' activations along the sequence over the TP ranks
    instead of repeating them on each (less activation memory, the same collectives' volume)."""

    disable_loss_parallel: bool = False
    """With tensor parallelism: gather the vocabulary-sharded logits before the loss instead of computing the loss on
    each rank's vocabulary shard (loss parallel, which never holds the full logits)."""

    enable_async_tensor_parallel: bool = False
    """Overlap TP's collectives with its matmuls inside compiled blocks (micro-pipelined TP); needs CUDA,
    tensor_parallel_degree > 1 and compile.enable with the model compiled."""

    expert_parallel_degree: int = ranged(at_least(1), default=1)
    """Ranks each mixture-of-experts layer's experts are split over (expert parallelism): each keeps n_experts / it
    experts and tokens travel to them by all-to-all. It borrows all the TP ranks, then FSDP ranks: a multiple of the
    TP degree whose quotient divides the data-parallel shard degree (without TP: a divisor of the shard degree), and
    a divisor of the model's experts; FSDP shards the experts over the ranks it leaves. 1: every rank holds all
    experts."""

    pipeline_parallel_degree: int = ranged(at_least(1), default=1)
    """Pipeline stages the layers are split over, one group of ranks per stage (pipeline parallelism, the outermost
    mesh dimension: across nodes). Data and tensor parallelism take the ranks left over."""

    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: GPipe or 1F1B (one stage per rank); Interleaved1F1B, LoopedBFS or InterleavedZeroBubble
    (several stages per rank, looped); ZBVZeroBubble or DualPipeV (two stages per rank, in a V)."""

    pipeline_parallel_microbatch_size: int = ranged(at_least(1), default=1)
    """Sequences per pipeline micro-batch; it must divide training.local_batch_size, and local_batch_size / it
    micro-batches go through the pipeline per accumulation step."""

    pipeline_parallel_layers_per_stage: int | None = ranged(POSITIVE_OR_UNSET, default=None)
    """Transformer blocks per pipeline stage (the embedding and the output counted as the *_less_layers keys say);
    unset: as many stages as the schedule needs, the blocks spread evenly."""

    pipeline_parallel_first_stage_less_layers: int = ranged(at_least(0), default=1)
    """How many blocks' worth of work the embedding counts for: the first stage gets that many blocks fewer."""

    pipeline_parallel_last_stage_less_layers: int = ranged(at_least(0), default=1)
    """How many blocks' worth of work the final norm and output projection count for: the last stage gets that many
    blocks fewer."""

    context_parallel_degree: int = ranged(at_least(1), default=1)
    """Ranks each sequence is split over (context parallelism): each keeps seq_len / it tokens of every sequence and
    all-gathers the others' keys and values in every attention layer. The cp ranks read the same batch; FSDP shards the
    parameters over data_parallel_shard_degree x it."""

    context_parallel_load_balancer: Literal["headtail", "none"] = "headtail"
    """How a sequence is cut over the cp ranks: headtail (2 x cp chunks, rank r keeping chunk r and chunk 2 cp - 1 - r,
    so every rank does the same causal-attention work; seq_len must be a multiple of 2 x cp) or none (cp contiguous
    chunks; seq_len a multiple of cp)."""

    context_parallel_rotate_method: str = ranged(ROTATE_METHODS, default="allgather")
    """How keys and values reach the other cp ranks: allgather (every rank gathers all the sequence's keys and values
    of its key/value heads, once per layer; the gradients are reduce-scattered back)."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """The stages by hand: for each stage, the names of the modules it holds (e.g. [["tok_embeddings", "layers.0"],
    ["layers.1", "norm", "output"]]; on the command line stages are separated by ';'). Overrides the layer counts."""


# Pipeline schedules by torchtitan's names (matched without regard to case), each with how
# its stages sit on the pp ranks: "single", one stage per rank; "loop", two or more per rank,
# rank r holding stages r, r + pp, r + 2 pp, ...; "v", exactly two per rank, rank r holding
# stages r and 2 pp - 1 - r (so the first and the last stage share rank 0).
PIPELINE_SCHEDULES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}


# Zero-bubble schedules split each backward into the inputs' gradient and, later, the
# weights' gradient.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def canonical_schedule(name: str) -> str | None:
    """The schedule's name as PIPELINE_SCHEDULES spells it, or None for an unknown one."""
    return next((known for known in PIPELINE_SCHEDULES if known.lower() == name.lower()), None)


def _is_selective_ac_option(option: str) -> bool:
    # isdigit alone accepts other scripts' digits ('٣'), which int() reads but nobody means.
    return option == "op" or (option.isascii() and option.isdigit() and int(option) >= 1)


SELECTIVE_AC_OPTION = Range("'op' or a positive integer", _is_selective_ac_option)


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "selective"
    """Activation checkpointing: none, full (every block) or selective (see selective_ac_option)."""

    selective_ac_option: str = ranged(SELECTIVE_AC_OPTION, default="2")
    """For selective mode: an integer N checkpoints every N-th block; 'op' saves only chosen matmul/attention outputs in
    every block."""


# What torch.compile may wrap (compile.components).
COMPILE_COMPONENTS = ("model", "loss")


@dataclass
class Compile:
    enable: bool = False
    """Compile each transformer block with torch.compile."""

    components: list[str] = ranged(subset_of(COMPILE_COMPONENTS), default_factory=lambda: ["model"])
    """What to compile when enabled: model (each block) and/or loss."""
