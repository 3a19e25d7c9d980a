"""Pre-flight: is a model directory's cache layout one the lineage cache restores exactly?

``check_model_dir`` reads only ``config.json``. It builds ``Model(config)`` the way
``mlx_vlm.utils.load_model`` does, but never reads the weights: every parameter is replaced by a
broadcast scalar of the config's dtype (no memory, whatever the model's size), and one short
forward (``PROBE_TOKENS``) through the language model fills its real cache objects. Their shapes
give each layer's bytes per token (append-only layers) and snapshot bytes (recurrent state, or a
sliding window at full size). The classification is the server's own: mlx-vlm's
``PrefixCachePlan`` (block = stock paged cache, checkpoint = the lineage cache) and
``CacheLayout.from_model`` (the codec per layer, or the refusal the server would raise).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from apcctl.lab.tinymodel.language_model import language_model_from_config
from server_patch.state.families import RESTORE_RULES

PROBE_TOKENS = 16
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass
class LayerReport:
    index: int
    classes: list[str]  # the layer's class, then its children's (CacheList)
    rules: list[str]  # one restore rule per class (children only for a CacheList)
    kv_bytes_per_token: int = 0  # append-only rows: grow with the prompt, sliced on restore
    snapshot_bytes: int = 0  # held once per restore point (full window for sliding layers)


@dataclass
class ModelReport:
    model_dir: str
    model_type: str
    dtype: str
    server_path: str  # "lineage", "stock block cache", or "no prefix cache"
    supported: bool
    layers: list[LayerReport] = field(default_factory=list)
    kv_bytes_per_token: int = 0
    snapshot_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    probe: str = ""
    # The chat template's order and the boundary kinds it gets (``apcctl.lab.template_check``);
    # None when the directory has no tokenizer files.
    template: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _placeholder_params(module: Any, dtype: Any) -> None:
    """Every parameter becomes a broadcast scalar: the model's shapes, none of its memory."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(k, mx.broadcast_to(mx.array(0.02, dtype=dtype), v.shape))
              for k, v in tree_flatten(module.parameters()) if isinstance(v, mx.array)]
    module.update(tree_unflatten(params))


def build_from_config(config: dict[str, Any], model_path: Path | None = None) -> tuple[Any, Any]:
    """(model module, language model) of ``config`` with placeholder parameters."""
    import mlx.core as mx
    from mlx_vlm.utils import get_model_and_args

    config = json.loads(json.dumps(config))  # load_model mutates its config
    module, _ = get_model_and_args(config, model_path)
    language_model = language_model_from_config(module, config)
    _placeholder_params(language_model, getattr(mx, _dtype_name(config)))
    return module, language_model


def _dtype_name(config: dict[str, Any]) -> str:
    text = config.get("text_config") or {}
    name = str(text.get("torch_dtype") or config.get("torch_dtype") or text.get("dtype")
               or config.get("dtype") or "bfloat16")
    return _DTYPES.get(name, "bfloat16")


def _children(cache: Any) -> list[Any]:
    from server_patch.state.registry import is_composite

    return list(cache.caches) if is_composite(cache) else [cache]


def _rule(cache: Any, derived: bool) -> str:
    if derived:
        from server_patch.state.registry import DERIVED

        return DERIVED.rule
    return RESTORE_RULES.get(type(cache).__name__, f"no restore rule for {type(cache).__name__}")


def _child_bytes(codec: Any, child: Any, tokens: int) -> tuple[int, int]:
    """(bytes per token of its append-only rows, snapshot bytes) of one probed cache."""
    import mlx.core as mx

    if codec.name == "derived":
        return 0, 0
    rows, snap = codec.split(child)
    per_token = sum(int(v.nbytes) for v in rows.values() if isinstance(v, mx.array)) // tokens
    arrays = {k: v for k, v in snap.items() if isinstance(v, mx.array)}
    if codec.name in ("rotating", "chunked") and "keys" in arrays:
        # The buffer grows to the window: count it at full size, not at the probe's length.
        window = int(snap.get("max_size", snap.get("chunk_size", 0)) or 0)
        row_bytes = sum(int(arrays[k].nbytes) // max(1, int(arrays[k].shape[2])) for k in ("keys", "values"))
        return per_token, row_bytes * window
    return per_token, sum(int(v.nbytes) for v in arrays.values())


def check_language_model(language_model: Any, *, model_dir: str = "", model_type: str = "",
                         dtype: str = "") -> ModelReport:
    """Classify and size ``language_model``'s caches (see the module docstring)."""
    import mlx.core as mx
    from mlx_vlm.apc_adapters import build_prefix_cache_plan_from_caches

    from server_patch.state.layout import CacheLayout, derived_children
    from server_patch.state.registry import UnsupportedCacheError, codec_for

    caches = language_model.make_cache()
    strategy = build_prefix_cache_plan_from_caches(caches).strategy
    server_path = {"block": "stock block cache", "checkpoint": "lineage"}.get(strategy, "no prefix cache")
    report = ModelReport(model_dir, model_type, dtype, server_path, supported=False)
    try:
        CacheLayout.from_model(language_model)
        layout_ok = True
    except UnsupportedCacheError as exc:
        layout_ok = False
        report.problems.append(str(exc))
    derived = derived_children(language_model)
    try:
        out = language_model(mx.arange(1, PROBE_TOKENS + 1)[None], cache=caches)
        del out  # shapes are known without evaluating anything
        probed = True
    except Exception as exc:  # noqa: BLE001 - a model we cannot probe is still classified
        probed = False
        report.problems.append(f"probe forward failed, sizes unknown: {type(exc).__name__}: {exc}")
    for i, cache in enumerate(caches):
        children = _children(cache)
        classes = [type(cache).__name__] + [type(c).__name__ for c in children if c is not cache]
        rules = [_rule(c, j in derived.get(i, ())) for j, c in enumerate(children)]
        layer = LayerReport(i, classes, rules)
        if probed:
            for j, child in enumerate(children):
                try:
                    codec = codec_for(child) if j not in derived.get(i, ()) else None
                except UnsupportedCacheError:
                    continue
                if codec is None:
                    continue
                per_token, snap = _child_bytes(codec, child, PROBE_TOKENS)
                layer.kv_bytes_per_token += per_token
                layer.snapshot_bytes += snap
        report.layers.append(layer)
    report.kv_bytes_per_token = sum(l.kv_bytes_per_token for l in report.layers)
    report.snapshot_bytes = sum(l.snapshot_bytes for l in report.layers)
    if server_path == "no prefix cache":
        report.problems.append("mlx-vlm finds no restorable prefix-cache plan for this model")
    report.supported = layout_ok and server_path != "no prefix cache"
    report.probe = (f"built from config.json with placeholder weights (no weights read), "
                    f"{'one lazy forward of ' + str(PROBE_TOKENS) + ' tokens' if probed else 'no forward'}")
    return report


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_model_dir(model_dir: Path) -> ModelReport:
    """``check_language_model`` for a model directory (its ``config.json``; its tokenizer files,
    when it has them, for the chat template's order and boundaries)."""
    report = check_config_file(Path(model_dir) / "config.json")
    if any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        from apcctl.lab.template_check import check_template

        report.template = check_template(Path(model_dir), report.model_type).as_dict()
    return report


def check_config_file(config_file: Path) -> ModelReport:
    """``check_language_model`` for a model built from one config file (placeholder weights)."""
    config_file = Path(config_file)
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    _, language_model = build_from_config(config, config_file.parent)
    return check_language_model(language_model, model_dir=str(config_file.parent),
                                model_type=str(config.get("model_type", "")), dtype=_dtype_name(config))


def format_report(report: ModelReport) -> str:
    """The human-readable report: one line per layer, then the totals and any problems."""
    lines = [f"{report.model_dir}  model_type={report.model_type} dtype={report.dtype}",
             f"server path: {report.server_path}   supported: {'yes' if report.supported else 'NO'}",
             f"{'layer':>5}  {'classes':<48} {'KV B/token':>10} {'snapshot B':>12}  rule"]
    for layer in report.layers:
        lines.append(f"{layer.index:>5}  {'/'.join(layer.classes):<48} {layer.kv_bytes_per_token:>10,} "
                     f"{layer.snapshot_bytes:>12,}  {'; '.join(layer.rules)}")
    lines.append(f"total: {report.kv_bytes_per_token:,} B/token of KV rows (stored once per lineage), "
                 f"{report.snapshot_bytes:,} B per snapshot (each entry head and checkpoint)")
    lines.append(f"probe: {report.probe}")
    lines += [f"problem: {p}" for p in report.problems]
    lines += _template_lines(report.template)
    return "\n".join(lines)


def _template_lines(template: dict[str, Any] | None) -> list[str]:
    if template is None:
        return ["chat template: not checked (no tokenizer files)"]
    kinds = ", ".join(template["kinds"]) or "none"
    anchor = template["anchor_len"]
    where = f" (anchor at token {anchor} of {template['prompt_tokens']})" if anchor is not None else ""
    lines = [f"chat template: {template['order']}; boundaries offered on an agent prompt: {kinds}{where}"]
    if template["order"] == "system first":
        lines.append("  (the system text renders before the tools block: a change late in it diverges "
                     "before the tools; the restore point is the last boundary inside the system text)")
    return lines + [f"template problem: {p}" for p in template["problems"]]
