"""Accelerators the estimators know: peak dense bf16 (and float8) FLOP/s, memory and the two
link speeds that decide FSDP/HSDP communication time.

Units are SI base units throughout: FLOP/s, bytes, bytes per second. Every bandwidth is
**per GPU and per direction** (unidirectional): the rate at which one GPU can send while
it also receives at the same rate. A ring all-gather or reduce-scatter keeps both
directions of every link busy, so the unidirectional figure is the one that divides the
bytes a GPU sends. Vendors usually quote the bidirectional sum (NVLink 4 "900 GB/s");
halve those. Network cards are quoted in bits (InfiniBand NDR "400 Gb/s"); divide by 8.

Peak FLOP/s are not written here: they come from ``titanlite.metrics.flops`` (the table
MFU is logged against), so the estimate and the training log use the same number.
"""

from dataclasses import dataclass, fields, replace

from titanlite.errors import unknown_name
from titanlite.metrics.flops import peak_flops_per_device

GiB = 2**30
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the node it usually sits in.

    name: table key, e.g. "h100".
    peak_flops: dense (no 2:4 sparsity) bf16 tensor-core FLOP/s of one GPU.
    memory_bytes: device memory of one GPU, in bytes (nominal capacity; the allocator
        can use slightly less).
    intra_node_bw: bytes/s one GPU sends to its node peers, per direction (NVLink,
        Infinity Fabric or PCIe).
    inter_node_bw: bytes/s one GPU sends to other nodes, per direction: the GPU's share
        of the node's network cards (one NIC per GPU in the reference systems).
    gpus_per_node: GPUs that share the fast intra-node link.
    float8_peak_flops: dense float8 tensor-core FLOP/s of one GPU (twice the bf16 peak on
        every float8 part here); None for a GPU without float8 matmuls.
    """

    name: str
    peak_flops: float
    memory_bytes: int
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int
    float8_peak_flops: float | None = None


def _peak(device_name: str) -> float:
    """The peak from metrics.flops for a device name as torch.cuda.get_device_name spells it."""
    flops = peak_flops_per_device(device_name)
    if flops is None:  # a table edit in metrics/flops.py broke the lookup
        raise RuntimeError(f"metrics.flops has no peak for {device_name!r}")
    return flops


# The vendors' dense float8 FLOP/s are twice their dense bf16 ones on Hopper, Ada, Blackwell
# and CDNA 3 alike, within 1% (H100 SXM: 1,979 against 989 TFLOP/s; L40S: 733 against 362);
# Ampere (A100) has no float8.
FLOAT8_OVER_BF16 = 2


def _float8(device_name: str) -> float:
    return FLOAT8_OVER_BF16 * _peak(device_name)


# Sources and assumptions, one row each. Memory is the marketed capacity, which for HBM
# parts is in binary units in practice (an H100 "80GB" reports 81559 MiB to nvidia-smi).
HARDWARE: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        # H100 SXM5 80GB (DGX/HGX H100): NVLink 4 is 900 GB/s bidirectional -> 450 GB/s per
        # direction; eight ConnectX-7 InfiniBand NDR cards, 400 Gb/s = 50 GB/s per GPU.
        Hardware(
            "h100", _peak("NVIDIA H100 80GB HBM3"), 80 * GiB, 450 * GB, 50 * GB, 8, _float8("NVIDIA H100 80GB HBM3")
        ),
        # H200 SXM 141GB (HGX H200): same compute and NVLink 4 as the H100, more and faster
        # HBM3e; same 400 Gb/s NDR per GPU.
        Hardware("h200", _peak("NVIDIA H200"), 141 * GiB, 450 * GB, 50 * GB, 8, _float8("NVIDIA H200")),
        # A100 SXM4 80GB (DGX A100): NVLink 3 is 600 GB/s bidirectional -> 300 GB/s per
        # direction; eight HDR InfiniBand cards, 200 Gb/s = 25 GB/s per GPU.
        Hardware("a100", _peak("NVIDIA A100-SXM4-80GB"), 80 * GiB, 300 * GB, 25 * GB, 8),
        # B200 (DGX B200): 180 GB of HBM3e exposed per GPU (1,440 GB per 8-GPU system);
        # NVLink 5 is 1.8 TB/s bidirectional -> 900 GB/s per direction; ConnectX-7
        # 400 Gb/s = 50 GB/s per GPU.
        Hardware("b200", _peak("NVIDIA B200"), 180 * GiB, 900 * GB, 50 * GB, 8, _float8("NVIDIA B200")),
        # MI300X (8-GPU OAM platform): 192 GB HBM3; seven Infinity Fabric links of 64 GB/s
        # per direction to the seven peers (a full mesh) -> 448 GB/s per direction when a
        # collective uses all of them, as RCCL's rings do; 400 Gb/s NIC = 50 GB/s per GPU.
        Hardware(
            "mi300x", _peak("AMD Instinct MI300X"), 192 * GiB, 448 * GB, 50 * GB, 8, _float8("AMD Instinct MI300X")
        ),
        # L40S (PCIe card, 8 per server assumed): 48 GB GDDR6; no NVLink, so peers talk
        # over PCIe 4.0 x16, 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s per direction;
        # assumed 200 Gb/s = 25 GB/s of network per GPU (servers vary).
        Hardware("l40s", _peak("NVIDIA L40S"), 48 * GiB, 31.5 * GB, 25 * GB, 8, _float8("NVIDIA L40S")),
    )
}

# Fields a caller may override, with the type each must have.
_FIELD_TYPES = {f.name: f.type for f in fields(Hardware) if f.name != "name"}


def _check_override(field_name: str, value) -> float | int:
    """An override must be a positive number; gpus_per_node must be a whole number."""
    if field_name not in _FIELD_TYPES:
        raise ValueError(unknown_name("hardware field", field_name, _FIELD_TYPES))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"hardware {field_name} must be a positive number, got {value!r}")
    if field_name in ("gpus_per_node", "memory_bytes"):
        if value != int(value):
            raise ValueError(f"hardware {field_name} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def get_hardware(name: str, **overrides) -> Hardware:
    """The table's row for ``name`` (case-insensitive; "-" and "_" are ignored, so "H100",
    "h-100" and "h100" are the same), with any field replaced by a keyword override,
    e.g. ``get_hardware("h100", inter_node_bw=25e9)``. An override of None leaves the
    field alone, so unset command-line options can be passed straight through.
    """
    key = name.strip().lower().replace("-", "").replace("_", "")
    if key not in HARDWARE:
        raise ValueError(unknown_name("hardware", name, HARDWARE))
    changes = {k: _check_override(k, v) for k, v in overrides.items() if v is not None}
    return replace(HARDWARE[key], **changes)


def parse_hardware_overrides(items: list[str]) -> dict[str, float]:
    """Command-line overrides as ``field=value`` strings (``inter_node_bw=25e9``) into the
    keyword arguments of get_hardware. Values are plain numbers in the Hardware units."""
    overrides = {}
    for item in items:
        field_name, sep, text = item.partition("=")
        field_name = field_name.strip()
        if not sep:
            raise ValueError(f"hardware override {item!r} must look like field=value, e.g. inter_node_bw=25e9")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"hardware override {item!r}: {text!r} is not a number") from None
        overrides[field_name] = _check_override(field_name, value)
    return overrides
