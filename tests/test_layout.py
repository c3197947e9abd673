"""One import name: celery-ledger installs ``celery_ledger`` and nothing else (issue 13).

A library must never break the project it is installed into. Celery imports every
``celery.commands`` entry point into every ``celery`` command line, so a top-level ``worker``
package of ours would shadow the user's own ``worker.py`` (``celery -A worker``) from the first
command on; ``ledger.py`` and ``recovery.py`` are just as common. These tests run a user's
project that has all three, with celery-ledger installed, through real ``celery`` commands.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

USER_WORKER = """
from celery import Celery

celery = Celery("shop", broker="memory://", backend="cache+memory://", include=["tasks"])
"""

USER_TASKS = """
from celery_ledger import LedgerTask, install

from worker import celery
import ledger

install(celery)


@celery.task(base=LedgerTask, bind=True, name="shop.charge")
def charge(self, order_id):
    return ledger.book(order_id)
"""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    """A Celery project whose modules are called ``worker``, ``ledger`` and ``recovery``."""
    (tmp_path / "worker.py").write_text(USER_WORKER)
    (tmp_path / "ledger.py").write_text("def book(order_id):\n    return f'booked {order_id}'\n")
    (tmp_path / "recovery.py").write_text("PLAN = 'restore from backup'\n")
    (tmp_path / "tasks.py").write_text(USER_TASKS)
    return tmp_path


def test_celery_report_loads_the_users_own_worker_module(user_project: Path) -> None:
    out = _run(["-m", "celery", "-A", "worker", "report"], user_project)
    assert out.returncode == 0, out.stderr
    assert "has no attribute" not in out.stderr


def test_celery_ledger_subcommand_runs_in_the_users_project(user_project: Path) -> None:
    out = _run(["-m", "celery", "-A", "worker", "ledger", "--help"], user_project)
    assert out.returncode == 0, out.stderr
    for command in ("list", "show", "release", "doctor"):
        assert f"  {command} " in out.stdout, out.stdout


def test_users_task_module_uses_celery_ledger_beside_its_own_ledger(user_project: Path) -> None:
    code = (
        "import tasks, ledger, recovery\n"
        "from celery_ledger import LedgerTask\n"
        "assert isinstance(tasks.charge, LedgerTask), type(tasks.charge)\n"
        "assert ledger.book('o-1') == 'booked o-1'\n"
        "assert recovery.PLAN == 'restore from backup'\n"
        "print(tasks.charge.name)\n"
    )
    out = _run(["-c", code], user_project)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "shop.charge"


@pytest.mark.parametrize("name", ["worker", "ledger", "recovery"])
def test_generic_names_are_not_importable_in_an_empty_directory(tmp_path: Path, name: str) -> None:
    out = _run(["-c", f"import {name}"], tmp_path)
    assert out.returncode != 0
    assert f"No module named '{name}'" in out.stderr


def test_the_subpackages_live_under_the_one_name(tmp_path: Path) -> None:
    code = (
        "import celery_ledger.ledger, celery_ledger.recovery, celery_ledger.cli.main\n"
        "import celery_ledger.harness.verify\n"
        "from celery_ledger import LedgerTask, create_app, install, Reconciled, AmbiguousStep\n"
        "print('ok')\n"
    )
    out = _run(["-c", code], tmp_path)
    assert out.returncode == 0, out.stderr


def test_a_built_wheel_holds_only_celery_ledger(tmp_path: Path) -> None:
    """What a non-editable install puts into site-packages: one top-level name, and the entry
    points under it."""
    # The dev extra installs the build backend, so the wheel builds offline.
    out = _run(
        [
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("celery_ledger-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        eps = zf.read(entry_points).decode()
    assert tops == {"celery_ledger"}, tops
    assert "celery-ledger = celery_ledger.cli.main:main" in eps
    assert "ledger = celery_ledger.cli.plugin:celery_ledger_command" in eps
    assert "celery_ledger/ledger/migrations/versions/0001_initial.py" in names


# -- layering: worker -> recovery -> ledger ------------------------------------------------------


def _imports(folder: str) -> dict[str, set[str]]:
    """Module -> the absolute modules it imports, read from the source (every branch)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        if "migrations" in path.parts:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def test_the_ledger_imports_no_celery_and_nothing_above_it() -> None:
    for module, names in _imports("ledger").items():
        bad = {
            n
            for n in names
            if n.split(".")[0] in ("celery", "kombu", "billiard")
            or (n.startswith("celery_ledger") and not n.startswith("celery_ledger.ledger"))
        }
        assert not bad, f"{module} imports {sorted(bad)}"


def test_recovery_imports_only_the_ledger_of_celery_ledger() -> None:
    for module, names in _imports("recovery").items():
        bad = {
            n
            for n in names
            if n.startswith("celery_ledger")
            and not n.startswith(("celery_ledger.ledger", "celery_ledger.recovery"))
        }
        assert not bad, f"{module} imports {sorted(bad)}"


def test_importing_the_ledger_loads_no_celery(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import celery_ledger.ledger, celery_ledger.ledger.store, celery_ledger.ledger.operator\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = _run(["-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert not {m for m in loaded if m.split(".")[0] in ("celery", "kombu", "billiard")}
    assert not {
        m
        for m in loaded
        if m.startswith("celery_ledger.") and not m.startswith("celery_ledger.ledger")
    }


# -- the runtime's own import graph -------------------------------------------------------------


def _runtime_graph() -> dict[str, set[str]]:
    """``celery_ledger.<module>`` -> the runtime modules it imports, for every ``worker/*.py``.

    Every import counts: module level, inside functions (a lazy import that dodges a cycle is
    still the cycle) and under ``TYPE_CHECKING``.
    """
    modules = {
        "celery_ledger" if p.stem == "__init__" else f"celery_ledger.{p.stem}": p
        for p in sorted((REPO / "worker").glob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = "celery_ledger" if name == "celery_ledger" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0]
                    base = f"{parent}.{base}" if base else parent
                # ``from celery_ledger import intents`` imports the module ``intents``;
                # ``from celery_ledger import LedgerTask`` imports the package itself.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            # Only runtime modules are nodes: ``celery_ledger.ledger`` and the other
            # subpackages sit below (or beside) the runtime, and a submodule's import running
            # its package's ``__init__`` is Python's edge, not one the code chose.
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_runtime_import_graph_has_no_cycle() -> None:
    graph = _runtime_graph()
    # The graph is read, not empty: the task module imports the attempt it runs.
    assert "celery_ledger.attempt" in graph["celery_ledger.task"]
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in the runtime: " + " -> ".join(cycle or [])


def test_flower_imports_nothing_from_the_cli() -> None:
    """The Ledger page and the CLI render one operator view (``celery_ledger.view``); the page
    never reaches into the click-bound CLI for its rules or its words."""
    for module, names in _imports("worker/flower").items():
        bad = {n for n in names if n == "celery_ledger.cli" or n.startswith("celery_ledger.cli.")}
        assert not bad, f"{module} imports {sorted(bad)}"


# -- the contract lives in the repository --------------------------------------------------------

#: Where the contract is written down: in this repository, for every reader of it.
CONTRACT = REPO / "docs" / "contract.md"

#: The design brief kept beside the repository (spelt in two halves, so that this file does
#: not cite it either).
_BRIEF = "shared" + "/DESIGN"

#: A relative path that leaves the repository (up a folder too many), the brief, or the workspace
#: around the repository: each names a file a reader of this repository cannot open.
_OUTSIDE = re.compile(r"(?<![\w.])((?:\.\./)+[\w./-]+|" + re.escape(_BRIEF) + r"[\w.]*|/work/\w+)")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    )
    files = []
    for name in out.stdout.split("\0"):
        path = REPO / name
        if not name or path.suffix in (".png", ".ico", ".gz") or not path.is_file():
            continue
        files.append(path)
    return files


def _outside_citations(path: Path, text: str) -> list[str]:
    found = []
    for match in _OUTSIDE.finditer(text):
        cited = match.group(1)
        if cited.startswith("../"):
            target = (path.parent / cited).resolve()
            if target.is_relative_to(REPO) and target.exists():
                continue
        found.append(cited)
    return found


def test_the_outside_citation_finder_finds_one(tmp_path: Path) -> None:
    doc = REPO / "docs" / "x.md"
    assert _outside_citations(doc, f"see `../{_BRIEF}.md` §2") == [f"../{_BRIEF}.md"]
    assert _outside_citations(doc, f"the brief ({_BRIEF}.md)") == [f"{_BRIEF}.md"]
    assert _outside_citations(doc, "see `../README.md` and docs/contract.md") == []


def test_no_file_cites_a_path_outside_the_repository() -> None:
    """Every promise is argued from files a reader of the repository can open."""
    cited = {}
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found = _outside_citations(path, text)
        if found:
            cited[str(path.relative_to(REPO))] = found
    assert not cited, f"files cite paths outside the repository: {cited}"


def test_the_contract_names_every_entry_status_and_gate() -> None:
    from celery_ledger.ledger import EntryStatus, Gate

    assert CONTRACT.is_file(), "docs/contract.md is missing"
    text = CONTRACT.read_text(encoding="utf-8")
    missing = [
        f"{kind.__name__}.{member.name}"
        for kind in (EntryStatus, Gate)
        for member in kind
        if f"`{member.value}`" not in text and f"`{member.name}`" not in text
    ]
    assert not missing, f"docs/contract.md does not name {missing}"


#: How a page states the promise (docs/contract.md §1).
_PROMISE = re.compile(
    r"at-most-once|at most once per effect|no silent (duplicate|loss)", re.IGNORECASE
)


def test_every_doc_that_states_the_promise_cites_the_contract() -> None:
    """README and each page in docs/ that states the promise points to docs/contract.md."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    stating = []
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        if doc != CONTRACT and _PROMISE.search(text):
            stating.append(doc.name)
            assert "contract.md" in text, f"{doc.relative_to(REPO)} states the promise uncited"
    assert "README.md" in stating, "the README no longer states the promise"
