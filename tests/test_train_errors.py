"""The trainer's own cross-checks (registry, world size, batch, tokenizer, dataset), end to end.

Each case runs ``python -m titanlite.train`` in a fresh folder and must stop with exit
status 2 and a single ``titanlite: config error: ...`` line on stderr that names the
offending key, path or value, before it writes anything. The parser's own checks are
covered in test_config.py. Starting Python with torch costs seconds, so one
module-scoped fixture runs every case (two at a time, one per core) and the tests
check the outcomes afterwards. The mistakes found in one process before any process
group exists (a model or flavor that is not registered, CPU offload without FSDP, a
tokenizer or text corpus that is missing or unusable, bad training data) go through
``main()`` in this process instead, with the same checks; the cases that need a world
size, and the checksum check after start-up, keep their own Python.
"""

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.forked_scripts import run_python
from tests.helpers import write_word_tokenizer
from tests.prepared_data import make_documents, prepare_documents
from titanlite.train import main

ERROR_PREFIX = "titanlite: config error:"
# Keeps any run that wrongly gets past its check short instead of training for 10000 steps.
SMALL_RUN = ["--training.steps", "1", "--training.seq_len", "16", "--training.local_batch_size", "1"]
REPO_ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTED_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOG_RANK")


@dataclass
class Case:
    """One trainer run. `setup(folder)` prepares files in the run's folder and returns the
    extra command-line arguments and the strings (or regexes) its error line must contain."""

    name: str
    setup: object
    env: dict = field(default_factory=dict)
    small_run: bool = True


def _fixed(args: list[str], must_name: list[str]):
    return lambda folder: (args, must_name)


def _missing_hf_assets(folder: Path):
    path = str(folder / "no_such_tokenizer_folder")
    return ["--model.hf_assets_path", path], [re.escape(path)]


def _tokenizer_without_eos(folder: Path):
    # A tokenizer with no end-of-document token to pack with.
    write_word_tokenizer(folder / "no_eos_tokenizer", n_words=100)
    return ["--model.hf_assets_path", str(folder / "no_eos_tokenizer")], [re.escape("no_eos_tokenizer"), "(?i)eos"]


def _missing_text_path(folder: Path):
    path = str(folder / "no_such_corpus")
    return ["--training.dataset", "text", "--training.dataset_path", path], [re.escape(path)]


def _prepared(folder: Path, name: str = "web", hf_assets_path: str | None = None) -> Path:
    return prepare_documents(folder / name, make_documents(1, 200), shard_tokens=2000, hf_assets_path=hf_assets_path)


def _train_on(spec) -> list[str]:
    return ["--training.dataset", "prepared", "--training.dataset_path", str(spec)]


def _prepared_shard_truncated(folder: Path):
    data = _prepared(folder)
    with open(data / "tokens-00001.bin", "r+b") as shard:
        shard.truncate(10)
    return _train_on(data), [re.escape(str(data)), "tokens-00001.bin", "truncated"]


def _prepared_shard_corrupted(folder: Path):
    data = _prepared(folder)
    with open(data / "tokens-00000.bin", "r+b") as shard:
        shard.seek(100)
        byte = shard.read(1)
        shard.seek(100)
        shard.write(bytes([byte[0] ^ 1]))  # still a valid token id: only the checksum can tell
    return _train_on(data), [re.escape(str(data)), "tokens-00000.bin", "checksum"]


def _prepared_without_manifest(folder: Path):
    data = _prepared(folder)
    (data / "manifest.json").unlink()
    return _train_on(data), [re.escape(str(data)), "manifest.json"]


def _prepared_with_another_tokenizer(folder: Path):
    write_word_tokenizer(folder / "word_tokenizer", n_words=30, specials=("<s>", "</s>"))
    data = _prepared(folder, hf_assets_path=str(folder / "word_tokenizer"))
    return _train_on(data), [re.escape(str(data)), "another tokenizer", "byte tokenizer"]


def _prepare_interrupted(folder: Path):
    data = _prepared(folder)
    data.rename(folder / "web.partial")  # what a killed prepare leaves
    return _train_on(data), [re.escape(str(data)), r"\.partial"]


def _mixture_negative_weight(folder: Path):
    web, code = _prepared(folder), _prepared(folder, "code")
    return _train_on(f"{web}:0.5,{code}:-0.5"), ["training.dataset_path", "-0.5", re.escape(str(code))]


def _mixture_missing_folder(folder: Path):
    web, gone = _prepared(folder), folder / "gone"
    return _train_on(f"{web}:0.5,{gone}:0.5"), [re.escape(str(gone)), "no such prepared folder"]


def _text_folder_without_text_files(folder: Path):
    corpus = folder / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "README.md").write_text("not a training file\n")
    (corpus / "sub" / "data.csv").write_text("a,b\n1,2\n")
    (corpus / "notes.json").write_text('{"text": "wrong suffix"}\n')
    return ["--training.dataset", "text", "--training.dataset_path", str(corpus)], [re.escape(str(corpus))]


ERROR_CASES = [
    Case(
        "degrees_do_not_match_world_size",
        _fixed(["--parallelism.data_parallel_shard_degree", "3"], ["data_parallel_shard_degree", r"\b3\b", r"\b4\b"]),
        env={"WORLD_SIZE": "4"},
    ),
    Case(
        "explicit_replicate_times_shard_is_not_world_size",
        _fixed(
            ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "3"],
            ["data_parallel_replicate_degree", "data_parallel_shard_degree", r"\b2\b", r"\b3\b", r"\b4\b"],
        ),
        env={"WORLD_SIZE": "4"},
    ),
    Case(
        "global_batch_not_a_multiple_of_local_times_dp",
        _fixed(
            ["--training.local_batch_size", "4", "--training.global_batch_size", "12"],
            ["training.global_batch_size", r"\b12\b", "local_batch_size", r"\b4\b"],
        ),
        env={"WORLD_SIZE": "2"},
    ),
    # The one bad-data case that needs every step of start-up: the checksums are checked
    # after the process group would be made. The others follow, checked in this process.
    Case("prepared_shard_corrupted", _prepared_shard_corrupted),
]

# Mistakes found in one process before any process group or file exists: run through main()
# in this process (a second each instead of a Python start), with the same checks.
IN_PROCESS_CASES = [
    Case(
        "unknown_model_name",
        _fixed(["--model.name", "llama4"], ["model.name", "'llama4'", "did you mean 'llama3'"]),
    ),
    Case(
        "unknown_model_flavor", _fixed(["--model.name", "llama2", "--model.flavor", "9B"], ["model.flavor", r"\b9B\b"])
    ),
    Case("cpu_offload_on_one_process", _fixed(["--training.enable_cpu_offload"], ["enable_cpu_offload"])),
    Case("missing_hf_assets_path", _missing_hf_assets),
    Case("tokenizer_without_eos", _tokenizer_without_eos),
    Case("text_dataset_missing_path", _missing_text_path),
    Case("text_dataset_folder_without_text_files", _text_folder_without_text_files),
    Case(
        "dataset_path_with_python_stdlib",
        _fixed(["--training.dataset_path", "/nonexistent"], ["training.dataset_path", "/nonexistent", "python_stdlib"]),
    ),
    Case("prepared_shard_truncated", _prepared_shard_truncated),
    Case("prepared_without_manifest", _prepared_without_manifest),
    Case("prepared_with_another_tokenizer", _prepared_with_another_tokenizer),
    Case("prepare_interrupted", _prepare_interrupted),
    Case("mixture_negative_weight", _mixture_negative_weight),
    Case("mixture_missing_folder", _mixture_missing_folder),
]

VALIDATE_ONLY_CASE = Case(
    "validate_only_hsdp",
    _fixed(["--job.validate_only", "--parallelism.data_parallel_replicate_degree", "2"], []),
    env={"WORLD_SIZE": "4"},
    small_run=False,
)


@dataclass
class Outcome:
    result: subprocess.CompletedProcess
    must_name: list[str]
    dump_folder: Path
    files_before: set
    files_after: set


def _listing(folder: Path) -> set:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


def _run(case: Case, folder: Path) -> Outcome:
    folder.mkdir(parents=True)
    args, must_name = case.setup(folder)
    dump_folder = folder / "dump"
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    env.update(case.env)
    # The checkout under test, not whichever titanlite happens to be installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = ["-m", "titanlite.train", "--job.dump_folder", str(dump_folder)]
    command += (SMALL_RUN if case.small_run else []) + args
    before = _listing(folder)
    result = run_python(command, cwd=folder, env=env, timeout=240)
    return Outcome(result, must_name, dump_folder, before, _listing(folder))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_errors")
    cases = ERROR_CASES + [VALIDATE_ONLY_CASE]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case.name: pool.submit(_run, case, root / case.name) for case in cases}
        return {name: future.result() for name, future in futures.items()}


def _describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


@pytest.mark.parametrize("name", [case.name for case in ERROR_CASES])
def test_trainer_reports_one_config_error_line(outcomes, name):
    outcome = outcomes[name]
    result = outcome.result
    assert "Traceback" not in result.stderr + result.stdout, _describe(result)
    assert result.returncode == 2, _describe(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, _describe(result)
    line = lines[0]
    assert line.startswith(ERROR_PREFIX), _describe(result)
    assert line[len(ERROR_PREFIX) :].strip(), _describe(result)
    for pattern in outcome.must_name:
        assert re.search(pattern, line), f"{pattern!r} not in: {line}"
    assert not outcome.dump_folder.exists()
    assert outcome.files_after == outcome.files_before  # nothing written anywhere in the run's folder


@pytest.mark.parametrize("case", IN_PROCESS_CASES, ids=[case.name for case in IN_PROCESS_CASES])
def test_a_mistake_found_in_one_process_is_one_config_error_line(
    case, tmp_path, capsys, monkeypatch, quiet_process_state
):
    for key in DISTRIBUTED_ENV:
        monkeypatch.delenv(key, raising=False)
    folder = tmp_path / case.name
    folder.mkdir()
    args, must_name = case.setup(folder)
    before = _listing(folder)
    capsys.readouterr()
    status = main(["--job.dump_folder", str(folder / "dump")] + SMALL_RUN + args)
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in out + err, (status, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), err
    for pattern in must_name:
        assert re.search(pattern, lines[0]), f"{pattern!r} not in: {lines[0]}"
    assert _listing(folder) == before  # nothing written anywhere in the run's folder


def test_validate_only_accepts_hsdp_and_writes_nothing(outcomes):
    outcome = outcomes[VALIDATE_ONLY_CASE.name]
    result = outcome.result
    assert "Traceback" not in result.stderr + result.stdout, _describe(result)
    assert result.returncode == 0, _describe(result)
    assert ERROR_PREFIX not in result.stderr
    hsdp_lines = [line for line in result.stdout.splitlines() if "HSDP" in line]
    assert len(hsdp_lines) == 1, _describe(result)
    assert re.search(r"\b4\b", hsdp_lines[0]), hsdp_lines[0]  # over the 4 ranks of WORLD_SIZE
    assert not outcome.dump_folder.exists()
    assert outcome.files_after == outcome.files_before
