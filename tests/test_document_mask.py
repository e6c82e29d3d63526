"""Document masking (model.attn_mask_type = "block_causal"): attention stops at the data
pipeline's end-of-document token. The reference runs each document of a packed window
separately with plain causal attention: RoPE depends only on the distance between a query and
a key, so a document's logits must not change with where it sits in the window, nor with what
precedes it. One process here for every family; CP 2 in test_parity's launch
(block_causal_logits_at_cp2). The config's refusals too."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import TINY, tiny_args
from titanlite.config import parse_args
from titanlite.models.attention import document_ids
from titanlite.plan import build_model, plan_run
from titanlite.registry import get_model_args, get_model_spec

END = 257  # the byte tokenizer's end-of-document token, which tiny_args' runs use
# Where each packed row's documents end (inclusive), 32 tokens a row: one spans the middle
# of the row (and, under CP 2 with headtail, chunks on both ranks), one is a single token.
ENDS = ([5, 6, 20, 31], [13, 27])


def short_documents() -> Path:
    """A JSON-lines file of 400 short documents (9 to 30 characters), so that every 32-token
    window holds several ends: the trainer runs of test_parity's block_causal jobs read it
    (training.dataset = "text"). Written once per machine, whole or not at all."""
    path = Path(tempfile.gettempdir()) / "titanlite_short_documents.jsonl"
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 21, (400,), generator=generator).tolist()
    text = "".join(
        json.dumps({"text": f"doc {index} " + "ab"[index % 2] * length}) + "\n" for index, length in enumerate(lengths)
    )
    if not path.exists() or path.read_text() != text:
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, path)
    return path


SHORT_DOCUMENTS = ["--training.dataset=text", f"--training.dataset_path={short_documents()}"]


def packed_rows(vocab: int, seed: int = 0) -> torch.Tensor:
    """Two rows of 32 random tokens (never END) with END at the positions ENDS lists."""
    tokens = torch.randint(0, END, (len(ENDS), 32), generator=torch.Generator().manual_seed(seed)) % vocab
    tokens[tokens == END] = 0
    for row, ends in enumerate(ENDS):
        tokens[row, ends] = END
    return tokens


def documents_run_separately(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [rows, 32, vocab] of every document run alone through ``model`` (plain causal),
    the tokens after a row's last END forming one more document."""
    rows = []
    for row in tokens:
        starts_and_ends = []
        start = 0
        for position in (row == END).nonzero().flatten().tolist() + [len(row) - 1]:
            if position >= start:
                starts_and_ends.append((start, position + 1))
                start = position + 1
        rows.append(torch.cat([model(row[None, a:b])[0] for a, b in starts_and_ends]))
    return torch.stack(rows)


def test_document_ids_count_the_ends_before_each_token():
    tokens = torch.tensor([[1, END, 2, 3, END, END, 4]])
    assert document_ids(tokens, END).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


FAMILIES = {"llama3": "tiny", "qwen3": "tiny_moe", "deepseek_v3": "tiny"}


@pytest.mark.parametrize("name", FAMILIES)
def test_block_causal_equals_each_document_run_separately(name):
    args = get_model_args(name, FAMILIES[name])
    with torch.device("cpu"):
        model = get_model_spec(name).model_cls(args)
    model.init_weights(seed=3, buffer_device=torch.device("cpu"))
    tokens = packed_rows(args.vocab_size)
    with torch.no_grad():
        reference = documents_run_separately(model, tokens)
        causal = model(tokens)
        model.document_end_id = END
        masked = model(tokens)
    torch.testing.assert_close(masked, reference, rtol=1e-5, atol=1e-5)
    # The test can fail: plain causal attention reads across documents.
    assert (causal - reference).abs().max() > 1e-3


def block_causal_logits_at_cp2() -> dict:
    """On 2 ranks (a job of test_parity's launch): the tiny model built by the trainer's
    build_model at CP 2 with block_causal, run on packed_rows' chunks of this rank, against the
    same weights in one process running each document separately (max difference)."""
    args = tiny_args({"model.attn_mask_type": "block_causal"})
    single = build_model(parse_args(args), plan_run(parse_args(args), 1), None, "cpu")
    config = parse_args([*args, "--parallelism.context_parallel_degree=2"])
    plan = plan_run(config, 2)
    dist.init_process_group("gloo")
    try:
        mesh = plan.parallel_dims.build_mesh("cpu")
        model = build_model(config, plan, mesh, "cpu")
        split = model.layers["0"].attention.attend.split
        tokens = packed_rows(plan.model_args.vocab_size)
        with torch.no_grad():
            ours = model(split.columns(tokens))
            reference = documents_run_separately(single, tokens)
        kept = split.local_positions(ours.shape[1])
        return {"difference": (ours - reference[:, kept]).abs().max().item(), "positions": kept.tolist()}
    finally:
        dist.destroy_process_group()


def test_a_later_pipeline_stage_without_the_tokens_refuses_to_guess_the_documents():
    """A stage after the first gets hidden states: block_causal cannot find documents in them,
    so the pipeline hands every stage the tokens (test_pipeline_parity's block_causal runs)."""
    config = parse_args(tiny_args({"model.attn_mask_type": "block_causal"}))
    plan = plan_run(config, 1)
    model = build_model(config, plan, None, "cpu", stage_modules=("layers.1", "layers.2", "norm", "output"))
    hidden = torch.zeros(2, 32, TINY.dim)
    with pytest.raises(ValueError, match="after the first needs the tokens as document_tokens"):
        model(hidden)
    tokens = packed_rows(plan.model_args.vocab_size)
    assert model(hidden, document_tokens=tokens).shape == (2, 32, plan.model_args.vocab_size)
