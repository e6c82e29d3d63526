"""Qwen3 dense: equal to transformers' Qwen3ForCausalLM in both directions, and trained under
FSDP 2, TP 2 and PP 2 equal to one process.

The transformers models are tiny, random and built in this process (no Hub). Their norm gains
are drawn away from 1, so that a q_norm/k_norm permuted the wrong way (or not at all) shows.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers import TINY_RUN_STEPS, full_weights, hf_tensors, load_script, tiny_args, train_tiny
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.test_parity import REFERENCE, TP2, assert_same_training, train_and_report
from tests.test_pipeline_parity import assert_pipeline_trains_like_one_process, pp_args, train_pipeline
from titanlite.checkpoint import read_model_description
from titanlite.checkpoint.load import load_model
from titanlite.config import ConfigError, parse_args
from titanlite.data.tokenizer import ByteTokenizer
from titanlite.models.generate import generate
from titanlite.models.qwen3 import Qwen3Transformer, args_to_hf_config
from titanlite.parallel.tensor_parallel import apply_tensor_parallel
from titanlite.plan import plan_run
from titanlite.registry import get_model_args, model_from_hf_config
from titanlite.train import Trainer

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
TOKENS = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(5))
PROMPT, NEW_TOKENS = [3, 141, 59, 26], 10
QWEN3 = ["--model.name=qwen3"]
PP2 = ["--parallelism.pipeline_parallel_degree=2"]
TIED, UNTIED = [*QWEN3, "--model.flavor=tiny_tied"], [*QWEN3, "--model.flavor=tiny"]


# The tiny flavors' attention as transformers spells it: heads wider than hidden / heads
# (4 x 32 in 64), grouped-query attention.
TINY_HF_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=258,
    max_position_embeddings=64,
    rope_theta=10000.0,
)


def save_random(model: transformers.PreTrainedModel, folder: Path) -> None:
    """Draw `model`'s norm gains away from 1 and scale its other weights so that logits are of
    order 10, not 0.1 (a close match then means something); save it to `folder`."""
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)
            else:
                param.mul_(10)
    model.save_pretrained(folder)


def hf_qwen3(folder: Path, tied: bool) -> tuple[Path, transformers.Qwen3ForCausalLM]:
    """A random Qwen3ForCausalLM of the tiny flavors' shape saved to `folder`."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(intermediate_size=96, tie_word_embeddings=tied, **TINY_HF_SHAPE)
    model = transformers.Qwen3ForCausalLM(config)
    save_random(model, folder)
    return folder, model


@pytest.fixture(scope="module", params=["untied", "tied"])
def hf_model(request, tmp_path_factory):
    return hf_qwen3(tmp_path_factory.mktemp("qwen3") / request.param, tied=request.param == "tied")


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_a_transformers_qwen3_imports_with_its_logits_and_greedy_tokens(hf_model):
    folder, theirs = hf_model
    ours, description = load_model(folder)
    assert description.name == "qwen3"
    assert description.args.tie_word_embeddings == theirs.config.tie_word_embeddings
    # Tied: one parameter under both modules, as in transformers.
    assert (ours.output.weight is ours.tok_embeddings.weight) == description.args.tie_word_embeddings
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours(TOKENS)
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() <= 1e-5
    assert generate(ours, PROMPT, NEW_TOKENS) == hf_greedy(theirs, PROMPT, NEW_TOKENS)


def test_hf_to_dcp_to_hf_gives_the_same_tensors(hf_model, tmp_path):
    folder, _ = hf_model
    assert load_script(SCRIPTS / "convert_hf_to_dcp.py").main([str(folder), str(tmp_path / "dcp")]) == 0
    step = tmp_path / "dcp" / "step-0"
    assert read_model_description(step).name == "qwen3"
    assert load_script(SCRIPTS / "convert_dcp_to_hf.py").main([str(step), str(tmp_path / "back")]) == 0
    before, after = hf_tensors(folder), hf_tensors(tmp_path / "back")
    assert before.keys() == after.keys()  # a tied model's: no lm_head.weight on either side
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 32


@pytest.fixture(scope="module")
def trained_tied(tmp_path_factory):
    """The tied tiny Qwen3 trained a few steps in this process, with checkpoints."""
    return train_tiny(tmp_path_factory.mktemp("qwen3_run"), TIED)


def test_a_trained_checkpoint_exports_to_transformers(trained_tied, tmp_path, capsys):
    assert load_script(SCRIPTS / "convert_dcp_to_hf.py").main([str(trained_tied.step_dir), str(tmp_path / "hf")]) == 0
    assert "output.weight" not in trained_tied.weights  # saved once, under the embedding's name
    assert "lm_head.weight" not in hf_tensors(tmp_path / "hf")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert isinstance(theirs, transformers.Qwen3ForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        expected = theirs.eval()(trained_tied.tokens).logits
    assert (trained_tied.logits - expected).abs().max().item() <= 1e-5
    # scripts/generate.py on the checkpoint continues a prompt as transformers does.
    prompt, tokenizer = "def main():", ByteTokenizer()
    continued = hf_greedy(theirs, [tokenizer.bos_id, *tokenizer.encode(prompt)], NEW_TOKENS)
    argv = ["--checkpoint", str(trained_tied.step_dir), "--prompt", prompt, "--max_new_tokens", str(NEW_TOKENS)]
    capsys.readouterr()  # the export's lines
    assert load_script(SCRIPTS / "generate.py").main(argv) == 0
    assert capsys.readouterr().out == prompt + tokenizer.decode(continued) + "\n"


def test_a_tied_checkpoint_resumes_with_one_parameter(trained_tied, tmp_path):
    """The state dict holds the tied matrix once: a resumed run gets it back into both
    modules as one parameter, with its Adam state, and trains on."""
    shutil.copytree(trained_tied.step_dir.parent.parent, tmp_path, dirs_exist_ok=True)
    overrides = {"training.steps": TINY_RUN_STEPS + 1, "optimizer.lr": 3e-3, "checkpoint.enable": True}
    args = tiny_args(overrides) + [*TIED, "--job.dump_folder", str(tmp_path)]
    trainer = Trainer(parse_args(args))
    assert trainer.step == TINY_RUN_STEPS
    assert trainer.model.output.weight is trainer.model.tok_embeddings.weight
    resumed = full_weights(trainer.model)
    assert resumed.keys() == trained_tied.weights.keys()
    for name, value in trained_tied.weights.items():
        assert torch.equal(resumed[name], value), name
    adam = trainer.optimizer.state_dict()["state"]
    assert len(adam) == len(list(trainer.model.parameters()))
    assert {int(state["step"]) for state in adam.values()} == {TINY_RUN_STEPS}
    assert [record.step for record in trainer.train()] == [TINY_RUN_STEPS + 1]


def test_a_run_seeds_from_a_transformers_folder(hf_model, tmp_path):
    """checkpoint.initial_load_in_hf: a qwen3 run of the folder's shape starts from its weights."""
    folder, theirs = hf_model
    flavor = "tiny_tied" if theirs.config.tie_word_embeddings else "tiny"
    overrides = {"model.name": "qwen3", "model.flavor": flavor, "training.steps": 1}
    overrides |= {"checkpoint.initial_load_path": str(folder), "checkpoint.initial_load_in_hf": True}
    trainer = Trainer(parse_args(tiny_args(overrides) + ["--job.dump_folder", str(tmp_path)]))
    with torch.no_grad():
        assert (trainer.model(TOKENS) - theirs(TOKENS).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"use_sliding_window": True}, "sliding-window attention is not supported"),
        ({"attention_bias": True}, "biases in attention are not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ],
)
def test_unsupported_qwen3_configs_are_refused_in_one_line(change, expected):
    # A config.json as the published ones spell it (transformers 4.51: rope_scaling, rope_theta).
    config = {**args_to_hf_config(get_model_args("qwen3", "0.6B")), **change}
    with pytest.raises(ValueError, match=expected) as error:
        model_from_hf_config(config, "x/config.json")
    assert str(error.value).startswith("x/config.json: ") and "\n" not in str(error.value)


def test_published_flavors_match_their_parameter_counts():
    # Qwen3's model cards: 0.6B has 0.44B parameters without the embedding, 8B 6.95B, 32B 31.2B.
    for flavor, non_embedding in (("0.6B", 0.44e9), ("8B", 6.95e9), ("32B", 31.2e9)):
        args = get_model_args("qwen3", flavor)
        with torch.device("meta"):
            model = Qwen3Transformer(args)
        total = sum(p.numel() for p in model.parameters())  # a tied matrix counts once
        embedding = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
        assert abs((total - embedding) / non_embedding - 1) < 0.01, flavor


# --- one process vs FSDP 2, TP 2 and PP 2 ---------------------------------------------------


def tp_plan_of_the_tied_model() -> dict:
    """On 2 ranks: the tied tiny Qwen3 on the meta device after the TP plan, as FSDP would
    find it next. A TP-only run would be tied again when materialised (Qwen3Transformer._apply),
    but FSDP, applied before that, must already see one parameter, not two."""
    dist.init_process_group("gloo")
    try:
        with torch.device("meta"):
            model = Qwen3Transformer(get_model_args("qwen3", "tiny_tied"))
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sequence_parallel=True, shard_logits=True)
        return {
            "one parameter": model.output.weight is model.tok_embeddings.weight,
            "placements": str(model.output.weight.placements),
        }
    finally:
        dist.destroy_process_group()


JOBS = {
    "reference tied": Job(1, REFERENCE.fn, ([*REFERENCE.args[0], *TIED],)),
    "reference untied": Job(1, REFERENCE.fn, ([*REFERENCE.args[0], *UNTIED],)),
    "fsdp2 tied": Job(2, train_and_report, (["--training.local_batch_size=4", *TIED],)),
    "tp2 tied": Job(2, train_and_report, (["--training.local_batch_size=8", *TP2, *TIED],)),
    "tp2 keeps the tie": Job(2, tp_plan_of_the_tied_model),
    "pp2 untied": Job(2, train_pipeline, (pp_args("1F1B", 4, 2, *UNTIED),)),
}


@pytest.fixture(scope="module")
def runs():
    return run_jobs_on_ranks(2, JOBS)


def test_the_reference_runs_learn(runs):
    for name in ("reference tied", "reference untied"):
        ref = runs[name][0]
        assert ref["loss"][-1] < ref["loss"][0] - 0.1, name
    assert "output.weight" not in runs["reference tied"][0]["params"]
    assert "layers.0.attention.q_norm.weight" in runs["reference tied"][0]["params"]


@pytest.mark.parametrize("layout", ["fsdp2 tied", "tp2 tied"])
def test_qwen3_layout_matches_single_process(runs, layout):
    for rank_run in runs[layout]:
        assert_same_training(rank_run, runs["reference tied"][0], rtol=1e-5)


def test_tensor_parallelism_keeps_tied_embeddings_one_parameter(runs):
    for rank_report in runs["tp2 keeps the tie"]:
        assert rank_report == {"one parameter": True, "placements": "(Shard(dim=0),)"}


def test_qwen3_pipeline_matches_single_process(runs):
    assert_pipeline_trains_like_one_process(runs["pp2 untied"], runs["reference untied"][0])


# --- tied embeddings under PP -------------------------------------------------------------


def test_tied_embeddings_are_refused_under_pipeline_parallelism(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    job_config = parse_args(tiny_args({"model.name": "qwen3", "model.flavor": "tiny_tied"}) + PP2)
    with pytest.raises(ConfigError, match="tie"):
        plan_run(job_config, 2)
