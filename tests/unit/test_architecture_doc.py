"""docs/ARCHITECTURE.md's package tree stays true: every module of the packages is named in it at
its own path (or is private: a name starting with an underscore, or generated stubs), and every
Python file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO

PACKAGES = ("disttrain_api", "preprocess_service", "trainer", "disttrain_tools")


def _tree() -> str:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Package tree"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def _modules() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))
            if (p.name != "__init__.py" and not p.name.startswith("_") and "_pb2" not in p.name)
            or p.name == "__main__.py"]


def _named_paths(tree: str) -> set[str]:
    """Repository paths of the files the tree names, read by its indentation: an entry line's
    leading names (``a.py, b.py``) are in the folder its indentation puts it in, and a folder
    entry's description (with its wrapped lines) names files inside that folder."""
    named: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    folder = ""
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent < 20:  # an entry; deeper lines continue the previous entry's description
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            head = re.match(r"((?:[\w.*/-]+, )*[\w.*/-]+)", line.strip()).group(1)
            first = head.split(", ")[0]
            if first.endswith("/"):
                folder = parent + first
                stack.append((indent, folder))
            else:
                folder = parent
            text = line.strip()[len(head):] if first.endswith("/") else head
        else:
            text = line
        named |= {folder + name for name in re.findall(r"[\w]+\.py", text)}
    return named


def test_every_package_module_is_in_the_architecture_tree():
    named = _named_paths(_tree())
    missing = [str(p.relative_to(REPO)) for p in _modules() if str(p.relative_to(REPO)) not in named]
    assert not missing, f"modules docs/ARCHITECTURE.md does not name where they are (add a line, or make them " \
                        f"private): {missing}"


def test_every_file_the_tree_names_exists():
    names = set(re.findall(r"[\w]+\.py", _tree())) - {"preprocess_pb2.py"}
    existing = {p.name for p in REPO.rglob("*.py") if ".venv" not in p.parts}
    stale = sorted(n for n in names if n not in existing)
    assert not stale, f"docs/ARCHITECTURE.md names files that do not exist: {stale}"


def test_unit_tests_mirror_the_package_tree():
    """tests/unit/<package path>/test_<name>.py: a unit test sits in the folder of the package it
    tests, so a newcomer finds a module's tests by its path (tests of the whole tree at the top)."""
    unit = REPO / "tests" / "unit"
    stray = [str(p.relative_to(REPO)) for p in unit.rglob("test_*.py")
             if p.parent != unit and not (REPO / p.parent.relative_to(unit)).is_dir()]
    assert not stray, f"unit tests in folders that mirror no package: {stray}"
    assert not list((REPO / "tests").glob("test_*.py")), "a test file at tests/: put it under tests/unit/<package>/"
