"""The canary's one hook: the generation loop, finding no active request, calls the door's
``idle`` with the server's parts (whose canary runs on the open lineage runtime).

That is the only point where a forward may run outside a request: the same thread as every
request's forward, never concurrently with one (``server_patch/canary/runner.py``).
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.server.generation",
        Edit(
            name="canary.idle",
            old="                if not active or batch_gen is None:\n                    continue\n",
            new=(
                "                if not active or batch_gen is None:\n"
                "                    from server_patch.integration import hooks as _apc_door\n"
                "\n"
                "                    _apc_door.idle(runtime.apc_parts, self)\n"
                "                    continue\n"
            ),
        ),
    ),
)
