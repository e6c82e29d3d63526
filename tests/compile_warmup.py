"""Imported by the fork server that rank processes fork from (tests/conftest.py): what every
compiling rank would otherwise do for itself, done once. It imports the compiler and probes
which vector instruction sets this CPU's C++ kernels can use (the probe compiles a test
library and loads it in 6 short subprocesses, about 1.3 s of waiting; its answer is cached
for the process, functools.cache, so forked ranks inherit it). Neither starts a thread pool
or loads a kernel in the server."""

from torch._inductor import compile_fx  # noqa: F401
from torch._inductor.cpu_vec_isa import valid_vec_isa_list

valid_vec_isa_list()
