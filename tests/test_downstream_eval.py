"""Downstream evaluation ([eval]): a choice's score is the log-likelihood of its tokens after
the context (checked against a hand computation); FSDP 2 scores every item once and gives one
process's metrics; an evaluation leaves training bit for bit as it was; the shipped tasks are
well formed; bad task files are one line.

One launch of 2 ranks runs the layouts (tests.rank_jobs.run_jobs_on_ranks).
"""

import json
import math

import pytest
import torch

from tests.helpers import capture_log_lines, free_ports, full_weights
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.test_checkpoint_resume import Session, layout
from titanlite.downstream import read_task, shipped_tasks
from titanlite.downstream.tasks import IGNORE_INDEX, choice_row, split_pair
from titanlite.train import Trainer

STEPS = 4
EVAL = ["--eval.enable", "--eval.freq=2", "--eval.tasks=python_keywords", "--eval.limit=40"]
MOE = ["--model.name=qwen3", "--model.flavor=tiny_moe"]
RUN = ["--training.global_batch_size=8", f"--training.steps={STEPS}", "--checkpoint.interval=1000"]


def logged(dump) -> list[dict]:
    """Every record of the run's JSONL metrics (the resumed trainer's folder, logging nothing, beside it)."""
    return [json.loads(line) for path in dump.glob("metrics/*/metrics.jsonl") for line in path.read_text().splitlines()]


def metrics_at_start(trainer: Trainer) -> dict:
    return trainer.evaluator.evaluate(trainer.model)


def training(trainer: Trainer) -> dict:
    records = trainer.train()
    return {"loss": [r.loss for r in records], "grad_norm": [r.grad_norm for r in records]}


def fsdp2_worker(dump: str, ports: list[int]) -> dict:
    session, out = Session(ports), {}
    on = (layout(2), *RUN, *EVAL, "--checkpoint.interval=2", f"--job.dump_folder={dump}/on")
    trainer = session.trainer(*on)
    out["start"] = metrics_at_start(trainer)
    out["on"] = training(trainer) | {"weights": full_weights(trainer.model)}
    # Resumed at step 2: scored on the weights the evaluation at step 2 scored.
    out["resumed_at_2"] = metrics_at_start(session.trainer(*on, "--checkpoint.load_step=2"))
    trainer = session.trainer(layout(2), *RUN, f"--job.dump_folder={dump}/off")
    out["off"] = training(trainer) | {"weights": full_weights(trainer.model)}
    tp2 = ["--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=8"]
    out["tp2"] = metrics_at_start(session.trainer(tp2, *RUN, *EVAL, f"--job.dump_folder={dump}/tp2"))
    hsdp = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1"]
    out["hsdp2x1"] = metrics_at_start(session.trainer(layout(2), hsdp, *RUN, *EVAL, f"--job.dump_folder={dump}/hsdp"))
    pp2 = ["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=8"]
    out["pp2"] = metrics_at_start(session.trainer(pp2, *RUN, *EVAL, f"--job.dump_folder={dump}/pp2"))
    cp2 = ["--parallelism.context_parallel_degree=2", "--training.local_batch_size=8"]
    out["cp2"] = metrics_at_start(session.trainer(cp2, *RUN, *EVAL, f"--job.dump_folder={dump}/cp2"))
    # An MoE model with its experts split over 2 ranks, against its own one-process score.
    ep2 = [*MOE, "--parallelism.expert_parallel_degree=2"]
    out["ep2"] = metrics_at_start(session.trainer(layout(2), ep2, *RUN, *EVAL, f"--job.dump_folder={dump}/ep2"))
    session.end()
    return out


def single_worker(dump: str) -> dict:
    session = Session([0] * 4)
    trainer = session.trainer(layout(1), *RUN, *EVAL, f"--job.dump_folder={dump}")
    moe = session.trainer(layout(1), MOE, *RUN, *EVAL, f"--job.dump_folder={dump}/moe")
    return {
        "start": metrics_at_start(trainer) | {"near_ties": near_ties(trainer)},
        "moe": metrics_at_start(moe) | {"near_ties": near_ties(moe)},
    }


def near_ties(trainer: Trainer, margin: float = 1e-4) -> dict[str, int]:
    """Items whose best two choices score within ``margin`` (and likewise after length
    normalisation): a layout's rounding may pick either, so its counts may differ by these."""
    task, ties = trainer.evaluator.tasks[0], {"acc": 0, "acc_norm": 0}
    with torch.no_grad():
        scores = trainer.evaluator.choice_logprobs(trainer.model.eval(), task)
    for index, logprobs in scores.items():
        lengths = [len(choice) for choice in task.items[index].choices]
        for metric, values in (
            ("acc", logprobs),
            ("acc_norm", [v / n for v, n in zip(logprobs, lengths, strict=True)]),
        ):
            best, second = sorted(values, reverse=True)[:2]
            ties[metric] += best - second < margin
    return ties


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dump = tmp_path_factory.mktemp("downstream")
    results = run_jobs_on_ranks(
        2,
        {
            "fsdp2": Job(2, fsdp2_worker, (str(dump / "fsdp2"), free_ports(12))),
            "single": Job(1, single_worker, (str(dump / "single"),)),
        },
    )
    return {name: ranks[0] for name, ranks in results.items()}, dump


@pytest.mark.parametrize(
    "name, reference",
    [("start", "start"), ("hsdp2x1", "start"), ("tp2", "start"), ("pp2", "start"), ("cp2", "start"), ("ep2", "moe")],
)
def test_each_layout_scores_every_item_once_and_equals_one_process(runs, name, reference):
    out, _ = runs
    other, single = out["fsdp2"][name], out["single"][reference]
    tags = {"eval/python_keywords/acc", "eval/python_keywords/acc_norm", "eval/python_keywords/bpb"}
    assert set(other) == tags | {"eval/tflop", "eval/seconds"}
    # The same items and sums: bits per byte within rounding; the counts below are whole
    # numbers of 40 only if every item was counted once.
    assert other["eval/python_keywords/bpb"] == pytest.approx(single["eval/python_keywords/bpb"], rel=1e-6)
    for metric in ("acc", "acc_norm"):  # counts of 40 items, equal but for near ties at these random weights
        count, expected = (run[f"eval/python_keywords/{metric}"] * 40 for run in (other, single))
        assert count.is_integer() and abs(count - expected) <= single["near_ties"][metric], (metric, count, expected)
    assert other["eval/tflop"] > 0


def test_an_evaluation_after_a_resume_equals_the_uninterrupted_runs(runs):
    out, dump = runs
    at_2 = next(record for record in logged(dump / "fsdp2" / "on") if "eval/python_keywords/acc" in record)
    assert at_2["step"] == 2
    for metric in ("acc", "acc_norm", "bpb"):
        tag = f"eval/python_keywords/{metric}"
        assert out["fsdp2"]["resumed_at_2"][tag] == at_2[tag], (metric, out["fsdp2"]["resumed_at_2"], at_2)


def test_an_evaluation_leaves_training_bit_for_bit_as_it_was(runs):
    out, dump = runs
    on, off = out["fsdp2"]["on"], out["fsdp2"]["off"]
    assert on["loss"] == off["loss"] and on["grad_norm"] == off["grad_norm"]
    for name, tensor in off["weights"].items():
        assert torch.equal(on["weights"][name], tensor), name
    # Logged at steps 2 and 4, in the JSONL beside the training steps.
    records = logged(dump / "fsdp2" / "on")
    evaluated = [record["step"] for record in records if "eval/python_keywords/acc" in record]
    assert evaluated == [2, 4], records


class Bytes:
    """A byte tokenizer with the built-in one's ids (bos 256)."""

    bos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def test_a_choice_scores_the_log_likelihood_of_its_tokens_after_the_context(tmp_path):
    from titanlite.downstream import DownstreamEvaluator
    from titanlite.models.llama.args import LlamaArgs
    from titanlite.models.llama.model import Transformer

    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=16, max_seq_len=16)
    model = Transformer(args)
    model.init_weights(seed=0)
    task_file = tmp_path / "task.jsonl"
    items = [
        {"context": "def f(x): ", "choices": ["return x", "retrun x", "pass"], "label": 0},
        {"context": "a" * 40, "choices": ["b", "cc"], "label": 1},  # longer than seq_len: cut from the left
        {"context": "", "choices": ["import os", "x"], "label": 0},
    ]
    task_file.write_text("".join(json.dumps(item) + "\n" for item in items))
    task = read_task(str(task_file))
    log = capture_log_lines()
    # With 3 FLOPs a training token, the forward's FLOPs count the tokens the batches hold.
    evaluator = DownstreamEvaluator(
        [task], Bytes(), seq_len=16, local_batch_size=2, device=torch.device("cpu"), flops_per_token=lambda width: 3.0
    )
    rows = [choice_row(Bytes(), item["context"], choice, 16)[0] for item in items for choice in item["choices"]]
    assert sum(map(len, rows)) <= evaluator.tflop * 1e12 <= math.ceil(len(rows) / 2) * 2 * 16
    # Said once: the long context's two rows, and two of the first item's three (19 tokens each).
    assert log.warnings() == ["eval task task: 4 choice row(s) longer than seq_len + 1 = 17 tokens, cut from the left"]
    model.eval()
    with torch.no_grad():
        scores = evaluator.choice_logprobs(model, task)
        for index, item in enumerate(items):
            for choice, score in zip(item["choices"], scores[index], strict=True):
                # By hand: the row alone, every position's log-softmax, the choice's tokens summed.
                context_ids, choice_ids = split_pair(Bytes(), item["context"], choice)
                tokens = ([256] + context_ids + choice_ids)[-17:]
                logprobs = torch.log_softmax(model(torch.tensor([tokens[:-1]])).float(), dim=-1)[0]
                scored = range(len(tokens) - 1 - min(len(choice_ids), len(tokens) - 1), len(tokens) - 1)
                expected = sum(logprobs[position, tokens[position + 1]].item() for position in scored)
                assert math.isclose(score, expected, rel_tol=0, abs_tol=1e-6), (item, choice, score, expected)
    # The split moves the context's trailing space to the choice, as lm-evaluation-harness does.
    assert split_pair(Bytes(), "def f(x): ", "return x") == (list(b"def f(x):"), list(b" return x"))
    inputs, labels, truncated = choice_row(Bytes(), "a" * 40, "cc", 16)
    assert truncated and len(inputs) == 16 and labels[-2:] == list(b"cc") and labels[:-2] == [IGNORE_INDEX] * 14


def test_the_shipped_tasks_are_well_formed_and_the_same_every_time():
    assert shipped_tasks() == ["python_brackets", "python_keywords"]
    for name in shipped_tasks():
        task = read_task(name)
        assert task.items == read_task(name).items and len(task.items) == 300
        for item in task.items:
            assert len(item.choices) == 4 == len(set(item.choices)) and 0 <= item.label < 4, item
        assert {item.label for item in task.items} == {0, 1, 2, 3}
    assert len(read_task("python_keywords", limit=7).items) == 7
