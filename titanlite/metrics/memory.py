"""Peak memory per logging window: the CUDA caching allocator's statistics on a GPU,
the process's resident memory (RSS) on a CPU.

The returned dicts are keyed by the tag names in titanlite.metrics.tags, so the
trainer can pass them to the loggers unchanged.
"""

import sys

import torch

from titanlite.metrics import tags

GIB = 1024**3
_PROC_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _proc_status_bytes(*fields: str) -> dict[str, int]:
    """The named "VmXXX:   1234 kB" lines of /proc/self/status, in bytes; empty off Linux."""
    found = {}
    try:
        with open(_PROC_STATUS, encoding="ascii") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in fields:
                    found[name] = int(value.split()[0]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return found


def _cpu_peak_bytes() -> int:
    """The process's peak RSS: VmHWM (which clear_refs can reset), else getrusage's
    lifetime maximum (kilobytes on Linux, bytes on macOS)."""
    hwm = _proc_status_bytes("VmHWM").get("VmHWM")
    if hwm is not None:
        return hwm
    import resource  # Unix only; imported here so the module still imports elsewhere

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def phase_peak_gib(device: torch.device) -> float:
    """The peak memory since the last reset, in GiB, for reporting phases (model build,
    first step, checkpoint save): CUDA max_memory_allocated, or the CPU process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return _cpu_peak_bytes() / GIB


class MemoryMonitor:
    """Peak memory between resets. Call reset_peak() after each log so every logged
    window reports its own peak rather than the run's."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        # What phase_peak_gib() measures, for log lines that print it.
        self.kind = "CUDA max allocated" if self.is_cuda else "CPU peak RSS"
        # Whether the CPU peak can be reset; False once the kernel refused (e.g. in a
        # container that mounts /proc read-only), after which the peak is the run's.
        self.cpu_peak_resettable = not self.is_cuda
        if self.is_cuda:
            self.capacity = torch.cuda.get_device_properties(self.device).total_memory
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.cpu_peak_resettable:
            # "5" resets VmHWM to the current RSS (Linux 4.0+, see proc(5)).
            try:
                with open(_CLEAR_REFS, "w", encoding="ascii") as clear_refs:
                    clear_refs.write("5")
            except OSError:
                self.cpu_peak_resettable = False

    def stats(self) -> dict[str, float]:
        """Peak numbers since the last reset_peak(), keyed by tag name."""
        return self._cuda_stats() if self.is_cuda else self._cpu_stats()

    def phase_peak_gib(self) -> float:
        return phase_peak_gib(self.device)

    def _cuda_stats(self) -> dict[str, float]:
        info = torch.cuda.memory_stats(self.device)
        active = info.get("active_bytes.all.peak", 0)
        reserved = info.get("reserved_bytes.all.peak", 0)
        return {
            tags.MAX_ACTIVE_GIB: active / GIB,
            tags.MAX_ACTIVE_PCT: 100.0 * active / self.capacity,
            tags.MAX_RESERVED_GIB: reserved / GIB,
            tags.MAX_RESERVED_PCT: 100.0 * reserved / self.capacity,
            # Retries mean the allocator had to free its cache and try again: a sign the
            # run is close to OOM (and slowed down by it) even when it does not crash.
            tags.NUM_ALLOC_RETRIES: info.get("num_alloc_retries", 0),
            tags.NUM_OOMS: info.get("num_ooms", 0),
        }

    def _cpu_stats(self) -> dict[str, float]:
        # Both read in one pass, so that the peak is never below the RSS beside it.
        status = _proc_status_bytes("VmRSS", "VmHWM")
        if "VmRSS" not in status:
            return {tags.PEAK_RSS_GIB: _cpu_peak_bytes() / GIB}
        rss = status["VmRSS"]
        peak = max(status.get("VmHWM", rss), rss)
        return {tags.RSS_GIB: rss / GIB, tags.PEAK_RSS_GIB: peak / GIB}
