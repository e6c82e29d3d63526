"""Replica groups agree on what they train before a group's first step.

Groups of different layouts, models, batches or data cannot average their gradients: the
ranks at one place hold shards of other shapes, or a group has no rank at that place, and
every step would fail to commit for ever. So each group carries a fingerprint (named keys
and their values), and while a group starts (until its first step) it compares its own with
those of every group in its quorum.

The fingerprints travel through the store torchft's process group across groups meets at:
for a quorum, every group's rank 0 is given the same store and key prefix (the quorum's id
and the group rank, 0), so rank 0 of each group writes its fingerprint there whenever its
quorum changes, and a starting group reads all of them. Groups already training keep
writing theirs, so a group that joins a running job is checked against them too. It all
happens in the process group's ``configure``, before the process group is made and before a
heal: a group that disagrees makes neither. Its rank 0 passes the verdict to the other ranks
of its group through the group's own store, since their quorums' stores are other ones.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

from torch.distributed import TCPStore

logger = logging.getLogger("titanlite")

DISAGREE = "replica groups disagree on "  # the start of the one line a mismatch gives
_FINGERPRINT = "titanlite/fingerprint/"  # under torchft's per-quorum prefix of group rank 0
_VERDICT = "titanlite/fingerprint_verdict/"  # in the group's own store, one key per quorum id


class GroupsDisagree(Exception):
    """This group's fingerprint differs from another group's in the quorum (one line)."""


class GroupAgreement:
    """This rank's side of the check. ``fingerprint``: (name, value) pairs, in the order a
    mismatch is reported; ``group``: this group's replica_id; ``group_store``: host and port
    of the group's own TCPStore; ``timeout``: how long a read waits for a peer's write."""

    def __init__(self, fingerprint: list[tuple[str, str]], group: int, group_store: tuple[str, int], timeout: float):
        self.fingerprint = fingerprint
        self.group = group
        self.group_store_address = group_store
        self.timeout = timedelta(seconds=timeout)
        self.checking = True  # while the group starts; a running group only publishes
        self.disagreement: str | None = None  # the one line, once found
        self._group_store: TCPStore | None = None

    def at_quorum(self, store_addr: str, participants: int, quorum_id: int | None, group_rank: int | None) -> None:
        """Called with a new quorum's process-group store (``host:port/prefix``); raises
        GroupsDisagree, which keeps torchft from making the process group or healing."""
        verdict = None
        if not group_rank:
            verdict = self._publish_and_compare(store_addr, participants)
            if self.checking:
                self._store().set(f"{_VERDICT}{quorum_id}", verdict or "")
        elif self.checking:
            verdict = self._read_verdict(quorum_id)
        if verdict:
            self.disagreement = verdict
            raise GroupsDisagree(verdict)

    def _publish_and_compare(self, store_addr: str, participants: int) -> str | None:
        from torchft.process_group import create_store_client

        try:
            store = create_store_client(store_addr, timeout=self.timeout)
            # Each group takes the next free slot; a quorum of N groups fills slots 0..N-1.
            slot = store.add(f"{_FINGERPRINT}joined", 1) - 1
            store.set(f"{_FINGERPRINT}{slot}", json.dumps({"group": self.group, "fingerprint": self.fingerprint}))
            if not self.checking:
                return None
            sent = [json.loads(store.get(f"{_FINGERPRINT}{i}")) for i in range(participants)]
        except Exception as error:  # noqa: BLE001 - a peer gone meanwhile: its step fails anyway
            if self.checking:
                logger.warning("fault tolerance: could not compare the groups' configs: %s", first_line(error))
            return None
        for peer in sent:
            if peer["group"] != self.group:
                line = disagreement(self.fingerprint, [tuple(pair) for pair in peer["fingerprint"]], peer["group"])
                if line:
                    return line
        return None

    def _read_verdict(self, quorum_id: int | None) -> str | None:
        try:
            return self._store().get(f"{_VERDICT}{quorum_id}").decode() or None
        except Exception as error:  # noqa: BLE001 - rank 0 gone: the group's quorum fails anyway
            logger.warning("fault tolerance: no verdict on the groups' configs from rank 0: %s", first_line(error))
            return None

    def _store(self) -> TCPStore:
        if self._group_store is None:
            host, port = self.group_store_address
            self._group_store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=self.timeout)
        return self._group_store


def disagreement(mine: list[tuple[str, str]], theirs: list[tuple[str, str]], group: int) -> str | None:
    """The one line naming the first key whose value differs (None when none does)."""
    their_values = dict(theirs)
    keys = [name for name, _ in mine] + [name for name, _ in theirs if name not in dict(mine)]
    mine_values = dict(mine)
    differing = [key for key in keys if mine_values.get(key, "unset") != their_values.get(key, "unset")]
    if not differing:
        return None
    key = differing[0]
    more = f" (and {len(differing) - 1} more key(s))" if len(differing) > 1 else ""
    return (
        f"{DISAGREE}{key}: {mine_values.get(key, 'unset')} here, {their_values.get(key, 'unset')} in group {group}"
        f"{more}; every group must run the same config"
    )


def checked_process_group(backend: type, agreement: GroupAgreement, **kwargs):
    """torchft's reconfigurable process group ``backend(**kwargs)``, whose every
    reconfiguration for a new quorum runs ``agreement`` first."""

    class Checked(backend):
        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None, *rest):
            agreement.at_quorum(store_addr, world_size, quorum_id, group_rank)
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, *rest)

    return Checked(**kwargs)


def first_line(error: object) -> str:
    """An error's message cut to its first line (at most 300 characters)."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
