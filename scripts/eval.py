"""Downstream evaluation of a checkpoint with lm-evaluation-harness: titanlite registered as a
model type, then lm-eval's own command line.

    python scripts/eval.py --checkpoint outputs/checkpoint/step-1000 --tasks arc_easy --batch_size 8
    python scripts/eval.py --model titanlite --model_args checkpoint=s3://bucket/run/step-1000 --tasks ...

--checkpoint is a step-N folder (a path or a URL; any checkpoint titanlite wrote, no export)
or a Hugging Face folder, scored by titanlite's model code in this one process; it stands for
`--model titanlite --model_args checkpoint=...`. Every other argument is lm-eval's
(`--include_path` for local task YAMLs, `--limit`, `--output_path`, ...). model_args:
checkpoint, device (cpu), dtype (float32), max_length (the model's RoPE length),
tokenizer (a tokenizer.json or its folder instead of the run's), add_bos_token (true, as the
exported tokenizer does), use_ema. lm-eval 0.4.13 has no plugin entry point for models, so
`lm_eval --model titanlite` cannot find it: this script registers it first.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "eval.py"


def lm_eval_arguments(argv: list[str]) -> list[str]:
    """lm-eval's arguments for ours: --checkpoint X becomes the titanlite model with checkpoint=X."""
    arguments, checkpoint, model_args = [], None, None
    words = iter(argv)
    for word in words:
        name, equals, value = word.partition("=")
        if name in ("--checkpoint", "--model_args"):
            value = value if equals else next(words, None)
            if value is None:
                raise ValueError(f"{name} needs a value")
            checkpoint, model_args = (value, model_args) if name == "--checkpoint" else (checkpoint, value)
        else:
            arguments.append(word)
    if checkpoint is not None:
        model_args = ",".join(filter(None, [f"checkpoint={checkpoint}", model_args]))
        arguments = ["--model", "titanlite", *arguments]
    return arguments + (["--model_args", model_args] if model_args else [])


def main(argv: list[str] | None = None) -> int:
    try:
        arguments = lm_eval_arguments(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    try:
        import lm_eval.__main__ as lm_eval_cli

        import titanlite.downstream.harness  # noqa: F401  (registers the model type "titanlite")
    except ImportError as error:
        print(
            f'{PROG}: error: lm-evaluation-harness is not installed ({error}): pip install "titanlite[eval]"',
            file=sys.stderr,
        )
        return 2
    sys.argv = ["lm_eval", *arguments]
    lm_eval_cli.cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
