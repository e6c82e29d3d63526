"""Dry run: `python -m titanlite.config [options]` parses the options exactly as
training does and prints the resolved config as TOML, without starting anything."""

import sys

from titanlite.config.manager import parse_args_or_exit, to_toml


def main(argv: list[str] | None = None) -> int:
    config = parse_args_or_exit(argv)
    sys.stdout.write(to_toml(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
