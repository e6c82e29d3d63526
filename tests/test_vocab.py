"""A run's vocabulary follows its tokenizer: an 8,000-id tokenizer trains the debugmodel in
8,064 rows (rounded up to 128), the checkpoint records both sizes, the export and
generation use the tokenizer's 8,000, and a Hugging Face folder with that tokenizer seeds
and imports into the padded rows.
"""

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers import full_weights, hf_tensors, save_hf_llama, tiny_args, write_word_tokenizer
from tests.prepared_data import write_jsonl
from titanlite.checkpoint import ModelDescription, hf, hf_export, read_model_description
from titanlite.config import parse_args
from titanlite.models.llama import LlamaStateDictAdapter
from titanlite.train import Trainer

transformers = pytest.importorskip("transformers")

REAL, PADDED = 8000, 8064  # the tokenizer's ids; the embedding's rows, a multiple of 128
STEPS = 2


def word_documents(count: int) -> list[str]:
    """Documents of words from the whole vocabulary, so that the highest ids are trained too."""
    generator = random.Random(0)
    return [" ".join(f"word{generator.randrange(REAL - 3)}" for _ in range(60)) for _ in range(count)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer folder, corpus): a word-level tokenizer of exactly 8,000 ids, <s> and </s>
    among them, and a small raw corpus written with it."""
    root = tmp_path_factory.mktemp("vocab")
    assert write_word_tokenizer(root / "tokenizer", REAL - 3, specials=("<s>", "</s>")) == REAL
    return root / "tokenizer", write_jsonl(root / "corpus.jsonl", word_documents(20))


def data_args(assets) -> list[str]:
    tokenizer, corpus = assets
    return ["--model.hf_assets_path", str(tokenizer), "--training.dataset=text", "--training.dataset_path", str(corpus)]


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """The llama3 debugmodel (2,048 rows of its own) trained two steps with the tokenizer; its
    checkpoint, and its logits on ids that reach the top of the vocabulary."""
    dump = tmp_path_factory.mktemp("run")
    options = {"model.flavor": "debugmodel", "training.steps": STEPS, "checkpoint.enable": True}
    trainer = Trainer(parse_args(tiny_args(options) + data_args(assets) + ["--job.dump_folder", str(dump)]))
    records = trainer.train()
    tokens = torch.tensor([[0, REAL - 1, 17, 4000, REAL - 2, 5]])
    with torch.no_grad():
        logits = trainer.model.eval()(tokens)
    return dump / "checkpoint" / f"step-{STEPS}", records, tokens, logits, full_weights(trainer.model)


def test_an_8000_id_tokenizer_trains_the_debugmodel_in_padded_rows(trained):
    _, records, _, logits, weights = trained
    assert len(records) == STEPS and all(torch.isfinite(torch.tensor(r.loss)) for r in records)
    assert weights["tok_embeddings.weight"].shape == (PADDED, 256)
    assert weights["output.weight"].shape == (PADDED, 256) and logits.shape[-1] == PADDED


def test_the_checkpoint_records_both_sizes(trained, assets):
    description = read_model_description(trained[0])
    assert (description.args.vocab_size, description.tokenizer_vocab_size) == (PADDED, REAL)
    assert description.real_vocab_size == REAL
    # A checkpoint from before the real size was recorded: every row is a token.
    state = description.to_state()
    del state["tokenizer_vocab_size"]
    assert ModelDescription.from_state(state, "old").real_vocab_size == PADDED


def test_the_export_has_the_tokenizers_size_and_titanlites_logits(trained, tmp_path):
    step_dir, _, tokens, logits, weights = trained
    hf_export.export_to_hf(step_dir, tmp_path / "hf")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.vocab_size == REAL
    assert hf_tensors(tmp_path / "hf")["lm_head.weight"].shape == (REAL, 256)
    with torch.no_grad():
        theirs = model(tokens).logits
    assert theirs.shape[-1] == REAL
    assert (theirs - logits[..., :REAL]).abs().max().item() <= 1e-5


def test_generate_never_picks_a_padding_id(trained, tmp_path, monkeypatch):
    """The padding rows of the output are made to win every argmax and all the probability;
    scripts/generate.py still picks tokens only, greedy and sampled."""
    import scripts.generate
    from titanlite.models import generate as generation

    step_dir, _, _, _, weights = trained
    description = read_model_description(step_dir)
    weights = dict(weights)
    output = torch.zeros_like(weights["output.weight"])
    output[REAL:] = torch.randn(PADDED - REAL, output.shape[1], generator=torch.Generator().manual_seed(0)) * 100
    weights["output.weight"] = output
    dcp.save({**weights, "model_args": description.to_state()}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)

    picked = []

    def recording(*args, **kwargs):
        new_ids = generate_for_real(*args, **kwargs)
        picked.extend(new_ids)
        return new_ids

    generate_for_real = generation.generate
    monkeypatch.setattr(generation, "generate", recording)
    for sampling in ([], ["--temperature", "1.0", "--seed", "0"]):
        argv = ["--checkpoint", str(tmp_path / "step-1"), "--prompt", "word1 word2", "--max_new_tokens", "4"]
        assert scripts.generate.main(argv + sampling) == 0
    assert len(picked) == 8 and max(picked) < REAL


def test_a_hugging_face_folder_seeds_and_imports_into_padded_rows(assets, tmp_path):
    """A folder of 8,000 ids with its tokenizer.json, imported or seeding the tiny model sized
    for that tokenizer: its rows as they are, zeros past them, transformers' logits on the
    tokens; the import records both sizes and is the model such a run builds."""
    folder = save_hf_llama(tmp_path / "hf", seed=3, vocab_size=REAL)
    shutil.copyfile(assets[0] / "tokenizer.json", folder / "tokenizer.json")
    imported = read_model_description(hf.import_from_hf(folder, tmp_path / "dcp"))
    assert (imported.args.vocab_size, imported.real_vocab_size) == (PADDED, REAL)

    options = {"training.steps": 1, "checkpoint.initial_load_in_hf": True, "model.hf_assets_path": str(folder)}
    argv = tiny_args(options) + data_args(assets)[2:] + ["--checkpoint.initial_load_path", str(folder)]
    trainer = Trainer(parse_args(argv + ["--job.dump_folder", str(tmp_path / "dump")]))
    assert imported.args.architecture() == trainer.plan.model_args.architecture()
    seeded = full_weights(trainer.model)
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    expected = LlamaStateDictAdapter(trainer.plan.model_args).from_hf(reference.state_dict())
    dcp_weights = {name: torch.empty_like(value) for name, value in seeded.items()}
    dcp.load(dcp_weights, checkpoint_id=str(tmp_path / "dcp" / "step-0"), no_dist=True)
    for name in ("tok_embeddings.weight", "output.weight"):
        for weights in (seeded, dcp_weights):
            assert weights[name].shape[0] == PADDED
            assert torch.equal(weights[name][:REAL], expected[name]) and not weights[name][REAL:].any(), name
    tokens = torch.tensor([[1, REAL - 1, 300, 7000]])
    with torch.no_grad():
        ours, theirs = trainer.model.eval()(tokens), reference(tokens).logits
    assert (ours[..., :REAL] - theirs).abs().max().item() <= 1e-5


def test_the_estimates_count_the_padded_rows(assets):
    """The step-time estimate and the trainer's FLOP count use the rows the model has:
    6 FLOPs per token per output weight, the 64 padding rows included."""
    from titanlite.estimate.step_time import estimate_for_job_config
    from titanlite.metrics.flops import flops_per_token
    from titanlite.plan import plan_run

    config = parse_args(tiny_args({"model.flavor": "debugmodel"}) + data_args(assets))
    plan = plan_run(config, 1)
    assert plan.model_args.vocab_size == PADDED and plan.tokenizer_vocab_size == REAL
    estimate = estimate_for_job_config(config, 1, "h100")
    assert estimate.flops_per_token == flops_per_token(plan.model_args, 32)
    flavor = dataclasses.replace(plan.model_args, vocab_size=2048)
    assert estimate.flops_per_token - flops_per_token(flavor, 32) == 6 * 256 * (PADDED - 2048)


def test_a_checkpoint_without_the_recorded_size_still_resumes(tmp_path, monkeypatch):
    """Checkpoints written before tokenizer_vocab_size was recorded resume: the entry is
    not asked of them. (A guard: this passed before the entry existed.)"""
    recorded = ModelDescription.to_state
    options = {"training.steps": 1, "checkpoint.enable": True, "job.dump_folder": str(tmp_path)}

    def without_entry(self):
        state = recorded(self)
        del state["tokenizer_vocab_size"]
        return state

    monkeypatch.setattr(ModelDescription, "to_state", without_entry)
    Trainer(parse_args(tiny_args(options))).train()
    stored = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-1")).read_metadata().state_dict_metadata
    assert "model_args.tokenizer_path" in stored and "model_args.tokenizer_vocab_size" not in stored
    monkeypatch.setattr(ModelDescription, "to_state", recorded)
    records = Trainer(parse_args(tiny_args({**options, "training.steps": 2}))).train()
    assert [record.step for record in records] == [2]
