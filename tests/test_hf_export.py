"""Exporting titanlite checkpoints to Hugging Face folders: the tokenizer travels with the
weights, the shards and index are huggingface_hub's, a checkpoint that contradicts its
own model_args is refused, and the fast reader writes what dcp.load would.
"""

import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from huggingface_hub import split_torch_state_dict_into_shards
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.forked_scripts import run_python
from tests.helpers import TINY, hf_tensors, load_script, train_tiny
from tests.prepared_data import make_documents, write_jsonl
from tests.rank_jobs import run_on_ranks
from titanlite.checkpoint import ModelDescription, hf_export, read_model_description
from titanlite.checkpoint.load import load_model
from titanlite.checkpoint.tensor_reader import CheckpointReader
from titanlite.data.tokenizer import HFTokenizer, build_tokenizer
from titanlite.models.generate import generate
from titanlite.models.llama import LlamaArgs, Transformer
from titanlite.registry import MODELS

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPORT = REPO_ROOT / "scripts" / "convert_dcp_to_hf.py"
GENERATE = REPO_ROOT / "scripts" / "generate.py"
TEXT = "def main():\n    return 'hello world'  # the quick brown fox"


def run_export(*args) -> subprocess.CompletedProcess:
    return run_python([EXPORT, *args])


def error_line(capsys, *args) -> str:
    """The export script's main(args), run in this process (a Python start costs seconds; the
    exports above and below run it as a command), must return 2 with one stderr line."""
    capsys.readouterr()
    status = load_script(EXPORT).main([str(arg) for arg in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("convert_dcp_to_hf: error: ")
    return lines[0]


def no_output(parent: Path, out: Path) -> bool:
    return not out.exists() and not [p for p in parent.iterdir() if ".partial" in p.name]


def make_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer with 258 ids (the 256 byte symbols, <s> and </s>),
    the vocabulary of the tiny model, plus the config files a Hugging Face repo has."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=258, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([TEXT] * 10, trainer)
    assert tokenizer.get_vocab_size() == 258
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def model_args_entry(args: LlamaArgs, tokenizer_path: str | None = None) -> dict:
    """The "model_args" entry the trainer saves beside the weights."""
    return {"name": "llama3", "flavor": "tiny", "args": dataclasses.asdict(args), "tokenizer_path": tokenizer_path}


def save_checkpoint(step_dir: Path, weights: dict, args: LlamaArgs, tokenizer_path: str | None = None) -> Path:
    """A model-only step folder as the trainer writes one: weights plus model_args."""
    dcp.save(
        {**weights, "model_args": model_args_entry(args, tokenizer_path)}, checkpoint_id=str(step_dir), no_dist=True
    )
    return step_dir


def tiny_weights(args: LlamaArgs = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    # init_weights, not the constructor alone: the norms are left uninitialised until
    # then, and stray NaNs in them made equality checks fail now and then.
    model = Transformer(args)
    model.init_weights(seed=seed)
    return model.state_dict()


# --- the tokenizer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("assets") / "tok")


@pytest.fixture(scope="module")
def trained_with_tokenizer(tokenizer_dir, tmp_path_factory):
    # A small raw corpus: the default python_stdlib would first be prepared whole with this
    # tokenizer (tens of seconds on a new machine) for a run that reads a few windows.
    corpus = write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", make_documents(7, 200))
    return train_tiny(
        tmp_path_factory.mktemp("run"),
        [
            "--model.hf_assets_path",
            str(tokenizer_dir),
            "--training.dataset",
            "text",
            "--training.dataset_path",
            str(corpus),
        ],
    )


def test_the_runs_tokenizer_is_exported(trained_with_tokenizer, tokenizer_dir, tmp_path):
    out = tmp_path / "hf"
    result = run_export(trained_with_tokenizer.step_dir, out)
    assert result.returncode == 0, result.stderr
    assert "exported the tokenizer" in result.stdout
    assert (out / "special_tokens_map.json").read_bytes() == (tokenizer_dir / "special_tokens_map.json").read_bytes()
    # tokenizer.json as it was but for the post-processor, which now adds training's BOS.
    exported, source = (json.loads((folder / "tokenizer.json").read_text()) for folder in (out, tokenizer_dir))
    assert exported["post_processor"]["type"] == "TemplateProcessing" and source["post_processor"] is None
    assert {**exported, "post_processor": None} == source
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config == {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}
    original = HFTokenizer(str(tokenizer_dir / "tokenizer.json"))
    ids = {"bos_token_id": original.bos_id, "eos_token_id": original.eos_id}
    assert ids == {"bos_token_id": 0, "eos_token_id": 1}
    assert json.loads((out / "generation_config.json").read_text()) == ids
    config = json.loads((out / "config.json").read_text())
    assert {key: config[key] for key in ids} == ids

    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded(TEXT, add_special_tokens=False)["input_ids"] == original.encode(TEXT)
    framed = [original.bos_id, *original.encode(TEXT)]  # as training starts a document
    assert loaded(TEXT)["input_ids"] == framed
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(TEXT).ids == framed
    assert loaded.eos_token_id == original.eos_id and loaded.bos_token_id == original.bos_id
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == original.eos_id


def test_a_moved_tokenizer_fails_before_writing_and_can_be_named(tokenizer_dir, tmp_path, capsys):
    gone = tmp_path / "moved-away" / "tokenizer.json"
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY, str(gone))
    out = tmp_path / "hf"
    line = error_line(capsys, step, out)
    assert str(gone) in line and "--tokenizer" in line
    assert no_output(tmp_path, out)
    with pytest.raises(ValueError, match="no longer exists"):
        hf_export.export_to_hf(step, out)
    assert no_output(tmp_path, out)

    result = run_export(step, out, "--tokenizer", tokenizer_dir)  # the folder
    assert result.returncode == 0, result.stderr
    exported, named = (json.loads((folder / "tokenizer.json").read_text()) for folder in (out, tokenizer_dir))
    assert exported["model"] == named["model"]
    hf_export.export_to_hf(step, tmp_path / "hf2", tokenizer=tokenizer_dir / "tokenizer.json")  # the file
    assert (tmp_path / "hf2" / "tokenizer_config.json").is_file()

    line = error_line(capsys, step, tmp_path / "hf3", "--tokenizer", tmp_path / "nothing-here")
    assert str(tmp_path / "nothing-here") in line and no_output(tmp_path, tmp_path / "hf3")


# Every byte value UTF-8 text can hold: ASCII, the lead and continuation bytes of 2-, 3-
# and 4-byte characters, and a literal "<s>" that the byte tokenizer reads as its bytes.
BYTE_TEXT = "".join(map(chr, range(1, 256))) + "߿ࠀ\uffff𐀀\U0010ffff \x00 <s></s> 日本"


def test_a_byte_tokenizer_run_exports_the_byte_tokenizer(tmp_path):
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY)
    out = tmp_path / "hf"
    result = run_export(step, out)
    assert result.returncode == 0, result.stderr
    assert "exported the byte tokenizer" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    ids = {"bos_token_id": 256, "eos_token_id": 257}
    assert json.loads((out / "generation_config.json").read_text()) == ids
    byte_ids = list(BYTE_TEXT.encode("utf-8"))
    assert {*range(0x80, 0xC0), 0xC2, 0xDF, 0xE0, 0xEF, 0xF0, 0xF4} <= set(byte_ids)
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (256, 257)
    assert loaded(BYTE_TEXT)["input_ids"] == [256, *byte_ids]
    assert loaded(BYTE_TEXT, add_special_tokens=False)["input_ids"] == byte_ids
    assert loaded.decode([256, *byte_ids, 257], skip_special_tokens=True) == BYTE_TEXT


def test_the_help_names_every_model_and_class_the_export_writes():
    """The classes, and every registered model beside its class (read from the registry, so a
    model added there is listed without a change to the script)."""
    text = " ".join(load_script(EXPORT).build_parser().format_help().split())
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        assert name in text
    assert "DeepseekV3ForCausalLM (deepseek_v3)" in text
    for model in MODELS:
        assert re.search(rf"ForCausalLM \([^)]*\b{model}\b", text), model


def test_the_exports_console_holds_its_own_lines_only(tmp_path):
    """A fresh interpreter (the fork server's imports would hide the export's own): the export
    imports neither transformers nor torchao, whose import logs on a CPU host that CUDA
    kernels (_C_mxfp8, _C_cutlass_90a) failed to load, and its console holds only its lines."""
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY)
    out = tmp_path / "hf"
    command = [sys.executable, "-X", "importtime", str(EXPORT), str(step), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    imports = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rpartition("|")[2].strip().split(".")[0] for line in imports}
    assert "torch" in imported and not imported & {"transformers", "torchao"}
    assert [line for line in result.stderr.splitlines() if line not in imports] == []
    assert result.stdout.splitlines() == [
        "convert_dcp_to_hf: exported the byte tokenizer as tokenizer.json",
        f"convert_dcp_to_hf: wrote {out}",
    ]


def test_without_the_tokenizers_package_the_export_refuses_before_writing(tmp_path):
    """tokenizers is a dependency of titanlite; an environment that lacks it anyway (here the
    import is blocked) gets one line, exit 2 and no folder, never a folder without a tokenizer."""
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY)
    out = tmp_path / "hf"
    blocked = (
        "import runpy, sys; sys.modules['tokenizers'] = None; "
        f"sys.argv = [{str(EXPORT)!r}, {str(step)!r}, {str(out)!r}]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("convert_dcp_to_hf: error: ") and "'tokenizers' package" in lines[0]
    assert no_output(tmp_path, out)


# --- shards -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shards_and_index_are_huggingface_hubs(tmp_path, dtype):
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY)
    out = tmp_path / "hf"
    hf_export.export_to_hf(step, out, dtype=dtype, max_shard_size="30KB")
    tensors = hf_tensors(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # The library's own split of the written tensors, in the model's order, is the one used.
    adapter = hf_export.get_model_spec("llama3").state_dict_adapter(TINY)
    with torch.device("meta"):
        names = list(Transformer(TINY).state_dict())
    in_model_order = {adapter.to_hf_name(name): tensors[adapter.to_hf_name(name)] for name in names}
    split = split_torch_state_dict_into_shards(in_model_order, max_shard_size=30_000)
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"] == split.metadata
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(split.filename_to_tensors)
    assert all(t.dtype == getattr(torch, dtype) for t in tensors.values())


def test_one_shard_is_model_safetensors(tmp_path):
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY)
    hf_export.export_to_hf(step, tmp_path / "big-limit", max_shard_size="1GB")
    hf_export.export_to_hf(step, tmp_path / "no-limit")
    for folder in (tmp_path / "big-limit", tmp_path / "no-limit"):
        assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]


# --- a checkpoint that contradicts its model_args -------------------------------------------


def test_shapes_that_disagree_with_model_args_are_refused(tmp_path, capsys):
    claimed = dataclasses.replace(TINY, n_kv_heads=4)  # wk/wv would be 64 rows, not 32
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(TINY), claimed)
    out = tmp_path / "hf"
    line = error_line(capsys, step, out)
    assert str(step) in line and "layers.0.attention.wk.weight" in line and "[32, 64]" in line
    assert no_output(tmp_path, out)


def test_expected_shapes_are_the_models():
    for args in (TINY, dataclasses.replace(TINY, n_kv_heads=None, ffn_dim_multiplier=1.3, multiple_of=16)):
        with torch.device("meta"):
            model = Transformer(args)
        actual = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        assert ModelDescription("llama3", "tiny", args).weight_shapes() == actual


# --- the reader -----------------------------------------------------------------------------


def record_fast_path(monkeypatch) -> list[tuple[str, bool]]:
    """A list that fills with (saved key, whether the fast reader took it) as exports run."""
    located = []
    original_locate = CheckpointReader.locate

    def recording(self, key, entry):
        pieces = original_locate(self, key, entry)
        located.append((key, pieces is not None))
        return pieces

    monkeypatch.setattr(CheckpointReader, "locate", recording)
    return located


def test_fast_reader_writes_what_dcp_load_gives(tmp_path, monkeypatch):
    weights = tiny_weights()
    # A weight saved as a transposed view: not row-major in the file, so the fast path
    # must leave it to dcp.load.
    weights["layers.1.feed_forward.w2.weight"] = weights["layers.1.feed_forward.w2.weight"].t().contiguous().t()
    assert not weights["layers.1.feed_forward.w2.weight"].is_contiguous()
    step = save_checkpoint(tmp_path / "step-1", weights, TINY)
    located = record_fast_path(monkeypatch)
    for dtype in ("float32", "bfloat16"):
        hf_export.export_to_hf(step, tmp_path / f"fast-{dtype}", dtype=dtype, max_shard_size="40KB")
    fast_keys = {key for key, fast in located if fast}
    assert "layers.1.feed_forward.w2.weight" not in fast_keys and len(fast_keys) == len(weights) - 1

    monkeypatch.setattr(CheckpointReader, "locate", lambda self, key, entry: None)
    for dtype in ("float32", "bfloat16"):
        hf_export.export_to_hf(step, tmp_path / f"slow-{dtype}", dtype=dtype, max_shard_size="40KB")
        fast, slow = tmp_path / f"fast-{dtype}", tmp_path / f"slow-{dtype}"
        assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in slow.iterdir())
        for file in fast.iterdir():
            assert file.read_bytes() == (slow / file.name).read_bytes(), file.name
    adapter = hf_export.get_model_spec("llama3").state_dict_adapter(TINY)
    exported = hf_tensors(tmp_path / "fast-float32")
    for name, value in weights.items():
        assert torch.equal(exported[adapter.to_hf_name(name)], adapter.to_hf_tensor(name, value)), name


def tp_placement(name: str):
    """A tensor-parallel layout: row-wise layers (and, here, the embedding) split by
    columns, column-wise ones by rows, norms replicated (DCP then saves them once)."""
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "tok_embeddings.weight")):
        return Shard(1)
    return Replicate() if name.endswith("norm.weight") else Shard(0)


SHARDED_LAYOUTS = {"fsdp": lambda name: Shard(0), "tp": tp_placement}


def save_sharded(folder: str) -> None:
    """On each of 2 ranks: save the tiny weights as DTensors in each layout, so that every
    rank writes its own chunks, as a 2-rank FSDP or TP run does."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights = tiny_weights()
    for layout, placement in SHARDED_LAYOUTS.items():
        state = {name: distribute_tensor(value, mesh, [placement(name)]) for name, value in weights.items()}
        dcp.save({**state, "model_args": model_args_entry(TINY)}, checkpoint_id=str(Path(folder) / layout))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_checkpoints(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    run_on_ranks(2, save_sharded, str(folder))
    return folder


@pytest.mark.parametrize("layout", list(SHARDED_LAYOUTS))
def test_fast_reader_reads_sharded_checkpoints(sharded_checkpoints, layout, tmp_path, monkeypatch):
    step = sharded_checkpoints / layout
    saved = hf_export.read_checkpoint_metadata(step).state_dict_metadata
    weights = tiny_weights()
    chunks = {name: len(saved[name].chunks) for name in weights}
    assert chunks == {name: 1 if layout == "tp" and name.endswith("norm.weight") else 2 for name in weights}
    located = record_fast_path(monkeypatch)
    hf_export.export_to_hf(step, tmp_path / "fast", max_shard_size="40KB")
    assert sorted(located) == sorted((name, True) for name in weights)  # every tensor through the fast path

    monkeypatch.setattr(CheckpointReader, "locate", lambda self, key, entry: None)
    hf_export.export_to_hf(step, tmp_path / "dcp", max_shard_size="40KB")
    fast, slow = tmp_path / "fast", tmp_path / "dcp"
    assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in slow.iterdir())
    for file in fast.iterdir():
        assert file.read_bytes() == (slow / file.name).read_bytes(), file.name
    adapter = hf_export.get_model_spec("llama3").state_dict_adapter(TINY)
    exported = hf_tensors(fast)
    for name, value in weights.items():
        assert torch.equal(exported[adapter.to_hf_name(name)], adapter.to_hf_tensor(name, value)), name


def test_a_truncated_checkpoint_file_is_an_error(tmp_path):
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY)
    data = next(step.glob("*.distcp"))
    with open(data, "r+b") as file:
        file.truncate(data.stat().st_size // 2)
    with pytest.raises(ValueError, match="damaged") as raised:
        hf_export.export_to_hf(step, tmp_path / "hf")
    assert str(step) in str(raised.value) and "\n" not in str(raised.value)
    assert no_output(tmp_path, tmp_path / "hf")


def test_the_output_does_not_depend_on_the_tokenizer_copy(tmp_path, tokenizer_dir):
    # Copying the companions only where they exist: a folder with tokenizer.json alone.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copyfile(tokenizer_dir / "tokenizer.json", alone / "tokenizer.json")
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY, str(alone / "tokenizer.json"))
    hf_export.export_to_hf(step, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if p.name.startswith(("tokenizer", "special"))) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # No tokenizer_config.json: HFTokenizer falls back to the well-known <s> / </s>, and the
    # exported config names them, so that transformers uses the same.
    ids = {"bos_token_id": 0, "eos_token_id": 1}
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == ids
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (loaded.bos_token_id, loaded.eos_token_id) == (0, 1)
    assert loaded(TEXT)["input_ids"] == [0, *HFTokenizer(str(alone / "tokenizer.json")).encode(TEXT)]


@pytest.mark.parametrize("run", ["byte", "bpe"])
def test_transformers_continues_a_prompt_as_generate_py(run, request, tmp_path):
    """The exported folder in transformers (AutoTokenizer, AutoModelForCausalLM, greedy)
    gives the prompt ids and the continuation scripts/generate.py gives on the checkpoint."""
    trained = request.getfixturevalue("tiny_ema_run" if run == "byte" else "trained_with_tokenizer")
    out = hf_export.export_to_hf(trained.step_dir, tmp_path / "hf")
    prompt, new_tokens = "def main():", 12
    ours = build_tokenizer(read_model_description(trained.step_dir).tokenizer_path)  # what generate.py uses
    prompt_ids = [ours.bos_id, *ours.encode(prompt)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer(prompt)["input_ids"] == prompt_ids

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    generated = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=ours.eos_id,
    )[0, len(prompt_ids) :].tolist()
    loaded, _ = load_model(trained.step_dir)
    real_vocab = read_model_description(trained.step_dir).real_vocab_size  # as generate.py limits it
    assert generated == generate(loaded, prompt_ids, new_tokens, eos_id=ours.eos_id, vocab_size=real_vocab)
    script = run_python(
        [GENERATE, "--checkpoint", trained.step_dir, "--prompt", prompt, "--max_new_tokens", new_tokens]
    )
    assert script.returncode == 0, script.stderr
    assert script.stdout == prompt + tokenizer.decode(generated, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_follows_the_umask(tmp_path, tokenizer_dir, umask):
    # safetensors creates its file 0600 and renames it into place; the export must give the
    # weights the mode every other file of the folder gets.
    step = save_checkpoint(tmp_path / "step-1", tiny_weights(), TINY, str(tokenizer_dir / "tokenizer.json"))
    previous = os.umask(umask)
    try:
        hf_export.export_to_hf(step, tmp_path / "hf", max_shard_size="40KB")
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "hf").iterdir()}
    assert any(name.endswith(".safetensors") for name in modes) and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
