#!/usr/bin/env bash
# Run the test suite; arguments go to pytest (default: every test under tests/).
#   ./run_tests.sh
#   ./run_tests.sh tests/test_config.py -k toml -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON="${PYTHON:-python3}"

# Checked from / so that the checkout itself (the current folder) does not count as installed.
# pyproject.toml pins torch, so this install cannot replace the torch build already present.
if ! (cd / && "$PYTHON" -c "import pytest, tokenizers, transformers, coverage, titanlite") >/dev/null 2>&1; then
    echo "run_tests.sh: installing titanlite with its test extras (pip install -e \".[test]\")"
    "$PYTHON" -m pip install -e ".[test]"
fi

exec "$PYTHON" -m pytest "$@"
