"""titanlite's trainer: builds everything from a JobConfig and runs the training loop.

    python -m titanlite.train --job.config_file train_configs/debug_model.toml
    torchrun --nproc_per_node 8 -m titanlite.train --job.config_file train_configs/llama7b.toml

The trainer composes the rooms (config, models via the registry, parallel, data, optim)
and is imported by nobody.
"""

import dataclasses
import gc
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.checkpoint import CheckpointError, CheckpointManager, ModelState, OptimizerState, RNGState
from titanlite.checkpoint.description import ModelDescription
from titanlite.checkpoint.hf import seed_from_hf
from titanlite.config import ConfigError, JobConfig, parse_args, to_toml
from titanlite.data import DataLoader, build_tokenizer, open_windows, stream_warning, tokenizer_file, verify_share
from titanlite.estimate import device_memory_bytes, step_floor_bytes
from titanlite.metrics import TPS, MemoryMonitor, build_loggers, default_run_name, flops_per_token, resolve_peak_flops
from titanlite.metrics.diagnostics import ComputeDtypeProbe, PhaseMemory, log_startup
from titanlite.metrics.processor import MetricsProcessor
from titanlite.metrics.profiling import profiler_context
from titanlite.metrics.validation import build_validation_documents, build_validator
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.optim.ema import EMA
from titanlite.parallel import (
    DTYPES,
    ParallelDims,
    clip_grad_norm_,
    compute_context,
    destroy_distributed,
    exit_process,
    first_error_on_any_rank,
    init_distributed,
    is_collective_failure,
    pick_device,
    use_collective_timeout,
    world_size_from_env,
)
from titanlite.registry import get_model_args, get_model_spec

logger = logging.getLogger("titanlite")


class NonFiniteError(RuntimeError):
    """A step produced NaN or inf gradients and no more skips were allowed."""


class DataError(RuntimeError):
    """The training data turned out to be unreadable after the run started."""


# Steps between the host's reads of what the device decided (the steps' non-finite flags)
# and of the ranks' stop signals; they are also read at every log step and save point.
# Between reads the CPU queues work ahead of the GPU instead of waiting for it each step.
SYNC_EVERY = 10


@dataclass(frozen=True)
class RunPlan:
    """Everything decided from the config before any process group or tensor exists."""

    parallel_dims: ParallelDims
    model_args: object
    global_batch_size: int
    grad_accum_steps: int


def plan_run(job_config: JobConfig, world_size: int) -> RunPlan:
    """Cross-check the config against the registry, the world size and the tokenizer.
    Every problem is a one-line ConfigError; nothing is created or written."""
    training, parallelism = job_config.training, job_config.parallelism
    model_args = get_model_args(job_config.model.name, job_config.model.flavor).with_seq_len(training.seq_len)
    try:
        parallel_dims = ParallelDims.resolve(
            parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree, world_size
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if training.enable_cpu_offload and parallel_dims.world_size == 1:
        raise ConfigError("training.enable_cpu_offload needs FSDP, i.e. more than one rank")

    try:
        global_batch, accumulation = parallel_dims.batch_plan(training.local_batch_size, training.global_batch_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return RunPlan(parallel_dims, model_args, global_batch, accumulation)


def check_memory_floor(job_config: JobConfig, plan: RunPlan) -> None:
    """Refuse a run whose rank surely cannot fit in this machine's device (the host's memory
    on CPU): told in one line before start-up, instead of by the out-of-memory killer."""
    training, parallel_dims, model_args = job_config.training, plan.parallel_dims, plan.model_args
    with torch.device("meta"):
        model = get_model_spec(job_config.model.name).model_cls(model_args)
    compute_bytes = torch.empty((), dtype=DTYPES[training.mixed_precision_param]).element_size()
    floor = step_floor_bytes(
        model,
        model_args.vocab_size,
        parallel_dims.dp_shard,
        training.local_batch_size,
        training.seq_len,
        compute_bytes,
        training.enable_cpu_offload,
    )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parallel_dims.world_size))
    available, what = device_memory_bytes(device_type, ranks_per_node)
    needed = sum(floor.values())
    if needed <= available:
        return

    def gib(size: int) -> str:
        return f"{size / 2**30:,.1f} GiB" if size < 2**50 else f"{size / 2**30:.2e} GiB"

    parts = ", ".join(f"{name} {gib(size)}" for name, size in floor.items())
    if floor["logits"] >= floor["weights and Adam state"]:
        key = f"training.local_batch_size {training.local_batch_size} (x seq_len {training.seq_len})"
        fix = "lower training.local_batch_size (training.global_batch_size keeps the batch through accumulation)"
    else:
        key = f"model {job_config.model.name} {job_config.model.flavor} on {parallel_dims.dp_shard} shard(s)"
        fix = "shard over more ranks (parallelism.data_parallel_shard_degree) or offload (training.enable_cpu_offload)"
    raise ConfigError(
        f"{key}: one rank needs at least {gib(needed)} ({parts}), more than {what} holds "
        f"({gib(available)}); {fix}. scripts/estimate.py estimates the whole step"
    )


def load_tokenizer_and_data(job_config: JobConfig, vocab_size: int):
    """The tokenizer and the training windows (prepared data opened, or a raw stream), checked
    against the model's vocabulary. The built-in corpus is prepared on first use."""
    training, data = job_config.training, job_config.data
    hf_assets_path = job_config.model.hf_assets_path
    try:
        tokenizer = build_tokenizer(hf_assets_path)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if tokenizer.eos_id is None:
        raise ConfigError(
            f"model.hf_assets_path: the tokenizer at {hf_assets_path} has no EOS token, "
            "which packing needs between documents"
        )
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model {job_config.model.name} "
            f"{job_config.model.flavor} embeds only {vocab_size}; pick a matching model.flavor or model.hf_assets_path"
        )
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
        if job_config.validation.enable:
            build_validation_documents(job_config.validation)  # only to find a bad path now
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return tokenizer, windows


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) next-token loss; the caller divides by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


class _StdoutHandler(logging.StreamHandler):
    """Writes each record to whatever sys.stdout is at that moment, so a handler made
    for one run never writes into a stream that was swapped or closed since (a later
    run in the same process, tests capturing output)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("[titanlite] %(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one; ours is looked up
        pass


def setup_logging(rank: int) -> None:
    """Log on the ranks named in LOG_RANK (comma-separated, default 0), warnings elsewhere;
    lines every rank must print about itself (e.g. its shard size) on all ranks."""
    shown = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip()}
    logging.basicConfig(handlers=[_StdoutHandler()], force=True)
    logger.setLevel(logging.INFO if rank in shown else logging.WARNING)
    every_rank = logging.getLogger("titanlite.every_rank")
    every_rank.setLevel(logging.INFO)
    every_rank.propagate = False
    if not any(isinstance(h, _StdoutHandler) for h in every_rank.handlers):
        every_rank.addHandler(_StdoutHandler())


@dataclass
class StepRecord:
    """What one logged step measured (the same numbers the console line shows)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_second: float


class Trainer(Stateful):
    """Builds the run from the config and trains. It is also the checkpoint's
    "train_state": the step, the tokens seen and the layout that wrote it."""

    def __init__(self, job_config: JobConfig):
        self.job_config = job_config
        training = job_config.training

        # 1. Decide and validate everything before creating a process group or tensor.
        self.plan = plan_run(job_config, world_size_from_env())
        check_memory_floor(job_config, self.plan)
        model_spec = get_model_spec(job_config.model.name)
        self.tokenizer, windows = load_tokenizer_and_data(job_config, self.plan.model_args.vocab_size)

        # 2. Devices and processes.
        self.device = pick_device()
        self.flight_recorder_dump = init_distributed(self.device, job_config.comm, job_config.job.dump_folder)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        setup_logging(self.rank)
        if self.flight_recorder_dump is not None:
            # NCCL's watchdog may end the process on a timeout before any error reaches
            # Python, so the place is said up front too.
            logger.info(
                "NCCL flight recorder on: a collective timeout writes this rank's record to %s",
                self.flight_recorder_dump,
            )
        torch.manual_seed(job_config.debug.seed)
        if job_config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
        parallel_dims = self.plan.parallel_dims
        mesh = parallel_dims.build_mesh(self.device.type)
        # init_device_mesh makes HSDP's and DDP's sub-groups with PyTorch's default timeout
        # (30 min on gloo, 10 on NCCL): they get the run's, here and after the first step.
        use_collective_timeout(mesh, job_config.comm.init_timeout_seconds)
        self.mesh = mesh

        # 3. Data: every rank reads a disjoint part of each global batch. Data parallelism
        # is the only dimension, so the data-parallel rank is the global rank.
        self.loader = self._build_loader(windows)

        # 4. Model: built on meta, parallelised, then materialised shard by shard.
        with torch.device("meta"):
            model = model_spec.model_cls(self.plan.model_args)
        model = model_spec.parallelize_fn(model, parallel_dims, mesh, job_config)
        model.to_empty(device="cpu" if training.enable_cpu_offload else self.device)
        model.init_weights(seed=job_config.debug.seed, buffer_device=self.device)
        model.train()
        self.model = model
        self.compute_context = compute_context(parallel_dims, training.mixed_precision_param, self.device.type)
        self.loss_fn = cross_entropy_sum
        if job_config.compile.enable and "loss" in job_config.compile.components:
            self.loss_fn = torch.compile(cross_entropy_sum)
        self._log_diagnostics(model, mesh)

        # 5. Optimizer, schedule and the weight average.
        self.optimizer = build_optimizer(model.parameters(), job_config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, job_config.lr_scheduler, training.steps)
        self.ema = EMA(model, job_config.ema.decay) if job_config.ema.enable else None
        self.step = 0
        self.tokens_seen = 0
        self.nonfinite_in_a_row = 0
        # (step, non-finite flag, gradient norm, loss share) of the steps the host has not read yet.
        self._unread_steps: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

        # 6. Checkpoints: everything a resume needs, by name; resume into the sharded model.
        states = {
            "model": ModelState(model, self.model_description()),
            "optimizer": OptimizerState(model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.loader,
            "train_state": self,
            "rng": RNGState(),
        }
        if self.ema is not None:
            states["ema"] = self.ema
        self.checkpointer = CheckpointManager(
            states, job_config.checkpoint, job_config.job.dump_folder, job_config.comm.init_timeout_seconds
        )
        loaded = self.checkpointer.load()
        if not loaded and job_config.checkpoint.initial_load_in_hf:
            self._seed_from_hf(model_spec)
            loaded = ["model"]
        if self.ema is not None and loaded and "ema" not in loaded:
            self.ema.restart()  # average the loaded weights, not the random ones
        self._stop_signal = None
        self._stop_signal_at: float | None = None  # time.monotonic() at the first stop signal
        if job_config.checkpoint.enable:
            self._save_on_signals()

        # 7. Metrics and held-out loss.
        self.metrics = self._build_metrics()
        self.validator = None
        if job_config.validation.enable:
            try:
                self.validator = build_validator(
                    job_config.validation,
                    tokenizer=self.tokenizer,
                    training_seq_len=training.seq_len,
                    training_local_batch_size=training.local_batch_size,
                    loss_fn=self.loss_fn,
                    compute_context=self.compute_context,
                    device=self.device,
                    dp_rank=self.rank,
                    dp_degree=parallel_dims.dp_degree,
                )
            except ValueError as error:
                raise ConfigError(str(error)) from None

        logger.info(
            "%s: model %s %s (%.2f M params), %s over %d rank(s) (replicate %d x shard %d) on %s, "
            "global batch %d = local %d x dp %d x accumulation %d",
            job_config.job.description,
            job_config.model.name,
            job_config.model.flavor,
            sum(p.numel() for p in model.parameters()) / 1e6,
            parallel_dims.strategy,
            parallel_dims.world_size,
            parallel_dims.dp_replicate,
            parallel_dims.dp_shard,
            self.device.type,
            self.plan.global_batch_size,
            training.local_batch_size,
            parallel_dims.dp_degree,
            self.plan.grad_accum_steps,
        )

    def _build_loader(self, windows) -> DataLoader:
        """The loader over ``windows``, once the ranks agree the prepared files are intact."""
        job_config, dims = self.job_config, self.plan.parallel_dims
        data = job_config.data
        if data.verify_checksums:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            error = first_error_on_any_rank(verify_share(windows, self.rank, world_size))
            if error is not None:
                raise ConfigError(error)
        warning = stream_warning(windows, job_config.training.dataset, dims.dp_degree)
        if warning is not None and self.rank == 0:
            logger.warning(warning)
        return DataLoader(
            windows,
            job_config.training.local_batch_size,
            dp_rank=self.rank,
            dp_degree=dims.dp_degree,
            prefetch=data.prefetch,
            pin_memory=self.device.type == "cuda",
            allow_changed_data=data.allow_changed_data,
        )

    def _seed_from_hf(self, model_spec) -> None:
        """Start from a Hugging Face folder's weights; the RoPE tables (not in the folder)
        were set by init_weights."""
        path = self.job_config.checkpoint.initial_load_path
        try:
            fingerprint = seed_from_hf(
                path, self.model, self.plan.model_args, model_spec.state_dict_adapter, self.checkpointer.process_group
            )
        except ValueError as error:
            raise CheckpointError(f"checkpoint.initial_load_path {error}") from error
        logger.info("seeded the weights from the Hugging Face folder %s (fingerprint %s)", path, fingerprint)

    def _log_diagnostics(self, model, mesh) -> None:
        """What was really built: settings, FSDP units, shard sizes; the compute dtype and
        per-phase memory follow during the first steps."""
        job_config, dims = self.job_config, self.plan.parallel_dims
        training, ac = job_config.training, job_config.activation_checkpoint
        settings = {
            "strategy": dims.strategy,
            "mesh": mesh if mesh is None else dict(zip(mesh.mesh_dim_names, mesh.shape)),
            "reshard_after_forward": job_config.parallelism.fsdp_reshard_after_forward,
            "param_dtype": training.mixed_precision_param,
            "reduce_dtype": training.mixed_precision_reduce,
            "cpu_offload": training.enable_cpu_offload,
            "activation_checkpoint": ac.mode + (f"({ac.selective_ac_option})" if ac.mode == "selective" else ""),
            "compile": job_config.compile.components if job_config.compile.enable else "off",
        }
        blocks = list(model.layers.values())
        log_startup(model, settings, len(blocks), sharded=mesh is not None, rank=self.rank)
        self.dtype_probe = ComputeDtypeProbe(model, DTYPES[training.mixed_precision_param])
        self.phase_memory = PhaseMemory(MemoryMonitor(self.device))

    def _build_metrics(self) -> MetricsProcessor:
        job_config = self.job_config
        run_name = [default_run_name()]
        if dist.is_initialized():  # one folder name for all ranks: rank 0's clock decides
            dist.broadcast_object_list(run_name, src=0)
        loggers = build_loggers(
            job_config.metrics, job_config.job.dump_folder, self.rank, run_name[0], dataclasses.asdict(job_config)
        )
        return MetricsProcessor(
            loggers,
            MemoryMonitor(self.device),
            flops_per_token(self.plan.model_args, job_config.training.seq_len),
            resolve_peak_flops(job_config.metrics.peak_tflops, self.device),
        )

    # --- one optimizer step ------------------------------------------------------------

    def _set_gradient_all_reduce(self, enabled: bool) -> None:
        """With replicas (DDP/HSDP), only the last micro-batch all-reduces across them;
        earlier ones only reduce-scatter within the shard group."""
        if self.plan.parallel_dims.dp_replicate > 1:
            self.model.set_requires_all_reduce(enabled)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the global batch.

        Returns this rank's share of the global mean loss (sum it over ranks for the
        loss itself) and the global gradient norm, both as tensors, so that nothing
        waits for the device unless the caller asks for the numbers.
        """
        training = self.job_config.training
        # Packed windows have no padding and no ignored labels, so the global batch
        # always holds exactly this many target tokens. Dividing every rank's summed
        # loss by it makes the summed gradients equal one big batch's, whatever the layout.
        global_tokens = self.plan.global_batch_size * training.seq_len
        loss_share = torch.zeros((), device=self.device)
        self.phase_memory.start_step()
        for micro_step in range(self.plan.grad_accum_steps):
            self._set_gradient_all_reduce(micro_step == self.plan.grad_accum_steps - 1)
            with self.metrics.data_loading():
                # From pinned memory on CUDA: the copies queue behind the compute, no wait here.
                inputs, labels = (t.to(self.device, non_blocking=True) for t in self._next_batch())
            with self.compute_context:
                logits = self.model(inputs)
                loss = self.loss_fn(logits, labels) / global_tokens
            del logits  # the [batch, seq, vocab] logits are the largest activation
            self.phase_memory.mark("forward")
            loss.backward()
            self.phase_memory.mark("backward")
            loss_share += loss.detach()

        grad_norm = clip_grad_norm_(self.model.parameters(), training.max_norm)
        # A NaN/inf anywhere reaches the global norm, which every rank holds alike after its
        # all-reduce, so all ranks skip the same steps without another collective.
        nonfinite = ~torch.isfinite(grad_norm)
        # An async save may still be copying the weights; they must not change under it.
        self.checkpointer.wait_for_staging()
        self._update_unless(nonfinite)
        self.phase_memory.mark("optimizer")
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.update(skip=nonfinite)
        self.step += 1
        self.tokens_seen += global_tokens
        self._unread_steps.append((self.step, nonfinite, grad_norm, loss_share))
        return loss_share, grad_norm

    def _update_unless(self, nonfinite: torch.Tensor) -> None:
        """Apply the optimizer's update unless ``nonfinite`` (a flag on the device) is set."""
        if self.optimizer.defaults.get("fused"):
            # The fused kernel reads the flag on the device and then leaves the weights, the
            # moments and the step count alone: the host does not wait for the norm.
            self.optimizer.found_inf = nonfinite.float()
            self.optimizer.step()
        elif not nonfinite.item():  # the other kernels cannot skip by themselves: one wait per step
            self.optimizer.step()

    # --- train_state, signals -----------------------------------------------------------

    def model_description(self) -> ModelDescription:
        model = self.job_config.model
        # tokenizer_path: where the run's tokenizer.json is (None: the byte tokenizer), so
        # that an export can ship the tokenizer beside the weights.
        return ModelDescription(
            model.name, model.flavor, self.plan.model_args, tokenizer_path=tokenizer_file(model.hf_assets_path)
        )

    def state_dict(self) -> dict:
        dims = self.plan.parallel_dims
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            # Not loaded back; kept to tell which layout wrote a checkpoint.
            "world_size": dims.world_size,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.step, self.tokens_seen = state_dict["step"], state_dict["tokens_seen"]
        dims = self.plan.parallel_dims
        saved = (state_dict["world_size"], state_dict["dp_replicate"], state_dict["dp_shard"])
        if saved != (dims.world_size, dims.dp_replicate, dims.dp_shard):
            logger.info(
                "resuming at step %d on %d rank(s) (replicate %d x shard %d) from a checkpoint written by "
                "%d rank(s) (replicate %d x shard %d): model, optimizer and data position are resharded",
                self.step,
                dims.world_size,
                dims.dp_replicate,
                dims.dp_shard,
                *saved,
            )

    def _save_on_signals(self) -> None:
        """A scheduler preempting the job sends SIGTERM (SIGINT from a terminal): finish the
        step, save, and exit cleanly instead of dying mid-step."""

        def remember(signum, frame):
            if self._stop_signal is None:
                self._stop_signal_at = time.monotonic()
            self._stop_signal = signum

        signal.signal(signal.SIGTERM, remember)
        signal.signal(signal.SIGINT, remember)

    def _stop_requested(self) -> bool:
        """Whether any rank got a stop signal; all ranks must agree to save together, so
        with several ranks they compare flags every SYNC_EVERY steps and at save points."""
        if not self.job_config.checkpoint.enable:
            return False
        if not dist.is_initialized():
            return self._stop_signal is not None
        due = self.step % SYNC_EVERY == 0 or self.checkpointer.should_save(self.step, self.job_config.training.steps)
        if not due:
            return False
        flag = torch.tensor([0 if self._stop_signal is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a CPU tensor: no wait on the GPU
        return bool(flag.item())

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Documents are read as training goes, so a bad record far into a file shows up
        # only here; the loader's message names the file and line.
        try:
            return self.loader.next_batch()
        except ValueError as error:
            raise DataError(str(error)) from error

    def _read_unread_steps(self) -> None:
        """Read the flags of the steps since the last read (one wait for the device) and act
        on them in order: warn about each skipped step, or stop at the first one past
        training.skip_nonfinite_steps in a row. Called before every log line and save, so a
        checkpoint never follows a step that should have stopped the run."""
        if not self._unread_steps:
            return
        steps = [step for step, *_ in self._unread_steps]
        flags, norms, shares = (torch.stack(column).tolist() for column in zip(*(u[1:] for u in self._unread_steps)))
        self._unread_steps = []
        limit = self.job_config.training.skip_nonfinite_steps
        for step, nonfinite, norm, share in zip(steps, flags, norms, shares):
            if not nonfinite:
                self.nonfinite_in_a_row = 0
                continue
            what = f"gradient norm {norm}, this rank's loss share {share}"
            if self.nonfinite_in_a_row < limit:
                self.nonfinite_in_a_row += 1
                logger.warning(
                    "step %d skipped, the weights are unchanged: %s (%d in a row, at most %d)",
                    step,
                    what,
                    self.nonfinite_in_a_row,
                    limit,
                )
                continue
            later = "" if step == self.step else f"; found at step {self.step}, and no step after it was saved"
            raise NonFiniteError(
                f"step {step}: {what}; its update was not applied, so every checkpoint holds finite weights"
                f"{later} (training.skip_nonfinite_steps skips such steps instead)"
            )

    def global_loss(self, loss_share: torch.Tensor) -> tuple[float, float]:
        """The loss over the global batch, and the largest of the ranks' own mean losses.
        Every rank holds the same number of tokens, so a rank's mean is its share times
        the number of ranks."""
        if not dist.is_initialized():
            return loss_share.item(), loss_share.item()
        shares = [torch.zeros_like(loss_share) for _ in range(dist.get_world_size())]
        dist.all_gather(shares, loss_share)
        shares = torch.stack(shares)
        return shares.sum().item(), (shares.max() * len(shares)).item()

    # --- the loop ----------------------------------------------------------------------

    def train(self) -> list[StepRecord]:
        training, log_freq = self.job_config.training, self.job_config.metrics.log_freq
        records: list[StepRecord] = []
        # Python's collector pauses at random moments, differently on every rank, which
        # stalls collectives; collect at fixed steps instead.
        gc.disable()
        first_step = self.step
        try:
            with profiler_context(
                self.job_config.profiling, self.job_config.job.dump_folder, self.rank, start_step=self.step
            ) as profiler:
                while self.step < training.steps:
                    record = self._one_step(log_freq)
                    profiler.step()
                    if self.step == first_step + 1:
                        self._use_train_timeout()
                    if record is not None:
                        records.append(record)
                    self._validate_if_due()
                    if self._save_or_stop():
                        break
        finally:
            gc.enable()
            self.loader.close()
            self.checkpointer.close()
            self.metrics.close()
        logger.info("training done: %d steps, %d tokens", self.step, self.tokens_seen)
        return records

    def _use_train_timeout(self) -> None:
        """Start-up (compiles, first all-gathers, loading) may be slow; after the first
        step a collective that waits longer than train_timeout_seconds means a dead or
        stuck rank, and failing beats hanging until the job's wall-clock limit."""
        use_collective_timeout(self.mesh, self.job_config.comm.train_timeout_seconds)  # checkpoint saves keep theirs

    def _one_step(self, log_freq: int) -> StepRecord | None:
        """Train one step; log it when it is due and return what was logged."""
        training = self.job_config.training
        lr = self.lr_scheduler.get_last_lr()[0]
        loss_share, grad_norm = self.train_step()
        self.metrics.step_done(training.local_batch_size * training.seq_len * self.plan.grad_accum_steps)
        if self.step % training.gc_freq == 0:
            gc.collect(1)
        if self.dtype_probe is not None:
            self.dtype_probe.report()
            self.dtype_probe = None
        self.phase_memory.end_step(self.step)
        log_due = self.step == 1 or self.step % log_freq == 0 or self.step == training.steps
        if log_due or self.step % SYNC_EVERY == 0:
            self._read_unread_steps()
        if not log_due:
            return None
        # Reading the numbers waits for the device, so the window's time ends after it.
        loss, max_loss = self.global_loss(loss_share)
        norm = grad_norm.item()
        metrics = self.metrics.log_step(self.step, loss, max_loss, norm, lr, self.tokens_seen)
        return StepRecord(self.step, loss, norm, lr, metrics[TPS])

    def _validate_if_due(self) -> None:
        if self.validator is None:
            return
        freq, last = self.job_config.validation.freq, self.job_config.training.steps
        if self.step % freq == 0 or self.step == last:
            start = time.perf_counter()
            result = self.validator.validate(self.model)
            self.metrics.leave_out(time.perf_counter() - start)
            self.metrics.log_validation(self.step, result["loss"])

    def _save_or_stop(self) -> bool:
        """Save when due; on a stop signal save in the quickest way and say stop."""
        training = self.job_config.training
        last = self.step == training.steps
        saved = self.checkpointer.should_save(self.step, training.steps)
        stop = not last and self._stop_requested()
        if saved or stop:
            self._read_unread_steps()  # a step that should have stopped the run is never saved
        if saved and not stop:  # a stop saves its own way: no interval save to wait for
            model_only = last and self.job_config.checkpoint.last_save_model_only
            self.checkpointer.save(self.step, model_only=model_only, sync=last)
            if last:
                self._fail_if_not_saved("the run's last save")
        if stop:
            self.checkpointer.save_at_stop(self.step)  # waits for a save still in flight, or saves this step
            self._fail_if_not_saved("the save on a stop signal")
            self._report_stop_time()
            return True
        return False

    def _report_stop_time(self) -> None:
        """Say how much of the launchers' grace after a stop signal the stop used, the figure
        to size checkpoint.stop_save_seconds by."""
        if self._stop_signal_at is None:  # the signal reached other ranks only
            return
        took, grace = time.monotonic() - self._stop_signal_at, self.job_config.checkpoint.stop_save_seconds
        # A shared filesystem's write speed varies from save to save: ask for room to spare.
        tight = took > grace / 2
        (logger.warning if tight else logger.info)(
            "stop signal: saved %.1f s after it, of the %d s the launchers give (checkpoint.stop_save_seconds)%s",
            took,
            grace,
            "; raise it to leave room" if tight else "",
        )

    def _fail_if_not_saved(self, which: str) -> None:
        """continue_on_save_error lets training go on past a failed save, trusting a later
        one; the run's final save has none after it, so its failure fails the run. An exit
        status of 0 would tell a scheduler or a job chain that the final state is on disk."""
        if self.checkpointer.failed_save is not None:
            raise CheckpointError(
                f"{self.checkpointer.failed_save} ({which}: nothing later can make up for it, "
                "so the run fails even with checkpoint.continue_on_save_error)"
            )


def main(argv: list[str] | None = None) -> int:
    """Train; every expected failure is one stderr line and an exit status (2: the config
    or checkpoint to start from, 1: something during training). A bare --debug adds the
    traceback after the line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--debug" in argv  # a flag of the launcher, not a config key
    argv = [arg for arg in argv if arg != "--debug"]

    def fail(line: str, status: int, printed: bool = True) -> int:
        if printed:
            print(line, file=sys.stderr)
            if show_traceback:
                traceback.print_exc()
        return status

    rank0 = int(os.environ.get("RANK", "0")) == 0  # every rank finds the same config mistake
    try:
        job_config = parse_args(argv)
    except ConfigError as error:
        return fail(f"titanlite: config error: {error}", 2, rank0)
    try:
        if job_config.job.validate_only:
            plan = plan_run(job_config, world_size_from_env())
            check_memory_floor(job_config, plan)
            load_tokenizer_and_data(job_config, plan.model_args.vocab_size)
            print(
                f"titanlite: config ok: {plan.parallel_dims.strategy} over {plan.parallel_dims.world_size} "
                f"rank(s), global batch {plan.global_batch_size}, {plan.grad_accum_steps} accumulation step(s)"
            )
            return 0
        trainer = Trainer(job_config)
    except (ConfigError, CheckpointError) as error:
        destroy_distributed()
        kind = "config" if isinstance(error, ConfigError) else "checkpoint"
        return fail(f"titanlite: {kind} error: {error}", 2, rank0)
    try:
        logger.info("resolved config:\n%s", to_toml(job_config))
        trainer.train()
    except CheckpointError as error:
        return fail(f"titanlite: checkpoint error at step {trainer.step}: {error}", 1)
    except DataError as error:
        return fail(f"titanlite: data error in step {trainer.step + 1}: {error}", 1)
    except NonFiniteError as error:
        # Every rank stops at the same step with the same norm: one line is enough.
        return fail(f"titanlite: non-finite values at {error}", 1, trainer.rank == 0)
    except (dist.DistError, RuntimeError) as error:
        if not is_collective_failure(error):
            raise
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        dump = trainer.flight_recorder_dump
        where = "" if dump is None else f"; NCCL flight recorder dump: {dump}"
        return fail(
            f"titanlite: rank {trainer.rank}: a collective failed after step {trainer.step} (did another "
            f"rank die or hang? see its log): {first_line[:300]}{where}",
            1,
        )
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    try:
        exit_status = main()
    except Exception:  # an unexpected error: its traceback, and a failed exit like Python's own
        traceback.print_exc()
        exit_status = 1
    exit_process(exit_status)
