"""Seeding a training run from a Hugging Face folder (checkpoint.initial_load_in_hf).

The folder is a randomly initialised transformers Llama of the tiny test shape, saved in
several safetensors shards. A single process seeded from it must reproduce transformers'
own logits; 2 and 4 ranks, each reading only its own slices, must hold exactly the same
weights and take the same first step as the single process.

Every multi-rank run of the module is a job of one 4-rank launch (the `runs` fixture).
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import TINY, full_weights, save_hf_llama, tiny_args
from tests.rank_jobs import Job, run_jobs_on_ranks
from titanlite.checkpoint import CheckpointError
from titanlite.checkpoint.hf import local_box
from titanlite.config import ConfigError, parse_args
from titanlite.models.llama import LlamaStateDictAdapter
from titanlite.train import Trainer

transformers = pytest.importorskip("transformers")

GLOBAL_BATCH = 4
BASE_ARGS = tiny_args(
    {
        "training.global_batch_size": GLOBAL_BATCH,
        "training.local_batch_size": GLOBAL_BATCH,  # one process; ranks override it
        "training.steps": 2,
        "optimizer.lr": 3e-3,
        "checkpoint.initial_load_in_hf": True,
    }
)
PROBE = torch.randint(0, TINY.vocab_size, (2, 20), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def hf_folder(tiny_hf_llama) -> Path:
    assert len(list(tiny_hf_llama.glob("*.safetensors"))) > 5  # really sharded
    return tiny_hf_llama


def hf_weights_in_titanlite_layout(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    return LlamaStateDictAdapter(TINY).from_hf(model.state_dict())


def seed_and_train(hf_dir: str, extra: list[str]) -> dict:
    """Seed from hf_dir, report the seeded weights (whole) and the part this rank read,
    the logits on PROBE, then train two steps."""
    trainer = Trainer(parse_args(BASE_ARGS + ["--checkpoint.initial_load_path", hf_dir] + extra))
    seeded = full_weights(trainer.model)
    local_boxes = {n: local_box(t) for n, t in trainer.model.state_dict().items()}
    with torch.no_grad():
        logits = trainer.model(PROBE) if not dist.is_initialized() else None
    records = trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"seeded": seeded, "local_boxes": local_boxes, "logits": logits, "loss": [r.loss for r in records]}


@pytest.fixture(scope="module")
def single(runs) -> dict:
    return runs["single"][0]


def test_single_process_matches_transformers(hf_folder, single):
    expected = hf_weights_in_titanlite_layout(hf_folder)
    assert single["seeded"].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(single["seeded"][name], value), name
    # The q/k permutation is right only if the logits agree, not just the values.
    with torch.no_grad():
        reference = transformers.LlamaForCausalLM.from_pretrained(hf_folder).eval()(PROBE).logits
    torch.testing.assert_close(single["logits"], reference, rtol=0, atol=1e-5)


# name -> (world size, arguments): the global batch stays GLOBAL_BATCH sequences.
LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size=2"]),
    "fsdp4": (4, ["--training.local_batch_size=1"]),
    # Column-wise weights are FSDP's strided shards of TP's shards.
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ranks_seed_like_one_process(runs, single, layout):
    world_size = LAYOUTS[layout][0]
    runs = runs[layout]
    for run in runs:
        for name, value in single["seeded"].items():
            assert torch.equal(run["seeded"][name], value), name
        torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(single["loss"]), rtol=1e-5, atol=0)
    # Each rank read only its own part; the different parts tile every tensor (TP ranks that
    # hold the same part, a norm say, read it each).
    for name, value in single["seeded"].items():
        boxes = {tuple(run["local_boxes"][name]) for run in runs}
        times_read = torch.zeros(value.shape, dtype=torch.int)
        for box in boxes:
            times_read[tuple(slice(start, stop) for start, stop in box)] += 1
        assert bool((times_read == 1).all()), name
        if world_size == 4 and name.endswith("attention.wk.weight"):
            assert min(box[0][1] - box[0][0] for box in boxes) < TINY.head_dim  # a shard ends inside a head


def test_rows_from_hf_matches_the_whole_permutation():
    adapter = LlamaStateDictAdapter(TINY)
    hf_wk = torch.arange(TINY.kv_heads * TINY.head_dim * 3, dtype=torch.float32).view(-1, 3)
    whole = adapter.from_hf_tensor("model.layers.0.self_attn.k_proj.weight", hf_wk)
    reads = []

    def read(a, b):
        reads.append((a, b))
        return hf_wk[a:b]

    for start in range(hf_wk.shape[0] + 1):
        for stop in range(start, hf_wk.shape[0] + 1):
            part = adapter.rows_from_hf("layers.0.attention.wk.weight", start, stop, read)
            assert torch.equal(part, whole[start:stop]), (start, stop)
    assert max(b - a for a, b in reads) == hf_wk.shape[0]  # never more than the heads asked for


def test_a_different_model_is_refused_with_one_line(tmp_path):
    folder = save_hf_llama(tmp_path / "wide", seed=1, intermediate_size=TINY.ffn_hidden_dim + 32)
    with pytest.raises(
        CheckpointError, match=r"wide: the folder holds a different model .*intermediate_size 224 vs 192"
    ):
        Trainer(parse_args(BASE_ARGS + ["--checkpoint.initial_load_path", str(folder)]))


def test_a_damaged_shard_is_named(hf_folder, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(hf_folder, folder)
    shard = sorted(folder.glob("*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}"):
        Trainer(parse_args(BASE_ARGS + ["--checkpoint.initial_load_path", str(folder)]))


def test_not_a_hugging_face_folder(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"initial_load_path .*empty: not a Hugging Face model folder \(no config.json\)"
    ):
        (tmp_path / "empty").mkdir()
        Trainer(parse_args(BASE_ARGS + ["--checkpoint.initial_load_path", str(tmp_path / "empty")]))


def test_config_rules():
    with pytest.raises(ConfigError, match="initial_load_in_hf needs checkpoint.initial_load_path"):
        parse_args(BASE_ARGS)
    with pytest.raises(ConfigError, match="initial_load_model_only must be true"):
        parse_args(BASE_ARGS + ["--checkpoint.initial_load_path", "x", "--checkpoint.initial_load_model_only=false"])


def seed_from_per_rank_folder(folders: list[str]) -> str:
    """Rank r seeds from folders[r]; returns the error each rank raised."""
    path = folders[int(os.environ["RANK"])]
    try:
        Trainer(parse_args(BASE_ARGS + ["--checkpoint.initial_load_path", path, "--training.local_batch_size=2"]))
    except CheckpointError as error:
        return str(error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return "no error"


def test_ranks_reading_different_weights_all_stop(runs):
    for error in runs["different weights"]:
        assert "the ranks read different files" in error, error


@pytest.fixture(scope="module")
def runs(hf_folder, tmp_path_factory) -> dict[str, list]:
    # Same shapes, names and files, other values: what a stale copy on one node looks like.
    other = save_hf_llama(tmp_path_factory.mktemp("other") / "llama", seed=2)
    jobs = {
        "single": Job(1, seed_and_train, (str(hf_folder), [f"--training.local_batch_size={GLOBAL_BATCH}"])),
        **{name: Job(n, seed_and_train, (str(hf_folder), args)) for name, (n, args) in LAYOUTS.items()},
        "different weights": Job(2, seed_from_per_rank_folder, ([str(hf_folder), str(other)],)),
    }
    return run_jobs_on_ranks(4, jobs)
