"""An MTP drafter for a tiny ``glm5_next`` model, fitted to its target in seconds.

mlx-vlm 0.7.10's ``glm5_next_mtp`` drafter (``--draft-model DIR --draft-kind mtp``) reads a
standalone checkpoint: ``config.json`` with ``model_type: glm5_next_mtp``, the target's
``text_config`` and ``block_size``, and ``model.safetensors`` under the drafter's own names
(``enorm``, ``hnorm``, ``eh_proj``, ``mtp_block.*``, ``shared_head_norm``), the layout
``Glm5NextMTPSplitter`` writes from a real checkpoint's layer 45. It proposes token ``t+2``
from the target's final hidden state at ``t`` and the embedding of token ``t+1``, through the
target's own embedding and ``lm_head``.

A random drafter would almost never agree with a random target, so acceptance would mean
nothing. This one is fitted, honestly and cheaply: the target generates greedily from the
bundled corpus, and ``eh_proj`` is the ridge least-squares map from ``[enorm(embed(x_t+1)),
hnorm(h_t)]`` to the target's next hidden state ``h_t+1`` (what its ``lm_head`` reads). The
drafter's decoder block is kept in the graph (its caches are real) but its residual writers
are zero, so the block is the identity and the linear fit alone drafts. ``fit_report`` in the
stamp says how often the fitted drafter's greedy token equals the target's on held-out
positions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

DRAFTER_DIR = "mtp"
DRAFTER_STAMP = ".apcctl-drafter.json"
DRAFTER_VERSION = "1"
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight")
_RIDGE = 1e-3


def drafter_dir(model_dir: Path) -> Path:
    """Where ``build_drafter`` puts the drafter of ``model_dir``: a subdirectory, so the
    target's own weight files (and its fingerprint) are untouched."""
    return Path(model_dir) / DRAFTER_DIR


def drafter_config(target_config: dict[str, Any]) -> dict[str, Any]:
    """The standalone ``glm5_next_mtp`` config for a target's ``config.json``."""
    text = dict(target_config.get("text_config") or target_config)
    text.setdefault("num_nextn_predict_layers", 1)
    return {
        "model_type": "glm5_next_mtp",
        "text_config": text,
        "block_size": int(text["num_nextn_predict_layers"]) + 1,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
    }


def is_drafter_built(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a drafter built by this version for its current weights."""
    from apcctl.tinymodel.fingerprint import weights_fingerprint

    try:
        stamp = json.loads((drafter_dir(model_dir) / DRAFTER_STAMP).read_text(encoding="utf-8"))
        target = weights_fingerprint(Path(model_dir))
    except (OSError, ValueError):
        return False
    return stamp.get("version") == DRAFTER_VERSION and stamp.get("target_fingerprint") == target


def _target_hidden_pairs(model_dir: Path, prompts: int, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy generations of the target from corpus prompts: per position, the next token's
    embedding, this position's final hidden state, and the next position's hidden state."""
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    from apcctl.tinymodel.corpus import training_corpus
    from tokenizers import Tokenizer

    model = load_model(Path(model_dir))
    lm = model.language_model
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    embeds, hiddens, nexts = [], [], []
    for line in training_corpus(prompts):
        ids = tokenizer.encode(line).ids[:48]
        cache = lm.make_cache()
        out = lm(mx.array([ids]), cache=cache, return_hidden=True)
        seq_hidden = [out.hidden_states[-1][0]]
        seq = list(ids)
        token = int(mx.argmax(out.logits[0, -1]).item())
        for _ in range(tokens):
            seq.append(token)
            out = lm(mx.array([[token]]), cache=cache, return_hidden=True)
            seq_hidden.append(out.hidden_states[-1][0])
            token = int(mx.argmax(out.logits[0, -1]).item())
        hidden = np.array(mx.concatenate(seq_hidden, axis=0))  # one row per token of seq
        emb = np.array(lm.model.embed_tokens(mx.array(seq)))
        embeds.append(emb[1:])  # embedding of x_{t+1}
        hiddens.append(hidden[:-1])  # h_t
        nexts.append(hidden[1:])  # h_{t+1}
    return np.concatenate(embeds), np.concatenate(hiddens), np.concatenate(nexts)


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def fit_eh_proj(embed: np.ndarray, hidden: np.ndarray, target: np.ndarray, eps: float) -> np.ndarray:
    """Ridge least squares for ``eh_proj`` (out x 2*hidden), inputs normalised as the drafter's
    ``enorm``/``hnorm`` (weight 1) normalise them."""
    features = np.concatenate([_rms(embed, eps), _rms(hidden, eps)], axis=1).astype(np.float64)
    gram = features.T @ features + _RIDGE * len(features) * np.eye(features.shape[1])
    solution = np.linalg.solve(gram, features.T @ target.astype(np.float64))
    return solution.T.astype(np.float32)


def _agreement(weights_eh: np.ndarray, embed, hidden, target, head: np.ndarray, eps: float) -> float:
    """Share of positions where the drafter's greedy token equals the target's."""
    features = np.concatenate([_rms(embed, eps), _rms(hidden, eps)], axis=1)
    drafted = _rms(features @ weights_eh.T, eps) @ head.T
    return float(np.mean(np.argmax(drafted, axis=1) == np.argmax(target @ head.T, axis=1)))


def _drafter_weights(config: dict[str, Any], eh_proj: np.ndarray) -> dict[str, np.ndarray]:
    """Every drafter parameter under its MLX name: the fitted ``eh_proj``, norms at 1, the
    decoder block random (so its caches fill with real values) with zero residual writers."""
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.glm5_next_mtp import Model, ModelConfig

    drafter = Model(ModelConfig.from_dict(json.loads(json.dumps(config))))
    rng = np.random.RandomState(7)
    weights = {}
    for name, param in sorted(tree_flatten(drafter.parameters())):
        shape = tuple(param.shape)
        leaf = name.rsplit(".", 1)[-1]
        if name == "eh_proj.weight":
            value = eh_proj
        elif name.endswith(_RESIDUAL_WRITERS):
            value = np.zeros(shape)
        elif len(shape) >= 2:
            value = rng.normal(0.0, 0.02, size=shape)
        elif leaf in ("weight", "scale"):
            value = np.ones(shape)
        else:
            value = np.zeros(shape)
        weights[name] = np.asarray(value, dtype=np.float32)
    return weights


def _write_drafter(tmp: Path, model_dir: Path, prompts: int, tokens: int) -> dict[str, Any]:
    from safetensors.numpy import load_file, save_file

    from apcctl.tinymodel.fingerprint import weights_fingerprint

    target_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config = drafter_config(target_config)
    eps = float(config["text_config"].get("rms_norm_eps", 1e-6))
    embed, hidden, target = _target_hidden_pairs(model_dir, prompts, tokens)
    held_out = max(1, len(embed) // 5)
    eh_proj = fit_eh_proj(embed[:-held_out], hidden[:-held_out], target[:-held_out], eps)
    head = load_file(str(model_dir / "model.safetensors"))["language_model.lm_head.weight"]
    agreement = _agreement(eh_proj, embed[-held_out:], hidden[-held_out:], target[-held_out:], head, eps)
    save_file(_drafter_weights(config, eh_proj), str(tmp / "model.safetensors"), metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    stamp = {
        "version": DRAFTER_VERSION,
        "target_fingerprint": weights_fingerprint(model_dir),
        "fit_report": {"positions": int(len(embed) - held_out), "held_out": int(held_out),
                       "greedy_agreement": round(agreement, 4)},
    }
    (tmp / DRAFTER_STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stamp


def build_drafter(model_dir: Path, prompts: int = 24, tokens: int = 32) -> Path:
    """Build (or reuse) the MTP drafter of the tiny model in ``model_dir``; return its path.

    Written in a temporary sibling and renamed into place, like the model itself."""
    model_dir = Path(model_dir)
    out = drafter_dir(model_dir)
    if is_drafter_built(model_dir):
        return out
    from apcctl.tinymodel.build import replace_dir

    def write(tmp: Path) -> None:
        _write_drafter(tmp, model_dir, prompts, tokens)
        os.chmod(tmp, 0o755)

    return replace_dir(out, write)


def fit_report(model_dir: Path) -> dict[str, Any] | None:
    """The drafter's fit report (held-out greedy agreement), or None when none is built."""
    try:
        stamp = json.loads((drafter_dir(model_dir) / DRAFTER_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stamp.get("fit_report")
