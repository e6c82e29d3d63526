"""convert_hf_to_dcp.py on damaged or mismatched Hugging Face folders: one stderr line
naming the file and the problem, exit status 2, and no output folder left behind."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import convert_hf_to_dcp  # noqa: E402


def damaged_copy(good: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(good, folder)
    return folder


def convert_fails(folder: Path, tmp_path: Path, capsys) -> str:
    out = tmp_path / "out"
    assert convert_hf_to_dcp.main([str(folder), str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("convert_hf_to_dcp: error: ")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    return lines[0]


def shard_of(folder: Path, hf_name: str) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][hf_name]


def test_the_good_folder_converts(tiny_hf_llama, tmp_path, capsys):
    assert convert_hf_to_dcp.main([str(tiny_hf_llama), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "step-0" / ".metadata").is_file()


def test_a_truncated_shard(tiny_hf_llama, tmp_path, capsys):
    folder = damaged_copy(tiny_hf_llama, tmp_path)
    shard = shard_of(folder, "model.layers.1.mlp.up_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-64])
    line = convert_fails(folder, tmp_path, capsys)
    assert f"{shard}: cannot read tensor 'model.layers.1.mlp.up_proj.weight'" in line


def test_a_tensor_of_the_wrong_shape(tiny_hf_llama, tmp_path, capsys):
    folder = damaged_copy(tiny_hf_llama, tmp_path)
    name = "model.layers.2.self_attn.k_proj.weight"
    shard = shard_of(folder, name)
    tensors = load_file(shard)
    tensors[name] = tensors[name][:-16]  # one key head fewer than config.json says
    save_file(tensors, shard, metadata={"format": "pt"})
    line = convert_fails(folder, tmp_path, capsys)
    assert f"{shard}: tensor '{name}' has shape (16, 64), the model needs (32, 64)" in line


def test_an_index_naming_a_missing_shard(tiny_hf_llama, tmp_path, capsys):
    folder = damaged_copy(tiny_hf_llama, tmp_path)
    shard = shard_of(folder, "lm_head.weight")
    shard.unlink()
    line = convert_fails(folder, tmp_path, capsys)
    assert f"{folder}: the index names {shard.name}, which is missing" in line


def test_a_tensor_titanlite_does_not_know(tiny_hf_llama, tmp_path, capsys):
    folder = damaged_copy(tiny_hf_llama, tmp_path)
    shard = shard_of(folder, "model.norm.weight")
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.q_proj.bias"] = tensors["model.norm.weight"].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = shard.name
    index_path.write_text(json.dumps(index))
    line = convert_fails(folder, tmp_path, capsys)
    assert "tensor 'model.layers.0.self_attn.q_proj.bias' has no titanlite counterpart" in line


def test_a_config_of_another_architecture(tiny_hf_llama, tmp_path, capsys):
    folder = damaged_copy(tiny_hf_llama, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    assert "model_type 'mistral' is not llama" in convert_fails(folder, tmp_path, capsys)
