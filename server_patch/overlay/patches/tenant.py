"""The tenant topic: mlx-vlm's app gets the request-namespace middleware, and its Responses
store is scoped by namespace. Edits only; what they call is ``server_patch.tenancy`` (the
middleware, ``tenancy.middleware.install``; the store, ``tenancy.responses``).

This module must not import mlx-vlm (topics load before the import hook).
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.server.app",
        Edit(
            name="tenant.namespace",
            old="app.add_middleware(\n    CORSMiddleware,\n",
            new=(
                "from server_patch.tenancy.middleware import install as _apc_tenant_install\n"
                "\n"
                "_apc_tenant_install(app)\n"
                "\n"
                "app.add_middleware(\n    CORSMiddleware,\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.responses_state",
        Edit(
            name="tenant.responses_store",
            old="response_store: Dict[str, StoredResponse] = {}\n",
            new=("from server_patch.tenancy.responses import NamespacedResponses as _ApcNamespacedResponses\n"
                 "\n"
                 "response_store: Dict[str, StoredResponse] = _ApcNamespacedResponses()\n"),
        ),
        Edit(
            name="tenant.responses_evict",
            old="            response_store.pop(old_id, None)\n",
            new="            response_store.evict(old_id)\n",
        ),
    ),
)
