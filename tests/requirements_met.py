"""Whether this Python has what the suite needs, as pyproject.toml states it: titanlite's own
requirements and its test extra, each installed at a version its specifier admits, and titanlite
importable. run_tests.sh runs this file before the suite and installs the test extras when it
names anything. A check of presence alone kept, say, a pytest-xdist older than a flag
run_tests.sh passes, and the suite then died on an unknown argument.

Versions are read from the installed packages' metadata, not imported: importing them all took
6 s before the suite could start."""

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10, where titanlite depends on tomli instead
    import tomli as tomllib


def unmet_requirements(pyproject: Path) -> list[str]:
    """Each requirement of the project and of its test extra that this Python does not satisfy,
    with what is installed instead."""
    project = tomllib.loads(pyproject.read_text())["project"]
    unmet = []
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            unmet.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} ({installed} installed)")
    return unmet


if __name__ == "__main__":
    # Run from outside the checkout, so that the checkout itself does not count as installed.
    unmet = unmet_requirements(Path(sys.argv[1]))
    if importlib.util.find_spec("titanlite") is None:
        unmet.append("titanlite (not installed)")
    print(", ".join(unmet))
    sys.exit(1 if unmet else 0)
