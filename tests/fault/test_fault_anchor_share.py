"""Issue 34 item 14: the anchor cap was shared across API keys by one LRU order, so one key
sending new system prompts pushed every other key's anchors out of RAM.

Now the anchor to leave is the least recently used one of the holder (API key, else namespace)
with the largest share (``lineage.anchor_share``). Over the real policy with sized handles, and
on the real server with two keys.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from server_patch.lineage import LineageCache, LineageConfig
from server_patch.tenancy.namespace import key_identity, namespace, share_holder
from tests.lineage.test_lineage_policy import Clock, serve, words
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)
from tests.server_harness import PatchedServer, text

KEY_A, KEY_B = namespace(key_identity(b"key-a"), None, None), namespace(key_identity(b"key-b"), None, None)


def _cache(**cfg) -> LineageCache:
    return LineageCache(LineageConfig(**cfg), clock=Clock())


def _anchors(cache: LineageCache) -> dict[str, int]:
    held: dict[str, int] = {}
    for entry in cache.entries():
        if entry.is_anchor:
            held[share_holder(entry.namespace)] = held.get(share_holder(entry.namespace), 0) + 1
    return held


@pytest.mark.usefixtures("checked_lineage")
def test_one_key_flooding_anchors_evicts_only_its_own() -> None:
    cache = _cache(anchor_max_entries=4, guard_tokens=16)
    serve(cache, words(300, 900) + words(20, 901), anchor_len=300, namespace=KEY_B)
    for i in range(10):  # key A: a new system prompt each time, under ever new tenants too
        tenant_ns = namespace(key_identity(b"key-a"), f"tenant-{i}", None)
        serve(cache, words(300, 910 + i) + words(20, 930 + i), anchor_len=300, namespace=tenant_ns)
    assert _anchors(cache) == {share_holder(KEY_B): 1, share_holder(KEY_A): 3}


@pytest.mark.usefixtures("checked_lineage")
def test_the_byte_cap_takes_from_the_largest_holder_and_one_holder_is_plain_lru() -> None:
    one = 300 * 100 + 1000  # an anchor's bytes with the policy tests' sized handles
    cache = _cache(anchor_max_bytes=3 * one, guard_tokens=16)
    serve(cache, words(300, 950) + words(20, 951), anchor_len=300, namespace=KEY_B)
    for i in range(5):
        serve(cache, words(300, 960 + i) + words(20, 970 + i), anchor_len=300, namespace=KEY_A)
    assert _anchors(cache) == {share_holder(KEY_B): 1, share_holder(KEY_A): 2}

    cache = _cache(anchor_max_entries=2, guard_tokens=16)
    made = [serve(cache, words(300, 980 + i) + words(20, 990 + i), anchor_len=300)[2] for i in range(3)]
    kept = sorted(e.tokens[:5].tolist() for e in cache.entries() if e.is_anchor)
    assert kept == sorted(m.tokens[:5].tolist() for m in made[1:])  # the oldest left


@pytest.mark.server
def test_a_keys_anchor_survives_another_key_flooding_the_cap(tiny_model_dir: Path, tmp_path: Path) -> None:
    keys = ("share-key-a-91f0", "share-key-b-0c3e")
    env = {"APC_API_KEYS": ",".join(keys), "APC_LINEAGE_ANCHOR_MAX_ENTRIES": "2"}

    def chat(server: PatchedServer, key: str, system: str, seed: int) -> dict:
        status, body = server.request("POST", "/v1/chat/completions", {
            "model": str(tiny_model_dir), "temperature": 0.0, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": text(30, seed)}]},
            headers={"Authorization": f"Bearer {key}"})
        assert status == 200, body
        return body

    def anchor_ids(server: PatchedServer) -> set[str]:
        status, body = server.admin("GET", "/entries?tier=ram")
        assert status == 200, body
        return {e["id"] for e in body["entries"] if e.get("is_anchor") or e.get("kind") == "anchor"}

    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        system_b = f"Key B's agent {uuid.uuid4().hex}. " + text(150, 700)
        chat(server, keys[1], system_b, 701)
        (b_anchor,) = anchor_ids(server)
        for i in range(4):
            chat(server, keys[0], f"Key A's agent {i} {uuid.uuid4().hex}. " + text(150, 710 + i), 720 + i)
        held = anchor_ids(server)
        assert b_anchor in held and len(held) == 2, (b_anchor, held)
        before = len(server.lineage_lines("restore"))
        chat(server, keys[1], system_b, 702)  # key B's next session restores its anchor from RAM
        line = server.lineage_lines("restore")[before]
        assert line["kind"] == "anchor", line
