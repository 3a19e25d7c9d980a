"""A live correctness canary: while idle, the server proves its restores equal a cold prefill.

* ``points``: which restore points to check (an entry's head and checkpoints, anchors, files);
* ``check``: restore through ``CacheLayout.build`` (a request's path), prefill the same tokens
  cold, compare next-token logits (``compare``: tolerance by dtype);
* ``runner``: runs checks on the generation thread between loop turns, only while idle, and
  abandons them at the next chunk boundary when a request arrives; the optional schedule;
* ``book``: results, counters, suspect restore kinds (``APC_CANARY_ON_FAIL=cold``);
* ``metrics``: the Prometheus families; ``faults``: test-only corruption;
* ``service``: the book and the runner as one part (``Canary``), which the server's parts
  (``integration.parts``) build; the generation loop's idle hook reaches it through the door.

This package module imports none of its modules (so ``runner`` and the package never import
each other); a request's refusal is ``LineageRuntime.refuses``, over the runtime's canary.
"""
