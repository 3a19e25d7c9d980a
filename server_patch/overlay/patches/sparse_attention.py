"""glm5_next sparse attention: the per-chunk path rule and the flag-file layer timer.

``Glm5NextAttention._attend`` delegates to ``server_patch.sparse.dispatch.attend``; the stock
method stays in the class as ``_stock_attend``, which the dispatcher calls for the paths it
keeps (chunks of <= 8 tokens, training). The text model calls the profiler's hooks around each
layer; they return at once unless ``begin_forward`` found the flag file.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of


_ATTEND_SIGNATURE = (
    "        self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only=False\n"
    "    ):\n"
)

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.models.glm5_next.language",
        Edit(
            name="sparse_attention.import_profiler",
            old="from .config import TextConfig\n",
            new=(
                "from .config import TextConfig\n"
                "from server_patch.sparse import profiler as _layer_profile\n"
            ),
        ),
        Edit(
            name="sparse_attention.delegate_attend",
            old="    def _attend(\n" + _ATTEND_SIGNATURE,
            new=(
                "    def _attend(self, *args, **kwargs):\n"
                "        from server_patch.sparse.dispatch import attend\n"
                "\n"
                "        return attend(self, *args, **kwargs)\n"
                "\n"
                "    def _stock_attend(\n" + _ATTEND_SIGNATURE
            ),
        ),
        Edit(
            name="sparse_attention.profile_attention",
            old=(
                "        return (\n"
                "            self.ffn_hc.apply_branch(x, self.post_attention_layernorm, self.mlp),\n"
            ),
            new=(
                "        _layer_profile.after_attention(self, x)\n"
                "        return (\n"
                "            self.ffn_hc.apply_branch(x, self.post_attention_layernorm, self.mlp),\n"
            ),
        ),
        Edit(
            name="sparse_attention.profile_begin",
            old="        h = mx.repeat(h[:, :, None], self.config.hc_mult, axis=2)\n",
            new=(
                "        h = mx.repeat(h[:, :, None], self.config.hc_mult, axis=2)\n"
                "        _layer_profile.begin_forward(h)\n"
            ),
        ),
        Edit(
            name="sparse_attention.profile_layers",
            old=(
                "                topk,\n"
                "            )\n"
                "        h = self.norm(h.mean(axis=2))\n"
            ),
            new=(
                "                topk,\n"
                "            )\n"
                "            _layer_profile.after_layer(layer, h)\n"
                "        h = self.norm(h.mean(axis=2))\n"
                "        _layer_profile.end_forward(h)\n"
            ),
        ),
    ),
)
