"""The intake checks' hooks into mlx-vlm 0.7.10 (``server_patch/intake``); each edit only calls into it.

* server/app.py: the body guard and the client-gone watcher wrap the app (after the inference
  routes are mounted, so they sit outside mlx-vlm's CORS and the tenant middleware); ``/metrics``
  keeps its per-request records for the admin token.
* server/generation.py: every token iterator ``generate`` hands out is watched, so a request
  whose client is gone is cancelled at the next step.
* server/request_normalization.py: ``logit_bias`` is checked against the vocabulary (400).
* utils.py: ``load_image`` fetches through the media policy (every redirect hop) and opens only
  allowed local paths.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.server.app",
        Edit(
            name="intake.install",
            old="app.include_router(inference_router)\n\n\n# MLX_VLM API endpoints\n",
            new=(
                "app.include_router(inference_router)\n"
                "from server_patch.intake.app import install as _apc_intake_install\n"
                "\n"
                "_apc_intake_install(app)\n"
                "\n\n# MLX_VLM API endpoints\n"
            ),
        ),
        Edit(
            name="intake.metrics_view",
            old="    payload = runtime.metrics.snapshot()\n",
            new=(
                "    from server_patch.intake.metrics_view import metrics_view as _apc_metrics_view\n"
                "\n"
                "    payload = _apc_metrics_view(request, runtime.metrics.snapshot())\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.generation",
        Edit(
            name="intake.watch_client",
            old=(
                "        return ctx, _TokenIterator(\n"
                "            rqueue, ctx.uid, self._cancel, get_token_queue_timeout()\n"
                "        )\n"
            ),
            new=(
                "        from server_patch.intake.client_gone import watched as _apc_watched\n"
                "\n"
                "        return ctx, _apc_watched(_TokenIterator(\n"
                "            rqueue, ctx.uid, self._cancel, get_token_queue_timeout()\n"
                "        ))\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.request_normalization",
        Edit(
            name="intake.logit_bias",
            old=(
                "    if logit_bias is not None and isinstance(logit_bias, dict):\n"
                "        logit_bias = {int(k): v for k, v in logit_bias.items()}\n"
            ),
            new=(
                "    from server_patch.intake import logit_bias as _apc_logit_bias\n"
                "\n"
                "    logit_bias = _apc_logit_bias.checked(\n"
                "        logit_bias,\n"
                "        _apc_logit_bias.vocabulary_size(\n"
                "            processor, config if config is not None else runtime.model_cache.get(\"config\")\n"
                "        ),\n"
                "    )\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.utils",
        Edit(
            name="intake.load_image",
            old=(
                "                with requests.get(\n"
                "                    image_source, stream=True, timeout=timeout\n"
                "                ) as response:\n"
                "                    response.raise_for_status()\n"
                "                    image_source = BytesIO(response.content)\n"
                "\n"
                "            image = Image.open(image_source)\n"
            ),
            new=(
                "                from server_patch.intake import media as _apc_media\n"
                "\n"
                "                image_source = BytesIO(_apc_media.fetch(image_source, timeout))\n"
                "            elif isinstance(image_source, (str, Path)):\n"
                "                from server_patch.intake import media as _apc_media\n"
                "\n"
                "                _apc_media.check_local(image_source)\n"
                "\n"
                "            image = Image.open(image_source)\n"
            ),
        ),
    ),
)
