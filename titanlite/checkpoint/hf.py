"""Reading Hugging Face model folders (Llama, Qwen3), and what the checkpoint tools share.

Import reads a Hugging Face folder (one ``model.safetensors`` or a sharded index) and
writes a DCP checkpoint ``step-0`` holding the weights under titanlite's names and a
``model_args`` description; it runs in one process without a process group and writes
into a temporary sibling folder that is renamed into place only when everything is
written. The import of a folder with a tokenizer.json pads the vocabulary as a training run
with that tokenizer does (zero rows past the folder's ids), so that such a run starts from
it; the real size is recorded. (Export, the other direction, is in hf_export.py.)

All renaming and the q/k RoPE permutation come from the model's state-dict adapter.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.checkpoint import hf_tokenizer
from titanlite.checkpoint.description import MODEL_ARGS, ModelDescription
from titanlite.checkpoint.files import check_output, write_model_checkpoint
from titanlite.errors import one_line
from titanlite.parallel.distributed import first_error_on_any_rank, gather_from_every_rank
from titanlite.registry import get_model_spec, model_from_hf_config, padded_vocab_size
from titanlite.storage import location

EMA_PREFIX = "ema."
# Buffers some Hugging Face checkpoints carry; they are recomputed, never trained.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
# Bytes read from the start, middle and end of each weight file to fingerprint a folder.
_SAMPLE = 64 * 1024


# --- reading a Hugging Face folder -----------------------------------------------------


def read_hf_config(hf_dir: Path) -> tuple[dict, ModelDescription]:
    """The folder's config.json and the model it describes (flavor "hf"; its tokenizer.json,
    if it has one)."""
    if not hf_dir.is_dir():
        raise ValueError(f"{hf_dir}: no such folder")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{hf_dir}: not a Hugging Face model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError:
        raise ValueError(f"{config_path}: not valid JSON") from None
    name, args = model_from_hf_config(config, str(config_path))
    tokenizer = hf_dir / "tokenizer.json"
    tokenizer_path = str(tokenizer.resolve()) if tokenizer.is_file() else None
    return config, ModelDescription(name, "hf", args, tokenizer_path)


def _hf_weight_map(hf_dir: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{index}: not a safetensors index (no weight_map)") from None
        absent = sorted(f for f in set(weight_map.values()) if not (hf_dir / f).is_file())
        if absent:
            raise ValueError(f"{hf_dir}: the index names {absent[0]}, which is missing")
        return {name: hf_dir / file for name, file in weight_map.items()}
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as handle:
                return {name: single for name in handle.keys()}
        except Exception as error:  # safetensors raises its own error types for bad files
            raise ValueError(f"{single}: not a readable safetensors file ({one_line(error)})") from None
    raise ValueError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def local_box(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) along each dimension of the part of `tensor` this rank holds: all of a
    plain tensor, or the local shard of a DTensor, placed where DTensor places it for DCP
    (the chunk a checkpoint records). That covers every layout DCP saves, among them FSDP's
    strided shard of a tensor-parallel shard (TP x FSDP), whose box is not the one a plain
    left-to-right split of the mesh dimensions would give."""
    if not isinstance(tensor, DTensor):
        return [(0, size) for size in tensor.shape]
    try:
        (chunk,) = tensor.__create_chunk_list__()
    except (ValueError, RuntimeError) as error:  # e.g. a Partial placement: no part of the tensor
        raise ValueError(f"a parameter laid out as {tensor.placements} has no box to read ({error})") from None
    box = [(start, start + size) for start, size in zip(chunk.offsets, chunk.sizes, strict=True)]
    if tuple(chunk.sizes) != tuple(tensor.to_local().shape):
        raise ValueError(f"a parameter's local shard {tuple(tensor.to_local().shape)} does not match {box}")
    return box


class HFWeights:
    """The safetensors weights of a Hugging Face folder, read under titanlite's names,
    whole or one rank's part at a time. Each read opens the file afresh, so the pages
    it maps are released at once and memory holds only the tensors asked for."""

    def __init__(self, hf_dir: Path, adapter, config: dict, expected_names: list[str]):
        self.hf_dir, self.adapter = hf_dir, adapter
        self.files = _hf_weight_map(hf_dir)
        for hf_name, file in self.files.items():
            if hf_name.endswith(_IGNORED_HF_SUFFIXES):
                continue
            try:
                adapter.from_hf_name(hf_name)
            except KeyError:
                raise ValueError(f"{file}: tensor '{hf_name}' has no titanlite counterpart") from None
        # titanlite keeps the output projection separate: tied embeddings are read twice.
        self.tied = bool(config.get("tie_word_embeddings")) and adapter.to_hf_name("output.weight") not in self.files
        self.vocab_size = config.get("vocab_size")  # the folder's token ids: a padded model gets zero rows past them
        missing = [hf for name in expected_names for hf in self.hf_names_of(name) if hf not in self.files]
        if missing:
            raise ValueError(f"{hf_dir}: the weights lack {len(missing)} tensor(s), e.g. {missing[0]}")

    def hf_name(self, name: str) -> str:
        if self.tied and name == "output.weight":
            name = "tok_embeddings.weight"
        return self.adapter.to_hf_name(name)

    def _stacked(self, name: str) -> dict[int, str] | None:
        """For a titanlite tensor stacked from several Hugging Face tensors (experts), or
        kept by Hugging Face under none (the expert bias): index along the first dimension ->
        Hugging Face name. None for a tensor with one counterpart."""
        parts = self.adapter.hf_parts(name)
        if list(parts.values()) == [None]:
            return None
        return {index: hf_name for hf_name, index in parts.items()}

    def hf_names_of(self, name: str) -> list[str]:
        """The Hugging Face tensors titanlite's tensor `name` is read from."""
        stacked = self._stacked(name)
        return [self.hf_name(name)] if stacked is None else list(stacked.values())

    def fingerprint(self) -> str:
        """A digest of config.json and, for every safetensors file, its size, its header
        (names, shapes, dtypes and offsets of all tensors) and three 64 KiB samples of its
        data. Reading the samples is cheap, and trained weights differ in every byte, so
        ranks that read different copies of different weights get different digests,
        while identical copies on different disks agree."""
        digest = hashlib.sha256((self.hf_dir / "config.json").read_bytes())
        for file in sorted(set(self.files.values())):
            size = file.stat().st_size
            digest.update(file.name.encode() + size.to_bytes(8, "little"))
            with open(file, "rb") as handle:
                header_size = int.from_bytes(handle.read(8), "little")
                digest.update(handle.read(min(header_size, size)))
                data_start = 8 + header_size
                for offset in (data_start, (data_start + size) // 2, size - _SAMPLE):
                    handle.seek(max(offset, data_start))
                    digest.update(handle.read(_SAMPLE))
        return digest.hexdigest()[:16]

    def rows_in_folder(self, name: str, shape: tuple[int, ...]) -> int:
        """How many of the model's rows of `name` (full shape `shape`) the folder holds: all,
        or for a vocabulary-indexed tensor the folder's token ids, when the model pads them."""
        if name not in self.adapter.vocab_rows or self.vocab_size is None or self.vocab_size == shape[0]:
            return shape[0]
        if self.vocab_size > shape[0]:
            raise ValueError(
                f"{self.hf_dir}: the folder embeds {self.vocab_size} token ids, more than the model's {shape[0]} "
                "(sized from the run's tokenizer, model.hf_assets_path)"
            )
        return self.vocab_size

    def read(self, name: str, shape: tuple[int, ...], box: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The part `box` (default: all) of titanlite's tensor `name`, whose full shape must
        be `shape`, in the file's dtype. Rows of a padded vocabulary past the folder's
        token ids are zeros."""
        box = box or [(0, size) for size in shape]
        stacked = self._stacked(name)
        if stacked is not None:
            return self._read_stacked(stacked, shape, box)
        hf_name = self.hf_name(name)
        file = self.files[hf_name]
        columns = tuple(slice(start, stop) for start, stop in box[1:])
        held = self.rows_in_folder(name, shape)
        hf_shape = (held, *shape[1:])

        def read_hf_rows(start: int, stop: int) -> torch.Tensor:
            return _read_slice(file, hf_name, hf_shape, (slice(start, stop), *columns))

        (start, stop) = box[0]
        try:
            rows = self.adapter.rows_from_hf(name, min(start, held), min(stop, held), read_hf_rows)
        except ValueError:
            raise
        except Exception as error:  # a damaged file: safetensors raises its own error types
            raise ValueError(f"{file}: cannot read tensor '{hf_name}' ({one_line(error)})") from None
        if stop <= held:
            return rows
        padding = torch.zeros((stop - max(start, held), *(b - a for a, b in box[1:])), dtype=rows.dtype)
        return torch.cat([rows, padding])

    def _read_stacked(self, stacked: dict[int, str], shape: tuple[int, ...], box: list[tuple[int, int]]):
        """The part `box` of a tensor whose row i is the Hugging Face tensor stacked[i] (an
        FSDP shard of the experts reads only its own experts' files); zeros for a tensor
        Hugging Face does not keep (no rows listed: the expert bias, which starts at 0)."""
        sizes = [stop - start for start, stop in box]
        if not stacked:
            return torch.zeros(sizes)
        inner = tuple(slice(start, stop) for start, stop in box[1:])
        rows = [_read_slice(self.files[stacked[i]], stacked[i], tuple(shape[1:]), inner) for i in range(*box[0])]
        return torch.stack(rows) if rows else torch.zeros(sizes)

    def copy_into(self, name: str, target: torch.Tensor) -> None:
        """Fill this rank's part of `target` (a plain tensor or a DTensor shard)."""
        box = local_box(target)
        local = target.to_local() if isinstance(target, DTensor) else target
        local.copy_(self.read(name, tuple(target.shape), box))


def _read_slice(file: Path, hf_name: str, expected_shape: tuple[int, ...], where: tuple[slice, ...]) -> torch.Tensor:
    """The part `where` of tensor `hf_name` of a safetensors file, which must have the shape
    the model needs."""
    with safe_open(str(file), framework="pt") as handle:
        part = handle.get_slice(hf_name)
        if tuple(part.get_shape()) != expected_shape:
            raise ValueError(
                f"{file}: tensor '{hf_name}' has shape {tuple(part.get_shape())}, the model needs {expected_shape}"
            )
        return part[where]


def open_hf_folder(hf_dir: str | Path, adapter_cls=None) -> tuple[ModelDescription, HFWeights]:
    """The model a Hugging Face folder holds and a reader of its weights; raises
    ValueError, one line naming the path, for anything no registered family reads."""
    hf_dir = Path(hf_dir)
    config, description = read_hf_config(hf_dir)
    adapter = (adapter_cls or get_model_spec(description.name).state_dict_adapter)(description.args)
    return description, HFWeights(hf_dir, adapter, config, list(description.weight_shapes()))


# --- seeding a training run from a Hugging Face folder ---------------------------------


def _on_every_rank(work, process_group):
    """Run work() on every rank; if it fails on any rank, raise ValueError on all of them
    (so no rank waits forever in a later collective for one that gave up)."""
    result, failure = None, None
    try:
        result = work()
    except (ValueError, OSError) as error:
        failure = one_line(error)
    if process_group is not None:
        failure = first_error_on_any_rank(failure, process_group, name_rank=True)
    if failure:
        raise ValueError(failure)
    return result


def _check_same_model(hf_args, run_args, adapter_cls, hf_dir: Path) -> None:
    """The folder must hold the model this run builds; the sequence length may differ, and
    the run's vocabulary may pad the folder's (HFWeights.rows_in_folder checks that)."""
    theirs, ours = adapter_cls(hf_args).hf_config(), adapter_cls(run_args).hf_config()
    # The auxiliary loss's switch and coefficient only steer training, as the run's own keys do.
    free = ("max_position_embeddings", "vocab_size", "output_router_logits", "router_aux_loss_coef")
    different = sorted(k for k in ours if k not in free and theirs.get(k) != ours.get(k))
    if different:
        details = ", ".join(f"{k} {theirs.get(k)} vs {ours.get(k)}" for k in different)
        raise ValueError(f"{hf_dir}: the folder holds a different model than this run builds ({details})")


def seed_from_hf(hf_dir: str | Path, model: nn.Module, run_args, adapter_cls, process_group=None) -> str:
    """Fill the parameters of an already sharded `model` from a Hugging Face folder. Every
    rank reads only the slices its own shards hold, so host memory per rank grows by its
    shards plus one tensor's part, not by the model. All ranks check that they read the
    same files. Returns the folder's fingerprint. The model's non-persistent buffers (the
    RoPE tables) are not in the folder: the caller initialises them."""
    hf_dir = Path(hf_dir)

    def open_and_check():
        description, weights = open_hf_folder(hf_dir, adapter_cls)
        # Same shapes and heads, so the folder's own adapter reads it for this run.
        _check_same_model(description.args, run_args, adapter_cls, hf_dir)
        return weights, weights.fingerprint()

    weights, fingerprint = _on_every_rank(open_and_check, process_group)
    if process_group is not None:
        fingerprints = gather_from_every_rank(fingerprint, process_group)
        if len(set(fingerprints)) > 1:
            seen = ", ".join(f"rank {rank} {value}" for rank, value in enumerate(fingerprints))
            raise ValueError(f"{hf_dir}: the ranks read different files ({seen})")

    def read_every_part():
        with torch.no_grad():
            for name, target in model.state_dict().items():
                weights.copy_into(name, target)

    _on_every_rank(read_every_part, process_group)
    return fingerprint


# --- import ----------------------------------------------------------------------------


def padded_description(description: ModelDescription) -> ModelDescription:
    """A Hugging Face model as a training run with the folder's tokenizer.json builds it: its
    vocabulary padded (registry.padded_vocab_size), the folder's size recorded as the real
    one. A folder without a tokenizer, or with the byte tokenizer's (a byte-tokenizer run's
    export), keeps its rows: a byte-tokenizer run does not pad its flavor's vocabulary."""
    if description.tokenizer_path is None or hf_tokenizer.is_byte_tokenizer(description.tokenizer_path):
        return description
    real = description.args.vocab_size
    args = dataclasses.replace(description.args, vocab_size=padded_vocab_size(real))
    return dataclasses.replace(description, args=args, tokenizer_vocab_size=real)


def import_from_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write out_dir/step-0 (out_dir a path or a URL), a DCP checkpoint of a Hugging Face model
    folder, keeping the folder's dtype. Returns step-0."""
    hf_dir, out_dir = Path(hf_dir), location(out_dir)
    description, weights = open_hf_folder(hf_dir)
    description = padded_description(description)
    check_output(out_dir)
    state = {name: weights.read(name, shape) for name, shape in description.weight_shapes().items()}
    state[MODEL_ARGS] = description.to_state()
    return write_model_checkpoint(state, out_dir)
