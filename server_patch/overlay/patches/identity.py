"""Proof that the overlay is live: ``/health`` reports the patch version.

Harmless on purpose: it is how a test or an operator tells a patched server from a stock one.
The fields are ``server_patch.serving.app.health_fields``.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of


FILE_PATCHES = (
    patch_of(
        "mlx_vlm.server.app",
        Edit(
            name="identity.import",
            old='@app.get("/health")\nasync def health_check(request: Request):\n',
            new=(
                "from server_patch.serving.app import health_fields as _apc_health_fields\n"
                "\n\n"
                '@app.get("/health")\nasync def health_check(request: Request):\n'
            ),
        ),
        Edit(
            name="identity.health_field",
            old='        "apc_enabled": runtime["apc"]["enabled"],\n    }\n',
            new=(
                '        "apc_enabled": runtime["apc"]["enabled"],\n'
                "        **_apc_health_fields(),\n"
                "    }\n"
            ),
        ),
    ),
)
