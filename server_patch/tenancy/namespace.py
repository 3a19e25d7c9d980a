"""The one function that names a request's cache namespace: (API key, tenant, cache salt).

mlx-vlm salts its cache keys (``extra_hash``) with the tenant string it reads from
``X-APC-Tenant``; two different strings never share an entry. So the namespace is handed to
mlx-vlm as that string. Without a key or a salt it is the tenant unchanged (stock behaviour);
with either, it is a JSON object of the three parts, so distinct triples give distinct strings
(no separator a tenant could contain can make two of them equal), and it holds digests, never
the key or the salt themselves: a namespace may show up in logs and admin views.
"""

from __future__ import annotations

import hashlib
import json

PREFIX = "apc-ns:"  # a plain tenant that starts like this is wrapped too, so it cannot pose as one


def digest(secret: str | bytes, purpose: str) -> str:
    """A 128-bit hex digest of ``secret``, separated by ``purpose`` (a key and an equal salt differ)."""
    data = secret.encode("utf-8") if isinstance(secret, str) else secret
    return hashlib.sha256(purpose.encode("ascii") + b"\0" + data).hexdigest()[:32]


def key_identity(key: bytes) -> str:
    """What names an API key in a namespace: its digest, never the key."""
    return digest(key, "apc-api-key")


def namespace(key_id: str | None, tenant: str | None, cache_salt: str | None) -> str | None:
    """The tenant string mlx-vlm salts the cache with; None leaves mlx-vlm's default tenant.

    ``key_id`` is :func:`key_identity` of the request's API key (None: no keys configured),
    ``tenant`` the tenant in force (header, ``user`` field or ``APC_DEFAULT_TENANT``), and
    ``cache_salt`` the request's own salt (vLLM's semantics: nothing is shared across salts).
    """
    if key_id is None and cache_salt is None and not (tenant or "").startswith(PREFIX):
        return tenant
    parts = {"key": key_id, "tenant": tenant,
             "salt": None if cache_salt is None else digest(cache_salt, "apc-cache-salt")}
    return PREFIX + json.dumps(parts, sort_keys=True, separators=(",", ":"))


def share_holder(name: str | None) -> str:
    """Who a namespace's share of the shared anchor caps belongs to (``lineage.anchor_share``): its
    API key when it has one (a key's tenants and salts are one holder), else the namespace."""
    if name and name.startswith(PREFIX):
        try:
            parts = json.loads(name[len(PREFIX):])
        except ValueError:
            return "namespace:" + name
        if isinstance(parts, dict) and isinstance(parts.get("key"), str):
            return "key:" + parts["key"]
    return "namespace:" + (name or "")
