"""Copy-free admission and commit: a warm turn copies the KV once, into the batch layout.

* ``merge``: the batch merge is the one copy, and it leaves room for the suffix (and a decode
  reserve), so the first forward never regrows the cache by concatenation;
* ``server_patch.state.rows``: at the prefill end of a request that is alone in its batch the
  entry is *deferred*: the coordinator keeps the snapshot layers (references) and adopts the
  request's own KV buffer, truncated, when the request stops writing it (it ends, or joins a
  multi-row batch, which concatenates into new buffers); otherwise it copies the row once;
* ``pool``: MLX's buffer pool is kept between prefill chunks and prompt batches (the clears
  are opt-in, ``APC_POOL_CLEAR=1``), bounded by ``mx.set_cache_limit`` and an idle release;
* ``counter``: a debug copy counter (``APC_COPY_COUNTER=1``) that counts the bytes every
  cache copy moves, including the implicit copy-on-write of a shared buffer.

Settings live in ``settings``; the patched mlx-vlm files reach this package through the one door,
``server_patch.integration.hooks``.
"""
