"""The suffix forward alone, in this process: ``python -m apcctl.lab.bench.ttft_forward``.

Run in a fresh process (the overlay must patch mlx-vlm before it is imported). Two uses:

* ``--cases FILE``: for ``apcctl bench ttft``. Each case is a warm turn's messages and how many
  of its tokens the server restored. The restored prefix is prefilled once with stock
  attention (the state differs from the patched server's by float rounding only); then each
  path restores it the way its server does and one forward of the rest is timed: patched,
  lineage views + the copy-free merge and the sparse dispatch under the patched server's pool
  limit; stock, its clone of the whole snapshot (projected cache included) + its merge and
  stock attention under MLX's default limit. Also timed: 0.7.10's split of the suffix into
  suffix - 1 tokens then 1. Prints one JSON list.
* ``--explain --context N``: the experiment behind the stock/patched gap of that forward
  (docs/benchmarks-ttft.md): the same cache restored and attended over in every combination
  (restore with or without the projected cache, dispatch or stock attention, forced gather,
  headroom rows, pool limit), with the path the dispatcher took. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

CHUNK = 2048  # prefill chunk of the restored prefix


@dataclass
class Bench:
    """The model, loaded once with the overlay installed, and the pieces every path needs."""

    model: Any
    processor: Any
    lm: Any
    layout: Any
    attention: Any  # the Glm5NextAttention class
    patched_attend: Callable[..., Any]
    default_limit: int
    patched_limit: int

    @classmethod
    def load(cls, model_dir: Path) -> "Bench":
        from server_patch.overlay import install

        install()
        import mlx.core as mx
        from mlx_vlm import load
        from mlx_vlm.models.glm5_next import language

        from server_patch.copyfree.settings import CopyFreeSettings
        from server_patch.state.layout import CacheLayout

        model, processor = load(str(model_dir))
        lm = model.language_model
        default_limit = mx.set_cache_limit(0)
        mx.set_cache_limit(default_limit)
        return cls(model, processor, lm, CacheLayout.from_model(lm), language.Glm5NextAttention,
                   language.Glm5NextAttention._attend, default_limit,
                   int(CopyFreeSettings.from_env().pool_limit_gb * (1 << 30)))

    @property
    def stock_attend(self) -> Callable[..., Any]:
        return self.attention._stock_attend

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        from mlx_vlm.prompt_utils import apply_chat_template
        from mlx_vlm.utils import prepare_inputs

        prompt = apply_chat_template(self.processor, self.model.config, messages)
        return prepare_inputs(self.processor, prompts=prompt)["input_ids"][0].tolist()

    def prefill(self, tokens: Sequence[int], length: int) -> list[Any]:
        """A cache of ``tokens[:length]``, built with stock attention (the patched sparse path
        is slow for long chunks on a CPU) in ``CHUNK``-token forwards, so its projected cache
        is in sync, as a stock prefill leaves it."""
        import mlx.core as mx

        with self.attend(self.stock_attend):
            cache = self.lm.make_cache()
            for start in range(0, length, CHUNK):
                out = self.lm(mx.array(tokens[start:min(length, start + CHUNK)])[None], cache=cache)
                mx.eval(out.logits, [c.state for c in cache])
        return cache

    def attend(self, attend: Callable[..., Any], limit: int | None = None) -> "_Using":
        return _Using(self, attend, limit)


class _Using:
    """Within the block: ``attend`` as the attention class's ``_attend``, and MLX's pool ``limit``."""

    def __init__(self, bench: Bench, attend: Callable[..., Any], limit: int | None) -> None:
        self.bench, self.attend, self.limit = bench, attend, limit

    def __enter__(self) -> None:
        import mlx.core as mx

        self.bench.attention._attend = self.attend
        if self.limit is not None:
            mx.set_cache_limit(self.limit)

    def __exit__(self, *exc: object) -> None:
        self.bench.attention._attend = self.bench.patched_attend


# ------------------------------------------------------------------------------ restores


def patched_restore(bench: Bench, cache: list[Any], length: int, suffix: int,
                    headroom: int = 0) -> Callable[[], list[Any]]:
    """The lineage restore: views of ``cache`` (no projected cache: it is derived, not stored),
    then the one copy, the copy-free merge (``headroom`` spare rows, as a lent buffer has)."""
    from server_patch.copyfree.merge import merge_rows

    kv, snapshot = bench.layout.split(cache, length)  # views; ``cache`` is not written again
    return lambda: merge_rows([bench.layout.build(kv, snapshot, length)], [length], [suffix], 256,
                              headroom=headroom)


def stock_restore(cache: list[Any], length: int, total: int) -> Callable[[], list[Any]]:
    """Stock 0.7.10's: a clone of the whole snapshot (projected cache included, in sync), then
    its merge."""
    from mlx_vlm.apc import _clone_prompt_cache_for_apc, make_warm_batch_exact_cache_multi

    def restore() -> list[Any]:
        clone = _clone_prompt_cache_for_apc(cache, min_capacity_tokens=total)
        merged, _ = make_warm_batch_exact_cache_multi([clone], [length])
        return merged

    return restore


def timed(bench: Bench, tokens: Sequence[int], at: int, restore: Callable[[], list[Any]],
          chunks: Sequence[int]) -> tuple[float, float]:
    """(ms of the forwards of ``chunks`` tokens from ``at``, ms of the restore before them)."""
    import mlx.core as mx

    start = time.perf_counter()
    caches = restore()
    restore_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    for n in chunks:
        out = bench.lm(mx.array(tokens[at:at + n])[None], cache=caches)
        mx.eval(out.logits, [c.state for c in caches])
        at += n
    return (time.perf_counter() - start) * 1000, restore_ms


def _medians(results: dict[str, list[float]]) -> dict[str, float]:
    return {k: round(statistics.median(v), 1) for k, v in results.items()}


# ------------------------------------------------------------------------------ the bench's cases


def measure_case(bench: Bench, messages: list[dict[str, str]], restored: int, repeat: int) -> dict[str, Any]:
    """Stock and patched forwards of one warm turn's tokens past ``restored``."""
    tokens = bench.ids(messages)
    suffix = len(tokens) - restored
    cache = bench.prefill(tokens, restored)
    paths = (("stock_", bench.stock_attend, bench.default_limit, stock_restore(cache, restored, len(tokens))),
             ("", bench.patched_attend, bench.patched_limit, patched_restore(bench, cache, restored, suffix)))
    results: dict[str, list[float]] = {}
    for i in range(repeat + 1):  # the first round warms up (and fills MLX's pool)
        for name, attend, limit, restore in paths:  # interleaved: host load hits both alike
            with bench.attend(attend, limit):
                one, restore_ms = timed(bench, tokens, restored, restore, [suffix])
                split, _ = timed(bench, tokens, restored, restore, [suffix - 1, 1] if suffix > 1 else [suffix])
            if i:
                results.setdefault(f"{name}one_forward_ms", []).append(one)
                results.setdefault(f"{name}split_forwards_ms", []).append(split)
                results.setdefault(f"{name}restore_ms", []).append(restore_ms)
    kv, _ = bench.layout.split(cache, restored)
    return {**_medians(results), "context": restored, "suffix": suffix, "kv_bytes": int(kv.nbytes)}


def measure_cases(model_dir: Path, cases: list[dict[str, Any]], repeat: int) -> list[dict[str, Any]]:
    bench = Bench.load(model_dir)
    return [{**measure_case(bench, c["messages"], int(c["restored"]), repeat), "modes": c["modes"]}
            for c in cases]


# ------------------------------------------------------------------------------ the experiment


def explain(model_dir: Path, context: int, repeat: int) -> dict[str, Any]:
    """The 22-token suffix forward over a ``context``-token restored cache, every way.

    Each variant: a restore (stock's clone, projected cache in sync; the lineage views + merge,
    no projected cache; the same with 512 headroom rows), an attention (the patched dispatch,
    with or without the gather forced; stock ``_attend``) and a pool limit. ``paths`` counts the
    dispatcher's choices per forward."""
    from server_patch.sparse import dispatch

    from apcctl.lab.bench.ttft import conversation, next_turn

    bench = Bench.load(model_dir)
    cold = conversation(context, model_dir)
    cold_ids = bench.ids(cold)
    restored = len(cold_ids) - 1
    tokens = bench.ids(next_turn(cold, "ok ok ok ok", 0))
    suffix = len(tokens) - restored
    cache = bench.prefill(tokens, restored)
    stock, patched = stock_restore(cache, restored, len(tokens)), patched_restore(bench, cache, restored, suffix)
    headroom = patched_restore(bench, cache, restored, suffix, headroom=512)
    p, s, lo, hi = bench.patched_attend, bench.stock_attend, bench.default_limit, bench.patched_limit
    variants: list[tuple[str, Callable[[], list[Any]], Callable[..., Any], int, bool]] = [
        ("stock: clone (projection in sync), stock attention, default pool", stock, s, lo, False),
        ("patched: lineage merge (no projection), dispatch, 16 GB pool", patched, p, hi, False),
        ("patched, merge with 512 headroom rows (a lent buffer's shape)", headroom, p, hi, False),
        ("patched, default pool", patched, p, lo, False),
        ("stock, 16 GB pool", stock, s, hi, False),
        ("dispatch over stock's clone (projection in sync)", stock, p, hi, False),
        ("dispatch, gather forced, over stock's clone", stock, p, hi, True),
        ("stock attention over the lineage merge (re-projects the context)", patched, s, hi, False),
    ]
    taken: list[str] = []
    choose = dispatch._path

    def recording(*args: Any, **kwargs: Any) -> str:
        path = choose(*args, **kwargs)
        taken.append(path)
        return path

    dispatch._path = recording
    penalty = dispatch.ABSORBED_MAX_PENALTY
    results: dict[str, list[float]] = {}
    paths: dict[str, dict[str, int]] = {}
    try:
        for i in range(repeat + 1):
            for label, restore, attend, limit, force in variants:
                dispatch.ABSORBED_MAX_PENALTY = math.inf if force else penalty
                taken.clear()
                with bench.attend(attend, limit):
                    ms, _ = timed(bench, tokens, restored, restore, [suffix])
                if i:
                    results.setdefault(label, []).append(ms)
                    paths[label] = {k: taken.count(k) for k in sorted(set(taken))}
    finally:
        dispatch._path, dispatch.ABSORBED_MAX_PENALTY = choose, penalty
    attn = next(layer.self_attn for layer in bench.lm.model.layers if hasattr(layer.self_attn, "kv_lora_rank"))
    return {"context": restored, "suffix": suffix, "repeat": repeat,
            "kv_lora_rank": int(attn.kv_lora_rank), "heads": int(attn.num_heads),
            "head_dims": int(attn.qk_nope_head_dim) + int(attn.v_head_dim),
            "variants": [{"variant": label, "forward_ms": _medians(results)[label], "paths": paths[label]}
                         for label, *_ in variants]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m apcctl.lab.bench.ttft_forward", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="bench-preset model dir (default: built once)")
    parser.add_argument("--cases", type=Path, help="JSON list of {messages, restored, modes}")
    parser.add_argument("--explain", action="store_true", help="run the experiment instead")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    from server_patch.overlay import install

    install()  # before anything imports mlx-vlm (the model builder does)
    model_dir = args.model
    if model_dir is None:
        import tempfile

        from apcctl.lab.tinymodel.build import build_model

        model_dir = build_model(Path(tempfile.gettempdir()) / "apcctl-bench-model", preset="bench", seed=0)
    if args.explain:
        print(json.dumps(explain(model_dir, args.context, args.repeat)))
    elif args.cases:
        print(json.dumps(measure_cases(model_dir, json.loads(args.cases.read_text()), args.repeat)))
    else:
        parser.error("give --cases FILE or --explain")


if __name__ == "__main__":
    main()
