"""PyTorch's NCCL flight recorder, set up from comm.*.

NCCL process groups keep a ring buffer of their latest collectives (which group, which
operation, its sequence number, sizes, state, the Python stack that started it). When a
collective times out, each rank writes that buffer to a file of its own, so a hang on GPUs
leaves a record of which rank waited for what instead of dying without a word. PyTorch
reads these settings from the environment when NCCL starts, so they are set before the
process group is made.
"""

import os
from collections.abc import MutableMapping
from pathlib import Path

from titanlite.config import Comm

# The names PyTorch 2.13 reads (ProcessGroupNCCL.hpp, FlightRecorder.hpp). For the buffer
# size and the dump file it looks at a newer TORCH_FR_* spelling first, so a value the user
# set under either spelling is theirs.
BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
_SPELLINGS = {names[-1]: names for names in (BUFFER_SIZE, DUMP_FILE, DUMP_ON_TIMEOUT)}


def flight_recorder_env(comm: Comm, dump_folder: str) -> dict[str, str]:
    """The variables that make the recorder do what ``comm`` asks: keep the last
    trace_buf_size events and, when a collective times out, write them to
    <dump_folder>/<save_traces_folder>/<save_traces_file_prefix><rank>. With trace_buf_size
    0 the recorder is off (left alone, PyTorch would keep 2000 events)."""
    if comm.trace_buf_size == 0:
        return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(comm.trace_buf_size),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(
            dump_folder, comm.save_traces_folder, comm.save_traces_file_prefix
        ),
    }


def start_flight_recorder(comm: Comm, dump_folder: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Put flight_recorder_env's variables into ``environ`` where the user has not set them,
    and make the folder the dumps go to. Return the dumps' path up to the rank number, or
    None when the environment now leaves the dump off."""
    for name, value in flight_recorder_env(comm, dump_folder).items():
        if not any(spelling in environ for spelling in _SPELLINGS[name]):
            environ[name] = value
    prefix = dump_prefix(environ)
    if prefix is not None:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    return prefix


def dump_prefix(environ: MutableMapping[str, str]) -> str | None:
    """Where PyTorch writes a rank's dump on a timeout, up to the rank number, as ``environ``
    says; None when it records nothing, does not dump, or writes to a place of its own choosing."""
    size = _first_set(environ, BUFFER_SIZE)
    dump = _first_set(environ, DUMP_ON_TIMEOUT)
    if size is None or size.strip() == "0" or dump is None or dump.strip().lower() in ("0", "false"):
        return None
    return _first_set(environ, DUMP_FILE)


def _first_set(environ: MutableMapping[str, str], names: tuple[str, ...]) -> str | None:
    """The value PyTorch uses: that of the first of ``names`` that is set."""
    return next((environ[name] for name in names if name in environ), None)
