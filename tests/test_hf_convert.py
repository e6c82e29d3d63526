"""Conversion between titanlite checkpoints and Hugging Face Llama folders.

A Hugging Face model survives HF -> DCP -> HF bit for bit; a model trained by titanlite
and exported gives, in transformers, the logits titanlite's own model gives; bad input
is one line on stderr, exit 2, and no output folder (checked through the scripts' main() in
this process; the conversions themselves run the scripts as commands).
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.forked_scripts import run_python
from tests.helpers import full_weights, hf_tensors, load_script, save_one_layer_hf_llama, tiny_args
from titanlite.checkpoint import hf as hf_convert
from titanlite.checkpoint import hf_export, read_model_description
from titanlite.config import parse_args
from titanlite.models.llama import LlamaArgs
from titanlite.models.llama.hf_config import ffn_sizing
from titanlite.train import Trainer

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPORT = REPO_ROOT / "scripts" / "convert_dcp_to_hf.py"
IMPORT = REPO_ROOT / "scripts" / "convert_hf_to_dcp.py"


def run_script(script: Path, *args) -> subprocess.CompletedProcess:
    return run_python([script, *args])


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial" in p.name]


# --- HF -> DCP -> HF ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[Path, transformers.LlamaForCausalLM]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=300,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("hf") / "original"
    model.save_pretrained(folder, max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").is_file()  # really sharded
    return folder, model


def test_hf_to_dcp_to_hf_is_bit_identical(hf_model, tmp_path):
    original_dir, original = hf_model
    result = run_script(IMPORT, original_dir, tmp_path / "dcp")
    assert result.returncode == 0, result.stderr
    description = read_model_description(tmp_path / "dcp" / "step-0")
    assert description.name == "llama3" and description.flavor == "hf"
    assert description.args.ffn_hidden_dim == 128 and description.args.kv_heads == 2
    assert description.args.rope_theta == 500000.0 and description.args.norm_eps == 1e-6

    result = run_script(EXPORT, tmp_path / "dcp" / "step-0", tmp_path / "back", "--max-shard-size", "50KB")
    assert result.returncode == 0, result.stderr
    before, after = hf_tensors(original_dir), hf_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name

    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_tied_embeddings_become_two_copies(tmp_path):
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=96,
        vocab_size=50,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    step = hf_convert.import_from_hf(tmp_path / "tied", tmp_path / "dcp")
    hf_export.export_to_hf(step, tmp_path / "untied")
    tensors = hf_tensors(tmp_path / "untied")
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_ffn_sizing_matches_or_refuses():
    for dim, intermediate in [(64, 128), (64, 192), (4096, 14336), (4096, 11008), (8192, 28672), (48, 100)]:
        multiple_of, multiplier = ffn_sizing(dim, intermediate)
        args = LlamaArgs(dim=dim, n_heads=1, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        assert args.ffn_hidden_dim == intermediate


# --- titanlite training -> HF ------------------------------------------------------------


def test_exported_model_gives_titanlite_logits(tiny_ema_run, tmp_path):
    step_dir, tokens, logits, _, _ = tiny_ema_run
    result = run_script(EXPORT, step_dir, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",  # the byte tokenizer's
        "tokenizer_config.json",
    ]
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        theirs = model.eval()(tokens).logits
    assert theirs.dtype == torch.float32
    assert (theirs - logits).abs().max().item() <= 1e-5
    assert logits.abs().max().item() > 1e-2  # not trivially zero


def test_ema_export_holds_the_averages(tiny_ema_run, tmp_path):
    step_dir, _, _, _, ema = tiny_ema_run
    hf_export.export_to_hf(step_dir, tmp_path / "ema", use_ema=True)
    hf_export.export_to_hf(step_dir, tmp_path / "plain")
    averaged, plain = hf_tensors(tmp_path / "ema"), hf_tensors(tmp_path / "plain")
    assert torch.equal(averaged["model.norm.weight"], ema["norm.weight"])
    assert torch.equal(averaged["model.layers.0.mlp.down_proj.weight"], ema["layers.0.feed_forward.w2.weight"])
    assert not torch.equal(averaged["lm_head.weight"], plain["lm_head.weight"])


def test_bf16_sharded_export(tiny_ema_run, tmp_path):
    step_dir = tiny_ema_run[0]
    out = tmp_path / "bf16"
    result = run_script(EXPORT, step_dir, out, "--dtype", "bfloat16", "--max-shard-size", "20KB")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["num_key_value_heads"] == 2
    tensors = hf_tensors(out)
    assert tensors and all(t.dtype == torch.bfloat16 for t in tensors.values())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shard_files) > 1 and sorted(set(index["weight_map"].values())) == shard_files
    assert index["weight_map"].keys() == tensors.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as handle:
            assert name in handle.keys()
    # Every shard stays under the limit unless it holds a single larger tensor.
    for file in shard_files:
        sizes = [tensors[n].numel() * 2 for n, f in index["weight_map"].items() if f == file]
        assert len(sizes) == 1 or sum(sizes) <= 20_000


def test_push_to_hub_uploads_the_output(tiny_ema_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_print_me_42")
    script = load_script(EXPORT)
    calls = []

    class FakeApi:
        def upload_folder(self, **kwargs):
            calls.append(kwargs)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "pushed"
    assert script.main([str(tiny_ema_run[0]), str(out), "--push-to-hub", "me/tiny"]) == 0
    assert calls == [{"folder_path": str(out), "repo_id": "me/tiny", "repo_type": "model"}]
    printed = capsys.readouterr()
    assert "hf_do_not_print_me_42" not in printed.out + printed.err


# --- bad input ---------------------------------------------------------------------------


def one_error_line(capsys, script: Path, args: list, prog: str, path: Path) -> str:
    """The script's main(args), run in this process (a Python start costs seconds; the
    scripts' runs above cover their command line), must return 2 with one stderr line,
    "PROG: error: ...", that names `path`."""
    capsys.readouterr()
    status = load_script(script).main([str(arg) for arg in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{prog}: error: ") and str(path) in lines[0]
    return lines[0]


def test_not_a_checkpoint_folder(tmp_path, capsys):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    line = one_error_line(capsys, EXPORT, [folder, tmp_path / "out"], "convert_dcp_to_hf", folder)
    assert "no .metadata" in line
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_missing_folder(tmp_path, capsys):
    one_error_line(capsys, EXPORT, [tmp_path / "nowhere", tmp_path / "out"], "convert_dcp_to_hf", tmp_path / "nowhere")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    one_error_line(capsys, IMPORT, [tmp_path / "nowhere", tmp_path / "out"], "convert_hf_to_dcp", tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()


def test_existing_output_folder_is_refused(tiny_ema_run, hf_model, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "not empty" in one_error_line(capsys, EXPORT, [tiny_ema_run[0], out], "convert_dcp_to_hf", out)
    assert "not empty" in one_error_line(capsys, IMPORT, [hf_model[0], out], "convert_hf_to_dcp", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and not leftovers(tmp_path)


def test_ema_missing_and_model_args_missing(tiny_ema_run, tmp_path):
    plain_step = tmp_path / "dcp"
    torch.distributed.checkpoint.save(
        {"tok_embeddings.weight": torch.zeros(2, 2)},
        storage_writer=torch.distributed.checkpoint.FileSystemWriter(str(plain_step)),
        no_dist=True,
    )
    with pytest.raises(ValueError, match="no model_args"):
        hf_export.export_to_hf(plain_step, tmp_path / "out")
    hf_step = hf_convert.import_from_hf(save_one_layer_hf_llama(tmp_path / "tiny_hf"), tmp_path / "tiny_dcp")
    with pytest.raises(ValueError, match="no 'ema.' entries"):
        hf_export.export_to_hf(hf_step, tmp_path / "out", use_ema=True)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_failure_while_writing_leaves_nothing(tiny_ema_run, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "save_file", broken)
    with pytest.raises(OSError):
        hf_export.export_to_hf(tiny_ema_run[0], tmp_path / "out", max_shard_size="20KB")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_run_starts_from_an_imported_checkpoint(tiny_ema_run, tmp_path, quiet_process_state):
    """Hugging Face folder -> convert_hf_to_dcp.py -> checkpoint.initial_load_path: the run
    starts from exactly the imported weights (a run once asked an import for a description
    entry imports did not write, and failed)."""
    assert run_script(EXPORT, tiny_ema_run.step_dir, tmp_path / "hf").returncode == 0
    result = run_script(IMPORT, tmp_path / "hf", tmp_path / "dcp")
    assert result.returncode == 0, result.stderr
    overrides = {"training.steps": 1, "checkpoint.enable": True, "job.dump_folder": str(tmp_path / "run")}
    overrides["checkpoint.initial_load_path"] = str(tmp_path / "dcp" / "step-0")
    trainer = Trainer(parse_args(tiny_args(overrides)))
    start = full_weights(trainer.model)
    trainer.train()
    assert start.keys() == tiny_ema_run.weights.keys()
    for name, value in tiny_ema_run.weights.items():
        assert torch.equal(start[name], value), name
