"""Benches that run real servers: they read the servers' JSON, never their logs.

* ``ttft``: warm-turn time to first token, the server's split of it and the bytes copied per
  turn, stock and patched (reply reuse on and off) side by side (``apcctl bench ttft``).
* ``ttft_forward``: its in-process half, the suffix forward alone over a restored cache, and
  the experiment that explains the stock/patched gap (``python -m apcctl.lab.bench.ttft_forward``).
* ``ttft_report``: the tables.

They work from an installed package: servers are started as ``python -m`` modules.
"""
