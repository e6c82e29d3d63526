"""torchtitan_compat.md stays true: its key tables against the parser, and torchtitan 0.2
TOML files (debug model, 8B) loading in titanlite."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import write_word_tokenizer
from titanlite.config import ConfigError, parse_args, parse_args_with_warnings, to_toml, torchtitan_keys
from titanlite.config.schema import key_types, toml_value

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "torchtitan_compat.md"
ROW = re.compile(r"^\| `([a-z0-9_.]+)` \| ([^|]+?) \| [^|]*\| [^|]*\|$")
RENAMED = re.compile(r"^renamed to `([a-z0-9_.]+)`$")
STATUSES = ("same", "ignored with a warning", "not supported", "titanlite only")


def doc_rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            key, status = match.groups()
            assert key not in rows, f"{key} is listed twice"
            rows[key] = status
    return rows


ROWS = doc_rows()
TORCHTITAN_ROWS = {key: status for key, status in ROWS.items() if status != "titanlite only"}


def by_status(status: str) -> list[str]:
    return sorted(key for key, value in ROWS.items() if value == status)


def changed_value(default):
    """A value other than torchtitan's default, of the same kind where there is one."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7
    if isinstance(default, float):
        return default + 0.25
    if isinstance(default, list):
        return ["layers.0"]
    if isinstance(default, str):
        return default + "_other"
    return "something"


def toml_for(dotted_key: str, value) -> str:
    table, _, key = dotted_key.rpartition(".")
    return f"[{table}]\n{key} = {toml_value(value)}\n"


def load(tmp_path, dotted_key, value, capsys):
    """Parse one setting (TOML, or the command line for an unset default); return
    (config, warning lines on stderr)."""
    capsys.readouterr()
    if value is None:
        config = parse_args([f"--{dotted_key}", "none"])
    else:
        path = tmp_path / "one.toml"
        path.write_text(toml_for(dotted_key, value))
        config = parse_args(["--job.config_file", str(path)])
    err = capsys.readouterr().err
    return config, [line for line in err.splitlines() if line.strip()]


# --- the document ---------------------------------------------------------------------


def test_every_section_has_a_table():
    text = DOC.read_text()
    for section in torchtitan_keys.TORCHTITAN_SECTIONS:
        assert f"### `[{section}]`" in text, section
    assert {key.partition(".")[0] for key in TORCHTITAN_ROWS} == set(torchtitan_keys.TORCHTITAN_SECTIONS)


def test_every_row_has_one_known_status():
    assert len(ROWS) > 100
    for key, status in ROWS.items():
        assert status in STATUSES or RENAMED.match(status), f"{key}: {status!r}"


def test_every_torchtitan_key_is_documented_once():
    assert set(TORCHTITAN_ROWS) == torchtitan_keys.ALL_KEYS


@pytest.mark.parametrize("key", by_status("same"))
def test_same_keys_exist(key):
    assert key in key_types()
    assert key in torchtitan_keys.SHARED_KEYS


@pytest.mark.parametrize("key", by_status("titanlite only"))
def test_titanlite_only_keys_exist_and_are_not_torchtitans(key):
    assert key in key_types()
    assert key not in torchtitan_keys.ALL_KEYS


def test_every_titanlite_key_is_documented():
    assert set(key_types()) <= set(ROWS)


@pytest.mark.parametrize("key", sorted(k for k, s in ROWS.items() if RENAMED.match(s)))
def test_renamed_keys_map_with_one_warning(key, tmp_path, capsys):
    new_key = RENAMED.match(ROWS[key]).group(1)
    assert new_key in key_types() and torchtitan_keys.RENAMED[key] == new_key
    value = True if key_types()[new_key] is bool else "some/folder"  # not the default either way
    config, warnings = load(tmp_path, key, value, capsys)
    section, _, name = new_key.partition(".")
    assert getattr(getattr(config, section), name) == value
    assert len(warnings) == 1 and key.rpartition(".")[2] in warnings[0] and name in warnings[0]


@pytest.mark.parametrize("key", by_status("not supported"))
def test_not_supported_keys_refuse_other_values(key, tmp_path, capsys):
    entry = torchtitan_keys.TORCHTITAN_ONLY[key]
    assert entry.verdict == "IGNORE_IF_DEFAULT"
    with pytest.raises(ConfigError, match=re.escape(key)) as error:
        load(tmp_path, key, changed_value(entry.default), capsys)
    assert "titanlite does not implement" in str(error.value) and entry.advice in str(error.value)


@pytest.mark.parametrize("key", by_status("not supported") + by_status("ignored with a warning"))
def test_defaults_give_one_warning_line(key, tmp_path, capsys):
    entry = torchtitan_keys.TORCHTITAN_ONLY[key]
    _, warnings = load(tmp_path, key, entry.default, capsys)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("titanlite: warning: ") and key.rpartition(".")[2] in warnings[0]
    assert warnings[0].endswith(
        "is a torchtitan setting titanlite does not implement; ignored (harmless at this value)"
    )


@pytest.mark.parametrize("key", by_status("ignored with a warning"))
def test_ignored_keys_take_any_value(key, tmp_path, capsys):
    entry = torchtitan_keys.TORCHTITAN_ONLY[key]
    assert entry.verdict == "IGNORE"
    _, warnings = load(tmp_path, key, changed_value(entry.default), capsys)
    assert len(warnings) == 1, warnings


def test_flight_recorder_keys_are_read_without_a_warning(tmp_path, capsys):
    path = tmp_path / "comm.toml"
    path.write_text('[comm]\ntrace_buf_size = 64\nsave_traces_folder = "fr"\nsave_traces_file_prefix = "r"\n')
    capsys.readouterr()
    comm = parse_args(["--job.config_file", str(path)]).comm
    assert (comm.trace_buf_size, comm.save_traces_folder, comm.save_traces_file_prefix) == (64, "fr", "r")
    assert capsys.readouterr().err == ""


def test_unknown_names_stay_errors_with_a_suggestion(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('[quantize.linear.float8]\nrecipe = "rowwise"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'quantize\.linear\.float8\.recipe'.*recipe_name"):
        parse_args(["--job.config_file", str(path)])
    with pytest.raises(ConfigError, match=r"did you mean '--training\.steps'"):
        parse_args(["--training.stepz", "3"])


def test_command_line_torchtitan_options():
    argv = ["--job.use_for_integration_test", "--parallelism.expert_tensor_parallel_degree=1", "--job.print_args"]
    config, warnings = parse_args_with_warnings(argv)
    assert len(warnings) == 3 and "--job.use_for_integration_test = true" in warnings[0]
    assert config.job.print_config is True  # a bare flag under torchtitan's older name
    with pytest.raises(ConfigError, match=r"parallelism\.custom_config_module|job\.custom_config_module"):
        parse_args(["--job.custom_config_module", "my.module"])


def test_context_parallel_keys_are_titanlites_and_alltoall_is_refused():
    config = parse_args(
        ["--parallelism.context_parallel_degree=2", "--parallelism.context_parallel_load_balancer=none"]
    )
    assert config.parallelism.context_parallel_degree == 2
    assert config.parallelism.context_parallel_load_balancer == "none"
    assert config.parallelism.context_parallel_rotate_method == "allgather"
    with pytest.raises(ConfigError, match=r"context_parallel_rotate_method.*no alltoall"):
        parse_args(["--parallelism.context_parallel_rotate_method=alltoall"])
    with pytest.raises(ConfigError, match=r"context_parallel_load_balancer"):
        parse_args(["--parallelism.context_parallel_load_balancer=ptrr"])


@pytest.mark.parametrize("written", ["1F1B", "1f1b", "interleaved1f1b", "ZBVZEROBUBBLE", "DualPipeV"])
def test_pipeline_schedules_by_torchtitans_names_in_any_case(written):
    config = parse_args(["--parallelism.pipeline_parallel_schedule", written])
    assert config.parallelism.pipeline_parallel_schedule == written  # kept as written, matched when planned


@pytest.mark.parametrize(
    "misspelt, meant", [("gpipee", "GPipe"), ("1FB1", "1F1B"), ("interleaved1f1bb", "Interleaved1F1B")]
)
def test_an_unknown_pipeline_schedule_gets_a_did_you_mean(misspelt, meant):
    with pytest.raises(ConfigError) as error:
        parse_args(["--parallelism.pipeline_parallel_schedule", misspelt])
    message = str(error.value)
    assert "parallelism.pipeline_parallel_schedule" in message and f"'{misspelt}' is not known" in message
    assert message.endswith(f"did you mean '{meant}'?"), message


def test_warnings_come_from_rank_zero_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    parse_args(["--job.print_args"])
    assert capsys.readouterr().err == ""


def test_warnings_are_not_repeated_after_the_preflight(capsys, monkeypatch):
    parse_args(["--job.print_args"])
    assert "job.print_args" in capsys.readouterr().err
    monkeypatch.setenv("TITANLITE_CONFIG_WARNINGS_SHOWN", "1")  # what run_train.sh sets for torchrun
    parse_args(["--job.print_args"])
    assert capsys.readouterr().err == ""


# --- torchtitan 0.2 files ----------------------------------------------------------------

# torchtitan 0.2's debug and 8B llama3 files as torchtitan ships them: its section and key
# names, and its values, dataset and asset paths included. The debug run is made CPU-sized
# on the command line (fewer steps, shorter sequences), never by editing the file.
TORCHTITAN_DEBUG_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_args = false
use_for_integration_test = true

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
# test folder with tokenizer.json, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
converters = []

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0
steps = 10
dataset = "c4_test"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
context_parallel_degree = 1
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "1F1B"
expert_parallel_degree = 1
expert_tensor_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"

[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"

[compile]
enable = false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[comm]
trace_buf_size = 20000

[memory_estimation]
enable = false

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""

TORCHTITAN_8B_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled"

[compile]
enable = false
components = ["model", "loss"]

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
"""


def write_torchtitan_test_assets(root: Path) -> int:
    """What a torchtitan checkout holds under tests/assets for its debug config: a tokenizer
    of 2,000 ids (word-level here, with Llama 3's BOS/EOS) and c4_test, JSON lines with a
    'text' field. Returns the tokenizer's vocabulary size."""
    tokenizer_folder = root / "tests" / "assets" / "tokenizer"
    n_words = 1997  # + [UNK], BOS and EOS = 2,000 ids
    vocab_size = write_word_tokenizer(tokenizer_folder, n_words, specials=("<|begin_of_text|>", "<|end_of_text|>"))
    (tokenizer_folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    c4_folder = root / "tests" / "assets" / "c4_test"
    c4_folder.mkdir(parents=True)
    with open(c4_folder / "data.json", "w") as data:
        for doc in range(200):
            text = " ".join(f"word{(doc * 37 + i * i) % n_words}" for i in range(60))
            data.write(
                json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{doc}"})
                + "\n"
            )
    return vocab_size


def test_torchtitan_debug_model_trains_on_cpu(tmp_path, capsys, monkeypatch, quiet_process_state):
    from titanlite.train import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOG_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # torchtitan's paths (./outputs, ./tests/assets/...) are relative
    assert write_torchtitan_test_assets(tmp_path) == 2000  # more ids than the byte tokenizer's 258
    path = tmp_path / "debug_model.toml"
    path.write_text(TORCHTITAN_DEBUG_TOML)
    capsys.readouterr()
    cpu_sized = ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2"]
    assert main(["--job.config_file", str(path), *cpu_sized]) == 0
    captured = capsys.readouterr()
    err = captured.err
    warnings = [line for line in err.splitlines() if line.startswith("titanlite: warning: ")]
    # Its [quantize.linear.float8] keys are titanlite's too, read without a warning (and unused:
    # converters is empty).
    expected = {
        "print_args",
        "use_for_integration_test",
        "expert_tensor_parallel_degree",
        "enable",
    }
    named = {re.search(r"\] (\w+) (=|is torchtitan's name) ", line).group(1) for line in warnings}
    assert named == expected and len(warnings) == len(expected), warnings
    assert "Traceback" not in err
    # It trained torchtitan's debug model on c4_test with the 2,000-id tokenizer, bf16 compute.
    assert "model llama3 debugmodel" in captured.out and "param_dtype=bfloat16" in captured.out
    (jsonl,) = (tmp_path / "outputs" / "metrics").glob("*/metrics.jsonl")
    losses = [json.loads(line)["loss_metrics/global_avg_loss"] for line in jsonl.read_text().splitlines()]
    assert len(losses) == 2 and all(7.0 < loss < 8.5 for loss in losses), losses  # about ln(2048) at the start
    # print_args = false: the resolved config is saved (test_config reads such a file back), not printed.
    saved = tmp_path / "outputs" / "resolved_config.toml"
    assert f"resolved config saved to {Path('outputs') / saved.name}" in captured.out
    assert "[training]" not in captured.out and "[training]" in saved.read_text()
    assert saved.read_text() == to_toml(parse_args(["--job.config_file", str(path), *cpu_sized]))


def test_torchtitan_8b_is_accepted_by_the_estimator(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import estimate

    path = tmp_path / "llama3_8b.toml"
    path.write_text(TORCHTITAN_8B_TOML)
    assert estimate.main(["--job.config_file", str(path), "--world_size", "8", "--skip_memory"]) == 0
    captured = capsys.readouterr()
    assert "llama3 8B, seq_len 8192" in captured.out
    # Its settings are all titanlite's too (pipeline_parallel_degree, context_parallel_degree, the
    # [quantize.linear.float8] keys), read without a warning; its tokenizer folder is not here: the
    # flavor's vocabulary stands in, with one warning.
    assert captured.err.count("titanlite: warning: ") == 1, captured.err
    assert "pipeline_parallel_degree" not in captured.err
    assert "Llama-3.1-8B: no such file or folder" in captured.err and "8B's own vocabulary" in captured.err


def test_the_slurm_example_parses():
    script = REPO / "multinode_trainer.slurm"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for piece in (
        "--rdzv_backend c10d",
        '--rdzv_endpoint "${members[0]}:29500"',  # a group's first node (the head node without FT)
        '--nnodes "$group_nodes"',
        "--nproc_per_node 8",
        "-m titanlite.train --job.config_file",
    ):
        assert piece in text, piece
