"""Loading a trained model for evaluation and sampling from it.

load_model gives the trainer's own logits from a full or a model-only step folder and
from an exported Hugging Face folder, and the EMA weights when asked; greedy generation
matches transformers'; seeded sampling repeats; the script prints text or fails in one line.
"""

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers

from tests.forked_scripts import run_python
from tests.helpers import load_script, save_one_layer_hf_llama, train_tiny
from titanlite.checkpoint import hf as hf_convert
from titanlite.checkpoint import hf_export, top_level_names
from titanlite.checkpoint.load import load_model
from titanlite.models.generate import generate
from titanlite.models.llama.model import Transformer, rope_tables

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "generate.py"
PROMPT = [256, 72, 101, 108, 108, 111]  # BOS "Hello"


@pytest.fixture(scope="module")
def hf_folder(tiny_ema_run, tmp_path_factory):
    return hf_export.export_to_hf(tiny_ema_run[0], tmp_path_factory.mktemp("hf") / "exported")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --- load_model ----------------------------------------------------------------------------


def test_full_checkpoint_gives_the_trainers_logits(tiny_ema_run):
    step_dir, tokens, logits, _, _ = tiny_ema_run
    assert "optimizer" in top_level_names(step_dir)  # really a full save
    model, description = load_model(step_dir)
    assert description.name == "llama3" and description.flavor == "tiny"
    assert not model.training
    with torch.no_grad():
        assert _max_diff(model(tokens), logits) <= 1e-6
    assert logits.abs().max().item() > 1e-2
    # The weights came from the checkpoint, not from a fresh initialisation.
    fresh = Transformer(description.args)
    fresh.init_weights(seed=0)
    with torch.no_grad():
        assert _max_diff(fresh.eval()(tokens), logits) > 1e-3


def test_model_only_checkpoint_gives_the_trainers_logits(tmp_path):
    step_dir, tokens, logits, _, _ = train_tiny(tmp_path, ["--checkpoint.last_save_model_only"])
    assert "optimizer" not in top_level_names(step_dir)  # really model-only
    model, _ = load_model(step_dir)
    with torch.no_grad():
        assert _max_diff(model(tokens), logits) <= 1e-6


def test_use_ema_gives_the_averages(tiny_ema_run):
    step_dir, _, _, weights, ema = tiny_ema_run
    averaged, _ = load_model(step_dir, use_ema=True)
    plain, _ = load_model(step_dir)
    for name, value in averaged.state_dict().items():
        assert torch.equal(value, ema[name]), name
        assert torch.equal(plain.state_dict()[name], weights[name]), name
    assert not torch.equal(averaged.output.weight, plain.output.weight)


def test_rope_tables_and_dtype(tiny_ema_run):
    model, description = load_model(tiny_ema_run[0], dtype=torch.bfloat16)
    assert model.output.weight.dtype == torch.bfloat16
    cos, sin = rope_tables(description.args)
    assert (
        model.rope_cos.dtype == torch.float32 and torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    )


def test_hf_folder_gives_the_same_logits(tiny_ema_run, hf_folder):
    _, tokens, logits, _, _ = tiny_ema_run
    model, description = load_model(hf_folder)
    assert description.flavor == "hf"
    with torch.no_grad():
        assert _max_diff(model(tokens), logits) <= 1e-5


def test_bad_paths_raise_one_line(tiny_ema_run, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hi")
    weights_only = tmp_path / "weights_only"
    dcp.save(
        {"tok_embeddings.weight": torch.zeros(2, 2)},
        storage_writer=dcp.FileSystemWriter(str(weights_only)),
        no_dist=True,
    )
    cases = [
        (tmp_path / "nowhere", "no such"),
        (plain, "not a checkpoint"),
        (plain / "notes.txt", "not a checkpoint"),
        (weights_only, "no model_args"),
    ]
    for path, problem in cases:
        with pytest.raises(ValueError) as raised:
            load_model(path)
        message = str(raised.value)
        assert str(path) in message and problem in message and "\n" not in message
    hf_step = hf_convert.import_from_hf(save_one_layer_hf_llama(tmp_path / "tiny_hf"), tmp_path / "tiny_dcp")
    with pytest.raises(ValueError, match="no 'ema.' entries"):
        load_model(hf_step, use_ema=True)


# --- generate ------------------------------------------------------------------------------


def test_greedy_matches_transformers(tiny_ema_run, hf_folder):
    model, _ = load_model(hf_folder)
    ours = generate(model, PROMPT, max_new_tokens=16)
    theirs_model = transformers.LlamaForCausalLM.from_pretrained(hf_folder).eval()
    theirs_model.generation_config.eos_token_id = None
    theirs_model.generation_config.pad_token_id = 0
    out = theirs_model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=16,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
    )
    theirs = out[0, len(PROMPT) :].tolist()
    assert len(ours) == 16 and ours == theirs
    # Greedy is the argmax of a full forward pass at each step.
    with torch.no_grad():
        first = model(torch.tensor([PROMPT]))[0, -1].argmax().item()
    assert ours[0] == first


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_ema_run):
    model, _ = load_model(tiny_ema_run[0])
    greedy = generate(model, PROMPT, max_new_tokens=12)
    first = generate(model, PROMPT, max_new_tokens=20, temperature=5.0, seed=7)
    again = generate(model, PROMPT, max_new_tokens=20, temperature=5.0, seed=7)
    other = generate(model, PROMPT, max_new_tokens=20, temperature=5.0, seed=8)
    assert first == again and first != other
    assert generate(model, PROMPT, max_new_tokens=12, temperature=1.0, top_k=1, seed=3) == greedy
    # top_k keeps only the k most likely tokens at each step.
    tokens = list(PROMPT)
    for token in generate(model, PROMPT, max_new_tokens=6, temperature=5.0, top_k=3, seed=1):
        with torch.no_grad():
            best = model(torch.tensor([tokens]))[0, -1].topk(3).indices.tolist()
        assert token in best
        tokens.append(token)


def test_stops_at_eos(tiny_ema_run):
    model, _ = load_model(tiny_ema_run[0])
    greedy = generate(model, PROMPT, max_new_tokens=10)
    stop = greedy[2]
    out = generate(model, PROMPT, max_new_tokens=10, eos_id=stop)
    assert out == greedy[: greedy.index(stop) + 1]


def test_prefix_is_cut_to_max_seq_len(tiny_ema_run):
    loaded, description = load_model(tiny_ema_run[0])
    args = dataclasses.replace(description.args, max_seq_len=8)
    short = Transformer(args)
    short.load_state_dict(loaded.state_dict())
    short.rope_cos, short.rope_sin = rope_tables(args)
    short.eval()
    out = generate(short, PROMPT, max_new_tokens=10)  # 16 tokens in all, the tables hold 8
    tokens = PROMPT + out
    for i, token in enumerate(out):
        window = tokens[: len(PROMPT) + i][-8:]
        with torch.no_grad():
            assert short(torch.tensor([window]))[0, -1].argmax().item() == token


def test_bad_arguments_are_refused(tiny_ema_run):
    model, _ = load_model(tiny_ema_run[0])
    for kwargs in ({"temperature": -1.0}, {"top_k": 0}, {"max_new_tokens": -1}):
        with pytest.raises(ValueError):
            generate(model, PROMPT, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 2)


# --- scripts/generate.py ---------------------------------------------------------------------


def run_script(*args) -> subprocess.CompletedProcess:
    return run_python([SCRIPT, *args])


def test_script_prints_the_continuation(tiny_ema_run):
    model, _ = load_model(tiny_ema_run[0])
    expected = generate(model, [256, *b"ab"], max_new_tokens=8, eos_id=257)
    result = run_script("--checkpoint", tiny_ema_run[0], "--prompt", "ab", "--max_new_tokens", 8)
    assert result.returncode == 0, result.stderr
    continuation = bytes(t for t in expected if t < 256).decode("utf-8", errors="replace")
    assert result.stdout == "ab" + continuation + "\n"


def test_script_sampling_on_hf_folder(hf_folder):
    args = ["--checkpoint", hf_folder, "--prompt", "x", "--max_new_tokens", 5, "--temperature", 0.8, "--seed", 1]
    first, second = run_script(*args), run_script(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("x") and first.stdout == second.stdout


def main_in_this_process(capsys, *args) -> tuple[int, list[str]]:
    """scripts/generate.py's main(args) in this process (a Python start costs seconds; the
    tests above run the script as a command): its exit status, argparse's exit included,
    and its non-empty stderr lines."""
    script = load_script(SCRIPT)
    capsys.readouterr()
    try:
        status = script.main([str(arg) for arg in args])
    except SystemExit as exit_request:
        status = exit_request.code
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_script_refuses_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    folder = tmp_path / "plain"
    folder.mkdir()
    for args in (
        ["--checkpoint", folder, "--prompt", "a", "--max_new_tokens", 3],
        ["--checkpoint", tmp_path / "nowhere", "--prompt", "a", "--max_new_tokens", 3],
    ):
        status, lines = main_in_this_process(capsys, *args)
        assert status == 2, lines
        assert len(lines) == 1 and lines[0].startswith("generate: error: ") and str(args[1]) in lines[0], lines
    status, lines = main_in_this_process(capsys, "--checkpoint", folder, "--prompt", "a")  # no --max_new_tokens
    assert status == 2 and len(lines) == 1 and lines[0].startswith("generate: error: "), (status, lines)
