"""Run planning: what a job config asks for, checked before any process group or tensor
exists, and the one way a run's model is built.

The trainer and the estimators both start here, so an estimate describes exactly the run
the trainer would make (same layout, same batch plan, same model build)."""

import functools
import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from titanlite.config import ConfigError, JobConfig, Model, Training, Validation, value_text
from titanlite.config.model import MOE_KEYS
from titanlite.config.parallelism import SPLIT_BACKWARD_SCHEDULES
from titanlite.data import ByteTokenizer, build_tokenizer, open_windows
from titanlite.layout_checks import check_context_parallel, check_document_mask, check_tensor_parallel
from titanlite.metrics.flops import block_flops_per_token
from titanlite.parallel import ParallelDims
from titanlite.parallel.parallelize import moe_layers
from titanlite.parallel.pipeline import PipelinePlan, plan_pipeline, prune_to_stage
from titanlite.quantize import convert_to_float8
from titanlite.registry import ModelSpec, get_model_args, get_model_spec, padded_vocab_size
from titanlite.validation import open_held_out

logger = logging.getLogger("titanlite")


@dataclass(frozen=True)
class RunPlan:
    """Everything decided from the config before any process group or tensor exists."""

    parallel_dims: ParallelDims
    model_spec: ModelSpec  # model.name's entry of the registry, looked up once
    model_args: object  # the flavor's, its vocabulary sized for the tokenizer (model_vocab_size)
    global_batch_size: int
    grad_accum_steps: int
    tokenizer: object
    pipeline: PipelinePlan | None = None  # the stages, with pipeline parallelism
    replica_groups: int = 1  # fault_tolerance.group_size: groups sharing global_batch_size

    @property
    def group_batch_size(self) -> int:
        """Sequences one replica group trains on per optimizer step (the global batch without fault tolerance)."""
        return self.global_batch_size // self.replica_groups

    @property
    def tokenizer_vocab_size(self) -> int | None:
        """The ids that are tokens when the vocabulary was sized from the tokenizer (the rows
        past them are padding); None with the byte tokenizer, whose model keeps the flavor's rows."""
        return None if isinstance(self.tokenizer, ByteTokenizer) else self.tokenizer.vocab_size

    def meta_model(self) -> nn.Module:
        """The run's model on the meta device: every parameter's shape and dtype, no memory."""
        return _on_meta(self.model_spec.model_cls, self.model_args)


def model_vocab_size(job_config: JobConfig, flavor_vocab_size: int, tokenizer) -> int:
    """The embedding's rows for a run: the flavor's own with the byte tokenizer (its 258 ids
    fit every flavor, and byte-tokenizer checkpoints keep their shape), else the tokenizer's
    size rounded up (registry.padded_vocab_size)."""
    if isinstance(tokenizer, ByteTokenizer):
        if tokenizer.vocab_size > flavor_vocab_size:
            raise ConfigError(
                f"the byte tokenizer has {tokenizer.vocab_size} ids but model {job_config.model.name} "
                f"{job_config.model.flavor} embeds only {flavor_vocab_size}; pick another model.flavor"
            )
        return flavor_vocab_size
    return padded_vocab_size(tokenizer.vocab_size)


def run_model_args(job_config: JobConfig, tokenizer=None):
    """The model args a run builds: its flavor's, with the run's sequence length, a
    vocabulary sized for ``tokenizer`` (default: the run's, loaded here) and the run's MoE
    router and load balancing where [model] sets them."""
    tokenizer = tokenizer or load_tokenizer(job_config)
    flavor = get_model_args(job_config.model.name, job_config.model.flavor)
    vocab_size = model_vocab_size(job_config, flavor.vocab_size, tokenizer)
    sized = replace(flavor.with_seq_len(job_config.training.seq_len), vocab_size=vocab_size)
    sized = with_rope_scaling(job_config, sized)
    chosen = moe_overrides(job_config, flavor)
    try:
        return replace(sized, **{MOE_KEYS[key]: value for key, value in chosen.items()})
    except ValueError as error:  # the model args' own check of the router's options
        keys = ", ".join(f"model.{key} = {value_text(job_config, f'model.{key}')}" for key in chosen)
        raise ConfigError(f"{keys}: {error}") from None


def with_rope_scaling(job_config: JobConfig, args):
    """``args`` with the RoPE scaling [model] sets for context extension, if it sets one."""
    model = job_config.model
    if model.rope_scaling_factor is None:
        if model.rope_original_seq_len is not None:
            raise ConfigError("model.rope_original_seq_len applies with model.rope_scaling_factor only; set both")
        return args
    try:
        return args.with_rope_scaling(model.rope_scaling_factor, model.rope_original_seq_len)
    except ValueError as error:
        raise ConfigError(f"model.rope_scaling_factor ({model.rope_scaling_factor}): {error}") from None


def moe_overrides(job_config: JobConfig, flavor_args) -> dict:
    """The MoE router and load-balancing keys [model] sets ({key: value}); a ConfigError for
    a model without MoE layers, which has nothing to route."""
    model = job_config.model
    chosen = {key: getattr(model, key) for key in MOE_KEYS if getattr(model, key) is not None}
    if chosen and not getattr(flavor_args, "is_moe", False):
        key = next(iter(chosen))
        raise ConfigError(
            f"model.{key} ({chosen[key]}) applies to MoE models only, and {model.name} {model.flavor} has no MoE "
            "layers; leave it unset"
        )
    return chosen


def tokenizer_for_estimate(job_config: JobConfig) -> tuple[object, str | None]:
    """(tokenizer, note): the run's tokenizer, which sizes the model an estimate describes;
    when it cannot be read here (a run planned on another machine names a tokenizer that is
    not on this one), the byte tokenizer stands in, i.e. the flavor's own vocabulary, and
    the note says so."""
    tokenizer, problem = _tokenizer_or_problem(job_config.model.hf_assets_path)
    if problem is None:
        return tokenizer, None
    model = job_config.model
    return ByteTokenizer(), f"{problem}; the estimate uses model {model.name} {model.flavor}'s own vocabulary"


@functools.lru_cache(maxsize=8)
def _tokenizer_or_problem(hf_assets_path: str | None) -> tuple[object, str | None]:
    """(tokenizer, None), or (None, why it cannot be read). Cached: a sweep estimates many
    layouts of one run, and a large tokenizer.json takes a second to read."""
    try:
        return load_tokenizer_at(hf_assets_path), None
    except ConfigError as error:
        return None, str(error)


def plan_run(job_config: JobConfig, world_size: int, tokenizer=None) -> RunPlan:
    """Cross-check the config against the registry, the world size and the tokenizer
    (default: the run's, loaded here). Every problem is a one-line ConfigError; nothing is
    created or written."""
    training, parallelism = job_config.training, job_config.parallelism
    tokenizer = tokenizer or load_tokenizer(job_config)
    model_args = run_model_args(job_config, tokenizer)
    spec = get_model_spec(job_config.model.name)
    try:
        parallel_dims = ParallelDims.resolve(
            parallelism.data_parallel_replicate_degree,
            parallelism.data_parallel_shard_degree,
            world_size,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            ep=parallelism.expert_parallel_degree,
            cp=parallelism.context_parallel_degree,
        )
        pipeline = None
        if parallel_dims.pp > 1:
            costs = block_flops_per_token(model_args, training.seq_len)
            pipeline = plan_pipeline(parallelism, spec.model_cls, model_args, training.local_batch_size, costs)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if pipeline is not None:
        check_pipeline_validation(job_config.validation, training)
    if parallel_dims.ep > 1:
        check_expert_parallel(job_config.model, spec.model_cls, model_args, parallel_dims)
    check_tensor_parallel(job_config, spec, model_args, parallel_dims.tp)
    check_context_parallel(job_config, spec.model_cls, model_args, parallel_dims)
    check_document_mask(job_config.model, tokenizer)
    if pipeline is not None:
        check_split_backward(job_config, pipeline.schedule, parallel_dims)
    if training.enable_cpu_offload and not parallel_dims.fsdp_applied:
        raise ConfigError("training.enable_cpu_offload needs FSDP, i.e. more than one data-parallel rank")

    try:
        groups = job_config.fault_tolerance.group_size if job_config.fault_tolerance.enable else 1
        global_batch, accumulation = parallel_dims.batch_plan(
            training.local_batch_size, training.global_batch_size, groups
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return RunPlan(parallel_dims, spec, model_args, global_batch, accumulation, tokenizer, pipeline, groups)


def check_pipeline_validation(validation: Validation, training: Training) -> None:
    """Under pipeline parallelism the held-out batches go through the training pipeline, whose
    stages hold buffers of the training micro-batches' shape: the validation batch must be the
    training one (-1, or the same numbers)."""
    if not validation.enable:
        return
    for key, size in (("local_batch_size", training.local_batch_size), ("seq_len", training.seq_len)):
        value = getattr(validation, key)
        if value not in (-1, size):
            raise ConfigError(
                f"validation.{key} ({value}) must be -1 or training.{key} ({size}) under pipeline parallelism: "
                "held-out batches go through the training pipeline, whose micro-batch shapes are fixed"
            )


# Keys that only one part of the layout reads: key -> (that part, whether a layout has it).
_FSDP = ("FSDP (more than one data-parallel rank)", lambda dims: dims.fsdp_applied)
_TP = ("tensor parallelism (parallelism.tensor_parallel_degree > 1)", lambda dims: dims.tp > 1)
_PP = ("pipeline parallelism (parallelism.pipeline_parallel_degree > 1)", lambda dims: dims.pp > 1)
_CP = ("context parallelism (parallelism.context_parallel_degree > 1)", lambda dims: dims.cp > 1)
LAYOUT_KEYS = {
    "parallelism.context_parallel_load_balancer": _CP,
    "parallelism.pipeline_parallel_schedule": _PP,
    "parallelism.pipeline_parallel_microbatch_size": _PP,
    "parallelism.pipeline_parallel_layers_per_stage": _PP,
    "parallelism.pipeline_parallel_first_stage_less_layers": _PP,
    "parallelism.pipeline_parallel_last_stage_less_layers": _PP,
    "parallelism.module_fqns_per_model_part": _PP,
    "training.mixed_precision_reduce": _FSDP,
    "parallelism.fsdp_reshard_after_forward": _FSDP,
    "quantize.linear.float8.enable_fsdp_float8_all_gather": _FSDP,
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": _FSDP,
    "parallelism.enable_sequence_parallel": _TP,
    "parallelism.disable_loss_parallel": _TP,
}


def unused_layout_keys(job_config: JobConfig, parallel_dims: ParallelDims) -> list[str]:
    """A warning line for each key set away from its default that this layout never reads
    (the run would go on as if it were unset)."""
    defaults = JobConfig()
    return [
        f"titanlite: warning: {key} = {value_text(job_config, key)} has no effect in this layout "
        f"({parallel_dims.strategy}, {parallel_dims.world_size} rank(s)); only {reader} reads it"
        for key, (reader, present) in LAYOUT_KEYS.items()
        if not present(parallel_dims) and value_text(job_config, key) != value_text(defaults, key)
    ]


def check_expert_parallel(model: Model, model_cls: type[nn.Module], model_args, dims: ParallelDims) -> None:
    """Expert parallelism against the model's MoE layers, read from the model itself (built
    on the meta device, so no model's args are named here): it needs experts, as many on
    each ep rank, and expert rows that FSDP splits evenly over the ranks EP leaves
    (data_parallel_shard_degree / (expert_parallel_degree / tensor_parallel_degree)): an ep
    group takes all the TP ranks first (ParallelDims.ep_shard)."""
    key, ep, which = "parallelism.expert_parallel_degree", dims.ep, f"{model.name} {model.flavor}"
    moe_args = _first_moe_args(model_cls, model_args)
    if moe_args is None:
        raise ConfigError(f"{key} ({ep}) needs a model with routed experts; {which} has none: set it to 1")
    n_experts = moe_args.n_experts
    if n_experts % ep:
        raise ConfigError(f"{key} ({ep}) must divide the model's {n_experts} experts ({which})")
    expert_fsdp = dims.expert_fsdp
    widths = {moe_args.dim, moe_args.hidden_dim}
    if any(width % expert_fsdp for width in widths):
        borrowed = f"({key} / parallelism.tensor_parallel_degree)" if dims.tp > 1 else key
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree / {borrowed} ({expert_fsdp}) must divide the experts' widths "
            f"{sorted(widths)} ({which}): FSDP splits each expert's rows over those ranks"
        )


@functools.lru_cache(maxsize=16)
def _first_moe_args(model_cls: type[nn.Module], model_args):
    """The first MoE layer's args of the model, built on meta (None for a dense model); kept,
    as a sweep asks for each of its hundreds of layouts."""
    layers = moe_layers(_on_meta(model_cls, model_args))
    return layers[0].args if layers else None


def check_split_backward(job_config: JobConfig, schedule: str, parallel_dims: ParallelDims) -> None:
    """What the zero-bubble schedules' split backward (inputs' gradient first, weights' later)
    cannot take in torch 2.13.

    Compiled blocks: their compiled backward frees its saved buffers after the inputs'
    gradient, and with that reuse turned off the weights' gradients came out wrong (grad norm
    2e-4 off at the first step).

    FSDP resharding after every forward: the stage lists the weights whose gradients it defers
    (``submod.parameters()``) when the inputs' gradient starts, before FSDP's pre-backward hook
    gathers them again; a stage resharded after its forward lists its sharded parameters, which
    the forward's graph never used, so the weights' step computes nothing for that micro-batch.
    Unrefused, PP 2 x FSDP 2 under ZBVZeroBubble lost every gradient of its last stage."""
    schedule_key = f"parallelism.pipeline_parallel_schedule {schedule}"
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError(
            f"{schedule_key} splits the backward, which compiled blocks do not "
            "support; pick 1F1B or Interleaved1F1B, or leave 'model' out of compile.components"
        )
    if parallel_dims.fsdp_applied and job_config.parallelism.fsdp_reshard_after_forward == "always":
        raise ConfigError(
            f"{schedule_key} splits the backward, which loses the weights' gradients of stages that FSDP "
            "reshards after every forward; set parallelism.fsdp_reshard_after_forward to default or never, "
            "or pick a schedule without the split (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)"
        )


def load_tokenizer(job_config: JobConfig):
    """The run's tokenizer (model.hf_assets_path's, else the byte tokenizer)."""
    return load_tokenizer_at(job_config.model.hf_assets_path)


def load_tokenizer_at(hf_assets_path: str | None):
    """The tokenizer model.hf_assets_path = ``hf_assets_path`` names, with an EOS token."""
    try:
        tokenizer = build_tokenizer(hf_assets_path)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if tokenizer.eos_id is None:
        raise ConfigError(
            f"model.hf_assets_path: the tokenizer at {hf_assets_path} has no EOS token, "
            "which packing needs between documents"
        )
    return tokenizer


def load_tokenizer_and_data(job_config: JobConfig, plan: RunPlan):
    """The plan's tokenizer and the training windows (prepared data opened, or a raw stream).
    The built-in corpus is prepared on first use."""
    training, data = job_config.training, job_config.data
    hf_assets_path, tokenizer = job_config.model.hf_assets_path, plan.tokenizer
    try:
        windows = open_windows(
            training.dataset,
            training.dataset_path,
            tokenizer,
            training.seq_len,
            hf_assets_path=hf_assets_path,
            shuffle=data.shuffle,
            seed=data.seed,
            cache_folder=data.cache_folder,
        )
        if job_config.validation.enable:  # only to find a bad path or folder now
            open_held_out(
                job_config.validation,
                tokenizer,
                training.seq_len,
                hf_assets_path=hf_assets_path,
                cache_folder=data.cache_folder,
            )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return tokenizer, windows


def meta_model(job_config: JobConfig, model_args) -> nn.Module:
    """The config's model on the meta device, before a plan exists (else RunPlan.meta_model)."""
    return _on_meta(get_model_spec(job_config.model.name).model_cls, model_args)


def _on_meta(model_cls: type[nn.Module], model_args) -> nn.Module:
    with torch.device("meta"):
        return model_cls(model_args)


def build_model(
    job_config: JobConfig,
    plan: RunPlan,
    mesh,
    device: torch.device | str | None = None,
    buffer_device: torch.device | None = None,
    stage_modules: tuple[str, ...] | None = None,
) -> nn.Module:
    """The run's model in training mode: built on meta, converted (float8, logging which layers),
    parallelised by the registry's function (activation checkpointing, compile, FSDP over
    ``mesh``), then, when ``device`` is given, materialised there shard by shard and initialised
    from debug.seed, its buffers (the RoPE tables) on ``buffer_device`` (default: ``device``).
    Without ``device`` it stays on meta, for a caller that materialises it its own way (e.g. as
    fake tensors). ``stage_modules``: build only the part of one pipeline stage, the modules it
    names."""
    model = plan.meta_model()
    if job_config.model.attn_mask_type == "block_causal":
        model.document_end_id = plan.tokenizer.eos_id  # checked by check_document_mask
    if stage_modules is not None:
        prune_to_stage(model, stage_modules)
    # Converters change the modules parallelisation wraps and splits (float8's TP styles), so they come first.
    for line in convert_to_float8(model, job_config, fsdp=plan.parallel_dims.fsdp_applied):
        logger.info(line)
    model = plan.model_spec.parallelize_fn(model, plan.parallel_dims, mesh, job_config)
    if device is not None:
        model.to_empty(device=device)
        model.init_weights(seed=job_config.debug.seed, buffer_device=buffer_device or torch.device(device))
    model.train()
    return model
