"""Export a titanlite step-N checkpoint as a Hugging Face folder of its model's class, as
the checkpoint records (exported_classes lists them).

Everything is decided before anything is written: the weights present and their shapes
against the model the saved model_args build (on the meta device), the tokenizer, and
the split into output shards (huggingface_hub's splitter, run on meta tensors). The export then reads the checkpoint
one output shard at a time and writes it with safetensors, in one process without a
process group, into a temporary sibling folder that is renamed into place only when
every file is written and synced. All renaming and the q/k RoPE permutation come from
the model's state-dict adapter.
"""

import json
import logging
import os
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlite.checkpoint import hf_tokenizer
from titanlite.checkpoint.description import ModelDescription, read_model_description
from titanlite.checkpoint.files import check_output, read_checkpoint_metadata, write_atomically
from titanlite.checkpoint.hf import EMA_PREFIX
from titanlite.checkpoint.tensor_reader import CheckpointReader, buffer_bytes
from titanlite.dtypes import DTYPES
from titanlite.files import BackgroundSyncer
from titanlite.registry import MODELS, get_model_spec
from titanlite.storage import location

logger = logging.getLogger("titanlite")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def exported_classes() -> dict[str, list[str]]:
    """Each registered model's Hugging Face classes, as its flavors' config.json files name
    them (a flavor Hugging Face has no config for, a ValueError, names none)."""
    classes = {}
    for name, spec in MODELS.items():
        named = []
        for args in spec.flavors.values():
            try:
                architectures = spec.state_dict_adapter(args).hf_config()["architectures"]
            except ValueError:
                continue
            named += [cls for cls in architectures if cls not in named]
        classes[name] = named
    return classes


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


def _export_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype '{dtype}': choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype}: choose from {', '.join(DTYPES)}")
    return dtype


# --- tokenizer -------------------------------------------------------------------------


def _tokenizer_file(step_dir: Path, recorded: str | None, override: str | Path | None) -> Path | None:
    """The tokenizer.json to ship: the override (a file or its folder), else the one the
    run recorded; None for a byte-tokenizer run. A recorded file that has gone is an
    error here, before anything is written, rather than an export without a tokenizer."""
    if override is not None:
        path = Path(override)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{override}: no tokenizer.json there (give a tokenizer.json or its folder)")
        return file
    if recorded is None:
        return None
    if not Path(recorded).is_file():
        raise ValueError(
            f"{step_dir}: the run's tokenizer {recorded} no longer exists; "
            "pass --tokenizer PATH (a tokenizer.json or its folder)"
        )
    return Path(recorded)


# --- which tensors, and checks -----------------------------------------------------------


def _weight_sources(step_dir: Path, metadata, adapter, names: list[str], use_ema: bool) -> dict:
    """Hugging Face name -> (saved key, titanlite name, its metadata, the index of the Hugging
    Face tensor in the saved one or None for all of it), in titanlite's model order
    (embedding, blocks, norm, output), for every model weight Hugging Face keeps."""
    prefix = EMA_PREFIX if use_ema else ""
    saved = metadata.state_dict_metadata
    if use_ema and not any(key.startswith(EMA_PREFIX) for key in saved):
        raise ValueError(f"{step_dir}: --ema asks for EMA weights but the checkpoint has no 'ema.' entries")
    missing = [prefix + name for name in names if not isinstance(saved.get(prefix + name), TensorStorageMetadata)]
    if missing:
        raise ValueError(f"{step_dir}: the checkpoint lacks {len(missing)} model weight(s), e.g. {missing[0]}")
    return {
        hf_name: (prefix + name, name, saved[prefix + name], index)
        for name in names
        for hf_name, index in adapter.hf_parts(name).items()
    }


def _part(tensor: torch.Tensor, index: int | None) -> torch.Tensor:
    """The Hugging Face tensor at `index` of a stacked saved tensor (None: the whole one)."""
    return tensor if index is None else tensor[index]


def _check_shapes(step_dir: Path, sources: dict, description: ModelDescription, expected: dict) -> None:
    """Refuse a checkpoint whose tensors do not have the shapes its own model_args give
    (`expected`, as the model lays them out): the exported config.json would describe a
    different model from the weights."""
    for key, name, entry, _ in sources.values():
        if tuple(entry.size) != expected[name]:
            raise ValueError(
                f"{step_dir}: tensor '{key}' has shape {list(entry.size)} but the checkpoint's "
                f"model_args ({description.name} {description.flavor}) give {list(expected[name])}"
            )


def _split(sources: dict, dtype_of, limit: int | None, exported_rows) -> object:
    """huggingface_hub's shard split, computed on meta tensors of each tensor's export dtype
    (``dtype_of(hf_name)``), cut to the exported rows (sizes only, no memory). Without a
    limit everything goes into one model.safetensors."""
    placeholders = {
        hf: _part(exported_rows(name, torch.empty(entry.size, dtype=dtype_of(hf), device="meta")), index)
        for hf, (_, name, entry, index) in sources.items()
    }
    if limit is None:
        limit = max(1, sum(t.numel() * t.element_size() for t in placeholders.values()))
    return split_torch_state_dict_into_shards(
        placeholders, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


def _umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it, and
    setting it even for a moment would race with other threads creating files)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    current = os.umask(0o022)  # a kernel without the field: set and restore
    os.umask(current)
    return current


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, file_mode: int) -> None:
    """save_file, then the mode every other exported file gets. safetensors writes a
    temporary file (created 0600) and renames it into place, so the umask is not applied."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, file_mode)


# --- export ----------------------------------------------------------------------------


def export_to_hf(
    step_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: str | int | None = None,
    use_ema: bool = False,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write a Hugging Face folder of the model's class (exported_classes), as the checkpoint
    records, from a titanlite step-N checkpoint.

    dtype is the dtype of the written weights; max_shard_size (e.g. "5GB") splits them
    into model-0000i-of-0000n.safetensors files and an index when they do not fit one;
    use_ema exports the ema.* weights; tokenizer (a tokenizer.json or its folder)
    overrides the tokenizer the run recorded. Returns out_dir. Bad input is a ValueError
    naming the path, raised before anything is written."""
    hf_tokenizer.require_tokenizers()
    step_dir, out_dir = location(step_dir), Path(out_dir)
    dtype = _export_dtype(dtype)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    check_output(out_dir)
    metadata = read_checkpoint_metadata(step_dir)
    description = read_model_description(step_dir)
    # The exported model has the tokenizer's rows only: a padded vocabulary's extra rows stay behind.
    real_vocab = description.real_vocab_size
    adapter = get_model_spec(description.name).state_dict_adapter(replace(description.args, vocab_size=real_vocab))
    shapes = description.weight_shapes()
    dropped = [name for name in shapes if not adapter.hf_parts(name)]
    if getattr(description.args, "moe_bias_update_rate", 0) > 0 and dropped:
        # A family whose Hugging Face model routes by the router's probabilities alone
        # (Qwen3-MoE) has no place for the bias: the exported model chooses its experts
        # without the bias the run trained, unlike the run's model.
        logger.warning(
            "%s: the run trained an expert bias (model.moe_bias_update_rate %g) that Hugging Face's "
            "format has no place for; the exported model routes without it",
            step_dir,
            description.args.moe_bias_update_rate,
        )
    tokenizer_json = _tokenizer_file(step_dir, description.tokenizer_path, tokenizer)
    special_ids = hf_tokenizer.special_ids(tokenizer_json)  # reads the tokenizer before anything is written
    try:  # a model Hugging Face's config cannot describe (an MoE router it lacks) is refused before any write
        hf_config = adapter.hf_config()
    except ValueError as error:
        raise ValueError(f"{step_dir}: {error}") from None
    sources = _weight_sources(step_dir, metadata, adapter, list(shapes), use_ema)
    _check_shapes(step_dir, sources, description, shapes)

    def exported_rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:real_vocab] if name in adapter.vocab_rows and tensor.shape[0] > real_vocab else tensor

    def dtype_of(hf_name: str) -> torch.dtype:
        """The export's dtype, or float32 for what the Hugging Face model keeps in float32."""
        return torch.float32 if hf_name.endswith(adapter.float32_hf_names) else dtype

    split = _split(sources, dtype_of, limit, exported_rows)
    file_mode = 0o666 & ~_umask()  # what open() gives the JSON and tokenizer files

    def passes_through(hf_name: str, name: str, entry: TensorStorageMetadata, index: int | None) -> bool:
        """Whether the saved tensor is written as it is: all of it, same dtype, and the
        adapter returns it unchanged (asked on a meta tensor, which costs nothing)."""
        probe = torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
        unchanged = adapter.to_hf_tensor(name, exported_rows(name, probe)) is probe
        return index is None and entry.properties.dtype == dtype_of(hf_name) and unchanged

    def saved_entries(hf_names: list[str]) -> dict[str, TensorStorageMetadata]:
        """The saved tensors these Hugging Face tensors come from, each once (a stacked one
        gives several)."""
        return {sources[hf][0]: sources[hf][2] for hf in hf_names}

    def write_shard(reader: CheckpointReader, folder: Path, file: str, hf_names: list[str]) -> None:
        loaded = reader.load(list(saved_entries(hf_names).items()))
        uses = Counter(sources[hf][0] for hf in hf_names)
        shard = {}
        for hf_name in hf_names:
            key, name, entry, index = sources[hf_name]
            tensor = loaded[key]
            uses[key] -= 1
            if not uses[key]:  # each saved tensor is released once its last part is converted
                del loaded[key]
            if not passes_through(hf_name, name, entry, index):
                # clone: a part must not share memory with the stacked tensor (safetensors refuses it).
                converted = _part(adapter.to_hf_tensor(name, exported_rows(name, tensor)), index)
                converted = converted.to(dtype_of(hf_name))
                tensor = converted.clone() if index is not None else converted.contiguous()
            shard[hf_name] = tensor
        _save_safetensors(shard, folder / file, file_mode)

    def write(folder: Path) -> None:
        largest = max(
            buffer_bytes(list(saved_entries(hf_names).values())) for hf_names in split.filename_to_tensors.values()
        )
        reader, syncer = CheckpointReader(step_dir, metadata, largest), BackgroundSyncer()
        try:
            for file, hf_names in split.filename_to_tensors.items():
                write_shard(reader, folder, file, hf_names)
                syncer.add(folder / file)
            if split.is_sharded:
                index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
                _write_json(folder / "model.safetensors.index.json", index)
            config = {**hf_config, **special_ids, "torch_dtype": str(dtype).removeprefix("torch.")}
            _write_json(folder / "config.json", config)
            _write_json(folder / "generation_config.json", special_ids)
            hf_tokenizer.write_hf_tokenizer(tokenizer_json, folder)
            for path in folder.iterdir():
                if path.suffix != ".safetensors":
                    syncer.add(path)
            syncer.wait()
        finally:
            reader.close()
            syncer.join()

    write_atomically(out_dir, write)
    return out_dir
