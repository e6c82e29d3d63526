"""Export a titanlite step-N checkpoint as a Hugging Face LlamaForCausalLM folder.

The export reads the checkpoint one output shard at a time and writes safetensors
files, so at most one output shard (plus the tensor being converted) is in memory. It
runs in one process without a process group and writes into a temporary sibling folder
that is renamed into place only when everything is written. All renaming and the q/k
RoPE permutation come from the model's state-dict adapter.
"""

import json
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlite.checkpoint.hf import (
    EMA_PREFIX,
    _check_output,
    _checkpoint_metadata,
    _single_process,
    _titanlite_names,
    _write_atomically,
    read_model_description,
)
from titanlite.checkpoint.manager import EXPORT_DTYPES
from titanlite.models.llama.args import LlamaArgs
from titanlite.registry import get_model_spec

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """'5GB' -> 5_000_000_000, '50KiB' -> 51_200; an int is bytes."""
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        if not match:
            raise ValueError(f"max shard size '{size}': expected a size such as 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"max shard size '{size}': must be positive")
    return value


def _layer_order(name: str):
    match = re.search(r"\.(\d+)\.", name)
    return (0 if name.startswith(("tok_embeddings", "model.embed")) else 1 if match else 2,
            int(match.group(1)) if match else 0, name)


def plan_shards(sizes: dict[str, int], max_shard_size: int | None) -> list[list[str]]:
    """Group names (in the given order) into shards of at most max_shard_size bytes; a
    tensor larger than the limit gets a shard of its own."""
    if max_shard_size is None:
        return [list(sizes)]
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


# --- export ----------------------------------------------------------------------------


def export_to_hf(
    step_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: str | int | None = None,
    use_ema: bool = False,
) -> Path:
    """Write a Hugging Face LlamaForCausalLM folder from a titanlite step-N checkpoint."""
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    if isinstance(dtype, str):
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype '{dtype}': choose from {', '.join(EXPORT_DTYPES)}")
        dtype = EXPORT_DTYPES[dtype]
    if dtype not in EXPORT_DTYPES.values():
        raise ValueError(f"dtype {dtype}: choose from {', '.join(EXPORT_DTYPES)}")
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    _check_output(out_dir)
    metadata = _checkpoint_metadata(step_dir)
    description = read_model_description(step_dir)
    args: LlamaArgs = description["args"]
    adapter = get_model_spec(description["name"]).state_dict_adapter(args)

    # Hugging Face name -> (saved key, titanlite name, its metadata) for every model weight.
    prefix = EMA_PREFIX if use_ema else ""
    sources: dict[str, tuple[str, str, TensorStorageMetadata]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata) or not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        try:
            hf_name = adapter.to_hf_name(name)
        except KeyError:
            continue  # optimizer state, other parts
        sources[hf_name] = (key, name, entry)
    if use_ema and not sources:
        raise ValueError(f"{step_dir}: --ema asks for EMA weights but the checkpoint has no 'ema.' entries")
    expected = {adapter.to_hf_name(n) for n in _titanlite_names(args)}
    missing = sorted(expected - sources.keys())
    if missing:
        raise ValueError(f"{step_dir}: the checkpoint lacks {len(missing)} model weight(s), e.g. {prefix}{adapter.from_hf_name(missing[0])}")

    ordered = dict(sorted(sources.items(), key=lambda item: _layer_order(item[1][1])))
    sizes = {hf: entry.size.numel() * dtype.itemsize for hf, (_, _, entry) in ordered.items()}
    shards = plan_shards(sizes, limit)
    reader_path = str(step_dir)

    def load_shard(names: list[str]) -> dict[str, torch.Tensor]:
        # One DCP load per output shard: planning a load and opening the data files per
        # tensor cost as much as the reading itself.
        state = {}
        for hf_name in names:
            key, _, entry = ordered[hf_name]
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        _single_process(dcp.load, state, storage_reader=FileSystemReader(reader_path), no_dist=True)
        return state

    def write(folder: Path) -> None:
        files = ["model.safetensors"] if len(shards) == 1 and limit is None else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
        ]
        weight_map = {}
        for file, names in zip(files, shards):
            loaded, shard = load_shard(names), {}
            for hf_name in names:
                key, name, _ = ordered[hf_name]
                # pop: each saved tensor is released as soon as its converted copy exists.
                shard[hf_name] = adapter.to_hf_tensor(name, loaded.pop(key)).to(dtype).contiguous()
                weight_map[hf_name] = file
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            del shard
        if limit is not None:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = {**adapter.hf_config(), "torch_dtype": str(dtype).removeprefix("torch.")}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # The checkpoint does not record the tokenizer, so no bos/eos ids are known here.
        (folder / "generation_config.json").write_text(json.dumps({}, indent=2) + "\n")

    _write_atomically(out_dir, write)
    return out_dir
