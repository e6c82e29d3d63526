"""Bad input, in one table: malformed config files and command lines, impossible layouts,
missing or empty data, a tokenizer that does not fit the model, and checkpoints that do
not fit the run.

Every case runs ``titanlite.train.main(argv)`` in this process and must end with a
non-zero exit status and exactly one stderr line, ``titanlite: <kind> error: ...``, that
names the offending key, file or step; no traceback; and no file created, changed or
deleted (a case that starts from an existing checkpoint must leave it as it was; a
"mid_run" case, whose mistake only the running loader can find, may leave what the run's
start wrote).

A bare ``--debug`` adds the traceback after that line (the last test).

The parser's own checks are also covered, one assertion each, in test_config.py, and a
few trainer checks as subprocesses in test_train_errors.py; this table is the one that
goes through every error path of ``main`` end to end.
"""

import re
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_args
from tests.prepared_data import prepare_documents
from tests.s3_server import BUCKET, CREDENTIALS, s3_server
from titanlite.train import main

# Keeps any case that wrongly gets past its check to one short step of the tiny model.
SMALL_RUN = tiny_args({"training.steps": 1})
DISTRIBUTED_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOG_RANK")
CHECKPOINT_STEP = 1


@dataclass(frozen=True)
class Case:
    """One bad run. In `argv` and `expect`, "{tmp}" stands for the case's own folder (escaped
    for the regex in `expect`); `setup(tmp)` writes the files the case needs there first."""

    id: str
    argv: list
    expect: str  # a regex the single stderr line must match
    kind: str | None = "config"  # None: any "titanlite: " line
    setup: object = None
    env: dict = field(default_factory=dict)
    code: int | None = 2  # None: any non-zero exit status
    from_checkpoint: bool = False  # start from a copy of the tiny checkpoint in dump/checkpoint
    mid_run: bool = False  # found only once training reads the data: the run's start may write files
    s3: str | None = None  # "server": a local S3 server (tests/s3_server.py); "refusing credentials": it refuses ours


# --- files the cases write ----------------------------------------------------------------


def _write(relative: str, text: str):
    def setup(tmp: Path) -> None:
        path = tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    return setup


def _write_bytes(relative: str, data: bytes):
    def setup(tmp: Path) -> None:
        (tmp / relative).write_bytes(data)

    return setup


def _torn_remote_step(key: str):
    """A step folder in the S3 server's bucket with its data and .metadata but no commit marker."""

    def setup(tmp: Path) -> None:
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        for name in (".metadata", "__0_0.distcp"):
            fs.pipe_file(f"{BUCKET}/{key}/{name}", b"x")

    return setup


def _make_folders(*relatives: str):
    def setup(tmp: Path) -> None:
        for relative in relatives:
            (tmp / relative).mkdir(parents=True)

    return setup


def _word_tokenizer(relative: str, n_words: int, eos: bool = True):
    """A word-level tokenizer.json with n_words words, [UNK] and (optionally) an EOS token."""

    def setup(tmp: Path) -> None:
        from tokenizers import AddedToken, Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace

        vocab = {f"w{index}": index for index in range(n_words)}
        vocab["[UNK]"] = n_words
        tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = Whitespace()
        if eos:
            tokenizer.add_special_tokens([AddedToken("<|end_of_text|>", special=True)])
        folder = tmp / relative
        folder.mkdir(parents=True)
        tokenizer.save(str(folder / "tokenizer.json"))

    return setup


def _prepared_with_word_tokenizer(relative: str):
    """A prepared folder of two documents, tokenized with a word-level tokenizer (not the run's)."""

    def setup(tmp: Path) -> None:
        _word_tokenizer("word_tokenizer", n_words=100)(tmp)
        prepare_documents(tmp / relative, ["w1 w2 w3", "w4 w5"], hf_assets_path=str(tmp / "word_tokenizer"))

    return setup


# --- the table ----------------------------------------------------------------------------

T = "{tmp}"
CASES = [
    # The TOML file.
    Case("toml_syntax_error", ["--job.config_file", f"{T}/job.toml"],
         r"invalid TOML in {tmp}/job\.toml: .*line 3", setup=_write("job.toml", "[training]\nsteps = 2\nseq_len = = 3\n")),
    Case("toml_unknown_section", ["--job.config_file", f"{T}/job.toml"],
         r"unknown section 'trainig' in {tmp}/job\.toml; did you mean 'training'\?", setup=_write("job.toml", "[trainig]\nsteps = 5\n")),
    Case("toml_unknown_key", ["--job.config_file", f"{T}/job.toml"],
         r"unknown key 'training\.step' in {tmp}/job\.toml; did you mean 'training\.steps'\?", setup=_write("job.toml", "[training]\nstep = 5\n")),
    Case("toml_key_in_wrong_section", ["--job.config_file", f"{T}/job.toml"],
         r"unknown key 'training\.lr' in {tmp}/job\.toml; did you mean 'optimizer\.lr'\?", setup=_write("job.toml", "[training]\nlr = 0.1\n")),
    Case("toml_wrong_type", ["--job.config_file", f"{T}/job.toml"],
         r"training\.steps in {tmp}/job\.toml expects int, got \"ten\" \(str\)", setup=_write("job.toml", '[training]\nsteps = "ten"\n')),
    Case("toml_bool_for_int", ["--job.config_file", f"{T}/job.toml"],
         r"training\.local_batch_size in {tmp}/job\.toml expects int, got true", setup=_write("job.toml", "[training]\nlocal_batch_size = true\n")),
    Case("toml_section_not_a_table", ["--job.config_file", f"{T}/job.toml"],
         r"'optimizer' in {tmp}/job\.toml must be a table", setup=_write("job.toml", "optimizer = 0.1\n")),
    Case("toml_not_utf8", ["--job.config_file", f"{T}/job.toml"],
         r"config file {tmp}/job\.toml is not valid UTF-8", setup=_write_bytes("job.toml", b'[job]\ndescription = "caf\xe9"\n')),
    Case("config_file_missing", ["--job.config_file", f"{T}/missing.toml"], r"config file {tmp}/missing\.toml not found"),
    Case("config_file_is_a_folder", ["--job.config_file", f"{T}/configs"],
         r"cannot read config file {tmp}/configs", setup=_make_folders("configs")),
    # The command line.
    Case("cli_missing_value_at_end", ["--training.steps"], r"option --training\.steps on the command line is missing its value"),
    Case("cli_missing_value_before_option", ["--optimizer.lr", "--training.steps", "1"], r"option --optimizer\.lr .*missing its value"),
    Case("cli_unknown_key", ["--training.step", "5"], r"unknown option '--training\.step'.*did you mean '--training\.steps'\?"),
    Case("cli_unknown_section", ["--optimzer.lr", "0.1"], r"unknown option '--optimzer\.lr'.*did you mean '--optimizer\.lr'\?"),
    Case("cli_key_without_section", ["--seq_len", "64"], r"unknown option '--seq_len'.*did you mean '--training\.seq_len'\?"),
    Case("cli_stray_argument", ["train.toml"], r"unexpected argument 'train\.toml'"),
    Case("cli_bad_bool", ["--checkpoint.enable=yes"], r"checkpoint\.enable on the command line expects bool, got 'yes'"),
    Case("cli_bad_int", ["--training.local_batch_size", "two"], r"training\.local_batch_size on the command line expects int, got 'two'"),
    Case("cli_float_for_int", ["--training.seq_len=2.5"], r"training\.seq_len on the command line expects int, got '2\.5'"),
    Case("cli_bad_float", ["--optimizer.lr", "fast"], r"optimizer\.lr on the command line expects float, got 'fast'"),
    Case("cli_nan_float", ["--optimizer.lr", "nan"], r"optimizer\.lr on the command line expects float, got 'nan'"),
    Case("cli_not_a_choice", ["--optimizer.name", "SGD"], r"optimizer\.name on the command line expects one of AdamW\|Adam, got 'SGD'"),
    # Values out of range and settings that contradict each other.
    Case("steps_zero", ["--training.steps", "0"], r"training\.steps must be >= 1, got 0"),
    Case("local_batch_zero", ["--training.local_batch_size=0"], r"training\.local_batch_size must be >= 1, got 0"),
    Case("beta2_one", ["--optimizer.beta2", "1.0"], r"optimizer\.beta2 must be in \[0, 1\), got 1\.0"),
    Case("decay_ratio_above_one", ["--lr_scheduler.decay_ratio", "1.5"], r"lr_scheduler\.decay_ratio must be in \[0, 1\]"),
    Case("degree_zero", ["--parallelism.data_parallel_shard_degree=0"], r"parallelism\.data_parallel_shard_degree must be -1 or >= 1, got 0"),
    Case("two_inferred_degrees", ["--parallelism.data_parallel_replicate_degree=-1"],
         r"parallelism\.data_parallel_replicate_degree and parallelism\.data_parallel_shard_degree"),
    Case("load_step_below_minus_one", ["--checkpoint.load_step=-2"], r"checkpoint\.load_step must be -1 or >= 0, got -2"),
    Case("load_step_without_checkpointing", ["--checkpoint.load_step", "4"], r"checkpoint\.load_step \(4\) needs checkpoint\.enable"),
    Case("unknown_part_not_to_load", ["--checkpoint.exclude_from_loading", "optimizer,schedule"], r"checkpoint\.exclude_from_loading must be a subset of"),
    Case("validation_longer_than_training", ["--validation.enable", "--validation.seq_len", "64"],
         r"validation\.seq_len \(64\) must not exceed training\.seq_len \(32\)"),
    # Downstream tasks: the file and the line that is wrong.
    Case("eval_task_missing", ["--eval.enable", "--eval.tasks", f"{T}/none.jsonl"],
         r"eval\.tasks: \S+/none\.jsonl: no such file, nor a shipped task \(python_brackets, python_keywords\)"),
    Case("eval_task_malformed_line", ["--eval.enable", "--eval.tasks", f"{T}/task.jsonl"],
         r"\S+/task\.jsonl:2: not a JSON object", setup=_write("task.jsonl", '{"context": "a", "choices": ["b"], "label": 0}\n{"context": \n')),
    Case("eval_task_label_out_of_range", ["--eval.enable", "--eval.tasks", f"{T}/task.jsonl"],
         r'\S+/task\.jsonl:1: "label" must be an integer from 0 to 1, got 2', setup=_write("task.jsonl", '{"context": "a", "choices": ["b", "c"], "label": 2}\n')),
    Case("eval_task_empty_choices", ["--eval.enable", "--eval.tasks", f"{T}/task.jsonl"],
         r'\S+/task\.jsonl:1: "choices" is empty', setup=_write("task.jsonl", '{"context": "a", "choices": [], "label": 0}\n')),
    Case("hf_seed_without_path", ["--checkpoint.initial_load_in_hf"], r"checkpoint\.initial_load_in_hf needs checkpoint\.initial_load_path"),
    # Object storage: run files stay local; a checkpoint URL is checked before any rank starts.
    Case("dump_folder_url", ["--job.dump_folder", "gs://bucket/run"], r"job\.dump_folder is a URL \(gs://\.\.\.\)"),
    Case("checkpoint_folder_unknown_scheme", ["--checkpoint.enable", "--checkpoint.folder", "s4://bucket/run"],
         r"checkpoint\.folder: s4:// is not a storage scheme fsspec knows"),
    Case("checkpoint_folder_backend_not_installed", ["--checkpoint.enable", "--checkpoint.folder", "gs://bucket/run"],
         r'checkpoint\.folder: gs:// needs its fsspec backend, which is not installed: pip install "titanlite\[gcs\]"'),
    # Credentials in the URL never reach the line.
    Case("initial_load_path_url_with_credentials", ["--checkpoint.initial_load_path", "s3://AKIDX:wJalrSECRET@bucket/run/step-5"],
         r"^(?!.*(AKIDX|wJalrSECRET|bucket/run))checkpoint\.initial_load_path: a s3:// URL with credentials in it"),
    Case("checkpoint_folder_missing_bucket", ["--checkpoint.enable", "--checkpoint.folder", "s3://no-such-bucket/run"],
         r"checkpoint\.folder: the bucket of s3://no-such-bucket/run does not exist", s3="server"),
    Case("checkpoint_folder_wrong_credentials", ["--checkpoint.enable", "--checkpoint.folder", f"s3://{BUCKET}/run"],
         rf"^(?!.*({CREDENTIALS['AWS_SECRET_ACCESS_KEY']}|{CREDENTIALS['AWS_ACCESS_KEY_ID']}))checkpoint\.folder: "
         r"s3://\S+ cannot be listed \(PermissionError: .*Access Key Id", s3="refusing credentials"),
    Case("checkpoint_folder_endpoint_refuses", ["--checkpoint.enable", "--checkpoint.folder", f"s3://{BUCKET}/run"],
         r"checkpoint\.folder: s3://\S+ cannot be listed \(EndpointConnectionError: Could not connect",
         env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", **CREDENTIALS}),
    Case("initial_load_path_uncommitted_step", ["--checkpoint.initial_load_path", f"s3://{BUCKET}/torn/step-3"],
         r"checkpoint\.initial_load_path s3://\S+/torn/step-3: the save did not finish \(no \.committed marker\)",
         kind="checkpoint", s3="server", setup=_torn_remote_step("torn/step-3")),
    Case("hf_seed_not_model_only", ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", f"{T}/hf",
                                    "--checkpoint.initial_load_model_only=false"], r"checkpoint\.initial_load_model_only must be true"),
    # The model and the layout.
    Case("unknown_model_name", ["--model.name", "llama4"], r"model\.name 'llama4' is not known .*did you mean 'llama3'\?"),
    Case("unknown_model_flavor", ["--model.flavor", "tiniest"], r"model\.flavor of llama3 'tiniest' is not known"),
    Case("flavor_in_other_case", ["--model.flavor", "8b"], r"model\.flavor of llama3 '8b' is not known .*did you mean '8B'\?$"),
    Case("qwen3_flavor_in_other_case", ["--model.name=qwen3", "--model.flavor=4b"], r"model\.flavor of qwen3 '4b' .*did you mean '4B'\?$"),
    Case("degrees_do_not_multiply_to_world_size", ["--job.validate_only", "--parallelism.data_parallel_replicate_degree", "2",
                                                   "--parallelism.data_parallel_shard_degree", "3"],
         r"parallelism\.data_parallel_replicate_degree \(2\) x parallelism\.data_parallel_shard_degree \(3\) must equal the world size \(4\)",
         env={"WORLD_SIZE": "4"}),
    Case("degree_does_not_divide_world_size", ["--job.validate_only", "--parallelism.data_parallel_replicate_degree", "3"],
         r"parallelism\.data_parallel_replicate_degree \(3\) must divide the world size \(4\)", env={"WORLD_SIZE": "4"}),
    Case("global_batch_does_not_divide", ["--job.validate_only", "--training.global_batch_size", "6"],
         r"training\.global_batch_size \(6\) must be a multiple of training\.local_batch_size \(2\) x data-parallel degree \(4\)",
         env={"WORLD_SIZE": "4"}),
    # Tensor parallelism: the degree against the model's shapes and the world; async TP's needs.
    Case("tp_does_not_divide_heads", ["--job.validate_only", "--parallelism.tensor_parallel_degree=3"],
         r"^parallelism\.tensor_parallel_degree \(3\) must divide the model's attention heads \(4\) \(llama3 tiny\)$",
         env={"WORLD_SIZE": "3"}),
    Case("tp_does_not_divide_kv_heads", ["--job.validate_only", "--parallelism.tensor_parallel_degree=4"],
         r"^parallelism\.tensor_parallel_degree \(4\) must divide the model's key/value heads \(2\) \(llama3 tiny\)$",
         env={"WORLD_SIZE": "4"}),
    # 40 heads and 40 key/value heads split over 5 ranks, its 13824 FFN features do not.
    Case("tp_does_not_divide_ffn", ["--job.validate_only", "--model.name=llama2", "--model.flavor=13B",
                                    "--parallelism.tensor_parallel_degree=5"],
         r"^parallelism\.tensor_parallel_degree \(5\) must divide the model's FFN hidden size \(13824\) \(llama2 13B\)$",
         env={"WORLD_SIZE": "5"}),
    Case("tp_does_not_divide_world_size", ["--job.validate_only", "--parallelism.tensor_parallel_degree=3"],
         r"^parallelism\.tensor_parallel_degree \(3\) must divide the world size \(4\)$", env={"WORLD_SIZE": "4"}),
    Case("inferred_degree_with_tp", ["--job.validate_only", "--parallelism.tensor_parallel_degree=2",
                                     "--parallelism.data_parallel_replicate_degree=3"],
         r"^parallelism\.data_parallel_replicate_degree \(3\) must divide the world size \(8\) / "
         r"parallelism\.tensor_parallel_degree \(2\) when the other degree is -1$", env={"WORLD_SIZE": "8"}),
    Case("sequence_parallel_seq_len_does_not_split", ["--job.validate_only", "--parallelism.tensor_parallel_degree=2",
                                                       "--training.seq_len=31"],
         r"^training\.seq_len \(31\) must be a multiple of parallelism\.tensor_parallel_degree \(2\) with sequence "
         r"parallel; change it or set parallelism\.enable_sequence_parallel = false$", env={"WORLD_SIZE": "2"}),
    # An MoE layer under TP routes an equal slice of every sequence on each rank, sequence parallel or not.
    Case("moe_tp_seq_len_does_not_split", ["--job.validate_only", "--parallelism.tensor_parallel_degree=2",
                                           "--parallelism.enable_sequence_parallel=false", "--model.name=qwen3",
                                           "--model.flavor=tiny_moe", "--training.seq_len=31"],
         r"^training\.seq_len \(31\) must be a multiple of parallelism\.tensor_parallel_degree \(2\) with an MoE "
         r"model: each TP rank routes an equal slice of every sequence$", env={"WORLD_SIZE": "2"}),
    Case("ep_not_a_multiple_of_tp", ["--job.validate_only", "--parallelism.tensor_parallel_degree=2",
                                     "--parallelism.expert_parallel_degree=3", "--model.name=qwen3",
                                     "--model.flavor=tiny_moe"],
         r"^parallelism\.expert_parallel_degree \(3\) must be a multiple of parallelism\.tensor_parallel_degree "
         r"\(2\): expert parallelism borrows all the TP ranks, then FSDP ranks$", env={"WORLD_SIZE": "4"}),
    Case("async_tp_without_cuda", ["--job.validate_only", "--parallelism.tensor_parallel_degree=2", "--compile.enable",
                                   "--parallelism.enable_async_tensor_parallel"],
         r"^parallelism\.enable_async_tensor_parallel needs CUDA GPUs; set it to false$", env={"WORLD_SIZE": "2"}),
    Case("async_tp_without_compile", ["--job.validate_only", "--parallelism.tensor_parallel_degree=2",
                                      "--parallelism.enable_async_tensor_parallel"],
         r"^parallelism\.enable_async_tensor_parallel needs compile\.enable with 'model' in compile\.components(, CUDA GPUs)?; "
         r"set it to false$",
         env={"WORLD_SIZE": "2"}),
    # Pipeline parallelism: the degree against the world, the stages against the schedule and
    # the micro-batches against the batch (tests/test_pipeline_plan.py has every rule).
    Case("pp_does_not_divide_world_size", ["--job.validate_only", "--parallelism.pipeline_parallel_degree=2"],
         r"^parallelism\.pipeline_parallel_degree \(2\) must divide the world size \(3\)$", env={"WORLD_SIZE": "3"}),
    Case("pp_unknown_schedule", ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=ZBV"],
         r"^parallelism\.pipeline_parallel_schedule 'ZBV' is not known \(choose from GPipe, .*\)"),
    Case("pp_v_schedule_without_two_stages_per_rank", ["--job.validate_only", "--parallelism.pipeline_parallel_degree=2",
                                                       "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
                                                       "--parallelism.module_fqns_per_model_part",
                                                       "tok_embeddings,layers.0;layers.1,layers.2,norm,output"],
         r"^parallelism\.pipeline_parallel_schedule ZBVZeroBubble needs exactly 2 stage\(s\) per pp rank, but "
         r"parallelism\.module_fqns_per_model_part gives 2 stage\(s\) over parallelism\.pipeline_parallel_degree = 2$",
         env={"WORLD_SIZE": "2"}),
    Case("pp_looped_schedule_with_one_stage_per_rank", ["--job.validate_only", "--parallelism.pipeline_parallel_degree=2",
                                                        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                                                        "--parallelism.pipeline_parallel_layers_per_stage=3",
                                                        "--parallelism.pipeline_parallel_last_stage_less_layers=2"],
         r"^parallelism\.pipeline_parallel_schedule Interleaved1F1B needs 2 or more stage\(s\) per pp rank, but "
         r"parallelism\.pipeline_parallel_layers_per_stage gives 2 stage\(s\)", env={"WORLD_SIZE": "2"}),
    Case("pp_batch_does_not_split_into_microbatches", ["--job.validate_only", "--parallelism.pipeline_parallel_degree=2",
                                                       "--parallelism.pipeline_parallel_microbatch_size=3"],
         r"^training\.local_batch_size \(2\) must be a multiple of parallelism\.pipeline_parallel_microbatch_size \(3\)$",
         env={"WORLD_SIZE": "2"}),
    Case("pp_1f1b_with_fewer_microbatches_than_stages", ["--job.validate_only", "--parallelism.pipeline_parallel_degree=2",
                                                         "--parallelism.pipeline_parallel_microbatch_size=2"],
         r"^1F1B needs at least one micro-batch per stage: .* = 1 is below the 2 stages",
         env={"WORLD_SIZE": "2"}),
    Case("global_batch_does_not_divide_one_rank", ["--training.global_batch_size", "5"],
         r"training\.global_batch_size \(5\) must be a multiple of training\.local_batch_size \(2\)"),
    Case("cpu_offload_on_one_rank", ["--training.enable_cpu_offload"], r"training\.enable_cpu_offload needs FSDP"),
    # Float8 (torchao).
    Case("float8_unknown_converter", ["--model.converters", "mx"], r"model\.converters: 'mx' is not a converter titanlite has; it has float8 only"),
    Case("float8_bad_recipe", ["--quantize.linear.float8.recipe_name", "rowwize"],
         r"quantize\.linear\.float8\.recipe_name on the command line expects one of tensorwise\|rowwise\|rowwise_with_gw_hp, got 'rowwize'"),
    Case("float8_experts", ["--model.converters", "quantize.grouped_mm.float8"], r"'quantize\.grouped_mm\.float8' \(float8 MoE experts\) is not supported"),
    Case("float8_all_gather_rowwise", ["--model.converters", "float8", "--quantize.linear.float8.emulate", "--quantize.linear.float8.recipe_name", "rowwise",
                                       "--quantize.linear.float8.enable_fsdp_float8_all_gather"], r"enable_fsdp_float8_all_gather needs .*recipe_name = \"tensorwise\""),
    Case("float8_without_a_float8_gpu", ["--model.converters", "float8"],
         r"model\.converters = \['float8'\] needs a CUDA GPU of compute capability 8\.9 or newer .*; found no CUDA GPU \(the CPU\): set quantize\.linear\.float8\.emulate = true",
         env={"CUDA_VISIBLE_DEVICES": ""}),
    # A rank that surely cannot fit: said before any process group or tensor exists.
    Case("batch_beyond_memory", ["--job.validate_only", "--job.validate_hardware", "cpu", "--training.local_batch_size", "99999999999999999999999"],
         r"training\.local_batch_size 99999999999999999999999 \(x seq_len \d+\): one rank needs at least .* GiB "
         r"\(weights and Adam state .*, logits .*\), more than the host's memory / 1 rank\(s\) on this node holds"),
    # On a host without a GPU, validate_only checks the GPU the config is for (h100 unless set).
    Case("model_beyond_memory", ["--job.validate_only", "--model.flavor", "405B"],
         r"model llama3 405B on 2 shard\(s\): one rank needs at least [\d,.]+ GiB .*, more than the h100 of "
         r"job\.validate_hardware holds \(80\.0 GiB\); shard over more ranks", env={"WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}),
    Case("validate_hardware_unknown", ["--job.validate_only", "--job.validate_hardware", "h1000"],
         r"job\.validate_hardware 'h1000' is not known \(choose from h100, .*, cpu\); did you mean 'h100'\?"),
    # Data and tokenizer.
    Case("text_dataset_without_path", ["--training.dataset", "text"], r"training\.dataset_path must be set when training\.dataset is 'text'"),
    Case("dataset_path_missing", ["--training.dataset", "text", "--training.dataset_path", f"{T}/corpus"],
         r"dataset_path {tmp}/corpus: no such file or folder"),
    Case("dataset_folder_without_text_files", ["--training.dataset", "text", "--training.dataset_path", f"{T}/corpus"],
         r"dataset_path {tmp}/corpus: folder has no \.txt, \.jsonl or \.jsonl\.gz files", setup=_write("corpus/notes.md", "# not data\n")),
    Case("dataset_empty", ["--training.dataset", "text", "--training.dataset_path", f"{T}/corpus"],
         r"{tmp}/corpus.*no documents", setup=_write("corpus/part-0.jsonl", "\n")),
    Case("dataset_wrong_suffix", ["--training.dataset", "text", "--training.dataset_path", f"{T}/corpus.csv"],
         r"dataset_path {tmp}/corpus\.csv: expected a \.txt, \.jsonl or \.jsonl\.gz file", setup=_write("corpus.csv", "a,b\n")),
    Case("dataset_bad_json_line", ["--training.dataset", "text", "--training.dataset_path", f"{T}/corpus"],
         r"data error in step 1: {tmp}/corpus/part-0\.jsonl:2: line is not valid JSON", kind=None, code=1, mid_run=True,
         setup=_write("corpus/part-0.jsonl", '{"text": "a"}\n{"text": \n')),
    Case("validation_path_missing", ["--validation.enable", "--validation.dataset", "text", "--validation.dataset_path", f"{T}/held_out"],
         r"{tmp}/held_out: no such file or folder"),
    Case("validation_prepared_folder_missing", ["--validation.enable", "--validation.dataset", "prepared",
                                                "--validation.dataset_path", f"{T}/held_out"],
         r"^validation\.dataset_path {tmp}/held_out: no such prepared folder$"),
    Case("validation_prepared_with_another_tokenizer", ["--validation.enable", "--validation.dataset", "prepared",
                                                        "--validation.dataset_path", f"{T}/held_out"],
         r"^validation\.dataset_path {tmp}/held_out: prepared with another tokenizer .* than this run's "
         r"\(the byte tokenizer: .*\); prepare it again with this run's tokenizer$",
         setup=_prepared_with_word_tokenizer("held_out")),
    Case("hf_assets_path_missing", ["--model.hf_assets_path", f"{T}/tokenizer"], r"hf_assets_path {tmp}/tokenizer: no such file or folder"),
    Case("hf_assets_folder_without_tokenizer", ["--model.hf_assets_path", f"{T}/assets"],
         r"hf_assets_path {tmp}/assets: folder has no tokenizer\.json", setup=_make_folders("assets")),
    Case("tokenizer_json_corrupt", ["--model.hf_assets_path", f"{T}/assets/tokenizer.json"],
         r"hf_assets_path {tmp}/assets/tokenizer\.json: cannot read tokenizer\.json", setup=_write("assets/tokenizer.json", "{not json")),
    Case("tokenizer_without_eos", ["--model.hf_assets_path", f"{T}/assets"],
         r"model\.hf_assets_path: the tokenizer at {tmp}/assets has no EOS token", setup=_word_tokenizer("assets", n_words=100, eos=False)),
    # Checkpoints.
    Case("checkpoint_of_another_model_shape", ["--checkpoint.enable", "--model.flavor", "debugmodel"],
         rf"{{tmp}}/dump/checkpoint/step-{CHECKPOINT_STEP}: .*differ in .*n_layers 3 -> 6.*pick another job\.dump_folder", kind="checkpoint", from_checkpoint=True),
    Case("load_step_missing", ["--checkpoint.enable", "--checkpoint.load_step", "7"],
         rf"checkpoint\.load_step 7: no complete step-7 in {{tmp}}/dump/checkpoint \(complete steps: {CHECKPOINT_STEP}\)",
         kind="checkpoint", from_checkpoint=True),
    Case("load_step_without_checkpoints", ["--checkpoint.enable", "--checkpoint.load_step", "3"],
         r"checkpoint\.load_step 3: no complete step-3 in {tmp}/dump/checkpoint \(complete steps: none\)", kind="checkpoint"),
    Case("initial_load_path_not_a_checkpoint", ["--checkpoint.initial_load_path", f"{T}/weights"],
         r"checkpoint\.initial_load_path {tmp}/weights: not a checkpoint folder", kind="checkpoint", setup=_make_folders("weights")),
    Case("initial_load_path_missing", ["--checkpoint.initial_load_path", f"{T}/weights"],
         r"checkpoint\.initial_load_path {tmp}/weights", kind="checkpoint"),
    Case("hf_seed_folder_missing", ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", f"{T}/hf"],
         r"checkpoint\.initial_load_path .*{tmp}/hf", kind="checkpoint"),
    Case("hf_seed_folder_without_config", ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", f"{T}/hf"],
         r"checkpoint\.initial_load_path .*{tmp}/hf", kind="checkpoint", setup=_make_folders("hf")),
]  # fmt: skip

# case id -> why it fails today.
XFAIL: dict[str, str] = {}
# case id -> why this machine cannot make the mistake.
SKIP: dict[str, str] = {"async_tp_without_cuda": "this machine has CUDA"} if torch.cuda.is_available() else {}


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[case.id])] if case.id in XFAIL else []
        if case.id in SKIP:
            marks.append(pytest.mark.skip(reason=SKIP[case.id]))
        yield pytest.param(case, id=case.id, marks=marks)


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def s3_env():
    with s3_server() as env:
        yield env


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A dump folder whose checkpoint/step-1 holds the tiny model after one step."""
    dump = tmp_path_factory.mktemp("bad_input_checkpoint") / "dump"
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in DISTRIBUTED_ENV:
            monkeypatch.delenv(name, raising=False)
        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = main(
                ["--job.dump_folder", str(dump), *SMALL_RUN, "--checkpoint.enable", "--metrics.enable_jsonl=false"]
            )
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
    assert code == 0
    assert (dump / "checkpoint" / f"step-{CHECKPOINT_STEP}" / ".metadata").is_file()
    return dump


def _snapshot(folder: Path) -> dict:
    """Every path under `folder`, with the size and modification time of each file."""
    listing = {}
    for path in folder.rglob("*"):
        stat = path.stat()
        listing[str(path.relative_to(folder))] = None if path.is_dir() else (stat.st_size, stat.st_mtime_ns)
    return listing


def _run_main(argv: list) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # the parser's errors exit 2 from parse_args_or_exit
        return stop.code


# --- the test -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input_is_one_clear_line(case, tmp_path, clean_env, quiet_process_state, capsys, request):
    tmp = tmp_path / "case"
    tmp.mkdir()
    dump = tmp / "dump"
    if case.from_checkpoint:
        source = request.getfixturevalue("tiny_checkpoint") / "checkpoint"
        shutil.copytree(source, dump / "checkpoint")
    if case.s3 is not None:
        for name, value in request.getfixturevalue("s3_env").items():
            clean_env.setenv(name, value)
        if case.s3 == "refusing credentials":
            clean_env.setattr("moto.settings.INITIAL_NO_AUTH_ACTION_COUNT", 0)
    if case.setup is not None:
        case.setup(tmp)
    for name, value in case.env.items():
        clean_env.setenv(name, value)
    clean_env.chdir(tmp)  # anything written to a relative path would land here and be seen
    argv = ["--job.dump_folder", str(dump), *SMALL_RUN, *(arg.replace(T, str(tmp)) for arg in case.argv)]
    before = _snapshot(tmp)
    capsys.readouterr()

    code = _run_main(argv)

    out, err = capsys.readouterr()
    report = f"exit {code}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
    assert "Traceback" not in out + err, report
    assert code != 0 if case.code is None else code == case.code, report
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, report
    prefix = "titanlite: " if case.kind is None else f"titanlite: {case.kind} error: "
    assert lines[0].startswith(prefix), report
    assert re.search(case.expect.replace(T, re.escape(str(tmp))), lines[0][len(prefix) :]), report
    if case.mid_run:
        return
    assert _snapshot(tmp) == before, "the run created, changed or deleted files"
    if not case.from_checkpoint:
        assert not dump.exists()


def test_debug_adds_the_traceback_after_the_line(tmp_path, clean_env, quiet_process_state, capsys):
    clean_env.chdir(tmp_path)
    code = _run_main(["--job.dump_folder", str(tmp_path / "dump"), *SMALL_RUN, "--debug", "--training.stepz", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines()[0].startswith("titanlite: config error: unknown option '--training.stepz'"), err
    assert "Traceback (most recent call last)" in err and "ConfigError" in err


def test_the_table_is_comprehensive():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)) >= 30
    assert set(XFAIL) <= set(ids)
    assert set(SKIP) <= set(ids)
