"""The disk tier is keyed by every byte of the weight files, so the runtime must know them.

mlx-vlm records where it loaded a model from on the top-level model only (``model.model_path``),
while the lineage runtime is built from the language model the batch generator holds. One edit
in ``mlx_vlm.utils.load_model`` hands the same path to the language model as
``_apc_model_path``, which ``server_patch.integration.coordinator`` passes to the runtime.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

ATTRIBUTE = "_apc_model_path"

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.utils",
        Edit(
            name="weights_path.language_model",
            old="    model.model_path = model_path\n    model.eval()\n    return model\n",
            new=(
                "    model.model_path = model_path\n"
                "    if getattr(model, \"language_model\", None) is not None:\n"
                f"        model.language_model.{ATTRIBUTE} = model_path\n"
                "    model.eval()\n    return model\n"
            ),
        ),
    ),
)
