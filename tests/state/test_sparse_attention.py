"""glm5_next sparse attention: the new paths against stock, the projected cache as derived
state, the flag-file layer timer, and a greedy conversation on the tiny model.

Small dimensions (4 heads, latent 32, index_topk 64 in pools of 16) keep stock's unabsorbed
path cheap on the CPU while the top-k selection still prunes above 64 tokens.
"""

from __future__ import annotations

import json
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_map

from mlx_vlm.models.cache import (
    BatchKVCache,
    BatchPoolingCache,
    CacheList,
    KVCache,
    PoolingCache,
)
from mlx_vlm.models.glm5_next import language as stock_language
from mlx_vlm.models.glm5_next.config import TextConfig
from server_patch.sparse import dispatch, gathered, profiler, projected

CHUNKS = (1, 2, 8, 16, 44, 128, 256, 512)
CONTEXTS = (0, 40, 150, 300)  # below and above index_topk = 64 (300: 19 pools of 16, the last partial)
LEFT_PADDING = (0, 5, 23)
HIDDEN = 64


def small_config(**overrides: Any) -> TextConfig:
    fields = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=64,
        index_kpool=16,
        layer_types=["deepseek_sparse_attention"] * 2,
        indexer_types=["full", "shared"],
        mlp_layer_types=["dense"] * 2,
    )
    fields.update(overrides)
    return TextConfig(**fields)


def make_layers(shared: bool, seed: int = 0) -> list[Any]:
    """One attention layer with its own indexer, plus one reusing its top-k if ``shared``."""
    config = small_config()
    mx.random.seed(seed)
    layers = [stock_language.Glm5NextAttention(config, i) for i in range(2 if shared else 1)]
    for layer in layers:
        layer.update(tree_map(lambda a: 0.3 * mx.random.normal(a.shape), layer.parameters()))
        layer.eval()
    return layers


def make_caches(layers: list[Any], left_padding: Optional[tuple[int, ...]] = None) -> list[CacheList]:
    def kv() -> Any:
        return KVCache() if left_padding is None else BatchKVCache(list(left_padding))

    caches = []
    for layer in layers:
        if layer.indexer is None:
            caches.append(CacheList(kv(), kv()))
        else:
            pool = (
                PoolingCache(16) if left_padding is None else BatchPoolingCache(16, list(left_padding))
            )
            caches.append(CacheList(kv(), kv(), pool, kv()))
    return caches


def forward(layers: list[Any], caches: list[CacheList], x: mx.array, mask=None) -> list[tuple]:
    """Every layer on the same input (they are not stacked), top-k passed down as the model does."""
    outputs, topk = [], None
    for layer, cache in zip(layers, caches):
        out, topk = layer(x, mask, cache, topk)
        outputs.append((out, topk))
    mx.eval(outputs)
    return outputs


@contextmanager
def attend_with(function: Callable[..., Any]) -> Iterator[None]:
    """Route every Glm5NextAttention._attend call through ``function(layer, ...)``."""
    cls = stock_language.Glm5NextAttention
    saved = cls.__dict__["_attend"]
    cls._attend = lambda self, *args, **kwargs: function(self, *args, **kwargs)
    try:
        yield
    finally:
        cls._attend = saved


def chunk_inputs(batch: int, context: int, length: int, seed: int = 1):
    """Hidden states for a prefill of ``context`` tokens (left padded when batched) and a chunk."""
    mx.random.seed(seed)
    prefill = mx.random.normal((batch, context, HIDDEN))
    chunk = mx.random.normal((batch, length, HIDDEN))
    if batch == 1:
        return prefill, chunk, None
    padded = context or length  # the forward that carries the padding keeps one real token
    return prefill, chunk, tuple(min(p, padded - 1) for p in LEFT_PADDING[:batch])


def run_sequence(layers, batch: int, context: int, length: int, function) -> list[tuple]:
    """Prefill ``context`` tokens, then one chunk of ``length``; returns the chunk's outputs.

    With a batch, rows are left padded: at context 0 the padding sits in the chunk itself.
    """
    prefill, chunk, padding = chunk_inputs(batch, context, length)
    caches = make_caches(layers, padding)
    with attend_with(function):
        if context:
            mask = None if padding is None else (mx.arange(context)[None] >= mx.array(padding)[:, None])
            forward(layers, caches, prefill, mask)
            return forward(layers, caches, chunk)
        mask = None if padding is None else (mx.arange(length)[None] >= mx.array(padding)[:, None])
        return forward(layers, caches, chunk, mask)


def keyed_rows(topk: mx.array, context: int) -> mx.array:
    """[B, L] rows whose query has at least one valid key."""
    return mx.any((topk >= 0) & (topk < context), axis=-1)


def relative_l2(new: mx.array, old: mx.array, rows: mx.array) -> float:
    keep = rows[..., None]
    diff = mx.where(keep, new - old, 0)
    return (mx.linalg.norm(diff) / mx.linalg.norm(mx.where(keep, old, 0))).item()


# --- equivalence with stock -------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["own-indexer", "with-shared"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("length", CHUNKS)
def test_chunk_matches_stock(length: int, context: int, batch: int, shared: bool) -> None:
    layers = make_layers(shared)
    stock = run_sequence(layers, batch, context, length, dispatch.stock_attend)
    new = run_sequence(layers, batch, context, length, dispatch.attend)
    for (old_out, old_topk), (new_out, new_topk) in zip(stock, new):
        assert mx.array_equal(old_topk, new_topk)
        rows = keyed_rows(new_topk, context + length)
        assert relative_l2(new_out, old_out, rows) <= 1e-5
        if length > 8:  # new paths zero keyless (padding) rows; the CPU's SDPA averages them
            assert not mx.any(mx.where(rows[..., None], 0, new_out)).item()
        else:
            assert mx.array_equal(new_out, old_out)


def test_gathered_path_matches_loop_for_short_chunks() -> None:
    """The batched gather agrees with stock's loop below 9 tokens too (used for last_only)."""
    layers = make_layers(shared=False)
    captured = record_attend_args(layers, context=150, length=8)
    q, latent, new_latent, topk, kv_cache, projected_cache = captured
    loop, _ = dispatch.stock_attend(layers[0], *captured)
    batched = gathered.blocked_absorbed_attention(layers[0], q, latent, topk)
    batched = batched.transpose(0, 2, 1, 3).reshape(loop.shape)
    assert relative_l2(batched, loop, mx.ones(loop.shape[:2], dtype=mx.bool_)) <= 1e-6


def test_blocks_cover_long_chunks_exactly() -> None:
    """Blocking by 128 queries gives what one gather over the whole chunk gives."""
    layers = make_layers(shared=False)
    q, latent, _, topk, _, _ = record_attend_args(layers, context=600, length=300)
    whole = gathered.absorbed_attention(layers[0], q, latent, topk)
    blocked = gathered.blocked_absorbed_attention(layers[0], q, latent, topk, block=128)
    assert mx.allclose(whole, blocked, rtol=1e-6, atol=1e-6).item()


def test_last_only_returns_the_last_row() -> None:
    layers = make_layers(shared=False)
    captured = record_attend_args(layers, context=150, length=44)
    full, _ = dispatch.attend(layers[0], *captured)
    last, topk = dispatch.attend(layers[0], *captured, last_only=True)
    assert last.shape == (1, 1, full.shape[-1]) and topk.shape[1] == 1
    assert mx.allclose(last, full[:, -1:], rtol=1e-6, atol=1e-6).item()


def test_topk_beyond_context_and_future_slots_are_masked() -> None:
    """Slots past a query's own position never count, even if an indexer produced them."""
    layer = make_layers(shared=False)[0]
    mx.random.seed(3)
    length, context = 12, 20
    latent = mx.random.normal((1, 1, context, 32))
    q = mx.random.normal((1, 4, length, 16))
    positions = context - length + mx.arange(length)
    honest = mx.where(mx.arange(64)[None] <= positions[:, None], mx.arange(64)[None], -1)[None]
    future = mx.broadcast_to(mx.arange(64)[None, None], honest.shape)  # includes later tokens
    a = gathered.absorbed_attention(layer, q, latent, honest.astype(mx.int32))
    b = gathered.absorbed_attention(layer, q, latent, future.astype(mx.int32))
    assert mx.array_equal(a, b).item()


# --- short chunks stay decode-identical --------------------------------------------------------


def record_attend_args(layers, context: int, length: int, batch: int = 1) -> tuple:
    """The ``_attend`` arguments of the first layer for a chunk after ``context`` tokens."""
    seen: list[tuple] = []

    def record(layer, *args, **kwargs):
        if layer is layers[0]:
            seen.append(args[:6])
        return dispatch.attend(layer, *args, **kwargs)

    prefill, chunk, padding = chunk_inputs(batch, context, length)
    caches = make_caches(layers, padding)
    mask = None if padding is None else (mx.arange(context)[None] >= mx.array(padding)[:, None])
    with attend_with(record):
        forward(layers, caches, prefill, mask)
        forward(layers, caches, chunk)
    return seen[-1]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [2, 5, 8])
def test_short_chunks_bit_identical_to_token_by_token_decode(length: int, batch: int) -> None:
    layers = make_layers(shared=False)
    q, latent, new_latent, topk, kv_cache, projected_cache = record_attend_args(
        layers, context=150, length=length, batch=batch
    )
    chunk, _ = dispatch.attend(layers[0], q, latent, new_latent, topk, kv_cache, projected_cache)
    total = latent.shape[2]
    for i in range(length):
        visible = total - length + i + 1
        one, _ = dispatch.attend(
            layers[0],
            q[:, :, i : i + 1],
            latent[:, :, :visible],
            new_latent[:, :, i : i + 1],
            topk[:, i : i + 1],
            kv_cache,
            projected_cache,
        )
        assert mx.array_equal(chunk[:, i : i + 1], one).item()


# --- the projected cache is derived state --------------------------------------------------------


@pytest.fixture
def force_unabsorbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send every chunk above 8 tokens down the unabsorbed path (as on a GPU with long chunks)."""
    monkeypatch.setattr(dispatch, "GATHER_ALWAYS_MAX", 8)
    monkeypatch.setattr(dispatch, "UNABSORBED_MIN_FRACTION", 0.0)
    monkeypatch.setattr(dispatch, "_default_on_gpu", lambda: True)


@pytest.fixture
def projections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens projected by each call of ``projected.project``."""
    counts: list[int] = []
    original = projected.project

    def counting(layer, latent):
        counts.append(latent.shape[2])
        return original(layer, latent)

    monkeypatch.setattr(projected, "project", counting)
    return counts


class Conversation:
    """Chunks through the stock and the new path side by side, outputs compared each time."""

    def __init__(self, shared: bool = True, left_padding: Optional[tuple[int, ...]] = None) -> None:
        self.layers = make_layers(shared)
        self.padding = left_padding
        self.stock = make_caches(self.layers, left_padding)
        self.new = make_caches(self.layers, left_padding)
        self.length = 0
        self.step = 0

    def chunk(self, length: int) -> None:
        self.step += 1
        mx.random.seed(100 + self.step)
        batch = 1 if self.padding is None else len(self.padding)
        x = mx.random.normal((batch, length, HIDDEN))
        mask = None
        if self.padding is not None and self.length == 0:
            mask = mx.arange(length)[None] >= mx.array(self.padding)[:, None]
        with attend_with(dispatch.stock_attend):
            old = forward(self.layers, self.stock, x, mask)
        with attend_with(dispatch.attend):
            new = forward(self.layers, self.new, x, mask)
        self.length += length
        for (old_out, topk), (new_out, _) in zip(old, new):
            rows = keyed_rows(topk, self.length)
            assert relative_l2(new_out, old_out, rows) <= 1e-5

    def projected_lengths(self) -> list[int]:
        return [
            projected.cached_length(cache[projected.projected_child_index(cache)])
            if cache[projected.projected_child_index(cache)].keys is not None
            else 0
            for cache in self.new
        ]


def test_stale_projection_catches_up_instead_of_reprojecting(force_unabsorbed, projections) -> None:
    talk = Conversation(shared=True)
    talk.chunk(100)
    talk.chunk(100)  # cold prefill: in sync, only new tokens projected
    assert projections == [100, 100] * 2
    for _ in range(3):
        talk.chunk(1)  # decode steps do not touch the projected cache
    projections.clear()
    talk.chunk(44)
    assert projections == [47, 47]  # the 3 decoded tokens + the chunk, not all 247
    talk.chunk(44)
    assert projections == [47, 47, 44, 44]
    assert talk.projected_lengths() == [291, 291]


def test_projection_rebuilt_once_after_restore(force_unabsorbed, projections) -> None:
    talk = Conversation(shared=True)
    talk.chunk(200)
    # A restore brings back latent and indexer state but not the derived projection.
    for cache in talk.new:
        projected.release(cache[projected.projected_child_index(cache)])
    projections.clear()
    talk.chunk(30)
    assert projections == [230, 230]  # rebuilt once from the whole latent
    talk.chunk(30)
    talk.chunk(1)
    talk.chunk(30)
    assert projections == [230, 230, 30, 30, 31, 31]


def test_gathered_chunk_releases_projection_and_next_long_chunk_rebuilds_once(
    monkeypatch: pytest.MonkeyPatch, projections
) -> None:
    monkeypatch.setattr(dispatch, "_default_on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "GATHER_ALWAYS_MAX", 64)
    talk = Conversation(shared=True)
    talk.chunk(100)  # > 64 and >= 0.2 * 100: unabsorbed, cache filled
    assert talk.projected_lengths() == [100, 100]
    talk.chunk(44)  # gathered: the stale projection is dropped, not kept resident
    assert talk.projected_lengths() == [0, 0]
    projections.clear()
    talk.chunk(100)  # unabsorbed again: one rebuild of everything
    talk.chunk(100)
    assert projections == [244, 244, 100, 100]


def test_batch_projection_rebuilt_once_when_stale(force_unabsorbed, projections) -> None:
    talk = Conversation(shared=True, left_padding=LEFT_PADDING)
    talk.chunk(60)
    talk.chunk(1)
    projections.clear()
    talk.chunk(20)  # stale batch cache: rebuilt from the latent once
    talk.chunk(20)  # then in sync
    assert projections == [81, 81, 20, 20]


def test_long_context_keeps_no_projection(force_unabsorbed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(projected, "MAX_PROJECTED_TOKENS", 150)
    talk = Conversation(shared=False)
    talk.chunk(100)
    assert talk.projected_lengths() == [100]
    talk.chunk(100)  # past the bound: projected for this chunk only, nothing kept
    assert talk.projected_lengths() == [0]


def test_projected_child_is_identified() -> None:
    layers = make_layers(shared=True)
    full, shared = make_caches(layers)
    forward(layers, [full, shared], mx.random.normal((1, 20, HIDDEN)))
    assert [projected.is_projected_child(full, i) for i in range(4)] == [False, False, False, True]
    assert [projected.is_projected_child(shared, i) for i in range(2)] == [False, True]
    assert [projected.projected_slot(layer) for layer in layers] == [3, 1]
    # deepseek_v32 / glm_moe_dsa: the second child is indexer keys, not derived state
    latent_and_rope = KVCache()
    latent_and_rope.update_and_fetch(mx.zeros((1, 1, 4, 32)), mx.zeros((1, 1, 4, 8)))
    assert not projected.is_projected_child(CacheList(latent_and_rope, KVCache()), 1)
    batch = make_caches(make_layers(shared=False), LEFT_PADDING)[0]
    assert projected.is_projected_child(batch, 3)


# --- the choice of path ---------------------------------------------------------------------------


def test_path_rule() -> None:
    choose = dispatch.choose_path
    assert [choose(n, 20_000, on_gpu=True) for n in (1, 8)] == ["decode_loop"] * 2
    assert {choose(n, t, on_gpu=g) for n in (9, 128, 512) for t in (600, 20_000) for g in (0, 1)} == {
        "gathered"
    }
    assert choose(2048, 8192, on_gpu=True) == "unabsorbed"  # 2048 >= 0.2 * 8192
    assert choose(2048, 20_000, on_gpu=True) == "gathered"
    assert choose(2048, 20_000, missing=2048, on_gpu=True) == "unabsorbed"  # projection in sync
    assert choose(2048, 4096, on_gpu=False) == "gathered"


# --- the layer timer ------------------------------------------------------------------------------


@pytest.fixture
def flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "profile.flag"
    monkeypatch.setenv(profiler.ENV_FLAG, str(path))
    monkeypatch.setenv(profiler.ENV_LOG, str(tmp_path / "profile.jsonl"))
    return path


def patched_language() -> types.ModuleType:
    """glm5_next's language module with the overlay's edits, loaded beside the stock one."""
    from server_patch.overlay import verify_all

    name = "mlx_vlm.models.glm5_next.language"
    module = types.ModuleType(name + "_overlay_test")
    module.__package__ = "mlx_vlm.models.glm5_next"
    module.__file__ = stock_language.__file__
    exec(compile(verify_all()[name], stock_language.__file__, "exec"), module.__dict__)
    return module


def tiny_hybrid(language: types.ModuleType) -> Any:
    """linear, sparse (own indexer), linear, sparse (shared); dense MLP first, then MoE."""
    config = small_config(
        num_hidden_layers=4,
        layer_types=["linear_attention", "deepseek_sparse_attention"] * 2,
        indexer_types=["full", "full", "full", "shared"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        moe_intermediate_size=32,
        intermediate_size=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        vocab_size=300,
        linear_attn_config={"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4},
    )
    model = language.LanguageModel(config)
    model.eval()
    return model


def test_timer_does_nothing_without_flag(flag: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*args, **kwargs):
        raise AssertionError("the timer evaluated or timed something with its flag absent")

    monkeypatch.setattr(profiler.ForwardTimer, "__init__", no_work)
    monkeypatch.setattr(profiler.ForwardTimer, "lap", no_work)
    model = tiny_hybrid(patched_language())
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=model.make_cache()).logits)
    assert not flag.exists() and not profiler.log_path().exists()
    assert profiler.begin_forward(mx.zeros((1, 3, 4))) is None
    assert profiler.end_forward(mx.zeros(1)) is None


def test_timer_logs_per_kind_times_when_flagged(flag: Path) -> None:
    model = tiny_hybrid(patched_language())
    cache = model.make_cache()
    profiler.enable()
    mx.eval(model(mx.arange(1, 45)[None], cache=cache).logits)
    mx.eval(model(mx.array([[7]]), cache=cache).logits)
    profiler.disable()
    mx.eval(model(mx.array([[8]]), cache=cache).logits)
    records = profiler.read_records()
    assert [r["chunk"] for r in records] == [44, 1]
    for record in records:
        assert record["layers"] == {
            "sparse_attention": 2,
            "linear_attention": 2,
            "moe": 3,
            "dense_mlp": 1,
            "other": 2,
        }
        assert all(ms >= 0 for ms in record["ms"].values())
        assert record["total_ms"] == pytest.approx(sum(record["ms"].values()), abs=0.01)


def test_profile_command_switches_flag(flag: Path) -> None:
    from apcctl.cli import main

    runner = CliRunner()
    assert "off" in runner.invoke(main, ["profile", "layers", "status"]).output
    assert runner.invoke(main, ["profile", "layers", "on"]).exit_code == 0
    assert flag.exists() and profiler.is_enabled()
    assert "on" in runner.invoke(main, ["profile", "layers", "status"]).output
    assert runner.invoke(main, ["profile", "layers", "off"]).exit_code == 0
    assert not flag.exists()


def test_overlay_routes_attend_through_dispatcher() -> None:
    language = patched_language()
    cls = language.Glm5NextAttention
    assert "_stock_attend" in cls.__dict__
    layer = cls(small_config(), 0)
    layer.eval()
    seen: list[str] = []
    original = dispatch.stock_attend

    def spy(layer, *args, **kwargs):
        seen.append("stock")
        return original(layer, *args, **kwargs)

    cache = CacheList(KVCache(), KVCache(), PoolingCache(16), KVCache())
    x = mx.random.normal((1, 20, HIDDEN))
    try:
        dispatch.stock_attend = spy
        layer(x, None, cache)  # 20 tokens: gathered, no stock call
        layer(x[:, :1], None, cache)  # one token: stock's decode loop
    finally:
        dispatch.stock_attend = original
    assert seen == ["stock"]


# --- end to end on the tiny model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Any:
    from mlx_vlm import load

    model, _ = load(str(tiny_model_dir))
    return model


def greedy_conversation(model: Any, turns: list[list[int]], new_tokens: int = 12) -> list[list[int]]:
    """Each turn appends a user message to the same cache (a warm conversation)."""
    from mlx_vlm.generate.ar import generate_step

    cache = model.language_model.make_cache()
    history: list[int] = []
    replies = []
    for message in turns:
        history += message
        cached = max(c[0].offset for c in cache if isinstance(c, CacheList))
        reply = []
        for token, _ in generate_step(
            mx.array([history[cached:]]), model, None, None,
            max_tokens=new_tokens, temperature=0.0, prompt_cache=cache,
        ):
            reply.append(int(token))
        history += reply
        replies.append(reply)
    return replies


def test_warm_conversation_generates_the_same_tokens(tiny_model: Any, monkeypatch) -> None:
    paths: list[str] = []
    original = gathered.blocked_absorbed_attention
    monkeypatch.setattr(
        dispatch, "blocked_absorbed_attention",
        lambda *a, **k: paths.append("gathered") or original(*a, **k),
    )
    mx.random.seed(5)
    vocab = tiny_model.language_model.args.vocab_size
    turns = [mx.random.randint(10, vocab, (n,)).tolist() for n in (150, 45, 300, 20)]
    with attend_with(dispatch.stock_attend):
        stock = greedy_conversation(tiny_model, turns)
    assert not paths
    with attend_with(dispatch.attend):
        new = greedy_conversation(tiny_model, turns)
    assert paths  # the new path really ran (prefill chunks and warm turns)
    assert new == stock


@pytest.mark.server
def test_patched_server_replies_like_stock_and_profiles_on_request(tmp_path: Path,
                                                                   tiny_model_dir: Path) -> None:
    """Through the real server: same greedy replies as stock over a warm conversation (APC
    hits included), and one profile record per forward only while the flag file exists."""
    from tests.server_harness import PatchedServer

    model_dir = tiny_model_dir
    flag = tmp_path / "profile.flag"
    env = {"APC_PROFILE_FLAG": str(flag), "APC_PROFILE_LOG": str(tmp_path / "profile.jsonl")}
    transcripts = {}
    for lineage in ("0", "1"):
        with PatchedServer(model_dir, env={**env, "APC_LINEAGE": lineage}, log_dir=tmp_path) as server:
            messages = [
                {"role": "system", "content": "word " * 300},
                {"role": "user", "content": "hello there"},
            ]
            replies = []
            for turn in range(3):
                if lineage == "1" and turn == 2:
                    flag.touch()
                reply = server.chat(messages, max_tokens=6)
                content = reply["choices"][0]["message"]["content"]
                cached = (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                replies.append((content, bool(cached)))
                messages += [
                    {"role": "assistant", "content": content},
                    {"role": "user", "content": "tell me more about it " * (turn + 2)},
                ]
            flag.unlink(missing_ok=True)
            transcripts[lineage] = replies
    assert [text for text, _ in transcripts["1"]] == [text for text, _ in transcripts["0"]]
    assert all(hit for replies in transcripts.values() for _, hit in replies[1:])
    records = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert records and records[0]["chunk"] > 8  # the warm turn's suffix, then decode steps
    assert {"sparse_attention", "linear_attention", "moe"} <= set(records[0]["ms"])


def test_switched_off_runs_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "ENABLED", False)
    layers = make_layers(shared=True)
    stock = run_sequence(layers, 1, 150, 44, dispatch.stock_attend)
    new = run_sequence(layers, 1, 150, 44, dispatch.attend)
    for (old_out, _), (new_out, _) in zip(stock, new):
        assert mx.array_equal(old_out, new_out).item()


def test_model_proportions_overrule_the_measured_rule_only_when_far_off():
    """glm5_next's dimensions never switch; a latent far wider than its heads does, when cold."""
    from types import SimpleNamespace

    from server_patch.sparse.dispatch import ABSORBED_MAX_PENALTY, absorbed_penalty

    glm = SimpleNamespace(kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256)
    for length in (9, 44, 128, 512, 2048):
        for missing in (0, length, 20_000):
            assert absorbed_penalty(glm, 2063, length, missing) < ABSORBED_MAX_PENALTY
    wide = SimpleNamespace(kv_lora_rank=2048, qk_nope_head_dim=16, v_head_dim=16)  # the bench model
    assert absorbed_penalty(wide, 527, 2048, 2048) >= ABSORBED_MAX_PENALTY  # cold chunk, in sync
    assert absorbed_penalty(wide, 527, 22, 4096) < ABSORBED_MAX_PENALTY  # warm, projection stale
