"""run_tests.sh's install check (tests/requirements_met.py): an installed package older than
pyproject.toml asks for counts as unmet, as a missing one does."""

from importlib.metadata import version
from pathlib import Path

from tests.requirements_met import unmet_requirements

REPO = Path(__file__).resolve().parent.parent


def test_a_version_below_its_pin_or_a_missing_package_is_unmet(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[project]\n"
        'dependencies = ["pytest>=7", "titanlite-no-such-package>=1", "pytest<1; python_version < \'3\'"]\n'
        "[project.optional-dependencies]\n"
        'test = ["pytest-xdist>=99"]\n'
    )
    assert unmet_requirements(pyproject) == [
        "titanlite-no-such-package>=1 (not installed)",
        f"pytest-xdist>=99 ({version('pytest-xdist')} installed)",
    ]


def test_the_suites_own_requirements_are_met() -> None:
    # The suite runs after run_tests.sh's check, so the project's own file must pass it; this
    # also reads every requirement line of the real pyproject.toml.
    assert unmet_requirements(REPO / "pyproject.toml") == []
