"""Build a random ``glm5_next`` model directory offline, deterministic by seed.

Why: the lineage cache must be exercised against the real mlx-vlm 0.7.10 model code
(KDA linear layers, DSA sparse attention with full and shared indexers, MoE,
hyper-connections) without downloading a checkpoint. The shapes are ``presets``; this module
puts config, tokenizer, chat template and weights together, stamps the directory with the
preset, seed and ``BUILDER_VERSION``, and writes it atomically.

Replies round-trip like a real GLM-4.5's (reply reuse, issue 13): the chat template is
GLM-4.5's structure (``template``), the tokenizer a WordPiece over a fixed word list
(``tokenizer``) and the output layer keeps the random model to tokens whose text re-encodes to
the same ids (``weights.keep_to_tokens``), so a reply re-sent as ``content`` re-renders as the
sampled ids.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from apcctl.lab.tinymodel.config import make_config
from apcctl.lab.tinymodel.fingerprint import weights_fingerprint
from apcctl.lab.tinymodel.presets import PRESETS
from apcctl.lab.tinymodel.template import CHAT_TEMPLATE
from apcctl.lab.tinymodel.tokenizer import build_tokenizer
from apcctl.lab.tinymodel.vocab import CONTROL_TOKENS, MARKUP_TOKENS, generatable, vocabulary
from apcctl.lab.tinymodel.weights import add_dominant_path, init_weights, keep_to_tokens

# 2: WordPiece tokenizer, GLM-4.5 template, no special tokens sampled, 0.1 writers; 3: dominant
# path in tiny and bench; 4: the path only in tiny-spec and bench-spec (tiny and bench weigh as in 2,
# but a version-3 build of them has the path, so the stamp moves on and such a build is rebuilt).
BUILDER_VERSION = "4"
STAMP_FILE = ".apcctl-build.json"
WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json")


def _tokenizer_config(chat_template: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "remove_space": False,
        "chat_template": chat_template,
    }


def _processor_config() -> dict[str, Any]:
    image = {
        "image_processor_type": "Glm5NextImageProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_image_tokens": 4,
        "max_image_tokens": 256,
    }
    return {"image_processor": image, "video_processor": dict(image)}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _stamp(preset: str, seed: int) -> dict[str, Any]:
    return {"builder_version": BUILDER_VERSION, "preset": preset, "seed": seed}


def is_built(out_dir: Path, preset: str = "tiny", seed: int = 0) -> bool:
    """True when ``out_dir`` holds a complete build of exactly this preset and seed."""
    try:
        stamp = json.loads((out_dir / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if {k: stamp.get(k) for k in ("builder_version", "preset", "seed")} != _stamp(preset, seed):
        return False
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def _write_model(tmp: Path, preset_name: str, seed: int) -> None:
    from safetensors.numpy import save_file

    preset = PRESETS[preset_name]
    tokenizer = build_tokenizer()
    token_ids = {t: tokenizer.token_to_id(t) for t in CONTROL_TOKENS + MARKUP_TOKENS}
    config = make_config(preset, token_ids, tokenizer.get_vocab_size())
    weights = init_weights(config, seed)
    allowed = np.array([generatable(t) for t in vocabulary()])
    keep_to_tokens(weights, allowed)
    add_dominant_path(weights, allowed, config["eos_token_id"], seed, preset.path_gain)

    tokenizer.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", _tokenizer_config(CHAT_TEMPLATE))
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "processor_config.json", _processor_config())
    _write_json(
        tmp / "generation_config.json",
        {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]},
    )
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "mlx"})
    stamp = _stamp(preset_name, seed) | {
        "fingerprint": weights_fingerprint(tmp),
        "preset_values": asdict(preset),
    }
    _write_json(tmp / STAMP_FILE, stamp)


def _make_readable(directory: Path) -> None:
    """mkdtemp makes the directory private; a model directory should read like any other."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)


def build_model(out_dir: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Build (or reuse) a random glm5_next model directory and return its path.

    Reuses ``out_dir`` when its build stamp matches preset, seed and builder version. A
    stale build of ours is replaced; a non-empty directory that is not ours is refused,
    so a typo cannot wipe unrelated files. The build happens in a sibling temporary
    directory and is renamed into place, so a crash never leaves a half-built model.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir = Path(out_dir)
    if is_built(out_dir, preset, seed):
        return out_dir
    if out_dir.exists():
        ours = (out_dir / STAMP_FILE).is_file()
        if not ours and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise FileExistsError(f"{out_dir} exists and is not a model built by apcctl")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        _write_model(tmp, preset, seed)
        _make_readable(tmp)

    return replace_dir(out_dir, write)


def replace_dir(out_dir: Path, write: Callable[[Path], object]) -> Path:
    """``write`` a directory in a temporary sibling of ``out_dir``, then rename it into place
    (replacing what was there): a crash never leaves a half-written directory."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
