"""titanlite's trainer: builds everything from a JobConfig and runs the training loop.

    python -m titanlite.train --job.config_file train_configs/debug_model.toml
    torchrun --nproc_per_node 8 -m titanlite.train --job.config_file train_configs/llama7b.toml

The trainer composes the packages (config, models via the registry, parallel, data, optim,
checkpoint, metrics) and is imported by nobody.
"""

import gc
import logging
import os
import sys
import time
import traceback
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlite.checkpoint import ModelState, OptimizerState, RNGState
from titanlite.checkpoint.description import ModelDescription
from titanlite.checkpoint.layout import LAYOUT_ENTRIES_ADDED_LATER, layout_record, log_resumed_layout
from titanlite.config import JobConfig, parse_args
from titanlite.downstream.run import build_evaluator
from titanlite.errors import DataError, collective_failure_line, report_failure
from titanlite.failures import START_FAILURES, TRAINING_FAILURES, failure
from titanlite.fault_tolerant_run import replica_group_metrics
from titanlite.loss import TrainingLoss, global_loss, global_loss_on_device
from titanlite.metrics import flops_per_token, tags
from titanlite.metrics.processor import StepRecord
from titanlite.nonfinite import SYNC_EVERY, UnreadSteps, step_unless
from titanlite.parallel import (
    clip_grad_norm_,
    compute_context,
    destroy_distributed,
    exit_process,
    is_collective_failure,
    loss_context,
    set_gradient_all_reduce,
    use_collective_timeout,
)
from titanlite.profiling import profiler_context
from titanlite.spikes import spike_window
from titanlite.stop_signal import StopSignal
from titanlite.trainer_setup import (
    balance_expert_load,
    build_loader,
    build_metrics,
    build_optimizers,
    build_run_model,
    build_run_validator,
    check_run,
    config_ok_line,
    log_built_model,
    log_run_summary,
    save_resolved_config,
    sequence_columns,
    start_from_checkpoint,
    start_processes,
)

logger = logging.getLogger("titanlite")


class Trainer(Stateful):
    """Builds the run from the config and trains. It is also the checkpoint's
    "train_state": the step, the tokens seen, and the layout and global batch that wrote it."""

    # train_state entries that checkpoints written before them lack (see checkpoint.layout).
    entries_added_later = LAYOUT_ENTRIES_ADDED_LATER

    def __init__(self, job_config: JobConfig):
        self.job_config = job_config
        training = job_config.training

        # 1. Decide and validate everything before creating a process group or tensor.
        plan, self.tokenizer, windows, _ = check_run(job_config)
        self.plan = plan

        # 2. Devices and processes.
        self.device, self.rank, mesh, self.flight_recorder_dump = start_processes(job_config, plan)
        parallel_dims, self.mesh = plan.parallel_dims, mesh

        # 3. Data: every data-parallel rank reads a disjoint part of each global batch (the
        # tensor-parallel ranks of one group read the same part).
        self.loader = build_loader(job_config, plan, windows, mesh, self.rank, self.device)

        # 4. Model: built on meta, parallelised, then materialised shard by shard (under
        # pipeline parallelism: this rank's stages, each so, run by the pipeline's schedule).
        self.compute_context = compute_context(parallel_dims, training.mixed_precision_param, self.device.type)
        # Entered anew for each micro-batch's loss and its backward (loss parallel under TP).
        self.loss_context = partial(loss_context, parallel_dims, job_config)
        # Packed windows have no padding and no ignored labels, so the group's batch always
        # holds exactly this many target tokens. Dividing every rank's summed loss by it makes
        # the summed gradients equal one big batch's, whatever the layout. (Without fault
        # tolerance the group is the whole job; with it the groups' gradients are averaged.)
        self.group_tokens = plan.group_batch_size * training.seq_len
        compiled = job_config.compile.enable and "loss" in job_config.compile.components
        self.objective = TrainingLoss(training.z_loss_coef, self.group_tokens, compiled, self.device)
        self.loss_fn = self.objective.cross_entropy_sum  # the held-out loss too
        model, self.pipeline = build_run_model(job_config, plan, mesh, self.device, self.objective)
        self.model = model
        self.dtype_probe, self.phase_memory = log_built_model(job_config, plan, model, mesh, self.rank, self.device)

        # 5. Optimizer, schedule and the weight average.
        self.optimizer, self.lr_scheduler, self.ema = build_optimizers(job_config, plan, model)
        self.step = self.tokens_seen = 0
        self.unread_steps = UnreadSteps(training.skip_nonfinite_steps, training.spike_max_in_a_row)
        self.spikes = spike_window(training, self.device)  # None unless training.skip_spike_steps

        # 6. Checkpoints: everything a resume needs, by name; resume into the sharded model
        # (or join the replica groups, or start from Hugging Face weights).
        description = ModelDescription.of_run(job_config.model, plan.model_args, plan.tokenizer_vocab_size)
        states = {
            "model": ModelState(model, description),
            "optimizer": OptimizerState(model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.loader,
            "train_state": self,
            "rng": RNGState(),
        }
        for name, state in (("ema", self.ema), ("spike_window", self.spikes)):
            if state is not None:
                states[name] = state
        self.checkpointer, self.replicas = start_from_checkpoint(job_config, plan, model, states)
        self.stop_signal = StopSignal()
        if job_config.checkpoint.enable:
            self.stop_signal.install()

        # 7. Metrics and held-out loss.
        self.metrics = build_metrics(job_config, plan, self.rank, self.device)
        self.balancer = balance_expert_load(plan, model, self.optimizer, self.metrics, mesh, self.group_tokens)
        if self.replicas is not None:
            self.metrics.add_source(partial(replica_group_metrics, self.replicas))
        if self.spikes is not None:
            self.metrics.add_source(self.spikes.metrics)
        if training.z_loss_coef > 0:
            self.metrics.add_source(lambda: {tags.Z_LOSS: self.global_loss(self.z_share)[0]})
        self.validator = build_run_validator(
            job_config, plan, self.tokenizer, self.loss_fn, self.loss_context, self.compute_context, mesh, self.device
        )
        self.evaluator = build_evaluator(
            job_config.eval,
            parallel_dims,
            self.tokenizer,
            seq_len=training.seq_len,
            training_batch=training.local_batch_size,
            dp_rank=parallel_dims.dp_rank(mesh),
            device=self.device,
            compute_context=self.compute_context,
            flops_per_token=partial(flops_per_token, plan.model_args),
            columns=sequence_columns(job_config.parallelism, parallel_dims, mesh),
            cp_group=None if parallel_dims.cp == 1 else parallel_dims.cp_mesh(mesh).get_group(),
        )
        log_run_summary(job_config, plan, model, self.device)

    # --- one optimizer step ------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One optimizer step over the global batch.

        Returns this rank's share of the global mean loss (sum it over ranks for the
        loss itself) and the global gradient norm, both as tensors, so that nothing
        waits for the device unless the caller asks for the numbers. Under fault tolerance,
        None when the replica groups did not commit the step (it is then tried again).
        """
        training, dims = self.job_config.training, self.plan.parallel_dims
        if self.replicas is not None:
            self.replicas.start_step(self.step)  # after a heal, every state (data position too) is a peer's
        data_mark = self.loader.state_dict() if self.replicas is not None else None
        loss_share = torch.zeros((), device=self.device)
        self.phase_memory.start_step()
        for micro_step in range(self.plan.grad_accum_steps):
            runs_backward = self.pipeline if self.pipeline is not None else self.model
            set_gradient_all_reduce(runs_backward, dims, micro_step == self.plan.grad_accum_steps - 1)
            with self.metrics.data_loading():
                # From pinned memory on CUDA: the copies queue behind the compute, no wait here.
                inputs, labels = (t.to(self.device, non_blocking=True) for t in self._next_batch())
            loss_share += self._forward_backward(inputs, labels)
            self.phase_memory.mark("backward")
        self.z_share = self.objective.take_z_share()
        loss_share -= self.z_share  # the cross-entropy's share, logged as the loss (the z-loss on its own)

        counts = [] if self.balancer is None else self.balancer.routed_counts()
        if self.replicas is not None and not self.replicas.average_and_commit(
            self.model.parameters(), loss_share, counts
        ):
            self.optimizer.zero_grad(set_to_none=True)
            if self.balancer is not None:
                self.balancer.discard_step()
            self.loader.load_state_dict(data_mark)  # the retry reads the same windows
            return None
        grad_norm = clip_grad_norm_(self.model.parameters(), training.max_norm, stages=dims.pp)
        # A NaN/inf anywhere reaches the global norm, which every rank holds alike after its
        # all-reduce, so all ranks skip the same steps without another collective.
        skip = nonfinite = ~torch.isfinite(grad_norm)
        # An async save may still be copying the weights (and the spike window); they must not change under it.
        self.checkpointer.wait_for_staging()
        if self.spikes is not None:  # the global loss is every rank's: they skip alike
            skip = self.spikes.judge(global_loss_on_device(loss_share, dims.tp), grad_norm, nonfinite)
        step_unless(self.optimizer, skip)
        self.phase_memory.mark("optimizer")
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.update(skip=skip)
        self.step += 1
        self.tokens_seen += self.group_tokens * (1 if self.replicas is None else self.replicas.participants)
        self.unread_steps.add(self.step, nonfinite, grad_norm, loss_share, getattr(self.spikes, "last", None))
        return loss_share, grad_norm

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-step's forward and backward; returns its share of the loss, detached.
        Under pipeline parallelism the schedule runs the micro-step's pipeline micro-batches."""
        if self.pipeline is not None:
            with self.loss_context(), self.compute_context:
                return self.pipeline.forward_backward(inputs, labels)
        with self.loss_context():
            with self.compute_context:
                logits = self.model(inputs)
                loss = self.objective(logits, labels)
            del logits  # the [batch, seq, vocab] logits are the largest activation
            self.phase_memory.mark("forward")
            loss.backward()
        # Under loss parallel the loss is a DTensor every TP rank holds whole.
        return loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()

    # --- train_state, signals -----------------------------------------------------------

    def state_dict(self) -> dict:
        # The layout is not loaded back: a resume compares it with its own (log_resumed_layout).
        return {"step": self.step, "tokens_seen": self.tokens_seen, **layout_record(self.plan)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step, self.tokens_seen = state_dict["step"], state_dict["tokens_seen"]
        log_resumed_layout(self.step, self.plan, state_dict, self.rank)

    def stop_requested(self) -> bool:
        """Whether any rank got a stop signal; all ranks must agree to save together, so
        with several ranks they compare flags every SYNC_EVERY steps and at save points."""
        due = self.step % SYNC_EVERY == 0 or self.checkpointer.should_save(self.step, self.job_config.training.steps)
        return self.job_config.checkpoint.enable and self.stop_signal.agreed(due)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Documents are read as training goes, so a bad record far into a file shows up
        # only here; the loader's message names the file and line.
        try:
            return self.loader.next_batch()
        except ValueError as error:
            raise DataError(str(error)) from error

    def read_unread_steps(self) -> None:
        """Act on the non-finite flags of the steps since the last read (see UnreadSteps.read)."""
        self.unread_steps.read(self.step)

    def global_loss(self, loss_share: torch.Tensor) -> tuple[float, float]:
        """The loss over the global batch, and the largest of the ranks' own mean losses."""
        dims = self.plan.parallel_dims
        return global_loss(loss_share, ranks_per_dp_rank=dims.tp, stages=dims.pp)

    # --- the loop ----------------------------------------------------------------------

    def train(self) -> list[StepRecord]:
        training, log_freq = self.job_config.training, self.job_config.metrics.log_freq
        records: list[StepRecord] = []
        # Python's collector pauses at random moments, differently on every rank, which
        # stalls collectives; collect at fixed steps instead.
        gc.disable()
        self.first_step = self.step  # where this run (or this part of it, when resumed) starts
        try:
            with profiler_context(
                self.job_config.profiling, self.job_config.job.dump_folder, self.rank, start_step=self.step
            ) as profiler:
                while self.step < training.steps:
                    step_before = self.step
                    record = self._one_step(log_freq)
                    profiler.step()
                    if self.step == step_before:  # not committed by the replica groups: again
                        continue
                    if self.step == self.first_step + 1:
                        # Start-up (compiles, first all-gathers, loading) may be slow; after the first
                        # step a collective that waits longer than train_timeout_seconds means a dead or
                        # stuck rank, and failing beats hanging until the job's wall-clock limit.
                        use_collective_timeout(self.mesh, self.job_config.comm.train_timeout_seconds)
                    if record is not None:
                        records.append(record)
                    self._validate_if_due()
                    self._evaluate_if_due()
                    if self._save_or_stop():
                        break
        finally:
            gc.enable()
            self.loader.close()
            self.checkpointer.close()
            self.metrics.close()
            if self.replicas is not None:
                self.replicas.close()
        logger.info("training done: %d steps, %d tokens", self.step, self.tokens_seen)
        return records

    def _one_step(self, log_freq: int) -> StepRecord | None:
        """Train one step; log it when it is due and return what was logged."""
        training = self.job_config.training
        lr = self.lr_scheduler.get_last_lr()[0]
        result = self.train_step()
        if result is None:  # not committed by the replica groups: the loop tries the step again
            return None
        loss_share, grad_norm = result
        # Per device: the tp ranks of a group, the pp stages of a pipeline and the cp ranks
        # splitting its sequences share their data-parallel rank's tokens (and FLOPs).
        dims = self.plan.parallel_dims
        device_tokens = training.local_batch_size * training.seq_len * self.plan.grad_accum_steps
        self.metrics.step_done(device_tokens / (dims.tp * dims.pp * dims.cp))
        if self.step % training.gc_freq == 0:
            gc.collect(1)
        self.dtype_probe.report()  # after the first step only
        self.phase_memory.end_step(self.step)
        # The first step of every run segment is logged, a resumed one's too.
        log_due = self.step == self.first_step + 1 or self.step % log_freq == 0 or self.step == training.steps
        if log_due or self.step % SYNC_EVERY == 0:
            self.read_unread_steps()
        if not log_due:
            return None
        # Reading the numbers waits for the device, so the window's time ends after it.
        loss, max_loss = self.global_loss(loss_share)
        norm = grad_norm.item()
        metrics = self.metrics.log_step(self.step, loss, max_loss, norm, lr, self.tokens_seen)
        return StepRecord(self.step, loss, norm, lr, metrics[tags.TPS])

    def _validate_if_due(self) -> None:
        if self.validator is None:
            return
        freq, last = self.job_config.validation.freq, self.job_config.training.steps
        if self.step % freq == 0 or self.step == last:
            start = time.perf_counter()
            result = self.validator.validate(self.model)
            self.metrics.leave_out(time.perf_counter() - start)
            self.metrics.log_validation(self.step, result["loss"])

    def _evaluate_if_due(self) -> None:
        if self.evaluator is None:
            return
        freq, last = self.job_config.eval.freq, self.job_config.training.steps
        if self.step % freq == 0 or self.step == last:
            metrics = self.evaluator.evaluate(self.model)
            self.metrics.leave_out(metrics[tags.EVAL_SECONDS])
            self.metrics.log_eval(self.step, metrics)

    def _save_or_stop(self) -> bool:
        """Save when due; on a stop signal save in the quickest way and say stop."""
        training = self.job_config.training
        last = self.step == training.steps
        saved = self.checkpointer.should_save(self.step, training.steps)
        if saved and self.replicas is not None:
            saved = self.replicas.first_participant()  # one group writes each checkpoint
        stop = not last and self.stop_requested()
        if saved or stop:
            self.read_unread_steps()  # a step that should have stopped the run is never saved
        if saved and not stop:  # a stop saves its own way: no interval save to wait for
            model_only = last and self.job_config.checkpoint.last_save_model_only
            self.checkpointer.save(self.step, model_only=model_only, sync=last)
            if last:
                self.checkpointer.fail_if_not_saved("the run's last save")
        if stop and (self.replicas is None or self.replicas.first_participant()):  # one group saves
            self.checkpointer.save_at_stop(self.step)  # waits for a save still in flight, or saves this step
            self.checkpointer.fail_if_not_saved("the save on a stop signal")
            self.stop_signal.report_time(self.job_config.checkpoint.stop_save_seconds)
            return True
        return False


def main(argv: list[str] | None = None) -> int:
    """Train; every expected failure is one stderr line and an exit status (titanlite.failures' tables).
    A bare --debug adds the traceback after the line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fail = partial(report_failure, show_traceback="--debug" in argv)  # a flag of the launcher, not a config key
    argv = [arg for arg in argv if arg != "--debug"]
    try:
        job_config = parse_args(argv)
        if job_config.job.validate_only:
            plan, *_, memory = check_run(job_config)
            print(config_ok_line(plan, memory))
            return 0
        trainer = Trainer(job_config)
    except tuple(START_FAILURES) as error:
        destroy_distributed()
        return fail(*failure(START_FAILURES, error, int(os.environ.get("RANK", "0"))))
    try:
        save_resolved_config(job_config, trainer.rank)
        trainer.train()
    except tuple(TRAINING_FAILURES) as error:
        return fail(*failure(TRAINING_FAILURES, error, trainer.rank, step=trainer.step, next_step=trainer.step + 1))
    except (dist.DistError, RuntimeError) as error:
        if not is_collective_failure(error):
            raise
        return fail(collective_failure_line(error, trainer.rank, trainer.step, trainer.flight_recorder_dump), 1)
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
