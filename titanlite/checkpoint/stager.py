"""The stager of checkpoint.async_mode = "async_with_pinned_mem": DCP's DefaultStager, one
for the whole run, so that its CPU buffers are allocated at the first save and reused.

torch before 2.13 closes a DefaultStager's inner StateDictStager at the end of every
staging (DefaultStager._stage calls its close(), to break a reference cycle of the stagers
that async_save makes for itself). That close empties the inner stager's buffer cache and
its copy dispatch table, so the second save through the same stager fails with
``KeyError: <class 'type'>``. torch 2.13 closes the inner stager only in
DefaultStager.close(), and closes the stagers async_save makes itself when their save ends.
Under older torch, ``keep_open_between_saves`` gives the run's one stager that behaviour:
a no-op close on that stager's own inner object, not on torch's class, lifted again by
``close_stager`` at the end of the run.
"""

import torch
from torch.distributed.checkpoint.staging import DefaultStager

# TorchVersion compares as a version: 2.13 nightlies ("2.13.0.devYYYYMMDD") count as older,
# and early ones still closed the inner stager after every staging.
CLOSES_AFTER_EVERY_STAGING = torch.__version__ < "2.13"


def _stay_open() -> None:
    """Stands in for the inner stager's close() between saves."""


def keep_open_between_saves(stager: DefaultStager) -> None:
    """Let `stager` serve every save of the run under torch before 2.13 (nothing to do on
    later torch). Call close_stager(stager) instead of stager.close() at the end."""
    if CLOSES_AFTER_EVERY_STAGING:
        stager._state_dict_stager.close = _stay_open  # an attribute of this one object


def close_stager(stager: DefaultStager) -> None:
    """Close `stager` for good: its thread, its buffers and its dispatch table."""
    if CLOSES_AFTER_EVERY_STAGING:
        vars(stager._state_dict_stager).pop("close", None)  # the class's close() again
    stager.close()
