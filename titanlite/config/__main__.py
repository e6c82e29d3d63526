"""Dry run: `python -m titanlite.config [options]` parses the options exactly as training does and
prints the resolved config as TOML, without starting anything. With `--get section.key` it
prints that one value instead, in its command-line form: the launch scripts read
checkpoint.stop_save_seconds this way, so that the TOML file and the command line both count."""

import sys

from titanlite.config import ConfigError, parse_args, to_toml, value_text


def _take_get(argv: list[str]) -> tuple[str | None, list[str]]:
    """Split `--get KEY` (or `--get=KEY`) off the training options."""
    key, rest, index = None, [], 0
    while index < len(argv):
        token = argv[index]
        if token == "--get":
            if index + 1 >= len(argv) or argv[index + 1].startswith("--"):
                raise ConfigError("--get needs a key, e.g. --get checkpoint.stop_save_seconds")
            key, index = argv[index + 1], index + 2
        elif token.startswith("--get="):
            key, index = token.partition("=")[2], index + 1
        else:
            rest.append(token)
            index += 1
    return key, rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The trainer's own flag for tracebacks (run_train.sh passes its arguments to both).
    argv = [arg for arg in argv if arg != "--debug"]
    try:
        key, options = _take_get(argv)
        config = parse_args(options)
        text = to_toml(config) if key is None else value_text(config, key) + "\n"
    except ConfigError as error:
        print(f"titanlite: config error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
