"""The sha256 a model directory's persistent cache is keyed by."""

from __future__ import annotations

import hashlib
from pathlib import Path


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and every weight file (name and bytes), in name order.

    This is what a persistent cache must be keyed by: stock mlx-vlm keys its disk tier by
    model path only, so a rebuilt model at the same path would otherwise reuse stale state.
    """
    model_dir = Path(model_dir)
    files = [model_dir / "config.json"] + sorted(model_dir.glob("*.safetensors"))
    if not files[0].is_file() or len(files) == 1:
        raise FileNotFoundError(f"{model_dir} has no config.json or no *.safetensors")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
