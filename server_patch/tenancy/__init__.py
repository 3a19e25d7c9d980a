"""Who a request is, cache-wise: inference API keys and the cache namespace of a request.

A shared prefix cache answers ``cached_tokens``, which tells a client how much of its prompt
someone sent before. That is only safe between clients that may see each other's prompts, so
the namespace a request's cache entries live in is derived from what separates users: the API
key it authenticated with, its tenant, and vLLM's per-request ``cache_salt``
(``server_patch.tenancy.namespace``). The middleware that applies it to every inference route is
``server_patch.tenancy.middleware`` (the overlay's ``tenant`` topic adds it to mlx-vlm's app);
docs/reliability.md has the threat model.
"""
