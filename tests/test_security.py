"""Static checks behind docs/security.md: every torch.load titanlite makes is
weights_only=True, and nothing parses configs with anything that can run code."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for folder in ("titanlite", "scripts", "benchmarks") for p in sorted((REPO / folder).rglob("*.py"))]


def calls_named(tree: ast.AST, dotted: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == dotted:
            yield node


def test_every_torch_load_is_weights_only():
    seen = 0
    for path in SOURCES:
        for call in calls_named(ast.parse(path.read_text()), "torch.load"):
            seen += 1
            flags = {kw.arg: kw.value for kw in call.keywords}
            assert "weights_only" in flags and ast.literal_eval(flags["weights_only"]) is True, (
                f"{path.relative_to(REPO)}:{call.lineno}: torch.load without weights_only=True"
            )
    assert seen >= 2  # the scan does find the calls that exist


def test_no_code_from_data():
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for name in (
            "eval",
            "exec",
            "pickle.load",
            "pickle.loads",
            "yaml.load",
            "importlib.import_module",
            "__import__",
        ):
            found = list(calls_named(tree, name))
            assert not found, f"{path.relative_to(REPO)}:{found[0].lineno}: {name}"
