"""Rules of psrt's shape that a reader relies on: a module small enough to read in one sitting,
and one meaning per class name, so that a name met in a traceback or a review says which
thing it is without its module."""
from __future__ import annotations

import ast
import collections
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("psrt", "launcher")
# A module over this many lines holds more than one job: split it by job.
MAX_LINES = 400


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def test_no_module_is_over_400_lines():
    long = [f"{path.relative_to(REPO)}: {lines} lines" for path in _modules()
            if (lines := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split each by job):\n" + "\n".join(long)


def test_no_class_name_is_defined_twice():
    """Every ``class`` statement, at the top of a module or nested, private names included:
    two classes of one name are two meanings of it.  No name is exempt."""
    where: dict[str, list[str]] = collections.defaultdict(list)
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(REPO)}:{node.lineno}")
    twice = [f"{name}: {', '.join(places)}" for name, places in sorted(where.items()) if len(places) > 1]
    assert not twice, "class names defined more than once (give each meaning its own name):\n" + "\n".join(twice)
