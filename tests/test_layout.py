"""One import name: celery-ledger installs ``celery_ledger`` and nothing else (docs/design.md
§ "Layout and the one import name").

A library must never break the project it is installed into. Celery imports every
``celery.commands`` entry point into every ``celery`` command line, so a top-level ``worker``
package of ours would shadow the user's own ``worker.py`` (``celery -A worker``) from the first
command on; ``ledger.py`` and ``recovery.py`` are just as common. These tests run a user's
project that has all three, with celery-ledger installed, through real ``celery`` commands.
"""

from __future__ import annotations

import ast
import re
import shutil
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


def test_only_the_django_app_imports_django_and_nothing_imports_it() -> None:
    """``celery_ledger.contrib.django`` is the one package that imports Django at module level
    (``django_steps`` imports it inside the function a Django step calls), and no module
    outside ``contrib`` imports ``contrib``: a project without Django never loads it."""
    for folder in ("worker", "ledger", "recovery"):
        for module, names in _imports(folder).items():
            if module.startswith("worker/contrib/"):
                continue
            assert not {n for n in names if n.startswith("celery_ledger.contrib")}, module
            tree = ast.parse((REPO / module).read_text())
            top = {
                alias.name
                for node in tree.body
                if isinstance(node, ast.Import)
                for alias in node.names
            } | {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
            assert not {n for n in top if n.split(".")[0] == "django"}, module


def test_celery_ledger_imports_with_django_unimportable(tmp_path: Path) -> None:
    """Every front end but the Django app loads where ``import django`` fails."""
    code = (
        "import sys\n"
        "sys.modules['django'] = None  # import django raises ImportError\n"
        "import celery_ledger, celery_ledger.app, celery_ledger.task, celery_ledger.cli.main\n"
        "import celery_ledger.flower.views, celery_ledger.flower.actions\n"
        "import celery_ledger.flower.hook, celery_ledger.view, celery_ledger.recovery\n"
        "from celery_ledger import LedgerTask, create_app\n"
        "print('ok')\n"
    )
    out = _run(["-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- import cycles, in every package ------------------------------------------------------------

#: Repository folder -> the package it is installed as (pyproject's ``package-dir``). The
#: subfolders of ``worker/`` are the subpackages ``celery_ledger.cli``, ``.flower``, ``.harness``.
ROOTS = {
    "worker": "celery_ledger",
    "ledger": "celery_ledger.ledger",
    "recovery": "celery_ledger.recovery",
}

#: Every package whose modules must not import each other in a circle.
PACKAGES = {
    "worker": "celery_ledger",
    "worker/cli": "celery_ledger.cli",
    "worker/flower": "celery_ledger.flower",
    "worker/harness": "celery_ledger.harness",
    "worker/contrib/django": "celery_ledger.contrib.django",
    "ledger": "celery_ledger.ledger",
    "recovery": "celery_ledger.recovery",
}


def _modules(root: Path) -> dict[str, Path]:
    """``celery_ledger...`` module name -> its file, for every module under ``root``'s folders
    (a package is its ``__init__.py``; Alembic's scripts are not importable modules)."""
    modules: dict[str, Path] = {}
    for folder, package in ROOTS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if "migrations" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the modules of ``celery_ledger`` it imports, read from the source with ``ast``.

    Every import counts: module level, inside functions (a lazy import that dodges a cycle is
    still the cycle) and under ``TYPE_CHECKING``. ``from pkg import name`` is an edge to the
    module ``pkg.name`` when there is one, else to the package ``pkg`` (its ``__init__``). A
    submodule's import running its package's ``__init__`` is Python's edge, not one the code
    chose, and is not counted.
    """
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0]
                    base = f"{parent}.{base}" if base else parent
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _package_of(module: str) -> str:
    """The package whose own module ``module`` is (a package's ``__init__`` is its own)."""
    return max((p for p in PACKAGES.values() if module == p or module.startswith(p + ".")), key=len)


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


def _tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of ``graph`` with more than one node: each holds a cycle,
    and every cycle lies within one (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = {stack.pop()}
            while node not in part:
                part.add(stack.pop())
            if len(part) > 1:
                found.append(part)

    for start in sorted(graph):
        if start not in index:
            visit(start)
    return found


def _cycle_in(package: str | None, graph: dict[str, set[str]]) -> str | None:
    """What the check reports: every import cycle among ``package``'s own modules (all the
    packages' modules together when None), one line each; or None."""
    members = {m for m in graph if package is None or _package_of(m) == package}
    own = {m: graph[m] & members for m in members}
    cycles = []
    for part in _tangles(own):
        cycle = _cycle({m: own[m] & part for m in part})
        assert cycle is not None
        cycles.append(" -> ".join(cycle))
    if not cycles:
        return None
    return f"import cycles in {package or 'celery_ledger'}:\n" + "\n".join(sorted(cycles))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    two = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"d"}}
    assert sorted(map(sorted, _tangles(two))) == [["a", "b"], ["d", "e"]]


def test_the_import_graph_is_read_from_every_package() -> None:
    graph = _import_graph()
    assert {_package_of(m) for m in graph} == set(PACKAGES.values())
    # Module level: the task module imports the attempt it runs.
    assert "celery_ledger.attempt" in graph["celery_ledger.task"]
    # Inside a function: the ``celery ledger`` plugin loads the CLI on first use.
    assert "celery_ledger.cli.main" in graph["celery_ledger.cli.plugin"]
    # ``from pkg import name`` where ``name`` is not a module: the package's ``__init__``.
    assert "celery_ledger.ledger" in graph["celery_ledger.recovery.sweep"]


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_no_package_has_an_import_cycle(folder: str) -> None:
    report = _cycle_in(PACKAGES[folder], _import_graph())
    assert report is None, report


def test_the_packages_import_each_other_in_no_cycle() -> None:
    report = _cycle_in(None, _import_graph())
    assert report is None, report


def _copy_of_the_tree(tmp_path: Path) -> Path:
    for folder in ROOTS:
        shutil.copytree(
            REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    return tmp_path


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_a_planted_pair_of_modules_is_a_cycle_the_check_reports(
    tmp_path: Path, folder: str
) -> None:
    """Two new modules in a copy of the package: one imports the other inside a function, the
    other imports it back, relatively, at module level."""
    root = _copy_of_the_tree(tmp_path)
    package = PACKAGES[folder]
    (root / folder / "planted_a.py").write_text(
        f"def later():\n    from {package} import planted_b\n\n    return planted_b\n"
    )
    (root / folder / "planted_b.py").write_text("from . import planted_a\n")
    report = _cycle_in(package, _import_graph(root))
    assert report is not None
    assert f"{package}.planted_a -> {package}.planted_b -> {package}.planted_a" in report, report
    whole = _cycle_in(None, _import_graph(root))
    assert whole is not None and f"{package}.planted_" in whole, whole


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_a_planted_edge_back_along_a_real_import_is_a_cycle_the_check_reports(
    tmp_path: Path, folder: str
) -> None:
    """The real modules, plus one import inside a function that closes a circle: for the first
    real import ``a -> b`` between two of the package's modules, ``b`` imports ``a`` back."""
    root = _copy_of_the_tree(tmp_path)
    package = PACKAGES[folder]
    graph = _import_graph(root)
    a, b = next(
        (a, b)
        for a in sorted(graph)
        if _package_of(a) == package
        for b in sorted(graph[a])
        if _package_of(b) == package
    )
    path = _modules(root)[b]
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    import {a}  # noqa: F401\n")
    report = _cycle_in(package, _import_graph(root))
    assert report is not None
    assert a in report and b in report, report


# -- one runtime per app ------------------------------------------------------------------------

#: The one module that keeps the ledger's state on a Celery app (``runtime_of``).
RUNTIME_MODULE = "worker/runtime.py"


def _ledger_attributes_touched(root: Path = REPO) -> list[str]:
    """``file:line name`` for each place outside ``worker/runtime.py`` that names a ``_ledger_*``
    attribute: an assignment to ``x._ledger_*`` (or a ``del``), or a ``_ledger_*`` string (the
    ``getattr``/``setattr``/``vars(app)`` spelling). Read with ``ast`` from every package."""
    found: list[str] = []
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            where = str(path.relative_to(root))
            if where == RUNTIME_MODULE or "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    name = node.attr
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    name = node.value
                else:
                    continue
                if name.startswith("_ledger_"):
                    found.append(f"{where}:{node.lineno} {name}")
    return found


def test_no_module_but_the_runtime_keeps_ledger_state_on_an_app() -> None:
    assert _ledger_attributes_touched() == []
    # The runtime's own attribute is the one it names.
    names = {
        node.value
        for node in ast.walk(ast.parse((REPO / RUNTIME_MODULE).read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("_ledger_")
    }
    assert names == {"_ledger_runtime"}


@pytest.mark.parametrize(
    ("folder", "line"),
    [
        ("worker", "def f(app):\n    app._ledger_store = None\n"),
        ("recovery", "def f(app):\n    setattr(app, '_ledger_confirmed', None)\n"),
        ("worker/flower", "def f(app):\n    return getattr(app, '_ledger_settings', None)\n"),
    ],
)
def test_a_planted_ledger_attribute_is_reported(tmp_path: Path, folder: str, line: str) -> None:
    root = _copy_of_the_tree(tmp_path)
    (root / folder / "planted.py").write_text(line)
    found = _ledger_attributes_touched(root)
    assert len(found) == 1 and found[0].startswith(f"{folder}/planted.py:2 _ledger_"), found


# -- readable without the issue tracker ----------------------------------------------------------

#: What must read on its own: the code, its tests and benchmarks, the docs and the README.
#: CHANGELOG.md is history and keeps its numbers.
READABLE = ("worker", "ledger", "recovery", "tests", "benchmarks", "docs", "README.md")

#: A reference to the tracker (a number after the word). Spelled in two pieces so that this file
#: does not match it.
TRACKER_NUMBER = re.compile(r"\b" + "iss" + r"ue \d+", re.IGNORECASE)

#: A citation of a section: ``NAME.md`` (or ``docs/NAME.md``, or a Markdown link to it), then the
#: section mark and the title in double quotes, read over line breaks and comment markers.
CITATION = re.compile(r"([\w-]+)\.md[`)]?,?\s*" + "\N{SECTION SIGN}" + r'\s*"([^"]+)"')
SECTION_MARK = re.compile("\N{SECTION SIGN}" + r'\s*"')


def _readable_files(root: Path) -> list[Path]:
    """Every text file under ``READABLE`` (compiled and binary files left out)."""
    files: list[Path] = []
    for name in READABLE:
        top = root / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            files.append(path)
    return files


def _tracker_numbers(root: Path = REPO) -> list[str]:
    """``file:line text`` for each reference to the issue tracker by number."""
    return [
        f"{path.relative_to(root)}:{number} {match.group(0)}"
        for path in _readable_files(root)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in TRACKER_NUMBER.finditer(line)
    ]


def _flattened(text: str) -> str:
    """The text as one line: each line's indentation and comment marker (``#``, ``#:``) dropped,
    so that a citation wrapped over two lines reads as one."""
    return " ".join(re.sub(r"^\s*(#:?\s*)?", "", line) for line in text.splitlines())


def _headings(doc: Path) -> set[str]:
    """A Markdown file's headings, outside fenced code, without their ``#`` and numbering."""
    found: set[str] = set()
    fenced = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(re.sub(r"^\d+\.\s+", "", line.lstrip("#").strip()))
    return found


def _names_a_heading(title: str, headings: set[str]) -> bool:
    """The whole heading, or its short form: the words before its colon or its parenthesis."""
    return any(
        title == heading or heading.startswith((f"{title}:", f"{title} (")) for heading in headings
    )


def _broken_citations(root: Path = REPO) -> list[str]:
    """``file: NAME.md "title"`` for each citation whose document has no such heading, and each
    section mark with a title but no document."""
    docs = {path.stem: path for path in (root / "docs").glob("*.md")}
    docs["README"] = root / "README.md"
    headings = {name: _headings(path) for name, path in docs.items()}
    broken: list[str] = []
    for path in _readable_files(root):
        text = _flattened(path.read_text(encoding="utf-8"))
        where = path.relative_to(root)
        cited = list(CITATION.finditer(text))
        for match in cited:
            name, title = match.group(1), " ".join(match.group(2).split())
            if name not in headings or not _names_a_heading(title, headings[name]):
                broken.append(f'{where}: {name}.md "{title}"')
        if len(SECTION_MARK.findall(text)) != len(cited):
            broken.append(f"{where}: a section title cited without its document")
    return broken


def test_nothing_cites_the_issue_tracker_by_number() -> None:
    assert _tracker_numbers() == []


def test_every_cited_section_is_a_heading_of_its_document() -> None:
    assert _broken_citations() == []


def test_the_citation_reader_knows_the_short_and_wrapped_forms() -> None:
    headings = {"Bad input: a clear error, nothing lost (project brief)", "Durable time"}
    assert _names_a_heading("Bad input", headings)
    assert _names_a_heading("Durable time", headings)
    assert not _names_a_heading("Bad", headings)
    wrapped = 'x (design.md \N{SECTION SIGN} "Canvas: chains,\n    # groups") y'
    assert [m.groups() for m in CITATION.finditer(_flattened(wrapped))] == [
        ("design", "Canvas: chains, groups")
    ]


def _copy_of_what_must_read(tmp_path: Path) -> Path:
    for name in READABLE:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("tests/test_planted.py", '"""A test (see ' + "Iss" + 'ue 14, fault 3)."""\n'),
        ("docs/planted.md", "# Planted\n\nSince " + "iss" + "ue 20 the sweep is faster.\n"),
    ],
)
def test_a_planted_tracker_number_is_reported(tmp_path: Path, where: str, text: str) -> None:
    root = _copy_of_what_must_read(tmp_path)
    assert _tracker_numbers(root) == []
    (root / where).write_text(text)
    found = _tracker_numbers(root)
    assert len(found) == 1 and found[0].startswith(f"{where}:"), found


@pytest.mark.parametrize(
    ("where", "text", "reported"),
    [
        (
            "worker/planted.py",
            '# A cited section that is gone (design.md \N{SECTION SIGN} "Crash\n# points").\n',
            'worker/planted.py: design.md "Crash points"',
        ),
        (
            "docs/planted.md",
            'See guarantees.md \N{SECTION SIGN} "Bad inputs".\n',
            'docs/planted.md: guarantees.md "Bad inputs"',
        ),
        (
            "tests/test_planted.py",
            '"""The nowhere.md \N{SECTION SIGN} "Recovery" of no document."""\n',
            'tests/test_planted.py: nowhere.md "Recovery"',
        ),
        (
            "benchmarks/planted.py",
            '"""A title alone (\N{SECTION SIGN} "Recovery")."""\n',
            "benchmarks/planted.py: a section title cited without its document",
        ),
    ],
)
def test_a_planted_broken_citation_is_reported(
    tmp_path: Path, where: str, text: str, reported: str
) -> None:
    root = _copy_of_what_must_read(tmp_path)
    assert _broken_citations(root) == []
    (root / where).write_text(text)
    assert _broken_citations(root) == [reported]
