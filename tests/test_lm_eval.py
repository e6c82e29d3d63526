"""titanlite as a model type of lm-evaluation-harness (titanlite/downstream/harness.py) gives
what lm-eval's own Hugging Face backend gives on the exported checkpoint: the same
log-likelihoods (within 1e-4), rolling log-likelihoods and greedy flags, and the same
accuracy on a local multiple-choice task (a YAML with dataset_path json and local data
files, HF_DATASETS_OFFLINE=1); scripts/eval.py runs lm-eval's command line on a checkpoint.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import train_tiny
from titanlite.checkpoint.hf_export import export_to_hf
from titanlite.downstream import read_task

REPO = Path(__file__).resolve().parent.parent
TASK = "titanlite_keywords"
PAIRS = [("def main():", " return 1"), ("", "import os"), ("x = ", "[1, 2]"), ("The quick brown", " fox jumps")]
TEXT = "def f(x):\n    return x * 2\n" * 3  # longer than the tiny model's 32 positions: rolled


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval")
    step = train_tiny(folder / "dump")[0]
    export_to_hf(step, folder / "hf")
    # A local multiple-choice task in lm-eval's own format: 20 items of the shipped task whose
    # rows fit the tiny model's 32 positions (the hf backend refuses a longer continuation).
    items = [
        {"context": item.context, "choices": list(item.choices), "label": item.label}
        for item in read_task("python_keywords").items
        if all(len(item.context.encode()) + len(choice.encode()) < 32 for choice in item.choices)
    ][:20]
    assert len(items) == 20
    (folder / "tasks").mkdir()
    (folder / "tasks" / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / "tasks" / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'tasks' / 'items.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
        monkeypatch.setenv("HF_DATASETS_CACHE", str(folder / "datasets_cache"))
        yield str(step), str(folder / "hf"), folder / "tasks"


@pytest.fixture(scope="module")
def backends(checkpoints):
    from lm_eval.models.huggingface import HFLM

    from titanlite.downstream.harness import TitanliteLM

    step, hf, _ = checkpoints
    return TitanliteLM(checkpoint=step, batch_size=4), HFLM(pretrained=hf, device="cpu", dtype="float32", batch_size=4)


def requests(kind: str, arguments: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, index) for index, args in enumerate(arguments)]


def test_log_likelihoods_equal_the_hugging_face_backends(backends):
    ours, theirs = backends
    mine, hf = (
        ours.loglikelihood(requests("loglikelihood", PAIRS)),
        theirs.loglikelihood(requests("loglikelihood", PAIRS)),
    )
    for pair, (logprob, greedy), (hf_logprob, hf_greedy) in zip(PAIRS, mine, hf, strict=True):
        assert logprob == pytest.approx(hf_logprob, abs=1e-4) and greedy == hf_greedy, pair
    rolling = requests("loglikelihood_rolling", [(TEXT,)])
    assert ours.loglikelihood_rolling(rolling)[0] == pytest.approx(theirs.loglikelihood_rolling(rolling)[0], abs=1e-4)
    # Greedy generation stops at the first `until` string, as the hf backend's does.
    generation = requests("generate_until", [("def main():\n", {"until": ["\n\n"], "max_gen_toks": 12})])
    assert ours.generate_until(generation) == theirs.generate_until(generation)


def test_the_accuracy_on_a_local_task_equals_the_hugging_face_backends(checkpoints, backends):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _, _, tasks = checkpoints
    results = [
        simple_evaluate(model=lm, tasks=[TASK], task_manager=TaskManager(include_path=str(tasks)))["results"][TASK]
        for lm in backends
    ]
    for metric in ("acc,none", "acc_norm,none"):
        assert results[0][metric] == results[1][metric], (metric, results)


def test_scripts_eval_runs_lm_evals_command_line_on_a_checkpoint(checkpoints, tmp_path):
    step, _, tasks = checkpoints
    command = [sys.executable, str(REPO / "scripts" / "eval.py"), "--checkpoint", step, "--model_args", "dtype=float32"]
    command += ["--tasks", TASK, "--include_path", str(tasks), "--batch_size", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert TASK in done.stdout and "acc" in done.stdout, done.stdout[-3000:]
