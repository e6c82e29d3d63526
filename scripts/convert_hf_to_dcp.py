"""Import a Hugging Face Llama folder as a titanlite checkpoint OUTPUT_DIR/step-0.

python scripts/convert_hf_to_dcp.py HF_DIR OUTPUT_DIR
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "convert_hf_to_dcp"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="a folder with config.json and model.safetensors (or a sharded index)")
    parser.add_argument(
        "output_dir", help="the folder to create, a path or a URL (s3://...); the checkpoint is OUTPUT_DIR/step-0"
    )
    args = parser.parse_args(argv)
    from titanlite.checkpoint.hf import import_from_hf

    try:
        step = import_from_hf(args.hf_dir, args.output_dir)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
