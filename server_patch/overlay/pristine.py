"""The pristine mlx-vlm 0.7.10 files the overlay edits, pinned by sha256 (from the wheel's RECORD).

Every topic builds its ``FilePatch`` through ``patch_of``, so a file's hash is written once.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit, FilePatch

# module -> (path inside site-packages, sha256 of the pristine 0.7.10 file)
PRISTINE: dict[str, tuple[str, str]] = {
    "mlx_vlm.apc": (
        "mlx_vlm/apc.py", "cf9aa91ce3915558dfdcd2faf1afe8764d8a29f1caa31d2bd4f3e2b4d81d859b"),
    "mlx_vlm.generate.ar": (
        "mlx_vlm/generate/ar.py", "315787385813c879db31e7856b69b92123f8c7e7be06070d24587d3834f86b80"),
    "mlx_vlm.generate.dispatch": (
        "mlx_vlm/generate/dispatch.py", "1712d8f00f292d4b0bed6d313e025db5c81b7e8c03fb2946813e67d96ba1050d"),
    "mlx_vlm.server": (
        "mlx_vlm/server/__init__.py", "dc1ae2a78cf2fd68e6135c296c8cd4373f29b29341a56970401147d39c46f05a"),
    "mlx_vlm.server.app": (
        "mlx_vlm/server/app.py", "b5a37930a826db5c053c04bf5dfd084fa036adebbedb1f3be502f92359847c3a"),
    "mlx_vlm.server.anthropic": (
        "mlx_vlm/server/anthropic.py", "4a504691d054be87cf76ac4d77707c9cf96630bc006e5634be8bca48524a5f61"),
    "mlx_vlm.server.generation": (
        "mlx_vlm/server/generation.py", "248187bb4e405e9c89acad5d6d5e4adc4f9138e267f67f747ac32418d3c917e4"),
    "mlx_vlm.server.runtime": (
        "mlx_vlm/server/runtime.py", "de80f06d985f98270d7f5d16d2c4e41f1f8ecd69c15c9a819ec8e891ff1f83d2"),
    "mlx_vlm.server.request_normalization": (
        "mlx_vlm/server/request_normalization.py", "68df01a0bf7b53587ea63f2d9ccb0b4cb6d02003526d6a8a9f4469cc1d867bc0"),
    "mlx_vlm.utils": (
        "mlx_vlm/utils.py", "ed95bcfd1c4e8cb522c3c7f34d4aaa10f5e53bc69a45622606f80edfa2fd7cc7"),
    "mlx_vlm.server.realtime": (
        "mlx_vlm/server/realtime.py", "815998c835bd348649779ce480152c48cf8ff770ca53503f1a1c31649668b416"),
    "mlx_vlm.server.responses_state": (
        "mlx_vlm/server/responses_state.py", "27cbf1414b31d2c044c639d620b280539d0ba0411f0f6b6b2897c86c5e35ed18"),
    "mlx_vlm.server.openai": (
        "mlx_vlm/server/openai.py", "260c92eb24fdb54edd243b4687a150c587d23d1d36bd8eace783c688499c0ae1"),
    "mlx_vlm.speculative.mtp": (
        "mlx_vlm/speculative/mtp.py", "4ed467918bd24e26c60730d6d3529c6a9e633448b2fc6028829965bb1f4daad1"),
    "mlx_vlm.speculative.utils": (
        "mlx_vlm/speculative/utils.py", "15cfd7e3627659829e49769d522da66fac93174185a7128a0b1209ee819c39b2"),
    "mlx_vlm.models.cache": (
        "mlx_vlm/models/cache.py", "4c7526c6b17b97827cc810ea0e66bb3a364b4100d6aedf4878a1e15703a95031"),
    "mlx_vlm.models.glm5_next.language": (
        "mlx_vlm/models/glm5_next/language.py", "478b285c862e09a6c2c9289af702e5644f50445a2aea3a1c5de086455f1c0d9c"),
}


def patch_of(module: str, *edits: Edit) -> FilePatch:
    """A ``FilePatch`` of ``module``'s pinned pristine file."""
    relpath, sha256 = PRISTINE[module]
    return FilePatch(module=module, relpath=relpath, sha256=sha256, edits=tuple(edits))
