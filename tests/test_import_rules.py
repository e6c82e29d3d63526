"""The import rules README.md writes down (its "Imports point one way" block) hold in the code:
each module of titanlite, and each script, imports only what its line allows; and no module of
the package outgrows its room."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEAF_MARK = "any package may import them"


def readme_rules() -> tuple[dict[str, set[str] | None], set[str]]:
    """(unit -> the units it may import, None for anything; the leaf units anyone may import)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"Imports point one way.*?```\n(.*?)```", text, re.S)
    assert block, "README.md has no import-rules block"
    rules, leaves = {}, set()
    for line in block.group(1).strip().splitlines():
        left, right = (side.strip() for side in line.split("->"))
        allowed, _, remark = right.partition(";")
        targets = {"anything": None, "nothing": set()}.get(allowed.strip())
        if allowed.strip() not in ("anything", "nothing"):
            targets = {name.strip() for name in allowed.split(",")}
        for unit in (name.strip() for name in left.split(",")):
            rules[unit] = targets
            if LEAF_MARK in remark:
                leaves.add(unit)
    return rules, leaves


def unit_of(path: Path) -> str:
    """The package or top-level module a file belongs to: checkpoint, train, ..., or scripts/."""
    if path.parent.name == "scripts":
        return "scripts/"
    first = path.relative_to(REPO / "titanlite").parts[0]
    return first.removesuffix(".py")


def imported_units(path: Path) -> set[str]:
    """The titanlite packages and top-level modules a file imports, anywhere in it."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "titanlite":
            parts = node.module.split(".")
            units.update(parts[1:2] or [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            units.update(a.name.split(".")[1] for a in node.names if a.name.startswith("titanlite."))
    return units


def test_every_module_imports_only_what_the_readme_allows():
    rules, leaves = readme_rules()
    files = sorted((REPO / "titanlite").rglob("*.py")) + sorted((REPO / "scripts").glob("*.py"))
    problems = []
    for path in files:
        unit = unit_of(path)
        if unit == "__init__":
            continue
        assert unit in rules, f"README.md's import rules do not mention {unit} ({path.relative_to(REPO)})"
        allowed = rules[unit]
        if allowed is None:
            continue
        for imported in sorted(imported_units(path) - {unit} - leaves - allowed):
            problems.append(f"{path.relative_to(REPO)} imports {imported}, which README.md does not allow {unit}")
    assert not problems, "\n".join(problems)


def test_the_rules_can_fail():
    """A module importing the trainer breaks the rules: the check is not vacuous."""
    rules, leaves = readme_rules()
    assert "train" not in leaves and all(allowed is None or "train" not in allowed for allowed in rules.values())
    assert "train" in imported_units(REPO / "benchmarks" / "checkpoint_stall.py")


# No module of the package over this many lines: each one a reader takes in one sitting,
# split by concern when it grows (README.md's map of the package names each).
MAX_MODULE_LINES = 450


def test_no_module_of_the_package_is_over_its_room_size():
    sizes = {path: len(path.read_text().splitlines()) for path in (REPO / "titanlite").rglob("*.py")}
    assert len(sizes) > 50, sorted(sizes)  # the package was found
    over = [
        f"{path.relative_to(REPO)}: {lines} lines" for path, lines in sorted(sizes.items()) if lines > MAX_MODULE_LINES
    ]
    assert not over, f"over {MAX_MODULE_LINES} lines (split by concern): {over}"
