"""``apcctl bench attention``: one glm5_next sparse-attention layer, stock path vs patched path.

One real ``Glm5NextAttention`` with random weights and the full model's dimensions (latent
512, head dims 256/256, q_lora 1536, top-k 2048 + 15 tail slots), optionally with fewer heads
so the stock path fits a CPU. Timed is ``_attend`` (what differs between the paths: the q/kv
projections, the indexer and o_proj are the same on both), with top-k indices laid out as the
indexer lays them out (whole 16-token pools ending at or before the query, chronological, -1
padding, the query's own partial pool as tail). Stock runs with a stale projected cache, as
after any decode step: for chunks of 9+ tokens it re-projects the whole context.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import click

DEFAULT_CONTEXTS = "2048,8192,20000"
DEFAULT_CHUNKS = "1,2,8,16,44,128,256,512"
FULL_HEADS = 64
LAYER_INDEX = 3  # the first sparse layer of the 45-layer model


@dataclass
class Row:
    context: int  # tokens before the chunk
    chunk: int
    path: str  # the patched dispatcher's choice
    stock_ms: float
    new_ms: float
    speedup: float
    rel_l2: float
    stock_runs: int  # 0: only the warm-up run was timed (it took longer than --budget)
    new_runs: int


def register(main: click.Group, bench: click.Group) -> None:
    del main
    bench.add_command(attention)


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


def describe_backend() -> dict[str, Any]:
    """MLX version, device, and the BLAS library actually mapped into this process."""
    import mlx.core as mx

    info: dict[str, Any] = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "platform": platform.platform(),
    }
    if mx.metal.is_available():
        try:
            info["gpu"] = mx.metal.device_info().get("architecture", "metal")
        except Exception:  # older MLX: the device name is optional
            info["gpu"] = "metal"
    if sys.platform == "darwin":
        info["blas"] = "Accelerate"
        return info
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    # numpy's own OpenBLAS (scipy_openblas, suffixed symbols) is mapped too but never used by MLX.
    libraries = sorted(
        {
            line.split()[-1]
            for line in maps.splitlines()
            if "blas" in line.lower() and "scipy_openblas" not in line
        }
    )
    names = ", ".join(Path(lib).name for lib in libraries) or "unknown"
    preload = os.environ.get("LD_PRELOAD", "")
    if "blas" in preload.lower():
        info["blas"] = f"{names} (LD_PRELOAD={preload})"
    elif any("mlx_cpu.libs" in lib for lib in libraries):
        info["blas"] = f"reference BLAS bundled with the mlx[cpu] wheel ({names})"
    else:
        info["blas"] = names
    return info


def synthetic_topk(context: int, chunk: int, topk: int, pool: int, seed: int) -> Any:
    """[1, chunk, topk + pool - 1] indices in the indexer's layout for the chunk's queries."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    out = np.full((chunk, topk + pool - 1), -1, np.int32)
    for i in range(chunk):
        position = context + i
        complete = (position + 1) // pool
        picked = np.sort(rng.choice(complete, min(topk // pool, complete), replace=False))
        tokens = (picked[:, None] * pool + np.arange(pool)).reshape(-1)
        out[i, : tokens.size] = tokens
        tail = np.arange(complete * pool, position + 1)
        out[i, topk : topk + tail.size] = tail
    return mx.array(out)[None]


def build_layer(heads: int, dtype_name: str, seed: int) -> Any:
    import mlx.core as mx

    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import Glm5NextAttention

    mx.random.seed(seed)
    layer = Glm5NextAttention(
        TextConfig(num_attention_heads=heads, num_key_value_heads=heads), LAYER_INDEX
    )
    layer.set_dtype(getattr(mx, dtype_name))
    layer.eval()
    return layer


def layer_inputs(layer: Any, context: int, chunk: int, seed: int) -> tuple:
    """q [1, H, L, d], the latent [1, 1, T+L, r] (RMS-normalised like kv_a_layernorm), top-k."""
    import mlx.core as mx

    mx.random.seed(seed + context + chunk)
    dtype = layer.embed_q.weight.dtype
    latent = mx.random.normal((1, 1, context + chunk, layer.kv_lora_rank))
    latent = (latent * mx.rsqrt(mx.mean(latent * latent, axis=-1, keepdims=True))).astype(dtype)
    q = mx.random.normal((1, layer.num_heads, chunk, layer.q_head_dim)).astype(dtype)
    indexer = layer.indexer
    topk = synthetic_topk(context, chunk, indexer.index_topk, indexer.index_kpool, seed)
    mx.eval(latent, q, topk)
    return q, latent, latent[:, :, -chunk:], topk


def timed(run: Callable[[], Any], repeat: int, budget: float) -> tuple[float, int, Any]:
    """(median seconds, timed runs, output); a warm-up slower than ``budget`` is the result."""
    import mlx.core as mx

    start = time.perf_counter()
    out = run()
    mx.eval(out)
    warm = time.perf_counter() - start
    if warm > budget:
        return warm, 0, out
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times), out


def measure(layer: Any, context: int, chunk: int, repeat: int, budget: float, seed: int) -> Row:
    import mlx.core as mx

    from server_patch.sparse import dispatch

    q, latent, new_latent, topk = layer_inputs(layer, context, chunk, seed)
    args = (q, latent, new_latent, topk, None, None)
    stock_s, stock_runs, stock_out = timed(
        lambda: dispatch.stock_attend(layer, *args)[0], repeat, budget
    )
    new_s, new_runs, new_out = timed(lambda: dispatch.attend(layer, *args)[0], repeat, budget)
    diff = (new_out - stock_out).astype(mx.float32)
    rel = (mx.linalg.norm(diff) / mx.linalg.norm(stock_out.astype(mx.float32))).item()
    return Row(
        context=context,
        chunk=chunk,
        path=dispatch.choose_path(chunk, context + chunk),
        stock_ms=round(stock_s * 1e3, 1),
        new_ms=round(new_s * 1e3, 1),
        speedup=round(stock_s / new_s, 2),
        rel_l2=float(f"{rel:.2e}"),
        stock_runs=stock_runs,
        new_runs=new_runs,
    )


def _table(rows: list[Row]) -> str:
    lines = [
        f"{'context':>8} {'chunk':>6} {'new path':>12} {'stock ms':>10} {'new ms':>9} "
        f"{'speedup':>8} {'rel L2':>9}"
    ]
    for r in rows:
        stock = f"{r.stock_ms:.1f}" + ("*" if r.stock_runs == 0 else "")
        new = f"{r.new_ms:.1f}" + ("*" if r.new_runs == 0 else "")
        lines.append(
            f"{r.context:>8} {r.chunk:>6} {r.path:>12} {stock:>10} {new:>9} "
            f"{r.speedup:>7.2f}x {r.rel_l2:>9.1e}"
        )
    return "\n".join(lines)


@click.command("attention")
@click.option("--contexts", default=DEFAULT_CONTEXTS, show_default=True,
              help="Context tokens before the chunk, comma-separated.")
@click.option("--chunks", default=DEFAULT_CHUNKS, show_default=True,
              help="Chunk lengths L, comma-separated.")
@click.option("--heads", type=int, default=None,
              help=f"Attention heads (the model has {FULL_HEADS}); default {FULL_HEADS} on a GPU, 8 on a CPU.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Weights and activations (MLX's CPU matmul has no BLAS for bf16).")
@click.option("--repeat", type=int, default=3, show_default=True, help="Timed runs per path (median).")
@click.option("--budget", type=float, default=2.0, show_default=True,
              help="Seconds: a path whose warm-up run takes longer is reported from that run (*).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def attention(contexts: str, chunks: str, heads: int | None, dtype: str, repeat: int,
              budget: float, seed: int, as_json: bool) -> None:
    """Milliseconds per sparse-attention forward, stock vs patched, side by side in one run."""
    import mlx.core as mx

    backend = describe_backend()
    if heads is None:
        heads = FULL_HEADS if mx.default_device() == mx.gpu else 8
    layer = build_layer(heads, dtype, seed)
    measure(layer, 64, 16, 1, budget, seed)  # compile MLX's CPU kernels outside the timings
    note = (
        f"{heads} heads instead of the model's {FULL_HEADS}: per-head work scales with H, the "
        "latent gather does not" if heads != FULL_HEADS else "full-size layer"
    )
    if not as_json:
        click.echo(f"device {backend['device']}; BLAS {backend['blas']}; mlx {backend['mlx']}")
        click.echo(f"one Glm5NextAttention, {dtype}, {note}; timed: _attend")
        click.echo("stock: L <= 8 decode loop, else unabsorbed with a stale projected cache")
    rows = []
    for context in _ints(contexts):
        for chunk in _ints(chunks):
            row = measure(layer, context, chunk, repeat, budget, seed)
            rows.append(row)
            if not as_json:
                click.echo(_table([row]).splitlines()[1] if len(rows) > 1 else _table([row]))
    if as_json:
        click.echo(json.dumps(
            {"backend": backend, "heads": heads, "full_heads": FULL_HEADS, "dtype": dtype,
             "note": note, "rows": [asdict(r) for r in rows]},
            indent=2,
        ))
    else:
        click.echo("* single run (its warm-up exceeded --budget)")
