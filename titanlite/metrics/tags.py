"""Metric tag names: the one place the trainer, the tests and the docs take them from.

The names and their grouping ("loss_metrics/...", "memory/...") are torchtitan's, so
TensorBoard and W&B dashboards built for torchtitan runs read titanlite runs too.
Users import the module, not the names: ``from titanlite.metrics import tags`` and
``tags.LOSS``.
"""

LOSS = "loss_metrics/global_avg_loss"
MAX_LOSS = "loss_metrics/global_max_loss"
Z_LOSS = "loss_metrics/z_loss"  # training.z_loss_coef's term of the training loss, over the global batch
GRAD_NORM = "grad_norm"
LR = "lr"
TOKENS_SEEN = "ntokens_seen"
TPS = "throughput(tps)"  # tokens per second per device
TFLOPS = "tflops"  # achieved TFLOPs per device
MFU = "mfu(%)"
STEP_TIME = "time_metrics/end_to_end(s)"  # seconds per optimizer step
DATA_TIME = "time_metrics/data_loading(s)"
DATA_PCT = "time_metrics/data_loading(%)"
MAX_ACTIVE_GIB = "memory/max_active(GiB)"
MAX_ACTIVE_PCT = "memory/max_active(%)"
MAX_RESERVED_GIB = "memory/max_reserved(GiB)"
MAX_RESERVED_PCT = "memory/max_reserved(%)"
NUM_ALLOC_RETRIES = "memory/num_alloc_retries"
NUM_OOMS = "memory/num_ooms"
RSS_GIB = "memory/rss(GiB)"  # CPU runs: the process's resident memory
PEAK_RSS_GIB = "memory/peak_rss(GiB)"
# MoE models only: expert load is max / mean (token, expert) pairs per expert over the
# logged step's global batch (1: perfectly even, n_experts / top_k: every token on the same
# top_k experts); each balancing loss only when it is on (its mean over the step's
# micro-batches, without its coefficient).
MOE_MAX_LOAD = "moe_metrics/max_load_imbalance"  # the largest over the MoE layers
MOE_WORST_LOAD = "moe_metrics/worst_load_imbalance"  # n_experts / top_k: a collapsed router's load
MOE_AUX_LOSS = "moe_metrics/aux_loss"  # transformers' pooled load-balancing loss
MOE_LOAD_BALANCE_LOSS = "moe_metrics/load_balance_loss"  # the per-layer one, summed over the layers
MOE_SEQ_BALANCE_LOSS = "moe_metrics/seq_balance_loss"  # DeepSeek-V3's sequence-wise one
MOE_Z_LOSS = "moe_metrics/router_z_loss"
# Fault tolerance only: replica groups in the step's quorum, heals this group received, and
# samples (windows) of the global order that absent groups' shares of committed steps skipped.
FT_GROUPS = "fault_tolerance/participating_groups"
FT_HEALS = "fault_tolerance/heals"
FT_SKIPPED = "fault_tolerance/skipped_samples"
# training.skip_spike_steps only: how far the logged step's loss or gradient norm (the larger)
# stood above the trailing window's mean, in its standard deviations; spike steps skipped so far.
SPIKE_Z_SCORE = "spike_metrics/z_score"
SPIKE_SKIPPED = "spike_metrics/skipped_steps"
VAL_LOSS = "validation_metrics/loss"
VAL_PERPLEXITY = "validation_metrics/perplexity"

ALL_TAGS = (
    LOSS,
    MAX_LOSS,
    Z_LOSS,
    GRAD_NORM,
    LR,
    TOKENS_SEEN,
    TPS,
    TFLOPS,
    MFU,
    STEP_TIME,
    DATA_TIME,
    DATA_PCT,
    MAX_ACTIVE_GIB,
    MAX_ACTIVE_PCT,
    MAX_RESERVED_GIB,
    MAX_RESERVED_PCT,
    NUM_ALLOC_RETRIES,
    NUM_OOMS,
    RSS_GIB,
    PEAK_RSS_GIB,
    MOE_MAX_LOAD,
    MOE_WORST_LOAD,
    MOE_AUX_LOSS,
    MOE_LOAD_BALANCE_LOSS,
    MOE_SEQ_BALANCE_LOSS,
    MOE_Z_LOSS,
    SPIKE_Z_SCORE,
    SPIKE_SKIPPED,
    VAL_LOSS,
    VAL_PERPLEXITY,
)


# eval.enable: eval/<task>/acc, eval/<task>/acc_norm, eval/<task>/bpb, eval/tflop (the evaluation's
# forward FLOPs, every rank's) and eval/seconds.
EVAL_PREFIX = "eval/"
EVAL_SECONDS = "eval/seconds"


def moe_layer_load(layer: int) -> str:
    """The tag of one MoE layer's expert load (max / mean), by its block index."""
    return f"moe_metrics/load_imbalance_layer_{layer}"
