"""Imported last by every fork server of the tests (tests/conftest.py, tests/forked_scripts.py,
tests/gpu_dry_runs.py): freezes the garbage collector's view of everything the server imported
(gc.freeze). A forked child's collections then skip those 300,000 to 400,000 objects, where each
full collection walked them all (0.15-0.2 s) and, by writing to their headers, copied the
server's memory pages into the child one by one. The objects are modules, classes and functions
that live as long as the process anyway. The pytest workers call freeze_what_is_loaded again
once collection has imported every test module (tests/conftest.py)."""

import gc


def freeze_what_is_loaded() -> None:
    """Collect once, then move every object still alive to the collector's permanent generation."""
    gc.collect()
    gc.freeze()


freeze_what_is_loaded()
