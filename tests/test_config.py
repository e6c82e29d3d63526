"""Tests for the config parser: precedence, CLI forms, help, errors and the TOML dump."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titanlite.config import ConfigError, JobConfig, format_help, parse_args, to_toml
from titanlite.config.parser import tomllib  # tomllib, or tomli on Python 3.10
from titanlite.config.schema import section_classes, section_of
from titanlite.trainer_setup import save_resolved_config

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def write_toml(tmp_path):
    """Write TOML text to a file in tmp_path and return its path as a string."""

    def write(text: str, name: str = "job.toml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


# ---------------------------------------------------------------------------
# Precedence and the accepted forms
# ---------------------------------------------------------------------------


def test_defaults_without_arguments():
    assert parse_args([]) == JobConfig()


def test_cli_beats_toml_beats_default(write_toml):
    path = write_toml("[training]\nsteps = 20\nseq_len = 64\n[optimizer]\nlr = 1\n")
    config = parse_args(["--job.config_file", path, "--training.steps", "30"])
    assert config.training.steps == 30  # CLI over TOML
    assert config.training.seq_len == 64  # TOML over default
    assert config.training.local_batch_size == 8  # default
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.job.config_file == path


def test_config_file_equals_form_and_position(write_toml):
    path = write_toml("[training]\nsteps = 20\n")
    # The config file is loaded first even when named after the overrides.
    config = parse_args(["--training.seq_len=16", f"--job.config_file={path}"])
    assert (config.training.steps, config.training.seq_len) == (20, 16)


def test_equals_and_space_forms():
    config = parse_args(["--training.steps=7", "--optimizer.lr", "3e-4", "--model.flavor=8B"])
    assert config.training.steps == 7
    assert config.optimizer.lr == pytest.approx(3e-4)
    assert config.model.flavor == "8B"


def test_negative_number_is_a_value_not_an_option():
    config = parse_args(["--parallelism.data_parallel_shard_degree", "-1", "--training.global_batch_size", "-1"])
    assert config.parallelism.data_parallel_shard_degree == -1


def test_last_repeated_option_wins():
    assert parse_args(["--training.steps", "3", "--training.steps", "4"]).training.steps == 4


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--compile.enable"], True),
        (["--compile.enable=true"], True),
        (["--compile.enable=FALSE"], False),
        (["--compile.enable", "false"], False),
        (["--compile.enable", "True"], True),
        (["--compile.enable", "--training.steps", "3"], True),
    ],
)
def test_bool_forms(argv, expected):
    assert parse_args(argv).compile.enable is expected


def test_bool_from_toml_and_cli_override(write_toml):
    path = write_toml("[debug]\ndeterministic = true\n")
    assert parse_args(["--job.config_file", path]).debug.deterministic is True
    assert parse_args(["--job.config_file", path, "--debug.deterministic=false"]).debug.deterministic is False


def test_list_parsing(write_toml):
    assert parse_args(["--compile.components", "model,loss"]).compile.components == ["model", "loss"]
    assert parse_args(["--compile.components= loss , model "]).compile.components == ["loss", "model"]
    assert parse_args(["--compile.components="]).compile.components == []
    path = write_toml('[compile]\ncomponents = ["loss"]\n')
    assert parse_args(["--job.config_file", path]).compile.components == ["loss"]


def test_none_able_fields(write_toml):
    path = write_toml('[lr_scheduler]\ndecay_ratio = 0.25\n[model]\nhf_assets_path = "assets"\n')
    config = parse_args(["--job.config_file", path])
    assert config.lr_scheduler.decay_ratio == 0.25
    assert config.model.hf_assets_path == "assets"
    config = parse_args(
        ["--job.config_file", path, "--lr_scheduler.decay_ratio", "none", "--model.hf_assets_path=NULL"]
    )
    assert config.lr_scheduler.decay_ratio is None
    assert config.model.hf_assets_path is None
    assert parse_args(["--job.config_file", "none"]).job.config_file is None


def test_defaults_are_not_shared_between_parses():
    first = parse_args([])
    first.compile.components.append("loss")
    assert parse_args([]).compile.components == ["model"]


# ---------------------------------------------------------------------------
# --help
# ---------------------------------------------------------------------------


def docstrings_by_plain_text() -> dict[str, str]:
    """'section.key' -> docstring, read from the sections' files by a plain text scan.

    Independent of the parser's ast-based reader, so a broken reader fails the help test.
    A docstring may be wrapped over several lines; its lines are joined with spaces.
    """
    section_of_class = {cls.__name__: name for name, cls in section_classes().items()}
    section_files = dict.fromkeys(sys.modules[cls.__module__].__file__ for cls in section_classes().values())
    docs = {}
    section = key = None
    doc_lines = None  # the lines read so far of a field's docstring that has not ended yet
    for line in (line for path in section_files for line in Path(path).read_text().splitlines()):
        if doc_lines is None and section and key and line.startswith('    """'):
            doc_lines = []
            line = line.replace('"""', "", 1)
        if doc_lines is not None:
            doc_lines.append(line.strip())
            if doc_lines[-1].endswith('"""'):
                doc_lines[-1] = doc_lines[-1].removesuffix('"""')
                docs[f"{section}.{key}"] = " ".join(doc_lines)
                doc_lines = key = None
            continue  # a docstring's words are never a class or a field
        class_match = re.match(r"class (\w+)", line)
        if class_match:
            section = section_of_class.get(class_match.group(1))
        field_match = re.match(r"    (\w+): .+ = ", line)  # a default may go on over more lines
        if field_match:
            key = field_match.group(1)
    return docs


def test_help_lists_every_section_key_and_docstring(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--training.steps", "3", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text == format_help() + "\n"
    flat_help = " ".join(help_text.split())  # docstrings are wrapped over lines
    docs = docstrings_by_plain_text()
    assert len(docs) >= 30
    assert "Peak learning rate." in flat_help
    for section_name in section_classes():  # [quantize.linear.float8] by its whole path
        assert f"[{section_name}]" in help_text
        for key in vars(section_of(JobConfig(), section_name)):
            assert f"--{section_name}.{key}  (" in help_text
            assert " ".join(docs[f"{section_name}.{key}"].split()) in flat_help


def test_help_says_once_what_each_section_holds():
    # JobConfig's fields' docstrings, read by a plain text scan of its file (each is one line).
    source = Path(sys.modules[JobConfig.__module__].__file__).read_text()
    held = dict(re.findall(r'\n    (\w+): \w+ = field\(default_factory=\w+\)\n    """(.+)"""', source))
    assert list(held) == list(vars(JobConfig()))
    flat_help = " ".join(format_help().split())
    for field_name, doc in held.items():
        # [quantize] is a level of tables: its docstring stands under [quantize.linear.float8].
        first_section = next(name for name in section_classes() if name.partition(".")[0] == field_name)
        assert f"[{first_section}] {doc} --{first_section}." in flat_help
        assert flat_help.count(doc) == 1


def test_help_shows_types_and_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["-h"])
    help_text = capsys.readouterr().out
    assert "--training.steps  (int, default: 10000)" in help_text
    assert "--optimizer.name  (one of AdamW|Adam, default: AdamW)" in help_text
    assert "--lr_scheduler.decay_ratio  (float or none, default: none)" in help_text
    assert "--compile.components  (list of str, default: model)" in help_text
    assert "--compile.enable  (bool, default: false)" in help_text


# ---------------------------------------------------------------------------
# Malformed inputs: one ConfigError each, one line, naming key or file
# ---------------------------------------------------------------------------

# (test id, TOML text or None, command-line arguments, text the message must contain).
# "{file}" in the expected text stands for the TOML file's path.
MALFORMED_INPUTS = [
    ("toml unknown key", "[training]\nstep = 5\n", [], ["training.step'", "'training.steps'", "{file}"]),
    ("cli unknown key", None, ["--training.step", "5"], ["--training.step'", "'--training.steps'"]),
    ("toml key in wrong section", "[training]\nlr = 0.1\n", [], ["training.lr", "'optimizer.lr'"]),
    ("toml typo'd section", "[trainig]\nsteps = 5\n", [], ["'trainig'", "'training'", "{file}"]),
    ("cli typo'd section", None, ["--optimzer.lr", "0.1"], ["optimzer.lr", "'--optimizer.lr'"]),
    ("cli option without section", None, ["--steps", "5"], ["'--steps'", "'--training.steps'"]),
    ("toml int given float", "[training]\nsteps = 3.0\n", [], ["training.steps", "int", "3.0", "{file}"]),
    ("toml int given bool", "[training]\nsteps = true\n", [], ["training.steps", "int", "true"]),
    ("toml int given string", '[training]\nsteps = "3"\n', [], ["training.steps", "int"]),
    ("cli int given word", None, ["--training.steps", "ten"], ["training.steps", "int", "'ten'"]),
    ("cli int given float", None, ["--training.seq_len=2.5"], ["training.seq_len", "int", "'2.5'"]),
    ("cli float given word", None, ["--optimizer.lr", "fast"], ["optimizer.lr", "float", "'fast'"]),
    ("cli float given nan", None, ["--optimizer.lr", "nan"], ["optimizer.lr", "float", "'nan'"]),
    ("toml float given bool", "[optimizer]\nlr = false\n", [], ["optimizer.lr", "float", "false"]),
    ("toml float given string", '[optimizer]\nlr = "1e-3"\n', [], ["optimizer.lr", "float"]),
    ("cli bool given word", None, ["--compile.enable=yes"], ["compile.enable", "bool", "'yes'"]),
    ("toml bool given int", "[compile]\nenable = 1\n", [], ["compile.enable", "bool", "1"]),
    ("cli literal not a choice", None, ["--optimizer.name", "SGD"], ["optimizer.name", "AdamW|Adam", "'SGD'"]),
    ("toml literal not a choice", '[training]\ndataset = "wikipedia"\n', [],
     ["training.dataset", "python_stdlib|text|huggingface|c4|c4_validation|c4_test", '"wikipedia"']),
    ("toml list given string", '[compile]\ncomponents = "model"\n', [], ["compile.components", "list of str"]),
    ("toml list of ints", "[compile]\ncomponents = [1]\n", [], ["compile.components", "list of str"]),
    ("toml str given int", "[activation_checkpoint]\nselective_ac_option = 2\n", [],
     ["activation_checkpoint.selective_ac_option", "str"]),
    ("toml optional given bool", "[lr_scheduler]\ndecay_ratio = true\n", [],
     ["lr_scheduler.decay_ratio", "float or none"]),
    ("bad toml syntax", "[training]\nsteps = = 3\n", [], ["{file}", "line 2"]),
    ("toml key set twice", "[training]\nsteps = 1\nsteps = 2\n", [],
     ["{file}: training.steps is set twice (line 3)"]),
    ("toml quoted key set twice", '[optimizer]\nlr = 0.1\n\n[training]\n"seq_len" = 8\nseq_len = 16  # again\n', [],
     ["{file}: training.seq_len is set twice (line 6)"]),
    ("toml table declared twice", "[training]\nsteps = 1\n[optimizer]\nlr = 0.1\n[training]\nseq_len = 4\n", [],
     ["{file}: [training] is declared twice (line 5)"]),
    ("non-table section", "training = 5\n", [], ["'training'", "table", "{file}"]),
    ("key outside any section", "steps = 5\n", [], ["'steps'", "'training.steps'", "{file}"]),
    ("missing value at end", None, ["--training.steps"], ["--training.steps", "missing its value"]),
    ("missing value before option", None, ["--training.steps", "--optimizer.lr", "1"], ["--training.steps", "missing"]),
    ("stray positional", None, ["train.toml"], ["'train.toml'"]),
    ("positional after bool flag", None, ["--compile.enable", "yes"], ["'yes'"]),
    ("single-dash option", None, ["-training.steps", "3"], ["'-training.steps'"]),
    ("negative steps", None, ["--training.steps", "-5"], ["training.steps", ">= 1", "-5"]),
    ("zero seq_len", "[training]\nseq_len = 0\n", [], ["training.seq_len", ">= 1"]),
    ("zero local batch", None, ["--training.local_batch_size=0"], ["training.local_batch_size"]),
    ("zero global batch", None, ["--training.global_batch_size=0"], ["training.global_batch_size", "-1 or >= 1"]),
    ("negative max_norm", None, ["--training.max_norm=-1"], ["training.max_norm"]),
    ("zero gc_freq", None, ["--training.gc_freq=0"], ["training.gc_freq"]),
    ("lr zero", None, ["--optimizer.lr", "0"], ["optimizer.lr", "> 0"]),
    ("beta2 one", "[optimizer]\nbeta2 = 1.0\n", [], ["optimizer.beta2", "[0, 1)"]),
    ("beta1 negative", None, ["--optimizer.beta1=-0.1"], ["optimizer.beta1"]),
    ("eps zero", None, ["--optimizer.eps=0"], ["optimizer.eps"]),
    ("negative weight decay", None, ["--optimizer.weight_decay=-0.1"], ["optimizer.weight_decay"]),
    ("negative warmup", None, ["--lr_scheduler.warmup_steps=-1"], ["lr_scheduler.warmup_steps"]),
    ("decay_ratio above one", None, ["--lr_scheduler.decay_ratio", "1.5"], ["lr_scheduler.decay_ratio", "[0, 1]"]),
    ("min_lr_factor above one", None, ["--lr_scheduler.min_lr_factor=2"], ["lr_scheduler.min_lr_factor"]),
    ("selective_ac_option word", None, ["--activation_checkpoint.selective_ac_option", "all"],
     ["activation_checkpoint.selective_ac_option", "'op'"]),
    ("selective_ac_option zero", None, ["--activation_checkpoint.selective_ac_option=0"],
     ["activation_checkpoint.selective_ac_option"]),
    ("unknown compile component", None, ["--compile.components", "model,lossy"], ["compile.components", "'lossy'"]),
    ("degree zero", None, ["--parallelism.data_parallel_replicate_degree=0"],
     ["parallelism.data_parallel_replicate_degree"]),
    ("two -1 degrees", None, ["--parallelism.data_parallel_replicate_degree=-1"],
     ["parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree"]),
    ("zero log_freq", None, ["--metrics.log_freq=0"], ["metrics.log_freq"]),
    ("zero stop save time", "[checkpoint]\nstop_save_seconds = 0\n", [],
     ["checkpoint.stop_save_seconds", ">= 1", "got 0"]),
    ("zero init timeout", None, ["--comm.init_timeout_seconds=0"], ["comm.init_timeout_seconds"]),
    ("negative trace buffer", None, ["--comm.trace_buf_size=-1"], ["comm.trace_buf_size", ">= 0"]),
    ("text dataset without path", None, ["--training.dataset", "text"], ["training.dataset_path", "'text'"]),
    ("huggingface dataset path unset", '[training]\ndataset = "huggingface"\ndataset_path = "c4"\n',
     ["--training.dataset_path=none"], ["training.dataset_path"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "toml_text, argv, expected_parts",
    [case[1:] for case in MALFORMED_INPUTS],
    ids=[case[0] for case in MALFORMED_INPUTS],
)
def test_malformed_input_raises_one_line_config_error(write_toml, toml_text, argv, expected_parts):
    file_path = write_toml(toml_text) if toml_text is not None else None
    if file_path is not None:
        argv = ["--job.config_file", file_path, *argv]
    with pytest.raises(ConfigError) as error_info:
        parse_args(argv)
    message = str(error_info.value)
    assert "\n" not in message
    for part in expected_parts:
        assert part.replace("{file}", str(file_path)) in message


def test_missing_config_file_names_it(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        parse_args(["--job.config_file", str(missing)])


def test_directory_as_config_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        parse_args([f"--job.config_file={tmp_path}"])


def test_non_utf8_config_file_names_it(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[job]\ndescription = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        parse_args(["--job.config_file", str(path)])


def test_config_error_is_a_value_error_and_folds_lines():
    assert issubclass(ConfigError, ValueError)
    assert "\n" not in str(ConfigError("first\nsecond"))


# ---------------------------------------------------------------------------
# The TOML dump
# ---------------------------------------------------------------------------


def test_to_toml_round_trip(tmp_path):
    argv = [
        "--training.steps=12",
        "--training.dataset=text",
        '--training.dataset_path=data/a "quoted"\\path\n.txt',
        "--optimizer.lr=1e-5",
        "--optimizer.eps=1e-12",
        "--lr_scheduler.decay_ratio=0.5",
        "--compile.enable",
        "--compile.components=model,loss",
        "--job.description=caf\u00e9\ttab \x7f",
        "--activation_checkpoint.selective_ac_option=op",
        "--parallelism.data_parallel_shard_degree=2",
        "--parallelism.data_parallel_replicate_degree=-1",
    ]
    config = parse_args(argv)
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(to_toml(config), encoding="utf-8")
    reloaded = parse_args(["--job.config_file", str(dumped)])
    config.job.config_file = str(dumped)  # the only field that records where it came from
    assert reloaded == config
    assert to_toml(JobConfig()).count("[") >= len(vars(JobConfig()))


def test_defaults_round_trip(tmp_path):
    dumped = tmp_path / "defaults.toml"
    dumped.write_text(to_toml(JobConfig()))
    reloaded = parse_args(["--job.config_file", str(dumped), "--job.config_file=none"])
    assert reloaded == JobConfig()


@pytest.mark.parametrize("print_config", [False, True])
def test_rank_zero_saves_the_resolved_config_and_prints_it_when_asked(tmp_path, caplog, print_config):
    dump = tmp_path / "dump"
    config = parse_args(["--job.dump_folder", str(dump), f"--job.print_config={str(print_config).lower()}"])
    with caplog.at_level(logging.INFO, logger="titanlite"):
        save_resolved_config(config, rank=1)
    assert not dump.exists()  # rank 0 writes it
    with caplog.at_level(logging.INFO, logger="titanlite"):
        save_resolved_config(config, rank=0)
    saved = dump / "resolved_config.toml"
    assert saved.read_text() == to_toml(config)
    assert [path.name for path in dump.iterdir()] == [saved.name]  # no temporary left beside it
    assert caplog.text.count(f"resolved config saved to {saved}") == 1
    dumps = caplog.text.count("[training]")
    assert dumps == (2 if print_config else 0)  # on both ranks' consoles, where their logs are shown


# ---------------------------------------------------------------------------
# python -m titanlite.config: the dry run
# ---------------------------------------------------------------------------


def run_dry_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "titanlite.config", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "toml_text, args",
    [
        (None, ["--training.step", "5"]),
        ("[training]\nsteps = = 3\n", []),
        (None, ["--training.steps", "0"]),
        (None, ["--job.config_file", "missing.toml"]),
    ],
    ids=["unknown key", "bad toml", "range", "missing file"],
)
def test_dry_run_config_error_exits_2_with_one_line(tmp_path, toml_text, args):
    if toml_text is not None:
        (tmp_path / "bad.toml").write_text(toml_text)
        args = ["--job.config_file", "bad.toml", *args]
    result = run_dry_run(["--job.dump_folder", "out", *args], cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    stderr_lines = result.stderr.splitlines()
    assert len(stderr_lines) == 1
    assert stderr_lines[0].startswith("titanlite: config error: ")
    assert result.stdout == ""
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_resolved_toml(tmp_path):
    result = run_dry_run(["--training.steps", "42", "--compile.enable"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["training"]["steps"] == 42
    assert printed["compile"]["enable"] is True
    assert result.stderr == ""


def test_dry_run_get_prints_one_resolved_value(tmp_path):
    """The launch scripts read checkpoint.stop_save_seconds this way: the TOML file counts,
    the command line wins over it, and the trainer's --debug flag is accepted as in training."""
    (tmp_path / "job.toml").write_text("[checkpoint]\nstop_save_seconds = 77\n[compile]\ncomponents = []\n")
    key = ["--get", "checkpoint.stop_save_seconds"]
    for args, printed in [
        (["--job.config_file", "job.toml", *key], "77\n"),
        (["--job.config_file", "job.toml", "--checkpoint.stop_save_seconds", "123", "--debug", *key], "123\n"),
        (["--get=compile.components", "--compile.components", "loss,model"], "loss,model\n"),
        (["--get", "lr_scheduler.decay_ratio"], "none\n"),
    ]:
        result = run_dry_run(args, cwd=tmp_path)
        assert (result.returncode, result.stdout, result.stderr) == (0, printed, ""), args


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--get", "checkpoint.stop_save_second"],
            "unknown key 'checkpoint.stop_save_second' for --get; did you mean 'checkpoint.stop_save_seconds'?",
        ),
        (["--get"], "--get needs a key, e.g. --get checkpoint.stop_save_seconds"),
        (
            ["--get", "checkpoint.stop_save_seconds", "--checkpoint.stop_save_seconds", "0"],
            "checkpoint.stop_save_seconds must be >= 1, got 0",
        ),
    ],
    ids=["unknown key", "no key", "bad config"],
)
def test_dry_run_get_mistakes_are_one_line(tmp_path, args, message):
    result = run_dry_run(args, cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"titanlite: config error: {message}\n")
