"""A checkpoint says which model it holds, and refuses to load into another one."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from titanlite.checkpoint import ModelDescription, ModelState
from titanlite.models.llama import LLAMA2_FLAVORS, LlamaArgs, Transformer

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--checkpoint.enable",
    "--metrics.log_freq",
    "1",
]


def train(dump: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "titanlite.train", "--job.dump_folder", str(dump), *SMALL, *args]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HOME": str(dump.parent)}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("model_args") / "run"
    result = train(dump, "--training.steps", "2")
    assert result.returncode == 0, result.stderr
    return dump


def test_checkpoint_records_the_model_description(llama3_checkpoint):
    keys = FileSystemReader(str(llama3_checkpoint / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    assert {"model_args.name", "model_args.flavor", "model_args.args.dim", "model_args.args.n_kv_heads"} <= keys.keys()


def test_resuming_into_another_model_shape_is_one_line(llama3_checkpoint):
    result = train(llama3_checkpoint, "--training.steps", "4", "--model.name", "llama2")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("titanlite: checkpoint error:")
    assert "step-2" in lines[0] and "layers.0.attention.wk.weight" in lines[0]


def description(**changes) -> dict:
    args = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": None,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_seq_len": 32,
    }
    return {"name": "llama2", "flavor": "debugmodel", "args": {**args, **changes}}


def test_same_shapes_but_other_hyperparameters_are_refused():
    with torch.device("meta"):
        model = Transformer(LLAMA2_FLAVORS["debugmodel"])
    state = ModelState(model, ModelDescription.from_state(description(), "test"))
    saved = {"model_args": description(rope_theta=500000.0, norm_eps=1e-6)}
    with pytest.raises(ValueError, match=r"differ in norm_eps, rope_theta"):
        state.load_state_dict(saved)


def test_another_sequence_length_is_not_a_different_model():
    model = Transformer(LLAMA2_FLAVORS["debugmodel"].with_seq_len(16))
    model.init_weights(seed=0)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    ModelState(model, ModelDescription.from_state(description(max_seq_len=16), "test")).load_state_dict(
        {**weights, "model_args": description(max_seq_len=4096)}
    )


def test_a_resume_through_dcp_compares_with_the_run_and_records_the_run(tmp_path):
    """dcp.load fills the very dict a Stateful handed it: the check must compare the saved
    description with the run's, not with itself, and later saves must record the run's."""
    model = Transformer(LLAMA2_FLAVORS["debugmodel"].with_seq_len(32))
    model.init_weights(seed=0)
    saved_run = ModelState(model, ModelDescription.from_state(description(rope_theta=500000.0), "test"))
    dcp.save({"model": saved_run}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)

    other = ModelState(model, ModelDescription.from_state(description(), "test"))
    with pytest.raises(ValueError, match=r"differ in rope_theta"):
        dcp.load({"model": other}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)

    longer = ModelState(model, ModelDescription.from_state(description(rope_theta=500000.0, max_seq_len=64), "test"))
    dcp.load({"model": longer}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    assert longer.state_dict()["model_args"]["args"]["max_seq_len"] == 64


def test_the_same_model_spelled_another_way_is_not_different():
    """A Hugging Face import spells the FFN size and the head count its own way."""
    run = ModelDescription("llama3", "tiny", LlamaArgs(dim=64, n_heads=4, n_kv_heads=None, multiple_of=64))
    imported = ModelDescription("llama3", "hf", LlamaArgs(dim=64, n_heads=4, n_kv_heads=4, multiple_of=192))
    assert run.args.ffn_hidden_dim == imported.args.ffn_hidden_dim == 192
    assert run.differences(imported) == []
    other_heads = ModelDescription("llama3", "hf", LlamaArgs(dim=64, n_heads=8, n_kv_heads=8, multiple_of=192))
    assert run.differences(other_heads) == ["kv_heads", "n_heads"]
