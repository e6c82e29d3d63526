"""The parts of a run the Trainer builds from the config beside the model and optimizer:
this rank's processes, the data loader, the metrics, the held-out validator, a seed from
Hugging Face weights, and what start-up logs about them. Each is a plain function of what
it needs, so the Trainer's constructor reads as a list; ``check_run`` is the start-up's
checks, which job.validate_only runs alone."""

import dataclasses
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.checkpoint import CheckpointError, CheckpointManager, ModelDescription
from titanlite.checkpoint.hf import seed_from_hf
from titanlite.checkpoint.layout import layout_text
from titanlite.checkpoint.steps import refuse_start_from_other_model
from titanlite.config import Checkpoint, ConfigError, Data, JobConfig, Parallelism, show_config_warnings, to_toml
from titanlite.data import DataLoader, stream_warning, verify_share
from titanlite.downstream.run import eval_tasks
from titanlite.dtypes import DTYPES
from titanlite.estimate import check_memory_floor
from titanlite.fault_tolerant_run import check_fault_tolerance_run, groups_text, join_replica_groups
from titanlite.files import write_text_atomically
from titanlite.logs import setup_logging
from titanlite.metrics import MemoryMonitor, build_loggers, default_run_name, flops_per_token, resolve_peak_flops
from titanlite.metrics.diagnostics import ComputeDtypeProbe, PhaseMemory, log_stages, log_startup
from titanlite.metrics.flops import param_counts
from titanlite.metrics.moe import CollapseWatch, moe_load_metrics
from titanlite.metrics.processor import MetricsProcessor
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.optim.ema import EMA
from titanlite.parallel import (
    first_error_on_any_rank,
    init_distributed,
    pick_device,
    use_collective_timeout,
    world_size_from_env,
)
from titanlite.parallel.context_parallel import kv_gather_line, sequence_split
from titanlite.parallel.expert_parallel import expert_parallel_summary
from titanlite.parallel.fault_tolerance import ReplicaGroups
from titanlite.parallel.load_balance import ExpertLoadBalancer
from titanlite.parallel.pipeline import LocalModel, Pipeline, microbatch_warning
from titanlite.plan import RunPlan, build_model, load_tokenizer_and_data, plan_run, unused_layout_keys
from titanlite.quantize import check_float8_run, scale_precompute_hook
from titanlite.storage import is_url, probe
from titanlite.validation import Validator, build_validator

logger = logging.getLogger("titanlite")


def check_run(job_config: JobConfig) -> tuple[RunPlan, object, object, str]:
    """(plan, tokenizer, training windows, the memory floor's verdict): every check made before
    a process group or tensor exists (layout, float8's needs, memory floor, the model of the
    checkpoint to start from, tokenizer, data).
    A problem is a ConfigError (a CheckpointError for that checkpoint); a key this layout
    ignores, a warning line. The trainer starts with it; job.validate_only runs it alone."""
    plan = plan_run(job_config, world_size_from_env())
    check_fault_tolerance_run(job_config)  # torchft and its lighthouse, with fault tolerance
    check_float8_run(job_config)  # torchao and a float8 GPU (or emulation), before anything is built
    warnings = unused_layout_keys(job_config, plan.parallel_dims)
    if plan.pipeline is not None and microbatch_warning(plan.pipeline) is not None:
        warnings.append(microbatch_warning(plan.pipeline))
    show_config_warnings(warnings)
    memory = check_memory_floor(job_config, plan)
    eval_tasks(job_config.eval, plan.parallel_dims)  # the task files, before anything is written
    if "RANK" not in os.environ:
        # The launchers' preflight, or a run of one process. Ranks leave it to the checkpoint
        # manager, where rank 0 alone reads the shared folder and tells the others.
        check_storage_reachable(job_config.checkpoint)
        description = ModelDescription.of_run(job_config.model, plan.model_args, plan.tokenizer_vocab_size)
        refuse_start_from_other_model(job_config.checkpoint, job_config.job.dump_folder, description)
    tokenizer, windows = load_tokenizer_and_data(job_config, plan)
    return plan, tokenizer, windows, memory


def check_storage_reachable(checkpoint: Checkpoint) -> None:
    """ConfigError when a checkpoint URL cannot be listed (no such bucket, credentials refused,
    no answer from the endpoint), before any rank starts work."""
    locations = (
        ("folder", checkpoint.folder if checkpoint.enable else None),
        ("initial_load_path", checkpoint.initial_load_path),
    )
    for key, value in locations:
        problem = probe(value) if is_url(value) else None
        if problem is not None:
            raise ConfigError(f"checkpoint.{key}: {problem}")


def config_ok_line(plan: RunPlan, memory: str) -> str:
    """What job.validate_only prints when every check passed; ``memory``: check_memory_floor's verdict."""
    pipeline = plan.pipeline
    stages = (
        ""
        if pipeline is None
        else f", {pipeline.num_stages} pipeline stages ({pipeline.schedule}, {pipeline.microbatches} micro-batch(es))"
    )
    dims = plan.parallel_dims
    experts = (
        "" if dims.ep == 1 else f", experts split over ep {dims.ep} and FSDP-sharded over {dims.expert_fsdp} rank(s)"
    )
    return (
        f"titanlite: config ok: {dims.strategy} over {dims.world_size} rank(s){stages}{experts}, "
        f"global batch {plan.global_batch_size}{groups_text(plan)}, {plan.grad_accum_steps} accumulation step(s), "
        f"{memory}"
    )


def start_processes(job_config: JobConfig, plan: RunPlan) -> tuple[torch.device, int, object, str | None]:
    """(device, rank, mesh, flight recorder dump path): this rank's device and process group,
    its logging and seeds, and the device mesh with the run's start-up timeout."""
    device = pick_device()
    flight_recorder_dump = init_distributed(device, job_config.comm, job_config.job.dump_folder)
    rank = dist.get_rank() if dist.is_initialized() else 0
    setup_logging(rank)
    if flight_recorder_dump is not None:
        # NCCL's watchdog may end the process on a timeout before any error reaches
        # Python, so the place is said up front too.
        logger.info(
            "NCCL flight recorder on: a collective timeout writes this rank's record to %s", flight_recorder_dump
        )
    torch.manual_seed(job_config.debug.seed)
    if job_config.debug.deterministic:
        torch.use_deterministic_algorithms(True)
    mesh = plan.parallel_dims.build_mesh(device.type)
    crossing = plan.parallel_dims.tensor_parallel_crosses_nodes(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if crossing is not None:
        logger.warning(crossing)
    # init_device_mesh makes HSDP's and DDP's sub-groups with PyTorch's default timeout
    # (30 min on gloo, 10 on NCCL): they get the run's, here and after the first step.
    use_collective_timeout(mesh, job_config.comm.init_timeout_seconds)
    return device, rank, mesh, flight_recorder_dump


def check_prepared_files(data: Data, windows) -> None:
    """With data.verify_checksums, the ranks agree that the prepared files of ``windows`` are
    intact; the work is split over all ranks, each checking its own share of the files."""
    if not data.verify_checksums:
        return
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    error = first_error_on_any_rank(verify_share(windows, rank, world_size))
    if error is not None:
        raise ConfigError(error)


def sequence_columns(parallelism: Parallelism, dims, mesh):
    """What this rank keeps of every batch row: under context parallelism its chunks of each
    sequence (the cp ranks of a data-parallel rank read the same rows), else None (all)."""
    split = sequence_split(dims, mesh, parallelism.context_parallel_load_balancer)
    return None if split is None else split.columns


def build_loader(job_config: JobConfig, plan: RunPlan, windows, mesh, rank: int, device: torch.device) -> DataLoader:
    """The loader over ``windows``, once the ranks agree the prepared files are intact. It
    reads the part of each batch of this rank's data-parallel index, its place in the mesh."""
    data, dims = job_config.data, plan.parallel_dims
    check_prepared_files(data, windows)
    # Replica group g of G reads the data-parallel ranks [g*dp, (g+1)*dp) of a G*dp layout.
    group = job_config.fault_tolerance.replica_id if plan.replica_groups > 1 else 0
    dp_degree = dims.dp_degree * plan.replica_groups
    warning = stream_warning(windows, job_config.training.dataset, dp_degree)
    if warning is not None and rank == 0:
        logger.warning(warning)
    return DataLoader(
        windows,
        job_config.training.local_batch_size,
        dp_rank=group * dims.dp_degree + dims.dp_rank(mesh),
        dp_degree=dp_degree,
        prefetch=data.prefetch,
        pin_memory=device.type == "cuda",
        allow_changed_data=data.allow_changed_data,
        columns=sequence_columns(job_config.parallelism, dims, mesh),
    )


def log_built_model(
    job_config: JobConfig, plan: RunPlan, model: nn.Module, mesh, rank: int, device: torch.device
) -> tuple[ComputeDtypeProbe, PhaseMemory]:
    """Log what was really built (settings, FSDP units, shard sizes); returns the probes that
    report the compute dtype and the per-phase memory during the first steps."""
    dims, training, ac = plan.parallel_dims, job_config.training, job_config.activation_checkpoint
    settings = {
        "strategy": dims.strategy,
        "mesh": mesh if mesh is None else dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
        "tensor_parallel": dims.tp,
        "reshard_after_forward": job_config.parallelism.fsdp_reshard_after_forward,
        "param_dtype": training.mixed_precision_param,
        "reduce_dtype": training.mixed_precision_reduce,
        "cpu_offload": training.enable_cpu_offload,
        "activation_checkpoint": ac.mode + (f"({ac.selective_ac_option})" if ac.mode == "selective" else ""),
        "compile": job_config.compile.components if job_config.compile.enable else "off",
    }
    if dims.ep > 1:
        settings["expert_parallel"] = dims.ep
    if dims.cp > 1:
        settings["context_parallel"] = f"{dims.cp} ({job_config.parallelism.context_parallel_load_balancer})"
    if dims.tp > 1:
        settings["sequence_parallel"] = job_config.parallelism.enable_sequence_parallel
        settings["loss_parallel"] = not job_config.parallelism.disable_loss_parallel
        settings["async_tensor_parallel"] = job_config.parallelism.enable_async_tensor_parallel
    pipeline = model.pipeline if isinstance(model, LocalModel) else None
    if pipeline is not None:
        settings["pipeline"] = f"{plan.pipeline.schedule}, {plan.pipeline.microbatches} micro-batch(es) per step"
    parts = model.parts if pipeline is not None else [model]
    log_startup(model, settings, len(model.layers), sharded=dims.fsdp_applied, rank=rank, parts=parts)
    experts = expert_parallel_summary(parts, dims.expert_fsdp, dims.dp_replicate)
    if experts is not None:
        logger.info("rank %d: %s", rank, experts)
    if dims.cp > 1 and rank == 0:
        attention = plan.model_spec.model_cls.block_cls.attention_cls
        batch, dtype_bytes = training.local_batch_size, DTYPES[training.mixed_precision_param].itemsize
        logger.info(kv_gather_line(plan.model_args, attention, batch, training.seq_len, dims.tp, dims.cp, dtype_bytes))
    if pipeline is not None:
        log_stages(plan.pipeline, pipeline.stage_indices, parts, rank)
    dtype_probe = ComputeDtypeProbe(parts, DTYPES[training.mixed_precision_param])
    return dtype_probe, PhaseMemory(MemoryMonitor(device), interleaved=pipeline is not None)


def build_run_model(
    job_config: JobConfig, plan: RunPlan, mesh, device: torch.device, loss_fn
) -> tuple[nn.Module, Pipeline | None]:
    """(model, pipeline): the model on this rank, built on meta, parallelised and materialised
    (model parameters on the CPU with CPU offload). With pipeline parallelism each of this
    rank's stages is built the same way, as a model part holding that stage's modules; the
    model returned is then a LocalModel of the parts (the whole model's names, for the
    optimizer, the checkpoint and the weight average) and the pipeline runs them, with
    ``loss_fn(logits, labels)`` as its loss."""
    weights_device = "cpu" if job_config.training.enable_cpu_offload else device
    if plan.pipeline is None:
        return build_model(job_config, plan, mesh, weights_device, device), None

    def build_part(stage_modules: tuple[str, ...]) -> nn.Module:
        return build_model(job_config, plan, mesh, weights_device, device, stage_modules=stage_modules)

    pp_mesh = plan.parallel_dims.pp_mesh(mesh)
    pp_rank, block_causal = pp_mesh.get_local_rank(), job_config.model.attn_mask_type == "block_causal"
    pipeline = Pipeline(plan.pipeline, pp_rank, pp_mesh.get_group(), device, build_part, loss_fn, block_causal)
    return LocalModel(pipeline.parts, pipeline), pipeline


def build_metrics(job_config: JobConfig, plan: RunPlan, rank: int, device: torch.device) -> MetricsProcessor:
    ft = job_config.fault_tolerance
    run_name = [default_run_name() + (f"_group{ft.replica_id}" if ft.enable else "")]  # groups share the dump folder
    if dist.is_initialized():  # one folder name for all ranks: rank 0's clock decides
        dist.broadcast_object_list(run_name, src=0)
    loggers = build_loggers(
        job_config.metrics, job_config.job.dump_folder, rank, run_name[0], dataclasses.asdict(job_config)
    )
    return MetricsProcessor(
        loggers,
        MemoryMonitor(device),
        flops_per_token(plan.model_args, job_config.training.seq_len),
        resolve_peak_flops(job_config.metrics.peak_tflops, device),
    )


def balance_expert_load(
    plan: RunPlan, model: nn.Module, optimizer, metrics: MetricsProcessor, mesh, step_tokens: int
) -> ExpertLoadBalancer | None:
    """For an MoE model: its layers' load balancing after every optimizer step, and their
    expert load (and balancing losses) in the metrics, with a warning when routers stay
    collapsed. ``step_tokens``: the tokens of one optimizer step over all ranks, which each
    forward's balancing losses are weighted against."""
    if not getattr(plan.model_args, "is_moe", False):
        return None
    moe_args = plan.model_args.moe_args()
    balancer = ExpertLoadBalancer(model, plan.model_args.n_layers, plan.parallel_dims, mesh, step_tokens, moe_args)
    optimizer.register_step_post_hook(balancer.after_step)
    watch = CollapseWatch(moe_args.worst_load)

    def moe_metrics() -> dict[str, float]:
        loads, losses = balancer.step_metrics()
        watch.see(loads)
        return moe_load_metrics(loads, losses, moe_args.worst_load)

    metrics.add_source(moe_metrics)
    return balancer


def build_run_validator(
    job_config: JobConfig, plan: RunPlan, tokenizer, loss_fn, loss_context, compute_context, mesh, device: torch.device
) -> Validator | None:
    """The held-out loss's validator, or None when validation is off; a bad setting is a ConfigError.
    ``loss_context()`` is what the training loss runs under (loss parallel under TP)."""
    if not job_config.validation.enable:
        return None
    training, dims = job_config.training, plan.parallel_dims

    def summed_loss(logits, labels):
        with loss_context():
            loss = loss_fn(logits, labels)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def pipeline_loss(model: LocalModel, inputs, labels):
        # Every stage takes part; the ranks of the last one hold the loss.
        with loss_context():
            loss = model.pipeline.forward_loss(inputs, labels, loss_fn)
        return loss if model.pipeline.has_last else None

    try:
        validator = build_validator(
            job_config.validation,
            tokenizer=tokenizer,
            training_seq_len=training.seq_len,
            training_local_batch_size=training.local_batch_size,
            hf_assets_path=job_config.model.hf_assets_path,
            cache_folder=job_config.data.cache_folder,
            loss_fn=summed_loss,
            compute_context=compute_context,
            device=device,
            dp_rank=dims.dp_rank(mesh),
            dp_degree=dims.dp_degree,
            ranks_per_dp_rank=dims.tp,
            columns=sequence_columns(job_config.parallelism, dims, mesh),
            forward_loss=pipeline_loss if plan.pipeline is not None else None,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_prepared_files(job_config.data, validator.held_out)
    warning = stream_warning(validator.held_out, job_config.validation.dataset, dims.dp_degree, section="validation")
    if warning is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(warning)
    return validator


def params_text(plan: RunPlan, model: nn.Module) -> str:
    """The model's parameter count for the run summary; under pipeline parallelism also the
    part of it this rank's stages hold."""
    here = sum(param.numel() for param in model.parameters()) / 1e6
    if not isinstance(model, LocalModel):
        return f"{here:.2f} M params"
    # The whole model's count from its shapes alone (built on meta, as the FLOPs count is).
    total = param_counts(plan.model_args).total / 1e6
    return f"{total:.2f} M params, {here:.2f} M of them in this rank's stages {list(model.pipeline.stage_indices)}"


def log_run_summary(job_config: JobConfig, plan: RunPlan, model: nn.Module, device: torch.device) -> None:
    """The one start-up line that says what runs where: the model built, layout and batch. The
    job's description comes last, as written: a config file's description may name another
    model than the command line's overrides built."""
    dims, training = plan.parallel_dims, job_config.training
    logger.info(
        "model %s %s (%s), %s over %s on %s, global batch %d%s = local %d x dp %d x accumulation %d; "
        "job.description: %s",
        job_config.model.name,
        job_config.model.flavor,
        params_text(plan, model),
        dims.strategy,
        layout_text(dims.world_size, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.pp > 1, dims.cp),
        device.type,
        plan.global_batch_size,
        groups_text(plan),
        training.local_batch_size,
        dims.dp_degree,
        plan.grad_accum_steps,
        job_config.job.description,
    )


RESOLVED_CONFIG_FILE = "resolved_config.toml"


def save_resolved_config(job_config: JobConfig, rank: int) -> None:
    """Rank 0 writes the resolved config as TOML into the dump folder and logs where; the
    whole text goes to the console only with job.print_config (it is over a hundred lines)."""
    text = to_toml(job_config)
    if rank == 0:
        path = Path(job_config.job.dump_folder) / RESOLVED_CONFIG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, text)
        logger.info("resolved config saved to %s (--job.print_config prints it here)", path)
    if job_config.job.print_config:
        logger.info("resolved config:\n%s", text)


def build_optimizers(job_config: JobConfig, plan: RunPlan, model: nn.Module) -> tuple[object, object, EMA | None]:
    """(optimizer, learning-rate schedule, weight average or None) of ``model``; under FSDP
    with float8 all-gathers the optimizer's step also precomputes the weights' scales."""
    optimizer = build_optimizer(model.parameters(), job_config.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, job_config.lr_scheduler, job_config.training.steps)
    precompute = scale_precompute_hook(job_config, plan.parallel_dims.fsdp_applied, model)
    if precompute is not None:  # float8 all-gathers' weight scales, once the weights changed
        optimizer.register_step_post_hook(precompute)
    return optimizer, lr_scheduler, EMA(model, job_config.ema.decay) if job_config.ema.enable else None


def start_from_checkpoint(
    job_config: JobConfig, plan: RunPlan, model: nn.Module, states: dict
) -> tuple[CheckpointManager, ReplicaGroups | None]:
    """(checkpointer, replica groups or None) of ``states``, the run's states by name, loaded
    from where the run starts: a group joining a running job heals from a live one in its first
    quorum and reads no checkpoint; a fresh or fully restarted job loads the checkpoint as
    without fault tolerance, or, finding none, with checkpoint.initial_load_in_hf seeds the
    model from Hugging Face weights. The weight average restarts from weights loaded without it."""
    replicas = join_replica_groups(job_config, plan, states)
    timeout, train_state, ema = job_config.comm.init_timeout_seconds, states["train_state"], states.get("ema")
    checkpointer = CheckpointManager(
        states, job_config.checkpoint, job_config.job.dump_folder, timeout, shared_by_groups=replicas is not None
    )
    healed = replicas is not None and replicas.wait_for_all_groups(train_state.step, timeout)
    loaded = [] if healed else checkpointer.load()
    if replicas is not None:
        replicas.resume_at(train_state.step)
    if not loaded and not healed and job_config.checkpoint.initial_load_in_hf:
        seed_weights_from_hf(job_config.checkpoint.initial_load_path, plan, model, checkpointer.process_group)
        loaded = ["model"]
    if ema is not None and loaded and "ema" not in loaded:
        ema.restart()  # average the loaded weights, not the random ones
    return checkpointer, replicas


def seed_weights_from_hf(path: str, plan: RunPlan, model: nn.Module, process_group) -> None:
    """Start from the Hugging Face folder at ``path`` (checkpoint.initial_load_path); the RoPE
    tables (not in the folder) were set by init_weights."""
    try:
        fingerprint = seed_from_hf(path, model, plan.model_args, plan.model_spec.state_dict_adapter, process_group)
    except ValueError as error:
        raise CheckpointError(f"checkpoint.initial_load_path {error}") from error
    logger.info("seeded the weights from the Hugging Face folder %s (fingerprint %s)", path, fingerprint)
