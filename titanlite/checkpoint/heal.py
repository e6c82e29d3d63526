"""A checkpoint kept in memory, for a replica group that heals from a live peer.

Under fault tolerance every replica group runs the same layout, so a rank of a restarted
group receives the states of the rank at its own place in a live group: the same local
shards. What travels is each state's state_dict() with every DTensor replaced by its local
tensor (the transport pickles plain tensors); the receiver fills its own states' tensors in
place, as a DCP load does, and hands them to their load_state_dict.
"""

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlite.checkpoint.states import plain_tensors


def local_states(states: dict[str, Stateful]) -> dict:
    """{part: its state_dict() with local tensors}: what a live rank sends to its healing peer."""
    return {name: _locals(plain_tensors(state.state_dict())) for name, state in states.items()}


def load_local_states(states: dict[str, Stateful], received: dict) -> None:
    """Load what ``local_states`` gave on a peer into ``states``; a part or tensor that does not
    match this rank's (another layout or model) is a ValueError naming it."""
    if set(received) != set(states):
        raise ValueError(f"the peer sent the parts {sorted(received)}, this run has {sorted(states)}")
    for name, state in states.items():
        state.load_state_dict(_fill(plain_tensors(state.state_dict()), received[name], name))


def _locals(value):
    if isinstance(value, dict):
        return {key: _locals(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_locals(item) for item in value)
    if isinstance(value, DTensor):
        return value.to_local()
    return value


def _fill(own, sent, where: str):
    """``own`` with its tensors overwritten in place by ``sent``'s and its other values replaced."""
    if isinstance(own, dict) and isinstance(sent, dict):
        if set(own) != set(sent):  # (a fresh optimizer's state_dict() already holds every moment)
            raise ValueError(f"{where}: the peer's keys differ from this rank's: {sorted(set(own) ^ set(sent))}")
        return {key: _fill(own[key], sent[key], f"{where}.{key}") for key in own}
    if isinstance(own, (list, tuple)) and isinstance(sent, (list, tuple)) and len(own) == len(sent):
        return type(own)(_fill(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(own, sent, strict=True)))
    if isinstance(own, torch.Tensor):
        local = own.to_local() if isinstance(own, DTensor) else own
        if not isinstance(sent, torch.Tensor) or sent.shape != local.shape or sent.dtype != local.dtype:
            got = f"{tuple(sent.shape)} {sent.dtype}" if isinstance(sent, torch.Tensor) else type(sent).__name__
            raise ValueError(f"{where}: the peer sent {got}, this rank holds {tuple(local.shape)} {local.dtype}")
        local.copy_(sent)
        return own
    return sent
