"""Which cache classes every model family of the installed mlx-vlm builds, read from its code.

The support matrix must follow the installed package, not a list written by hand: for each
package under ``mlx_vlm.models`` we find the language model class (what ``Model.__init__``
assigns to ``self.language_model``, else ``LanguageModel``, else ``Model``), take its
``make_cache`` (inheritance and imports resolved by Python, not by us) and walk its syntax
tree: every name that resolves to a cache class is a class the family can build; calls to
``self.<method>``, ``self.<attr>.<method>`` (the attribute's class read from ``__init__``),
``Class.method(self)`` and module functions are followed. A family with no ``make_cache``
gets ``make_prompt_cache``'s default: one ``KVCache`` per layer. Nothing is instantiated.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable

from server_patch.state.registry import restore_rules

_MAX_DEPTH = 4

#: How the lineage cache restores each class, or why it refuses it (the registry's codecs), so
#: a class a family builds without a codec shows up as unknown.
RESTORE_RULES: dict[str, str] = restore_rules()


@dataclass(frozen=True)
class FamilyCaches:
    """One model package: the cache classes its language model's ``make_cache`` can build."""

    family: str
    classes: tuple[str, ...]
    language_model: str = ""
    has_make_cache: bool = True
    error: str = ""  # why the package could not be inspected (import error), else ""
    unresolved: tuple[str, ...] = field(default_factory=tuple)  # calls we could not follow

    @property
    def hybrid(self) -> bool:
        """Mixes append-only layers with snapshot layers (the case exact-mode caches miss)."""
        names = set(self.classes)
        return bool(names & {"ArraysCache"}) and bool(names & {"KVCache", "ChunkedKVCache"})

    @property
    def sliding(self) -> bool:
        return bool(set(self.classes) & {"RotatingKVCache", "BufferedRotatingKVCache", "ChunkedKVCache"})

    @property
    def recurrent(self) -> bool:
        return "ArraysCache" in self.classes

    @property
    def beyond_kv(self) -> bool:
        """Builds anything but plain ``KVCache`` layers: mlx-vlm's checkpoint strategy, so the
        lineage cache serves it (or refuses it). Plain-KV families use the stock block cache."""
        return bool(self.classes) and not set(self.classes) <= {"KVCache"}

    @property
    def unknown_classes(self) -> tuple[str, ...]:
        """Classes it builds that have no restore rule, or whose rule is a refusal."""
        return tuple(c for c in self.classes
                     if c not in RESTORE_RULES or RESTORE_RULES[c].startswith("refused"))

    @property
    def supported(self) -> bool:
        """Every class it builds has a restore rule that restores (not one that refuses)."""
        return not self.error and not self.unknown_classes


def _is_cache_class(obj: Any) -> bool:
    if not inspect.isclass(obj):
        return False
    from mlx_vlm.models.cache import _BaseCache

    return issubclass(obj, _BaseCache) or (obj.__name__.endswith("Cache")
                                           and obj.__module__.startswith("mlx_vlm"))


def _parse(fn: Callable[..., Any]) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


def _attr_classes(cls: type) -> dict[str, type]:
    """``self.<attr> = Name(...)`` assignments in ``cls.__init__`` (and its bases'), resolved."""
    found: dict[str, type] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        tree = _parse(init) if init is not None and inspect.isfunction(init) else None
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                target = node.targets[0]
                func = node.value.func
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self" and isinstance(func, ast.Name)):
                    value = init.__globals__.get(func.id)
                    if inspect.isclass(value):
                        found[target.attr] = value
    return found


def _local_imports(tree: ast.AST, module: str) -> dict[str, Any]:
    """Names bound by ``from ..cache import KVCache`` inside a function body."""
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        package = module.rsplit(".", node.level)[0] if node.level else ""
        target = f"{package}.{node.module}" if node.module and package else (node.module or package)
        try:
            imported = importlib.import_module(target)
        except Exception:  # noqa: BLE001 - an unresolvable import just adds no names
            continue
        for alias in node.names:
            names[alias.asname or alias.name] = getattr(imported, alias.name, None)
    return names


class _Walker:
    """Collects cache classes reachable from one ``make_cache``."""

    def __init__(self) -> None:
        self.classes: set[str] = set()
        self.unresolved: set[str] = set()
        self._seen: set[Any] = set()

    def walk(self, fn: Any, owner: type | None, depth: int = 0) -> None:
        fn = inspect.unwrap(fn)
        if fn in self._seen or depth > _MAX_DEPTH or not inspect.isfunction(fn):
            return
        self._seen.add(fn)
        tree = _parse(fn)
        if tree is None:
            self.unresolved.add(getattr(fn, "__qualname__", repr(fn)))
            return
        scope = {**fn.__globals__, **_local_imports(tree, fn.__module__)}
        attrs = _attr_classes(owner) if owner is not None else {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                value = scope.get(node.id)
                if _is_cache_class(value):
                    self.classes.add(value.__name__)
            elif isinstance(node, ast.Attribute):
                value = self._resolve_attribute(node, scope)
                if _is_cache_class(value):
                    self.classes.add(value.__name__)
            if isinstance(node, ast.Call):
                self._follow(node.func, scope, owner, attrs, depth)

    @staticmethod
    def _resolve_attribute(node: ast.Attribute, scope: dict[str, Any]) -> Any:
        """``module.Class`` (e.g. ``cache.KVCache``) resolved through the function's globals."""
        if isinstance(node.value, ast.Name):
            base = scope.get(node.value.id)
            if inspect.ismodule(base):
                return getattr(base, node.attr, None)
        return None

    def _follow(self, func: ast.AST, scope: dict[str, Any], owner: type | None,
                attrs: dict[str, type], depth: int) -> None:
        if isinstance(func, ast.Name):
            target = scope.get(func.id)
            if inspect.isfunction(target) and target.__module__.startswith("mlx_vlm"):
                self.walk(target, None, depth + 1)
            return
        if not isinstance(func, ast.Attribute):
            return
        base = func.value
        if isinstance(base, ast.Name) and base.id == "self" and owner is not None:
            method = getattr(owner, func.attr, None)
            if inspect.isfunction(method):
                self.walk(method, owner, depth + 1)
            return
        if isinstance(base, ast.Name):  # Class.method(self) / module.function(...)
            target = scope.get(base.id)
            if inspect.isclass(target) and not _is_cache_class(target):
                method = getattr(target, func.attr, None)
                if inspect.isfunction(method):
                    self.walk(method, target, depth + 1)
            elif inspect.ismodule(target):
                value = getattr(target, func.attr, None)
                if inspect.isfunction(value) and value.__module__.startswith("mlx_vlm"):
                    self.walk(value, None, depth + 1)
            return
        if (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                and base.value.id == "self" and func.attr == "make_cache"):
            cls = attrs.get(base.attr)
            method = getattr(cls, "make_cache", None) if cls is not None else None
            if inspect.isfunction(method):
                self.walk(method, cls, depth + 1)
            else:
                self.unresolved.add(f"self.{base.attr}.make_cache")
        elif func.attr == "make_cache":
            self.unresolved.add(ast.unparse(func))


def language_model_class(module: Any) -> type | None:
    """The class ``Model`` builds as ``self.language_model`` (else ``LanguageModel``/``Model``)."""
    model = getattr(module, "Model", None)
    if inspect.isclass(model):
        cls = _attr_classes(model).get("language_model")
        if cls is not None:
            return cls
    for name in ("LanguageModel", "Model"):
        value = getattr(module, name, None)
        if inspect.isclass(value):
            return value
    return None


def inspect_family(family: str) -> FamilyCaches:
    """The cache classes ``mlx_vlm.models.<family>``'s language model can build."""
    try:
        module = importlib.import_module(f"mlx_vlm.models.{family}")
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return FamilyCaches(family, (), error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
    cls = language_model_class(module)
    if cls is None:
        return FamilyCaches(family, (), error="no Model or LanguageModel class")
    make_cache = getattr(cls, "make_cache", None)
    if make_cache is None:
        model = getattr(module, "Model", None)
        make_cache = getattr(model, "make_cache", None) if model is not None else None
        cls = model if make_cache is not None else cls
    if make_cache is None:
        return FamilyCaches(family, ("KVCache",), cls.__name__, has_make_cache=False)
    walker = _Walker()
    walker.walk(make_cache, cls)
    return FamilyCaches(family, tuple(sorted(walker.classes)), cls.__name__,
                        unresolved=tuple(sorted(walker.unresolved)))


def model_families() -> list[str]:
    """Every model package of the installed mlx-vlm (``mlx_vlm/models/<name>/``)."""
    import mlx_vlm.models as models

    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg)


@lru_cache(maxsize=1)
def all_families() -> tuple[FamilyCaches, ...]:
    """``inspect_family`` for every package (imports them all: a few seconds, once)."""
    return tuple(inspect_family(name) for name in model_families())


def select(families: Iterable[FamilyCaches], *, hybrid: bool = False, sliding: bool = False,
           recurrent: bool = False, beyond_kv: bool = False) -> list[str]:
    """Names of the families with any of the requested properties."""
    return [f.family for f in families
            if (hybrid and f.hybrid) or (sliding and f.sliding) or (recurrent and f.recurrent)
            or (beyond_kv and f.beyond_kv)]
