"""Replica groups that outlive each other's failures, through torchft.

Each replica group is one torchrun job with its own inner layout (FSDP, TP, PP, EP, CP); the
groups together play the part of the dp_replicate dimension. Every step:

1. ``start_step``: torchft's lighthouse forms a quorum of the groups alive. A group behind the
   others (a restarted one) receives the states of a live peer here, rank by rank, from memory.
2. The group trains its share of the global batch as any run does.
3. ``average``: each rank averages its local gradient shards with the ranks at its place in
   the other groups of the quorum. Every group reads the same number of tokens per step, so
   the plain mean is the token-weighted one.
4. ``commit``: the step is applied only if every participant got this far without an error;
   otherwise it is thrown away and retried with the groups still alive, for at most
   ``retry_seconds`` in a row.

Until its first step a group also checks that the groups in its quorum run the same layout,
model, batch and data (titanlite/parallel/group_agreement.py): a ConfigError otherwise.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlite.config import ConfigError
from titanlite.config.fault_tolerance import FaultTolerance
from titanlite.parallel.group_agreement import DISAGREE, GroupAgreement, checked_process_group, first_line

logger = logging.getLogger("titanlite")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # where torchft's Manager reads the lighthouse's address
_BUCKET_BYTES = 64 * 2**20  # gradients travel in flat buffers of at most this size, per dtype


class FaultToleranceError(Exception):
    """The groups cannot go on (the lighthouse is gone, or a heal failed): one line for the user."""


def torchft_missing() -> str | None:
    """Why fault tolerance cannot run here (torchft not installed), or None."""
    _quiet_torchft()
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        return (
            f"fault_tolerance.enable needs torchft, which does not import ({error}); "
            "install it with pip install 'titanlite[ft]'"
        )
    return None


def _quiet_torchft() -> None:
    """torchft's Rust side logs every quorum and commit at INFO: keep its warnings and errors
    (RUST_LOG is read once, when torchft is first imported; a setting of the user's own wins).
    Its Python side logs a failed collective across groups, which fault tolerance expects,
    with a traceback: one line is enough."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in _TORCHFT_LOGGERS:
        torchft_logger = logging.getLogger(name)
        if _one_line not in torchft_logger.filters:
            torchft_logger.addFilter(_one_line)


# The modules of torchft that log (each through logging.getLogger(__name__)).
_TORCHFT_LOGGERS = ("torchft.manager", "torchft.process_group", "torchft.checkpointing.http_transport")


def _one_line(record: logging.LogRecord) -> bool:
    record.msg, record.args = first_line(record.getMessage()), None
    record.exc_info = record.exc_text = None
    # A mismatch is the trainer's own error line; the recorder is NCCL's, reset or not on gloo.
    return DISAGREE not in record.msg and "Unable to reset NCCL flight recorder" not in record.msg


def backend_problem(section: FaultTolerance) -> str | None:
    """Why the process group across groups cannot run here (NCCL without CUDA), or None."""
    if section.process_group == "nccl" and not torch.cuda.is_available():
        return "fault_tolerance.process_group = 'nccl' needs CUDA GPUs; use 'gloo' on this machine"
    return None


def lighthouse_problem(timeout_seconds: float) -> str | None:
    """Why the lighthouse named by TORCHFT_LIGHTHOUSE cannot be reached, or None."""
    address = os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        return (
            f"fault_tolerance.enable needs the lighthouse's address in {LIGHTHOUSE_ENV} "
            "(e.g. http://host:29510; start it with torchft_lighthouse --min_replicas 1)"
        )
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        return f"{LIGHTHOUSE_ENV}={address!r} is not an address like http://host:29510"
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds):
            return None
    except OSError as error:
        return (
            f"the lighthouse at {address} ({LIGHTHOUSE_ENV}) does not answer: {error.strerror or error}; "
            "start it with torchft_lighthouse --min_replicas 1 --bind [::]:PORT"
        )


class ReplicaGroups(Stateful):
    """This group's place among the replica groups: torchft's Manager on every rank, plus
    what the run counts of the other groups' absence (a Stateful part of the checkpoint).

    ``send_states()`` gives this rank's states for a healing peer (local tensors);
    ``receive_states(sent)`` loads a peer's. ``windows_per_group_step``: windows one group
    reads in a step, to count what an absent group's share of a step skipped.
    ``fingerprint``: what every group must run alike, as (name, value) pairs.
    ``retry_seconds``: how long one step may go on failing to commit before the run stops."""

    def __init__(
        self,
        section: FaultTolerance,
        send_states: Callable[[], dict],
        receive_states: Callable[[dict], None],
        windows_per_group_step: int,
        quorum_timeout_seconds: float,
        fingerprint: list[tuple[str, str]],
        retry_seconds: float,
    ):
        _quiet_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.section = section
        self.windows_per_group_step = windows_per_group_step
        timeout = timedelta(milliseconds=section.process_group_timeout_ms)
        backend = ProcessGroupNCCL if section.process_group == "nccl" else ProcessGroupGloo
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        store_addr, store_port = _group_store()
        self.agreement = GroupAgreement(
            fingerprint, section.replica_id, (store_addr, store_port), timeout=quorum_timeout_seconds
        )
        self.states_for_peer, self._received = send_states, receive_states
        self.healed_now = False  # set by a heal inside start_step
        self.manager = Manager(
            pg=checked_process_group(backend, self.agreement, timeout=timeout),
            load_state_dict=self._heal_from,
            state_dict=send_states,
            min_replica_size=section.min_replica_size,
            # Quorum before the forward, so that a healed group trains the same step as the others.
            use_async_quorum=False,
            # Every group seeds its weights alike; a fresh job needs no copy at step 0.
            init_sync=False,
            timeout=timeout,
            # A quorum after a group died waits until the lighthouse stops counting it as alive
            # (its heartbeat timeout, 5 s by default), which may exceed the collectives' timeout.
            quorum_timeout=timedelta(seconds=quorum_timeout_seconds),
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            replica_id=f"titanlite_group_{section.replica_id}",
        )
        self._quorum_ready = False  # wait_for_all_groups formed the first step's quorum
        self.heals = 0  # times this group received a peer's states
        self.skipped_windows = 0  # windows of the global order no group trained on (absent groups' shares)
        self.participants = 0  # groups in the last step's quorum
        self.retry_seconds = retry_seconds
        self._failed_tries = 0  # of the step now being tried, in a row
        self._failing_since = 0.0  # time.monotonic() of its first failed try

    # --- every step -----------------------------------------------------------------------

    def start_step(self, step: int) -> bool:
        """The quorum for the step after ``step``; True when this group healed in it (its
        states, the trainer's step included, are then a live peer's)."""
        if self._quorum_ready:  # the first step's, formed by wait_for_all_groups
            self._quorum_ready = False
            return False
        self.healed_now = False
        started = time.perf_counter()
        try:
            self.manager.start_quorum()
        except Exception as error:  # noqa: BLE001 - torchft raises whatever its RPC layer gives
            why = lighthouse_problem(self.section.process_group_timeout_ms / 1000) or first_line(error)
            raise FaultToleranceError(f"no quorum before step {step + 1}: {why}") from error
        if self.agreement.disagreement is not None:
            raise ConfigError(self.agreement.disagreement)
        self.participants = self.manager.num_participants()
        if self.healed_now:
            self.heals += 1
            logger.info(
                "fault tolerance: healed from a live group at step %d in %.1f s (%d group(s) in the quorum)",
                self.manager.current_step(),
                time.perf_counter() - started,
                self.participants,
            )
        return self.healed_now

    def _heal_from(self, sent: dict) -> None:
        self._received(sent)
        self.healed_now = True

    def wait_for_all_groups(self, step: int, timeout_seconds: float) -> bool:
        """Before a job's first step: quorums until every group has joined (or this group
        healed from a running job, or ``timeout_seconds`` passed), so that a fresh start
        trains its first step with every group. True when this group healed. The first
        training step uses the last quorum formed here."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            healed = self.start_step(step)
            if healed or self.participants >= self.section.group_size or time.monotonic() > deadline:
                if not healed and self.participants < self.section.group_size:
                    logger.warning(
                        "fault tolerance: starting with %d of %d groups; the others join when they come up",
                        self.participants,
                        self.section.group_size,
                    )
                self._quorum_ready = True
                self.agreement.checking = False  # a group joining later checks itself against this one
                return healed
            time.sleep(0.2)

    def all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp.RedOpType) -> None:
        """Reduce ``tensors`` (DTensors or not: their local shards) over the groups in the
        quorum, in place, in flat buckets; ReduceOp.AVG divides by the groups taking part. A
        failure is recorded by torchft and makes ``commit`` say no; the tensors are then
        garbage and the step is thrown away."""
        locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        for bucket in _buckets(locals_):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.manager.allreduce(flat, reduce_op=op).wait()
            parts = flat.split([t.numel() for t in bucket])
            torch._foreach_copy_(bucket, [part.view_as(t) for part, t in zip(parts, bucket, strict=True)])

    def average_and_commit(self, params, loss_share: torch.Tensor, counts: list[torch.Tensor]) -> bool:
        """Average the parameters' gradients and this rank's loss share, and sum the routed
        ``counts`` of MoE layers, over the groups of the step's quorum; then ``commit``."""
        grads = []
        for param in params:
            if param.grad is None:  # every group must send the same tensors
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        self.all_reduce([*grads, loss_share], ReduceOp.AVG)
        self.all_reduce(counts, ReduceOp.SUM)
        return self.commit()

    def commit(self) -> bool:
        """Whether every group in the quorum finished the step; if so it counts as done and
        the absent groups' shares of it as skipped. A step that has failed to commit for
        ``retry_seconds`` raises FaultToleranceError instead of being tried again."""
        committed = self.manager.should_commit()
        if committed:
            self.skipped_windows += (self.section.group_size - self.participants) * self.windows_per_group_step
            self._failed_tries = 0
            return True
        self._failed_tries += 1
        if self._failed_tries == 1:
            self._failing_since = time.monotonic()
        failing_for = time.monotonic() - self._failing_since
        step = self.manager.current_step() + 1
        why = (
            f"{self.participants} group(s) in the quorum, fewer than min_replica_size {self.section.min_replica_size}"
            if self.participants < self.section.min_replica_size
            else f"{self.participants} group(s) in the quorum; a collective across groups failed"
        )
        if failing_for >= self.retry_seconds and self._failed_tries > 1:
            raise FaultToleranceError(
                f"step {step} not committed in {self._failed_tries} tries over {failing_for:.0f} s ({why}); "
                f"stopping after comm.init_timeout_seconds ({self.retry_seconds:g} s) of retries"
            )
        if self._failed_tries == 1 or self._failed_tries % 10 == 0:  # not a line per try
            logger.warning(
                "fault tolerance: step %d not committed (try %d: %s); trying it again for up to %g s",
                step,
                self._failed_tries,
                why,
                self.retry_seconds,
            )
        return False

    def first_participant(self) -> bool:
        """Whether this group is the first of the quorum: the one that saves checkpoints."""
        return self.manager.participating_rank() == 0

    def resume_at(self, step: int) -> None:
        """Tell torchft the step a checkpoint resumed at (the quorum compares steps)."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # --- Stateful: what the run counted, saved with the checkpoint and sent when healing ----

    def state_dict(self) -> dict:
        return {"skipped_windows": self.skipped_windows, "heals": self.heals}

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped_windows = int(state_dict["skipped_windows"])
        self.heals = int(state_dict["heals"])


def _group_store() -> tuple[str, int]:
    """The TCPStore this group's ranks meet at: torchrun's (MASTER_ADDR/PORT), or, for a group
    of one process started without a launcher, one hosted here."""
    if dist.is_initialized():
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    global _own_store
    host = socket.gethostname()
    _own_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return host, _own_store.port


_own_store = None  # kept alive for the process's life: the Manager and the groups' PG use it


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of one dtype and device of at most _BUCKET_BYTES."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        last = buckets[-1][-1] if buckets else None
        same_kind = last is not None and last.dtype == t.dtype and last.device == t.device
        if not same_kind or size + t.numel() * t.element_size() > _BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel() * t.element_size()
    return buckets
