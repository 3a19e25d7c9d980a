"""The layout's arrows, checked on the real imports of the package files (parsed, not run).

* No import cycles in ``server_patch``, ``apcctl`` or ``tui``, among modules and among packages
  (a package's modules taken as one part: ``admin`` <-> ``integration`` is a knot even when no
  two of their modules import each other), in two strengths. Imports that run when a
  module is loaded (module level and class bodies, not ``if TYPE_CHECKING:``) must never form
  one: that is an import-time failure waiting for an import order. An import inside a function
  runs at call time, after every module has loaded, so it cannot fail that way; but two modules
  that reach into each other that way are still one tangled part (boundary finding was, before
  issue 16), so a second check counts them too. Function-level imports also count for the
  forbidden arrows below.
* ``server_patch.boundaries`` imports neither MLX nor mlx-vlm, and ``server_patch.lineage`` no
  mlx-vlm, not even through what they import (checked on the parsed graph and in a fresh
  interpreter).
* Inside ``apcctl``, the research lab (``apcctl.lab``: ``sim``, ``bench``, ``tinymodel``, ``template_check``,
  ``drafter_check``, ``model_check``, ``model_matrix``) and the operator CLI (``core``, ``config``, ``service``,
  ``fleet``, the demo's traffic) meet only in the commands; the lab's layers point one way.
* ``server_patch`` never imports the CLI (``apcctl``) or the dashboard (``tui``).
* The dashboard (``tui``) imports nothing of ``apcctl`` but the shared core, ``apcctl.core``; the
  core imports no other ``apcctl`` module (so never ``apcctl.commands``) and never ``tui``, at
  load or call time (``if TYPE_CHECKING:`` imports are types only and do not count).
* The overlay's edits (the text they add to mlx-vlm, parsed from the topics) reach the lineage
  cache, the copy-free hooks, the canary and the admin endpoint only through the one door,
  ``server_patch.integration.hooks``, which dispatches by no name (no ``getattr``/``hasattr``).
* The server's parts are handed on from one object (``integration.parts.Parts``): no module
  holds ``RUNTIMES``, ``FINDER``, ``BOOK``, ``RUNNER`` or ``TRAFFIC``, ``integration.runtime``
  has no ``current()``, and the canary package imports none of its modules (its runner once
  imported the package that imported it back).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a server_patch submodule when one is named), or a package
    eager: bool  # runs when ``source`` is loaded (not inside a function or TYPE_CHECKING)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules(package: str = "server_patch") -> dict[str, Path]:
    return {module_name(p): p for p in sorted((REPO / package).rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


OURS = ("server_patch", "apcctl", "tui")


def _is_module(name: str) -> bool:
    top = name.split(".")[0]
    return top in OURS and name in modules(top)


def imports_of(module: str, path: Path) -> list[Import]:
    out: list[Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for part in child.orelse:
                    visit(part, eager)
            elif isinstance(child, ast.Import):
                out.extend(Import(module, alias.name, eager) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, path, child)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    out.append(Import(module, sub if _is_module(sub) else base, eager))
            else:
                visit(child, eager)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), True)
    return out


@cache
def all_imports(package: str = "server_patch") -> tuple[Import, ...]:
    return tuple(i for name, path in modules(package).items() for i in imports_of(name, path))


def _top(target: str) -> str:
    return target.split(".")[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _loaded_with(target: str) -> list[str]:
    """The server_patch modules Python runs to import ``target``: its packages, then itself."""
    parts = target.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules()]


def eager_closure(root: str) -> set[str]:
    """Every module (server_patch or not) that loading the ``root`` package loads."""
    start = [m for m in modules() if m == root or m.startswith(root + ".")]
    seen: set[str] = set()
    stack = [m for s in start for m in _loaded_with(s)]
    outside: set[str] = set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for imp in all_imports():
            if imp.source == current and imp.eager:
                if _top(imp.target) == "server_patch":
                    stack.extend(_loaded_with(imp.target))
                else:
                    outside.add(imp.target)
    return seen | outside


# ----------------------------------------------------------------------------- the checks


def test_the_parser_sees_the_imports_it_should():
    """Guards the checks below against a parser that finds nothing."""
    found = {(i.source, i.target, i.eager) for i in all_imports()}
    assert ("server_patch.integration.segments", "server_patch.boundaries", True) in found
    assert ("server_patch.boundaries.finder", "server_patch.boundaries.walk", True) in found
    assert ("server_patch.sparse.dispatch", "mlx_vlm.models.glm5_next", True) in found
    assert any(not i.eager for i in all_imports())


# Packages that only group packages: their parts are one level further down.
GROUPS = ("apcctl.lab",)


def _unit(module: str) -> str:
    """The part a module belongs to for the package-level check: its top-level sub-package
    (``server_patch.admin``, ``apcctl.core``) or, for a top-level module, itself; inside a group
    (``apcctl.lab``) its sub-package or module there (``apcctl.lab.sim``)."""
    depth = 3 if any(module.startswith(group + ".") for group in GROUPS) else 2
    return ".".join(module.split(".")[:depth])


def import_graph(package: str, lazy: bool, level: str) -> dict[str, set[str]]:
    """``package``'s imports among its own modules (``level="module"``) or among its parts
    (``level="package"``), module-level only or with the function-level ones (``lazy``)."""
    name = (lambda m: m) if level == "module" else _unit
    graph: dict[str, set[str]] = {name(m): set() for m in modules(package)}
    for imp in all_imports(package):
        if not (imp.eager or lazy) or _top(imp.target) != package:
            continue
        source, target = name(imp.source), name(imp.target)
        if target in graph and target != source:
            graph[source].add(target)
    return graph


# Cycles that are known and owned elsewhere, each as its sorted members, keyed by (package,
# level, with function-level imports): the check fails on any other cycle, and on a listed one
# that is gone (so the list only shrinks). Empty since issue 35 broke the last ones by moving
# the shared piece to its owner: the chat template's facts to ``boundaries.template`` (the
# finder holds them), the disk tier's location and volume to ``server_patch.disk_paths`` (the
# lineage config sizes its disk cap from it), how a request ended to ``observe.outcomes`` (the
# timing record writes it, the admin answers parse it), and the simulator's conversations to
# ``apcctl.lab.sim.conversation`` (the trace generator and the client patterns both build on them).
KNOWN_CYCLES: dict[tuple[str, str, bool], list[list[str]]] = {}


@pytest.mark.parametrize("level", ["module", "package"])
@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "with-function-level"])
@pytest.mark.parametrize("package", OURS)
def test_no_import_cycles(package: str, lazy: bool, level: str):
    """No cycle among ``package``'s modules, nor among its parts (``server_patch.admin`` <->
    ``server_patch.integration`` is a knot even when no two modules import each other)."""
    cycles = _cycles(import_graph(package, lazy, level))
    known = KNOWN_CYCLES.get((package, level, lazy), [])
    kind = "module-level and function-level" if lazy else "module-level"
    new = [c for c in cycles if c not in known]
    assert not new, f"{level} import cycles in {package} ({kind} imports), each as its members: " + \
        "; ".join(" <-> ".join(c) for c in new)
    gone = [c for c in known if c not in cycles]
    assert not gone, f"cycles no longer there: drop them from KNOWN_CYCLES: {gone}"


# The neutral packages under every surface (issue 35): the HTTP plumbing (the admin token, the
# ASGI gate, the traffic gate) and what the server counts about itself (the copy ledger). They
# import only the leaves, so ``admin``, ``intake``, ``serving``, ``tenancy``, ``canary``,
# ``state`` and ``copyfree`` can all use them without importing each other.
NEUTRAL = ("server_patch.infra", "server_patch.observe")
LEAVES = ("server_patch.settings", "server_patch.envconfig", "server_patch.clock", "server_patch.paths",
          "server_patch.private_files")


def test_the_neutral_packages_import_only_the_leaves():
    found = [i for i in all_imports() if _unit(i.source) in NEUTRAL and _top(i.target) == "server_patch"]
    assert any(i.target == "server_patch.infra.auth" for i in found)  # the parser sees their imports
    wrong = [i for i in found if _unit(i.target) not in (*NEUTRAL, *LEAVES, "server_patch")]
    assert not wrong, wrong


# The research lab inside apcctl, in layers: a layer imports only the ones before it (and the
# core). The tiny models are the floor (with the corpus and the agent prompts every layer above
# writes from); the chat-template and drafter checks and the model matrix read them; the model check uses the
# template check; the simulator sizes a model through the model check; the benches drive servers.
LAB_LAYERS = (("apcctl.lab.tinymodel",), ("apcctl.lab.template_check", "apcctl.lab.drafter_check", "apcctl.lab.model_matrix"),
              ("apcctl.lab.model_check",),
              ("apcctl.lab.sim", "apcctl.lab.bench"))
LAB = tuple(part for layer in LAB_LAYERS for part in layer)
LAB_PACKAGE = "apcctl.lab"  # every lab module lives in it, and is in a layer
# What of the lab the operator's side may use: the corpus (word lists, data), for the demo's
# agent traffic. The commands (``apcctl.commands``, ``apcctl.cli``) are the surface for both.
LAB_DATA = ("apcctl.lab.tinymodel.corpus",)
SURFACE = ("apcctl.commands", "apcctl.cli")


def _lab_layer(module: str) -> int | None:
    return next((n for n, layer in enumerate(LAB_LAYERS) if any(_within(module, p) for p in layer)), None)


def test_the_lab_stands_apart_from_the_operator_cli():
    """The research lab (simulator, benches, tiny models, template study and model check) and the
    operator CLI (core, config, service, fleet, the demo's traffic) meet only in the commands:
    the lab imports nothing of the operator's side but the core, the operator's side nothing of
    the lab but its data, at load or call time; inside the lab, a layer never imports a later one."""
    unlayered = [m for m in modules("apcctl") if _within(m, LAB_PACKAGE) and m != LAB_PACKAGE and _lab_layer(m) is None]
    assert not unlayered, f"lab modules in no layer of LAB_LAYERS: {unlayered}"
    imports = [i for i in all_imports("apcctl") if _top(i.target) == "apcctl" and _unit(i.source) != _unit(i.target)]
    lab_up = [i for i in imports if _lab_layer(i.source) is not None and
              (_lab_layer(i.target) is None and not _within(i.target, CORE)
               or (_lab_layer(i.target) or 0) > _lab_layer(i.source))]
    assert not lab_up, lab_up
    operator_in = [i for i in imports if _lab_layer(i.source) is None and _lab_layer(i.target) is not None
                   and not any(_within(i.source, s) for s in SURFACE)
                   and not any(_within(i.target, d) for d in LAB_DATA)]
    assert not operator_in, operator_in
    seen = {(_unit(i.source), _unit(i.target)) for i in imports}
    # The parser sees the arrows these rules are about.
    assert {("apcctl.lab.sim", "apcctl.lab.model_check"), ("apcctl.lab.model_check", "apcctl.lab.template_check"),
            ("apcctl.commands", "apcctl.lab.sim"), ("apcctl.agent_traffic", "apcctl.lab.tinymodel")} <= seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


@pytest.mark.parametrize("package,forbidden", [
    ("server_patch.boundaries", ("mlx", "mlx_vlm")),
    ("server_patch.lineage", ("mlx_vlm",)),
])
def test_pure_packages_import_no_mlx(package: str, forbidden: tuple[str, ...]):
    direct = [i for i in all_imports() if (i.source == package or i.source.startswith(package + "."))
              and _top(i.target) in forbidden]
    assert not direct, direct
    through = sorted(m for m in eager_closure(package) if _top(m) in forbidden)
    assert not through, f"{package} loads {through}"


def test_pure_packages_load_without_mlx_in_a_fresh_interpreter():
    code = ("import sys; import server_patch.boundaries, server_patch.lineage; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_vlm'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_server_never_imports_the_cli_or_the_dashboard():
    wrong = [i for i in all_imports() if _top(i.target) in ("apcctl", "tui")]
    assert not wrong, wrong


CORE = "apcctl.core"


def test_the_parser_sees_the_cli_and_dashboard_imports():
    found = {(i.source, i.target) for i in all_imports("tui") + all_imports("apcctl")}
    assert ("tui.source", "apcctl.core.client") in found
    assert ("tui.widgets.gauge", "apcctl.core.render") in found  # ``from apcctl.core import render``
    assert ("apcctl.core.roll", "apcctl.core.fleet_state") in found
    assert ("apcctl.commands.restart", "apcctl.core.roll") in found


def test_the_dashboard_imports_only_the_shared_core():
    wrong = [i for i in all_imports("tui") if _top(i.target) == "apcctl" and not _within(i.target, CORE)]
    assert not wrong, wrong


def test_the_core_imports_neither_the_rest_of_the_cli_nor_the_dashboard():
    core = [i for i in all_imports("apcctl") if _within(i.source, CORE)]
    assert core, "no imports parsed in apcctl.core"
    wrong = [i for i in core if _top(i.target) == "tui" or (_top(i.target) == "apcctl" and not _within(i.target, CORE))]
    assert not wrong, wrong


def test_the_dashboard_loads_no_cli_module_in_a_fresh_interpreter():
    code = ("import sys; import tui.app, tui.fleet, tui.recorded, tui.testing, apcctl.core.roll; "
            "print(sorted(m for m in sys.modules if m.startswith('apcctl.') and not m.startswith('apcctl.core')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- the one door and the parts

DOOR = "server_patch.integration.hooks"
# The packages whose code a patched mlx-vlm file may reach only through the door.
BEHIND_THE_DOOR = ("server_patch.integration", "server_patch.copyfree", "server_patch.canary",
                   "server_patch.admin.api", "server_patch.infra.traffic")
_NAMED = re.compile(r"(?:from\s+(server_patch[\w.]*)\s+import\s+(\w+)|import\s+(server_patch[\w.]*))")


def _edit_imports(text: str) -> set[str]:
    """The server_patch modules an edit's new text imports (``from P import m`` names P.m)."""
    found = set()
    for base, name, plain in _NAMED.findall(text):
        module = plain or (f"{base}.{name}" if _is_module(f"{base}.{name}") else base)
        found.add(module)
    return found


def test_overlay_edits_reach_the_lineage_only_through_the_door():
    from server_patch.overlay.patches import load_topics

    seen, wrong = set(), []
    for file_patch in load_topics().values():
        for edit in file_patch.edits:
            for module in _edit_imports(edit.new):
                seen.add(module)
                if any(_within(module, p) for p in BEHIND_THE_DOOR) and module != DOOR:
                    wrong.append((file_patch.module, edit.name, module))
    assert DOOR in seen and "server_patch.intake.media" in seen  # the parser sees the edits' imports
    assert not wrong, wrong


def test_the_door_dispatches_by_no_name():
    """No ``getattr``/``hasattr``/``setattr`` in the door: what it calls is in its source."""
    tree = ast.parse(modules()[DOOR].read_text(encoding="utf-8"))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"getattr", "hasattr", "setattr"}, calls & {"getattr", "hasattr", "setattr"}


SINGLETONS = ("RUNTIMES", "FINDER", "BOOK", "RUNNER", "TRAFFIC",
              # a runtime's workers are its own (``infra.workers``): no process-wide disk writer,
              # no switch lock beside the parts, no overlay finder beside ``sys.meta_path``
              "WRITER", "_SWITCH", "_finder", "REQUEST_LOADS",
              # nor a loader of the canary's checks (``LineageRuntime.checks``) or joint batch
              # buffers made ahead (``LineageRuntime.spares``) beside the runtime's own
              "LOADS", "_spares", "_spares_lock")
# Workers (and joint spares) built at import would be the process's, not a runtime's
# (``LineageRuntime.loads``, ``.stages``, ``.checks``, ``.spares``): none is left (issue 35).
WORKER_CLASSES = ("BackgroundLoads", "Worker", "Workers", "ThreadPoolExecutor", "JointSpares")
BUILT_AT_IMPORT: set[tuple[str, str]] = set()


def test_the_parts_are_no_module_singletons():
    """The server's parts live on one object (``integration.parts.Parts``) that is handed on;
    no module holds a runtime registry, the finder, the canary's book or runner, the gate, a
    disk writer, a loader or stager, or the model switch's lock."""
    wrong = []
    for name, path in modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            wrong += [(name, t.id) for t in targets if isinstance(t, ast.Name) and t.id in SINGLETONS]
            value = getattr(node, "value", None)
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in WORKER_CLASSES:
                wrong += [(name, t.id) for t in targets if isinstance(t, ast.Name)
                          and (name, t.id) not in BUILT_AT_IMPORT]
            if name == "server_patch.integration.runtime" and isinstance(node, ast.FunctionDef):
                assert node.name != "current", "integration.runtime.current(): the most recent runtime"
    assert not wrong, wrong


def test_the_canary_package_and_its_runner_do_not_import_each_other():
    package = [i.target for i in all_imports() if i.source == "server_patch.canary"]
    assert not [t for t in package if _within(t, "server_patch.canary")], package
    assert ("server_patch.canary.service", "server_patch.canary.runner", True) in \
        {(i.source, i.target, i.eager) for i in all_imports()}


# Test files that check the whole house (the import graph, the settings registry, the overlay's
# edits against pristine mlx-vlm, the tiny model every other test builds, the type checker and
# the linter) stay at the top.
HOUSE_WIDE = {"test_layout.py", "test_settings.py", "test_overlay.py", "test_tiny_model.py", "test_typecheck.py"}
# Rooms that are not one package: the CLI, the dashboard, the simulator, injected faults, and
# whole-server conversations.
CROSS_CUTTING = {"cli", "tui", "sim", "fault", "e2e"}


def test_the_tests_are_laid_out_by_room():
    """``tests/`` mirrors the packages (as vLLM's tests do): every other test file lives in a
    room named after the ``server_patch`` package it tests, or in a cross-cutting room."""
    tests = REPO / "tests"
    assert {p.name for p in tests.glob("test_*.py")} == HOUSE_WIDE
    packages = {p.parent.name for p in (REPO / "server_patch").glob("*/__init__.py")}
    rooms = {p.parent.relative_to(tests).as_posix() for p in tests.rglob("test_*.py") if p.parent != tests}
    assert rooms and rooms <= packages | CROSS_CUTTING, rooms - packages - CROSS_CUTTING
    assert all((tests / room / "__init__.py").exists() for room in rooms)  # imported as tests.<room>.<file>
