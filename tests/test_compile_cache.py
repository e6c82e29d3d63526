"""Inductor's on-disk cache and the CPU's vector instructions (keep_compiled_code_per_cpu_isa).

torch 2.13 keys its FX graph cache without the vector ISA it generated C++ for, so a process
that picks another ISA (ATEN_CPU_CAPABILITY) is served code written for the first one, and
compiles it with its own vector width: AVX-512 code under AVX2 skipped half of every vector
loop ("index out of bounds" in an MoE job), and under ATEN_CPU_CAPABILITY=default it does not
compile at all. The reproduction without titanlite is in docs/performance.md.
"""

import os
import tempfile

import torch

from tests.rank_jobs import run_on_ranks
from titanlite.parallel.parallelize import keep_compiled_code_per_cpu_isa


def gather_halves(index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """An indexing kernel inductor vectorizes: row index // 2 of the table."""
    return table[index // 2]


def compile_at_both_capabilities() -> list[dict]:
    """In a rank process of its own (the environment and compiler state are process-wide): the
    same function compiled with one cache folder, first at the host's vector ISA, then with
    ATEN_CPU_CAPABILITY=default (no vector ISA, which any x86 host can pick)."""
    index, table = torch.arange(256), torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    shared = tempfile.mkdtemp()
    results = []
    for capability in (None, "default"):
        os.environ.pop("ATEN_CPU_CAPABILITY", None)
        if capability is not None:
            os.environ["ATEN_CPU_CAPABILITY"] = capability
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = shared
        keep_compiled_code_per_cpu_isa()
        torch._dynamo.reset()
        try:
            equal = torch.equal(torch.compile(gather_halves)(index, table), gather_halves(index, table))
            results.append({"equal": equal, "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"], "error": None})
        except Exception as error:  # the bug's symptom, reported instead of failing the rank
            results.append({"equal": False, "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"], "error": repr(error)})
    return results


def test_code_compiled_for_one_vector_isa_is_never_served_to_another():
    host_isa, no_isa = run_on_ranks(1, compile_at_both_capabilities)[0]
    assert host_isa["equal"] and host_isa["error"] is None, host_isa
    assert no_isa["equal"] and no_isa["error"] is None, no_isa
    # each in a folder of its own under the one the user (here: the test) named
    assert os.path.dirname(host_isa["cache"]) == os.path.dirname(no_isa["cache"])
    assert os.path.basename(no_isa["cache"]) == "isa-InvalidVecISA"
    assert host_isa["cache"] != no_isa["cache"]
