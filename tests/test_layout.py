"""The code base's layering, read from the source with `ast` (nothing is imported):

- tasks/ is stage logic in plain Python: it never imports `flows`, `infra` or `prefect`;
- the services under infra/services/ never import `flows`;
- no import cycles between the modules of tasks/, flows/ and infra/;
- no function outside tests/ is longer than MAX_FUNCTION_LINES, unless the line just above it (above
  its decorators) is a comment `# long: <why>`;
- tasks/ never calls Prefect's API over HTTP by hand, nor waits for an event-triggered flow's result
  by watching files: the flows own every Prefect interaction (flows/triggered_runs.py waits on those
  flow runs through Prefect's client).

Imports are found at any depth (inside functions too), relative imports are resolved; an import
under `if TYPE_CHECKING:` never runs, so it counts for the layers but closes no cycle. Each checker
takes the root of a source tree, so the `*_is_reported` tests can prove it on a small synthetic tree
that breaks its rule.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("tasks", "flows", "infra")  # the packages whose imports are checked
SOURCE_DIRS = (*LAYERS, "benchmarks")  # all Python outside tests/, for the function length
# what stage logic never imports: the other layers, and Prefect with its integrations
TASKS_MUST_NOT_IMPORT = {"flows", "infra", "prefect", "prefect_ray"}
MAX_FUNCTION_LINES = 100
LONG_MARK = "# long:"
HTTP_CLIENTS = {"httpx", "requests", "urllib", "urllib3", "aiohttp", "urlopen"}  # calls that reach an HTTP API
# what names Prefect's REST API in a function: its URL setting, its auth headers, its resource paths
PREFECT_API_MARKS = ("PREFECT_API_URL", "prefect_api_headers", "/flow_runs", "/task_runs", "/deployments",
                     "/automations", "/artifacts")
# what names an event-triggered flow's result: its record's place in the run directory, the flows' names
TRIGGERED_RESULTS = {"triggered_eval_report", "triggered_deploy_record", "triggered_eval_dir", "EVAL_FLOW",
                     "DEPLOY_FLOW"}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the tree's root
    line: int
    statement: str  # as written (unparsed), for the report
    targets: tuple[str, ...]  # absolute dotted names: `from a import b, c` gives a.b and a.c
    type_only: bool  # under `if TYPE_CHECKING:`: never runs

    @property
    def top_levels(self) -> set[str]:
        return {t.split(".")[0] for t in self.targets}

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.statement}"


def python_files(root: Path, dirs: tuple[str, ...]) -> list[Path]:
    """The .py files under `dirs`, leaving out caches and hidden folders (build trees such as infra/.build)."""
    return sorted(p for d in dirs for p in (root / d).rglob("*.py")
                  if not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(root).parts))


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(root: Path, path: Path) -> str:
    """The package a module's relative imports start from."""
    name = module_name(root, path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imports_of(root: Path, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    type_only = _type_checking_nodes(tree)
    rel = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = tuple(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package(root, path).split(".")
                anchor = ".".join(package[:len(package) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            targets = tuple(base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)
        else:
            continue
        found.append(Import(rel, node.lineno, ast.unparse(node), targets, id(node) in type_only))
    return sorted(found, key=lambda i: (i.file, i.line))


def all_imports(root: Path, dirs: tuple[str, ...] = LAYERS) -> list[Import]:
    return [imp for path in python_files(root, dirs) for imp in imports_of(root, path)]


# ----------------------------------------------------------------------------------- checkers


def forbidden_imports(root: Path, under: str, forbidden: set[str]) -> list[str]:
    """Imports in files under `under` (a folder relative to root) of the top-level packages `forbidden`."""
    prefix = under.rstrip("/") + "/"
    return [f"{imp}  (imports {', '.join(sorted(imp.top_levels & forbidden))})"
            for imp in all_imports(root) if imp.file.startswith(prefix) and imp.top_levels & forbidden]


def _resolve(name: str, modules: set[str]) -> str | None:
    """The project module an import of `name` loads: `pkg.mod.func` -> pkg.mod; None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> dict[str, dict[str, list[Import]]]:
    """module -> {imported project module -> the import statements}; type-only imports left out."""
    files = python_files(root, LAYERS)
    modules = {module_name(root, p) for p in files}
    graph: dict[str, dict[str, list[Import]]] = {m: {} for m in modules}
    for path in files:
        src = module_name(root, path)
        for imp in imports_of(root, path):
            if imp.type_only:
                continue
            for target in {_resolve(t, modules) for t in imp.targets} - {None, src}:
                graph[src].setdefault(target, []).append(imp)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def import_cycles(root: Path) -> list[str]:
    """One entry per cycle: its modules, then each import that keeps it closed."""
    graph = import_graph(root)
    reports = []
    for component in strongly_connected(graph):
        members = set(component)
        edges = [f"    {imp}" for m in component for target, imps in sorted(graph[m].items())
                 if target in members for imp in imps]
        reports.append(f"cycle between {', '.join(component)}:\n" + "\n".join(edges))
    return reports


def long_functions(root: Path, dirs: tuple[str, ...] = SOURCE_DIRS) -> list[str]:
    """Functions and methods longer than MAX_FUNCTION_LINES without a `# long:` reason above them."""
    found = []
    for path in python_files(root, dirs):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if length <= MAX_FUNCTION_LINES:
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            above = lines[first - 2].strip() if first >= 2 else ""
            if above.startswith(LONG_MARK) and above[len(LONG_MARK):].strip():
                continue
            found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}: {node.name} is {length} lines")
    return sorted(found)


def _calls(node: ast.AST) -> list[str]:
    """The called names in `node`, as written (`httpx.post`, `time.sleep`, `urlopen`)."""
    return [ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)]


def _files_under(root: Path, under: str) -> list[tuple[str, ast.AST]]:
    return [(p.relative_to(root).as_posix(), ast.parse(p.read_text(encoding="utf-8"), filename=str(p)))
            for p in python_files(root, (under,))]


def prefect_rest_calls(root: Path, under: str = "tasks") -> list[str]:
    """Functions under `under` that make an HTTP call (httpx, requests, urllib, ...) and name Prefect's
    API (its URL setting, auth headers or a resource path): Prefect called by hand."""
    found = []
    for rel, tree in _files_under(root, under):
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            http = [c for c in _calls(fn) if c.split(".")[0] in HTTP_CLIENTS]
            if http and any(mark in ast.unparse(fn) for mark in PREFECT_API_MARKS):
                found.append(f"{rel}:{fn.lineno}: {fn.name} calls Prefect's API by hand ({min(http, key=len)})")
    return sorted(found)


def result_file_polling(root: Path, under: str = "tasks") -> list[str]:
    """Loops that sleep, in modules under `under` that name an event-triggered flow's result (its
    record's place or the flows' names): waiting for a flow's result by watching its files."""
    found = []
    for rel, tree in _files_under(root, under):
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if not names & TRIGGERED_RESULTS:
            continue
        for loop in ast.walk(tree):
            if isinstance(loop, (ast.While, ast.For, ast.AsyncFor)) and \
                    any(c.split(".")[-1] == "sleep" for c in _calls(loop)):
                found.append(f"{rel}:{loop.lineno}: a loop that sleeps, beside triggered flow results "
                             f"({', '.join(sorted(names & TRIGGERED_RESULTS))})")
    return sorted(found)


# ------------------------------------------------------------------------------ the real tree


def _report(what: str, violations: list[str]) -> str:
    return f"{len(violations)} {what}:\n" + "\n".join(violations)


def test_tasks_import_no_flows_infra_or_prefect():
    violations = forbidden_imports(REPO, "tasks", TASKS_MUST_NOT_IMPORT)
    assert not violations, _report("imports of flows/infra/prefect in tasks/", violations)


def test_services_import_no_flows():
    violations = forbidden_imports(REPO, "infra/services", {"flows"})
    assert not violations, _report("imports of flows in infra/services/", violations)


def test_no_import_cycles():
    cycles = import_cycles(REPO)
    assert not cycles, _report("import cycles", cycles)


def test_tasks_call_no_prefect_api_and_poll_no_flow_results():
    """The flows own every Prefect interaction: tasks/ neither calls Prefect's REST API by hand nor
    watches the triggered flows' result files (the flows wait on those runs and hand the results in)."""
    violations = prefect_rest_calls(REPO) + result_file_polling(REPO)
    assert not violations, _report("Prefect calls by hand or result-file polling in tasks/", violations)


def test_no_long_functions():
    violations = long_functions(REPO)
    assert not violations, _report(f"functions over {MAX_FUNCTION_LINES} lines without a `{LONG_MARK}` reason",
                                   violations)


# ------------------------------------------------------------- the checkers on synthetic trees


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _function(name: str, n_lines: int, indent: str = "") -> str:
    """A function `n_lines` long, the def line included."""
    return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(n_lines - 1))


def test_forbidden_imports_is_reported(tmp_path):
    _write(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/stage.py": "import os\nimport prefect.events\n\n\ndef run():\n    from flows.pretrain import x\n",
        "tasks/sub/mod.py": "from ..stage import run\nfrom infra import stack\n",
        "tasks/ok.py": "from tasks.stage import run\nimport prefectless\n",
        "tasks/ray.py": "def f():\n    from prefect_ray import RayTaskRunner\n",
        "flows/pretrain.py": "import prefect\nfrom infra import stack\n",
        "infra/services/lineage/app.py": "from tasks.stage import run\n\n\ndef f():\n    import flows.triggers\n",
        "infra/cli.py": "from flows import pretrain\n",
    })
    assert forbidden_imports(tmp_path, "tasks", TASKS_MUST_NOT_IMPORT) == [
        "tasks/ray.py:2: from prefect_ray import RayTaskRunner  (imports prefect_ray)",
        "tasks/stage.py:2: import prefect.events  (imports prefect)",
        "tasks/stage.py:6: from flows.pretrain import x  (imports flows)",
        "tasks/sub/mod.py:2: from infra import stack  (imports infra)",
    ]
    assert forbidden_imports(tmp_path, "infra/services", {"flows"}) == [
        "infra/services/lineage/app.py:5: import flows.triggers  (imports flows)"]


def test_relative_imports_are_resolved(tmp_path):
    _write(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/a/__init__.py": "from . import b\nfrom .b import f\n",
        "tasks/a/b.py": "from .. import c\nfrom ..c.d import g\nfrom . import *\n",
    })
    assert [(i.file, i.targets) for i in all_imports(tmp_path)] == [
        ("tasks/a/__init__.py", ("tasks.a.b",)), ("tasks/a/__init__.py", ("tasks.a.b.f",)),
        ("tasks/a/b.py", ("tasks.c",)), ("tasks/a/b.py", ("tasks.c.d.g",)), ("tasks/a/b.py", ("tasks.a",))]


def test_import_cycle_is_reported(tmp_path):
    _write(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/a.py": "from . import b\n",
        "tasks/b.py": "def f():\n    import tasks.c\n",
        "tasks/c.py": "from tasks.a import thing\n",
        "tasks/d.py": "from tasks import a\n",  # imports into the cycle, is not part of it
        "flows/x.py": "from infra.y import run\n",
        "infra/y.py": "from flows import x\n",
        "infra/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infra.z import Z\n",
        "infra/z.py": "from infra.typed import T\n",  # closed only by a type-only import: no cycle
    })
    assert strongly_connected(import_graph(tmp_path)) == [["flows.x", "infra.y"], ["tasks.a", "tasks.b", "tasks.c"]]
    assert import_cycles(tmp_path) == [
        "cycle between flows.x, infra.y:\n    flows/x.py:1: from infra.y import run\n"
        "    infra/y.py:1: from flows import x",
        "cycle between tasks.a, tasks.b, tasks.c:\n    tasks/a.py:1: from . import b\n"
        "    tasks/b.py:2: import tasks.c\n    tasks/c.py:1: from tasks.a import thing",
    ]


def test_long_function_is_reported(tmp_path):
    limit = MAX_FUNCTION_LINES
    _write(tmp_path, {
        "tasks/a.py": _function("fits", limit) + _function("too_long", limit + 1)
                      + "class K:\n    @staticmethod\n" + _function("method", limit + 1, indent="    "),
        "flows/b.py": "# long: one table of steps, clearer in one piece\n@decorator\n" + _function("explained", limit + 1)
                      + "# long:\n" + _function("no_reason", limit + 1),  # a mark without a reason
        "tests/test_c.py": _function("test_long", limit + 1),
    })
    assert long_functions(tmp_path) == [
        f"flows/b.py:{limit + 5}: no_reason is {limit + 1} lines",
        f"tasks/a.py:{limit + 1}: too_long is {limit + 1} lines",
        f"tasks/a.py:{2 * limit + 4}: method is {limit + 1} lines",
    ]


def test_prefect_rest_calls_and_result_polling_are_reported(tmp_path):
    _write(tmp_path, {
        "tasks/deploy/wait.py": (
            "import os, time\nimport httpx\n\n\n"
            "def failed(dep):\n"
            "    api = os.environ['PREFECT_API_URL']\n"
            "    return httpx.post(f'{api}/flow_runs/filter', json={}).json()\n\n\n"
            "def wait(layout, ckpt):\n"
            "    path = layout.triggered_eval_report(ckpt)\n"
            "    while not path.exists():\n"
            "        time.sleep(1)\n"),
        "tasks/deploy/ok.py": (
            "import time\nimport httpx\n\n\n"
            "def fetch(url):\n    return httpx.get(url)\n\n\n"  # HTTP, but not Prefect
            "def retry(f):\n    for i in range(3):\n        time.sleep(i)\n"),  # sleeps, no flow results
        "tasks/deploy/read.py": "def once(layout, ckpt):\n    return layout.triggered_eval_report(ckpt).read_text()\n",
        "flows/wait.py": "import time\n\n\ndef wait(layout, c):\n    while True:\n"
                         "        layout.triggered_eval_report(c)\n        time.sleep(1)\n",
    })
    assert prefect_rest_calls(tmp_path) == [
        "tasks/deploy/wait.py:5: failed calls Prefect's API by hand (httpx.post)"]
    assert result_file_polling(tmp_path) == [
        "tasks/deploy/wait.py:12: a loop that sleeps, beside triggered flow results (triggered_eval_report)"]
