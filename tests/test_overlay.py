"""The patch overlay: exact-text edits, the import hook, verification, diff, CLI, launcher."""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import re
import sys
import traceback
import uuid
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from tests.server_harness import PatchedServer
from server_patch import PATCH_VERSION
from server_patch.launch import lineage_enabled, server_argv, take_copy_counter
from server_patch.launch import main as launch_main
from server_patch.overlay import (
    Edit,
    FilePatch,
    OverlayFinder,
    PatchError,
    apply,
    install,
    installed,
    register,
    unified_diff,
    verify_all,
)
from server_patch.overlay.patches import load_topics

MOD_SOURCE = '''"""A fake module to patch."""

VALUE = "pristine"


def boom():
    raise ValueError("pristine failure")
'''


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class FakePackage:
    """A throwaway package on sys.path: ``<name>/__init__.py``, ``mod.py``, ``other.py``."""

    def __init__(self, root: Path) -> None:
        self.name = f"fakepkg_{uuid.uuid4().hex[:8]}"
        self.dir = root / self.name
        self.dir.mkdir()
        self.init_source = "PKG = 'pristine'\n"
        (self.dir / "__init__.py").write_text(self.init_source)
        (self.dir / "mod.py").write_text(MOD_SOURCE)
        (self.dir / "other.py").write_text("OTHER = 1\n")

    def patch(self, *edits: Edit, module: str = "mod", source: str = MOD_SOURCE) -> FilePatch:
        relpath = f"{self.name}/__init__.py" if module == "__init__" else f"{self.name}/{module}.py"
        full = self.name if module == "__init__" else f"{self.name}.{module}"
        return FilePatch(module=full, relpath=relpath, sha256=sha(source), edits=edits, dist=None)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = FakePackage(tmp_path)
    finders: list[OverlayFinder] = []
    yield pkg, finders
    for finder in finders:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == pkg.name or n.startswith(pkg.name + ".")]:
        del sys.modules[name]


def activate(finders: list[OverlayFinder], *patches: FilePatch) -> OverlayFinder:
    finder = OverlayFinder({p.module: p for p in patches})
    sys.meta_path.insert(0, finder)
    finders.append(finder)
    return finder


VALUE_EDIT = Edit("value", 'VALUE = "pristine"', 'VALUE = "patched"')


# ------------------------------------------------------------------ apply (pure text)


def test_apply_replaces_each_anchor_once(fake) -> None:
    pkg, _ = fake
    patch = pkg.patch(VALUE_EDIT, Edit("boom", 'raise ValueError("pristine failure")', "return 42"))
    out = apply(patch, MOD_SOURCE)
    assert 'VALUE = "patched"' in out and "return 42" in out
    assert out.startswith('"""A fake module to patch."""\n')  # text around anchors kept
    assert out.count("patched") == 1 and "pristine" not in out


def test_zero_matches_names_file_and_edit(fake) -> None:
    pkg, _ = fake
    patch = pkg.patch(Edit("missing", "NOT THERE", "x"))
    with pytest.raises(PatchError, match=rf"edit 'missing' in {pkg.name}/mod.py matched 0 times"):
        apply(patch, MOD_SOURCE)


def test_two_matches_is_an_error(fake) -> None:
    pkg, _ = fake
    patch = pkg.patch(Edit("ambiguous", "pristine", "x"))
    with pytest.raises(PatchError, match=r"edit 'ambiguous' in .*/mod.py matched 2 times"):
        apply(patch, MOD_SOURCE)
    # Overlapping occurrences of a self-similar anchor count too.
    text = "aaa\n"
    with pytest.raises(PatchError, match="matched 2 times"):
        apply(FilePatch(pkg.name + ".mod", f"{pkg.name}/mod.py", sha(text), (Edit("aa", "aa", "b"),), dist=None), text)


def test_overlapping_edits_are_rejected(fake) -> None:
    pkg, _ = fake
    patch = pkg.patch(VALUE_EDIT, Edit("wider", 'VALUE = "pristine"\n\n\ndef boom', "x"))
    with pytest.raises(PatchError, match="edits 'value' and 'wider' in .* overlap"):
        apply(patch, MOD_SOURCE)


def test_sha_mismatch_refuses_before_looking_at_edits(fake) -> None:
    pkg, _ = fake
    patch = pkg.patch(VALUE_EDIT)
    with pytest.raises(PatchError, match="sha256 mismatch: .*mod.py"):
        apply(patch, MOD_SOURCE + "# local change\n")
    real = FilePatch("mlx_vlm.server.app", "mlx_vlm/server/app.py", "0" * 64, (VALUE_EDIT,))
    with pytest.raises(PatchError, match=r"sha256 mismatch: installed mlx-vlm is not 0\.7\.10"):
        apply(real, "anything")


def test_every_problem_is_reported_at_once(fake) -> None:
    pkg, _ = fake
    patch = pkg.patch(Edit("a", "NOPE", "x"), Edit("b", "pristine", "y"))
    with pytest.raises(PatchError) as info:
        apply(patch, MOD_SOURCE)
    assert len(info.value.problems) == 2


# ------------------------------------------------------------------ registry


def test_register_merges_topics_for_one_file_and_rejects_conflicts(fake) -> None:
    pkg, _ = fake
    registry: dict[str, FilePatch] = {}
    register(pkg.patch(VALUE_EDIT), registry)
    register(pkg.patch(Edit("boom", 'raise ValueError("pristine failure")', "return 42")), registry)
    register(pkg.patch(VALUE_EDIT), registry)  # a topic imported twice is a no-op
    merged = registry[f"{pkg.name}.mod"]
    assert [e.name for e in merged.edits] == ["value", "boom"]
    assert "return 42" in apply(merged, MOD_SOURCE)

    with pytest.raises(PatchError, match="registered twice with different text"):
        register(pkg.patch(Edit("value", 'VALUE = "pristine"', "VALUE = 0")), registry)
    with pytest.raises(PatchError, match="disagree"):
        register(pkg.patch(Edit("z", "def", "def"), source="other text"), registry)


def test_edits_from_two_topics_must_not_overlap(fake) -> None:
    pkg, _ = fake
    registry: dict[str, FilePatch] = {}
    register(pkg.patch(VALUE_EDIT), registry)
    register(pkg.patch(Edit("other_topic", '"pristine"\n', '"mine"\n')), registry)
    with pytest.raises(PatchError, match="overlap"):
        verify_all(registry)


def test_topics_are_listed_and_the_registry_is_built_afresh_without_import_side_effects() -> None:
    import pkgutil

    from server_patch.overlay import patches

    on_disk = sorted(info.name for info in pkgutil.iter_modules(patches.__path__))
    assert list(patches.TOPICS) == on_disk  # a new topic file must be listed to take effect
    first = load_topics()
    edits = [e.name for e in first["mlx_vlm.server.app"].edits]
    first.clear()  # a caller's registry is its own: the next one is whole again
    assert [e.name for e in load_topics()["mlx_vlm.server.app"].edits] == edits
    assert not any(isinstance(v, dict) and v and all(isinstance(x, FilePatch) for x in v.values())
                   for module in (patches, importlib.import_module("server_patch.overlay.edits"))
                   for v in vars(module).values())  # no module-level registry to mutate


def test_filepatch_checks_module_and_relpath_agree() -> None:
    with pytest.raises(PatchError, match="is not the file of module"):
        FilePatch("mlx_vlm.server.app", "mlx_vlm/server/openai.py", "0" * 64, ())


# ------------------------------------------------------------------ the import hook


def test_hook_loads_patched_source_under_the_original_filename(fake) -> None:
    pkg, finders = fake
    activate(finders, pkg.patch(
        VALUE_EDIT,
        Edit("boom", '    raise ValueError("pristine failure")\n',
             '    extra = "a line that shifts numbering"\n    raise ValueError("patched failure")\n'),
    ))
    mod = importlib.import_module(f"{pkg.name}.mod")
    assert mod.VALUE == "patched"
    assert mod.__file__ == str(pkg.dir / "mod.py")
    other = importlib.import_module(f"{pkg.name}.other")  # not patched: the normal loader
    assert other.OTHER == 1 and not isinstance(other.__loader__, type(mod.__loader__))
    assert (pkg.dir / "mod.py").read_text() == MOD_SOURCE  # nothing on disk changed

    with pytest.raises(ValueError) as info:
        mod.boom()
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename == str(pkg.dir / "mod.py")
    assert frame.line == 'raise ValueError("patched failure")'


def test_hook_patches_a_package_init_and_keeps_its_submodules(fake) -> None:
    pkg, finders = fake
    activate(finders, pkg.patch(Edit("pkg", "PKG = 'pristine'", "PKG = 'patched'"),
                                module="__init__", source=pkg.init_source))
    package = importlib.import_module(pkg.name)
    assert package.PKG == "patched"
    assert importlib.import_module(f"{pkg.name}.other").OTHER == 1


def test_hook_fails_closed_when_the_file_changed_after_verification(fake) -> None:
    pkg, finders = fake
    patch = pkg.patch(VALUE_EDIT)
    verify_all({patch.module: patch})
    (pkg.dir / "mod.py").write_text(MOD_SOURCE + "# edited later\n")
    activate(finders, patch)
    with pytest.raises(PatchError, match="sha256 mismatch"):
        importlib.import_module(f"{pkg.name}.mod")
    assert f"{pkg.name}.mod" not in sys.modules


def test_install_refuses_when_the_module_is_already_imported(fake) -> None:
    pkg, _ = fake
    importlib.import_module(f"{pkg.name}.mod")
    patch = pkg.patch(VALUE_EDIT)
    with pytest.raises(PatchError, match=rf"already imported unpatched: {pkg.name}\.mod"):
        install({patch.module: patch})
    assert not installed()


def test_install_verifies_everything_before_touching_meta_path(fake) -> None:
    pkg, _ = fake
    patch = pkg.patch(VALUE_EDIT, Edit("broken", "NOT THERE", "x"))
    before = list(sys.meta_path)
    with pytest.raises(PatchError, match="matched 0 times"):
        install({patch.module: patch})
    assert sys.meta_path == before and not installed()


# ------------------------------------------------------------------ the real mlx-vlm


def test_verify_all_passes_on_the_installed_mlx_vlm() -> None:
    patched = verify_all()
    assert "**_apc_health_fields()," in patched["mlx_vlm.server.app"]
    assert "mlx_vlm.server.app" in load_topics()


def test_version_pin_is_checked() -> None:
    real = load_topics()["mlx_vlm.server.app"]
    wrong = FilePatch(real.module, real.relpath, real.sha256, real.edits, version="0.7.9")
    with pytest.raises(PatchError, match="installed mlx-vlm is 0.7.10, the patch needs exactly 0.7.9"):
        verify_all({wrong.module: wrong})


def test_unified_diff_shows_the_identity_edit() -> None:
    diff = unified_diff()
    assert "--- a/mlx_vlm/server/app.py\n+++ b/mlx_vlm/server/app.py\n" in diff
    assert "\n+        **_apc_health_fields(),\n" in diff
    assert '\n         "apc_enabled": runtime["apc"]["enabled"],\n' in diff  # context line


def test_cli_patch_verify_and_diff(monkeypatch: pytest.MonkeyPatch) -> None:
    from apcctl.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["patch", "verify"])
    assert result.exit_code == 0 and result.output.startswith("ok:")
    result = runner.invoke(main, ["patch", "verify", "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 0 and report["ok"] is True
    app = next(f for f in report["files"] if f["module"] == "mlx_vlm.server.app")
    assert {"identity.import", "identity.health_field"} <= set(app["edits"])
    result = runner.invoke(main, ["patch", "diff"])
    assert result.exit_code == 0 and "+        **_apc_health_fields()," in result.output

    real = load_topics()["mlx_vlm.server.app"]
    broken = FilePatch(real.module, real.relpath, real.sha256, real.edits + (Edit("gone", "NO SUCH TEXT", ""),))
    monkeypatch.setattr("server_patch.overlay.patches.load_topics", lambda: {broken.module: broken})
    result = runner.invoke(main, ["patch", "verify"])
    assert result.exit_code == 1
    assert "edit 'gone' in mlx_vlm/server/app.py matched 0 times" in result.output
    result = runner.invoke(main, ["patch", "verify", "--json"])
    assert result.exit_code == 1 and json.loads(result.output)["ok"] is False


# ------------------------------------------------------------------ launcher


def test_launcher_defaults_to_loopback_and_keeps_an_explicit_host() -> None:
    assert server_argv(["--port", "1"]) == ["--host", "127.0.0.1", "--port", "1"]
    assert server_argv(["--host", "0.0.0.0"]) == ["--host", "0.0.0.0"]
    assert server_argv(["--host=::1"]) == ["--host=::1"]
    assert lineage_enabled({}) and lineage_enabled({"APC_LINEAGE": "1"})
    assert not lineage_enabled({"APC_LINEAGE": "0"}) and not lineage_enabled({"APC_LINEAGE": "off"})
    with pytest.raises(SystemExit, match="--reload"):
        launch_main(["--model", "x", "--reload"])


def test_the_copy_counter_flag_is_the_launchers_not_mlx_vlms() -> None:
    assert take_copy_counter(["--model", "m", "--port", "1"]) == (["--model", "m", "--port", "1"], False, None)
    assert take_copy_counter(["--copy-counter", "--model", "m"]) == (["--model", "m"], True, None)
    assert take_copy_counter(["--model", "m", "--copy-counter=/tmp/c.json"]) == (["--model", "m"], True,
                                                                                 "/tmp/c.json")


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apcctl.lab.tinymodel.build import build_model

    return build_model(tmp_path_factory.mktemp("overlay-model") / "tiny", "tiny", seed=0)


@pytest.fixture
def start_server(tiny_model: Path, tmp_path: Path):
    servers: list[PatchedServer] = []

    def start(**env: str) -> PatchedServer:
        server = PatchedServer(
            tiny_model,
            env={"APC_ENABLED": "1", "APC_DISK_ENABLED": "0",
                 "APC_DISK_PATH": str(tmp_path / f"disk-{len(servers)}"), **env},
            log_dir=tmp_path,
        )
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


def _listening_hosts(pid: int, port: int) -> set[str]:
    return {
        conn.laddr.ip
        for conn in psutil.Process(pid).net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
    }


@pytest.mark.server
def test_patched_server_reports_the_patch_and_serves_chat(start_server) -> None:
    server = start_server()
    health = server.get_json("/health")
    assert health["apc_lineage_patch"] == PATCH_VERSION
    assert health["apc_enabled"] is True
    assert _listening_hosts(server.pid, server.port) == {"127.0.0.1"}
    assert "overlay installed" in server.log_text()

    reply = server.chat([{"role": "user", "content": "Hello there"}], max_tokens=4)
    assert reply["usage"]["completion_tokens"] == 4
    assert reply["usage"]["prompt_tokens"] > 0
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")

    assert server.stop() is not None
    assert server.process.poll() is not None


@pytest.mark.server
def test_apc_lineage_0_is_stock_mlx_vlm(start_server) -> None:
    server = start_server(APC_LINEAGE="0")
    health = server.get_json("/health")
    assert "apc_lineage_patch" not in health
    assert "running stock mlx-vlm" in server.log_text()
    assert health["status"] == "healthy"
    assert _listening_hosts(server.pid, server.port) == {"127.0.0.1"}


# --- what the overlay sets on mlx-vlm's objects (issue 35: an honest overlay) -----------------

_ASSIGNED = re.compile(r"^[ \t]*(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)[ \t]*(?::[^=\n]+)?=(?!=)", re.M)
# a name annotated and assigned on a line of its own, not a parameter (those end in a comma):
# a dataclass field, or a class attribute
_FIELD = re.compile(r"^[ \t]+([A-Za-z_]\w*)[ \t]*:[^=\n]+=(?!=)[^\n]*[^,\n]$", re.M)


def _set_by_edits() -> dict[str, list[str]]:
    """Attribute names each edit's new text assigns (``x.name = ...``) or adds as a class field,
    where the pristine text it replaces did not, by name: the edits that do."""
    found: dict[str, list[str]] = {}
    for file_patch in load_topics().values():
        for edit in file_patch.edits:
            before = set(_ASSIGNED.findall(edit.old)) | set(_FIELD.findall(edit.old))
            for name in (set(_ASSIGNED.findall(edit.new)) | set(_FIELD.findall(edit.new))) - before:
                found.setdefault(name, []).append(edit.name)
    return found


def test_every_attribute_an_edit_sets_on_mlx_vlm_is_registered_and_explained() -> None:
    from server_patch.infra import attributes

    found = _set_by_edits()
    unregistered = {name: edits for name, edits in found.items() if name not in attributes.NAMES}
    assert not unregistered, f"register these in server_patch/infra/attributes.py: {unregistered}"
    # every registered attribute of an mlx-vlm object is still set by an edit (no stale entry)
    assert attributes.NAMES <= set(found), attributes.NAMES - set(found)
    assert all(a.why and a.set_by and a.read_by for a in attributes.ATTRIBUTES)


def _app_state_writes(tree: ast.AST) -> list[int]:
    """Lines that write ``<x>.state.<name>`` (assignment, ``setattr(<x>.state, ...)``, ``del``)."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Attribute) and first.attr == "state":
                lines.append(node.lineno)
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute) \
                    and target.value.attr == "state":
                lines.append(target.lineno)
    return lines


def test_app_state_is_written_and_read_only_through_the_registry() -> None:
    from server_patch.infra import attributes

    root = Path(attributes.__file__).resolve().parents[2]
    registry = Path(attributes.__file__).resolve()
    wrong, reads, put = [], [], set()
    for path in sorted((root / "server_patch").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if path.resolve() != registry:
            wrong += [f"{path.relative_to(root)}:{line}" for line in _app_state_writes(tree)]
            reads += [f"{path.relative_to(root)}:{n.lineno}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                      and n.value.attr == "state" and n.attr.startswith("apc_")]
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "put_state":
                put |= {k.arg for k in call.keywords if k.arg}
    assert not wrong, f"app.state written outside server_patch/infra/attributes.py: {wrong}"
    assert not reads, f"read app.state through attributes.state_of: {reads}"
    assert put == attributes.APP_STATE, (put, attributes.APP_STATE)  # each registered value is set


def _mlx_vlm_attributes_assigned(tree: ast.AST) -> set[str]:
    """``Class.attr`` (or ``module.attr``) for each assignment to something a module imported from
    mlx-vlm (``import mlx_vlm.models.cache as c``: ``c.KVCache.extract = ...``)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {(a.asname or a.name.split(".")[0]): a.name for a in node.names if a.name.startswith("mlx_vlm")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_vlm"):
            aliases |= {(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names}
    found = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            targets = [ast.Attribute(value=node.args[0], attr=str(node.args[1].value))]
        for target in targets:
            chain = []
            while isinstance(target, ast.Attribute):
                chain.insert(0, target.attr)
                target = target.value
            if chain and isinstance(target, ast.Name) and target.id in aliases:
                owner = chain[-2] if len(chain) > 1 else aliases[target.id].rsplit(".", 1)[-1]
                found.add(f"{owner}.{chain[-1]}")
    return found


def test_modules_set_on_mlx_vlm_only_what_the_registry_lists() -> None:
    """Outside the edits, only the copy counter (measurement) replaces anything of mlx-vlm's, and
    exactly the methods ``attributes.COUNTER_WRAPS`` lists."""
    from server_patch.infra import attributes

    root = Path(attributes.__file__).resolve().parents[2]
    found = {}
    for path in sorted((root / "server_patch").rglob("*.py")):
        for name in _mlx_vlm_attributes_assigned(ast.parse(path.read_text(encoding="utf-8"))):
            found[name] = path.relative_to(root).as_posix()
    assert set(found) == attributes.COUNTER_WRAPS, (set(found) ^ attributes.COUNTER_WRAPS)
    assert set(found.values()) == {"server_patch/copyfree/counter.py"}


def test_the_registry_refuses_an_unregistered_app_state_name() -> None:
    from types import SimpleNamespace

    from server_patch.infra.attributes import put_state, state_of

    app = SimpleNamespace(state=SimpleNamespace())
    put_state(app, apc_admin_token="t")
    assert state_of(app, "apc_admin_token") == "t" and state_of(app, "apc_parts") is None
    with pytest.raises(KeyError, match="apc_token"):
        put_state(app, apc_token="t")
    with pytest.raises(KeyError, match="apc_token"):
        state_of(app, "apc_token")
    assert not hasattr(app.state, "apc_token")


def test_topics_hold_edit_lists_only_and_edits_call_their_packages() -> None:
    """A topic module (``overlay/patches/*.py``) is an edit list: what its edits call lives in
    the package the topic patches in (the tenant middleware in ``tenancy``, the intake checks in
    ``intake``, the 404 and ``/health`` fields in ``serving``), never in the overlay. Private
    helpers that build edit text are allowed (``lineage._door_after``)."""
    import server_patch.overlay.patches as topics

    defined = {}
    for path in sorted(Path(topics.__file__).parent.glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        public = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and not n.name.startswith("_")]
        if public:
            defined[path.name] = public
    assert not defined, f"runtime code in topic modules: {defined}"
    into_overlay = [(fp.module, e.name) for fp in load_topics().values() for e in fp.edits
                    if "server_patch.overlay" in e.new]
    assert not into_overlay, into_overlay
    tenant = next(e for fp in load_topics().values() for e in fp.edits if e.name == "tenant.namespace")
    assert "from server_patch.tenancy.middleware import install" in tenant.new
