"""A checkpoint says which model it holds, and refuses to load into another one."""

import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.forked_scripts import run_python
from tests.helpers import NoArgs
from titanlite import train as train_module
from titanlite.checkpoint import CheckpointError, CheckpointManager, ModelDescription, ModelState
from titanlite.config import Checkpoint
from titanlite.models.llama import LLAMA2_FLAVORS, LlamaArgs, Transformer
from titanlite.train import main

REPO_ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTED_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOG_RANK")
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
    command = ["-m", "titanlite.train", "--job.dump_folder", str(dump), *SMALL, *args]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HOME": str(dump.parent)}
    return run_python(command, env=env)


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("model_args") / "run"
    result = train(dump, "--training.steps", "2")
    assert result.returncode == 0, result.stderr
    return dump


def test_checkpoint_records_the_model_description(llama3_checkpoint):
    keys = FileSystemReader(str(llama3_checkpoint / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    assert {"model_args.name", "model_args.flavor", "model_args.args.dim", "model_args.args.n_kv_heads"} <= keys.keys()


def _spy_on_loads(monkeypatch) -> list[set[str]]:
    """The top-level keys of every dcp.load call from now on."""
    calls, load = [], dcp.load

    def spying_load(state_dict, *args, **kwargs):
        calls.append(set(state_dict))
        return load(state_dict, *args, **kwargs)

    monkeypatch.setattr(dcp, "load", spying_load)
    return calls


def _no_rank_may_start(*args, **kwargs):
    raise AssertionError("the run got past its checks and started a process group")


OTHER_MODELS = {
    "same-family": (
        ["--model.name", "llama2"],
        r"holds model llama3 debugmodel, this run builds llama2 debugmodel \(they differ in "
        r"kv_heads 4 -> 16, rope_theta 500000.0 -> 10000.0, vocab_size 2048 -> \d+, checkpoint -> run\)",
    ),
    "other-family": (
        ["--model.name", "qwen3", "--model.flavor", "tiny"],
        r"holds model llama3 debugmodel, this run builds qwen3 tiny;",
    ),
    "preflight": (  # what run_train.sh and the Slurm script run before torchrun
        ["--model.name", "llama2", "--job.validate_only"],
        r"holds model llama3 debugmodel, this run builds llama2 debugmodel \(they differ in kv_heads",
    ),
}


@pytest.mark.parametrize("case", OTHER_MODELS)
def test_starting_on_another_models_checkpoint_is_one_line_before_any_weight_is_read(
    llama3_checkpoint, case, monkeypatch, capsys, quiet_process_state
):
    for key in DISTRIBUTED_ENV:  # one process, as in the launchers' preflight
        monkeypatch.delenv(key, raising=False)
    loads = _spy_on_loads(monkeypatch)
    monkeypatch.setattr(train_module, "start_processes", _no_rank_may_start)
    args, names = OTHER_MODELS[case]
    capsys.readouterr()
    status = main(["--job.dump_folder", str(llama3_checkpoint), *SMALL, "--training.steps", "4", *args])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in out + err, (status, out, err)
    step_dir = llama3_checkpoint / "checkpoint" / "step-2"
    assert lines[0].startswith(f"titanlite: checkpoint error: {step_dir}: the checkpoint "), lines[0]
    assert re.search(names, lines[0]), lines[0]
    remedy = f"pick another job.dump_folder or remove the old checkpoints in {step_dir.parent}"
    assert lines[0].endswith(remedy), lines[0]
    assert loads == [{"model_args"}]  # the description alone, no weight


def test_the_manager_refuses_another_model_before_reading_a_weight(llama3_checkpoint, monkeypatch):
    """As on the ranks, which leave the check to the manager's load (rank 0 reads, all raise)."""
    with torch.device("meta"):
        model = Transformer(LLAMA2_FLAVORS["debugmodel"])
    state = ModelState(model, ModelDescription("llama2", "debugmodel", LLAMA2_FLAVORS["debugmodel"]))
    manager = CheckpointManager({"model": state}, Checkpoint(enable=True), str(llama3_checkpoint))
    loads = _spy_on_loads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"step-2: the checkpoint holds model llama3 debugmodel, .*kv_heads"):
        manager.load()
    manager.close()
    assert loads == [{"model_args"}]


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
    with pytest.raises(ValueError, match=r"differ in norm_eps 1e-06 -> 1e-05, rope_theta 500000.0 -> 10000.0, "):
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


def test_a_checkpoint_that_records_no_model_fails_on_the_first_weight_of_another_shape(tmp_path):
    """A checkpoint written by another tool (torchtitan's) says nothing of its model: then
    the load itself names the weight whose shape differs, in one line."""
    dcp.save(torch.nn.Linear(4, 5).state_dict(), checkpoint_id=str(tmp_path / "step-0"), no_dist=True)
    state = ModelState(torch.nn.Linear(4, 3), ModelDescription("linear", "4x3", NoArgs()))
    manager = CheckpointManager({"model": state}, Checkpoint(initial_load_path=str(tmp_path / "step-0")), str(tmp_path))
    message = r"step-0: loading failed on rank 0: ValueError: Size mismatch .*torch.Size\(\[5\]\) .*\[3\]\) for bias$"
    with pytest.raises(CheckpointError, match=message):
        manager.load()
    manager.close()
