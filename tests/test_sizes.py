"""No module over 550 lines, no function over 80, outside the proof harness (docs/design.md §
"Layout and the one import name").

A function that must stay longer says why in its docstring, on a line that starts
``Stays long:``. The limits are read from the source with ``ast``: a function's length is
``end_lineno - lineno + 1`` (from its ``def`` line to its last line, its docstring included),
for every function and method, nested ones too.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

MAX_MODULE_LINES = 550
MAX_FUNCTION_LINES = 80

#: The folders whose modules are held to the limits, and what is exempt within them (the proof
#: harness: scenario scripts that read best whole).
FOLDERS = ("ledger", "recovery", "worker")
EXEMPT = ("worker/harness/",)

#: How a function that must stay longer says why: a docstring line starting with this, then
#: the reason.
STAYS_LONG = "Stays long:"


def _says_why(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for line in (ast.get_docstring(node) or "").splitlines():
        line = line.strip()
        if line.startswith(STAYS_LONG) and line[len(STAYS_LONG) :].strip():
            return True
    return False


def oversized(source: str, name: str) -> list[str]:
    """Every limit the module ``source`` (called ``name`` in the report) breaks, one line each."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assert node.end_lineno is not None
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES and not _says_why(node):
            found.append(
                f"{name}:{node.lineno} {node.name}: {length} lines (at most "
                f"{MAX_FUNCTION_LINES}, or a docstring line {STAYS_LONG!r} with the reason)"
            )
    return found


def _checked(root: Path) -> list[str]:
    """The modules under ``root`` held to the limits, as paths relative to it."""
    return [
        rel
        for folder in FOLDERS
        for path in sorted((root / folder).rglob("*.py"))
        if not (rel := path.relative_to(root).as_posix()).startswith(EXEMPT)
    ]


def report(root: Path = REPO) -> list[str]:
    """Every limit broken under ``root``'s folders, one line each."""
    return [line for rel in _checked(root) for line in oversized((root / rel).read_text(), rel)]


def test_no_module_or_function_is_over_its_limit() -> None:
    broken = report()
    assert not broken, "\n".join(broken)


def test_the_check_reads_every_package() -> None:
    checked = _checked(REPO)
    assert {rel.split("/")[0] for rel in checked} == set(FOLDERS)
    assert "worker/cli/doctor.py" in checked and "ledger/hotpath.py" in checked
    assert not [rel for rel in checked if rel.startswith("worker/harness/")]


def _function(name: str, body_lines: int, docstring: str = "", indent: str = "") -> str:
    """A function of exactly ``body_lines`` + 1 lines (+ its docstring's)."""
    doc = [f'{indent}    """{docstring}"""'] if docstring else []
    body = [f"{indent}    x{i} = {i}" for i in range(body_lines)]
    return "\n".join([f"{indent}def {name}():", *doc, *body]) + "\n"


def test_a_module_over_the_limit_is_reported() -> None:
    at_limit = "x = 1\n" * MAX_MODULE_LINES
    assert oversized(at_limit, "m.py") == []
    over = oversized(at_limit + "y = 2\n", "m.py")
    assert over == [f"m.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"]


def _placed(kind: str, body_lines: int) -> str:
    """A module holding a function ``f`` of ``body_lines`` + 1 lines, placed as ``kind`` says."""
    if kind == "function":
        return _function("f", body_lines)
    if kind == "async":
        return "async " + _function("f", body_lines)
    if kind == "method":
        return "class C:\n" + _function("f", body_lines, indent="    ")
    # Nested in a method (which is then longer still, and reported too).
    return "class C:\n    def outer(self):\n" + _function("f", body_lines, indent="        ")


@pytest.mark.parametrize("kind", ["function", "async", "method", "nested"])
def test_a_function_over_the_limit_is_reported(kind: str) -> None:
    at_limit = oversized(_placed(kind, MAX_FUNCTION_LINES - 1), "m.py")
    assert not [line for line in at_limit if " f: " in line], at_limit
    over = oversized(_placed(kind, MAX_FUNCTION_LINES), "m.py")
    assert [line for line in over if f" f: {MAX_FUNCTION_LINES + 1} lines" in line], over


def test_a_long_function_that_says_why_is_allowed() -> None:
    why = _function("f", MAX_FUNCTION_LINES, "One page.\n\n    Stays long: one decision table.\n")
    assert oversized(why, "m.py") == []
    # The reason is required, and the line must start with it.
    empty = _function("f", MAX_FUNCTION_LINES, "One page.\n\n    Stays long:\n")
    assert len(oversized(empty, "m.py")) == 1
    mention = _function("f", MAX_FUNCTION_LINES, "One page. Stays long: no, not at line start.")
    assert len(oversized(mention, "m.py")) == 1


def test_a_planted_big_module_and_function_fail_the_tree_check(tmp_path: Path) -> None:
    """Planted in a copy of the tree, each fails the check the real tree passes; in the
    harness, neither does."""
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*.pyc"))
    big = "x = 1\n" * (MAX_MODULE_LINES + 1)
    long = _function("planted", MAX_FUNCTION_LINES)
    (tmp_path / "ledger" / "planted_big.py").write_text(big)
    (tmp_path / "worker" / "cli" / "planted_long.py").write_text(long)
    (tmp_path / "worker" / "harness" / "planted_harness.py").write_text(big + long)
    found = [line for line in report(tmp_path) if "planted" in line or "/harness/" in line]
    assert found == [
        f"ledger/planted_big.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})",
        f"worker/cli/planted_long.py:1 planted: {MAX_FUNCTION_LINES + 1} lines (at most "
        f"{MAX_FUNCTION_LINES}, or a docstring line {STAYS_LONG!r} with the reason)",
    ], found
