"""An MTP drafter for a tiny ``glm5_next`` model, constructed to agree with its target.

mlx-vlm 0.7.10's ``glm5_next_mtp`` drafter (``--draft-model DIR --draft-kind mtp``) reads a
standalone checkpoint: ``config.json`` with ``model_type: glm5_next_mtp``, the target's
``text_config`` and ``block_size``, and ``model.safetensors`` under the drafter's own names
(``enorm``, ``hnorm``, ``eh_proj``, ``mtp_block.*``, ``shared_head_norm``), the layout
``Glm5NextMTPSplitter`` writes from a real checkpoint's layer 45. It proposes token ``t+2``
from the target's final hidden state at ``t`` and the embedding of token ``t+1``, through the
target's own embedding and ``lm_head``.

A random drafter almost never agrees with a random target, and a least-squares fit of one
reached ~20% on held-out positions (a linear map cannot follow six random layers), so
acceptance meant nothing. The tiny models are therefore built with a dominant path
(``weights.add_dominant_path``): the embedding of token ``x`` votes, in features no layer
writes, for its successor in a fixed cycle, and the lm_head reads that vote; the context
overrules it where its logits differ by more. This drafter is *constructed* to implement exactly
that path for token ``t+2`` from the embedding of token ``t+1``: ``eh_proj`` copies the
embedding's path features and nothing else (the target's hidden state is read and ignored), and
its decoder block is kept in the graph (its caches are real) with zero residual writers, so it
is the identity. Nothing is fitted; acceptance is how often the target follows its own path.
The stamp's ``fit_report`` says how often, measured on greedy generations of the target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

DRAFTER_DIR = "mtp"
DRAFTER_STAMP = ".apcctl-drafter.json"
DRAFTER_VERSION = "2"  # 2: constructed on the target's dominant path (1: ridge fit, ~0 acceptance)
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight")


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
    from apcctl.lab.tinymodel.fingerprint import weights_fingerprint

    try:
        stamp = json.loads((drafter_dir(model_dir) / DRAFTER_STAMP).read_text(encoding="utf-8"))
        target = weights_fingerprint(Path(model_dir))
    except (OSError, ValueError):
        return False
    return stamp.get("version") == DRAFTER_VERSION and stamp.get("target_fingerprint") == target


def path_eh_proj(hidden: int) -> np.ndarray:
    """``eh_proj`` (hidden x 2*hidden) that keeps the token embedding's dominant-path features
    and drops everything else, the target's hidden state included."""
    from apcctl.lab.tinymodel.weights import path_features

    eh_proj = np.zeros((hidden, 2 * hidden), dtype=np.float32)
    feats = np.arange(hidden)[path_features(hidden)]
    eh_proj[feats, feats] = 1.0
    return eh_proj


def drafted_tokens(tokens: np.ndarray, embed: np.ndarray, head: np.ndarray, eh_proj: np.ndarray,
                   eps: float) -> np.ndarray:
    """What the drafter proposes after each of ``tokens`` (its block is the identity): the
    argmax of ``lm_head(norm(eh_proj([enorm(embed(x)), .])))``. The hidden half of ``eh_proj``
    is zero, so the target's hidden state is not needed."""
    hidden = embed.shape[1]
    e = _rms(embed[tokens], eps)
    drafted: np.ndarray = np.argmax(_rms(e @ eh_proj[:, :hidden].T, eps) @ head.T, axis=-1)
    return drafted


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    normed: np.ndarray = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed


def greedy_generations(model_dir: Path, prompts: int, tokens: int, prompt_tokens: int = 16) -> np.ndarray:
    """Greedy continuations of corpus lines by the target, one batch: ``prompts`` rows of the
    prompt's last token followed by ``tokens`` generated ones."""
    import mlx.core as mx
    from mlx_vlm.utils import load_model
    from tokenizers import Tokenizer

    from apcctl.lab.tinymodel.corpus import training_corpus

    lm = load_model(Path(model_dir)).language_model
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    encoded = (tokenizer.encode(line).ids for line in training_corpus(8 * prompts))
    batch = [ids[:prompt_tokens] for ids in encoded if len(ids) >= prompt_tokens][:prompts]
    cache = lm.make_cache()
    logits = lm(mx.array(batch), cache=cache).logits[:, -1]
    seq = [mx.array(batch)[:, -1]]
    for _ in range(tokens):
        seq.append(mx.argmax(logits, axis=-1))
        logits = lm(seq[-1][:, None], cache=cache).logits[:, -1]
        mx.eval(logits)
    return np.array(mx.stack(seq, axis=1))


def agreement(model_dir: Path, eh_proj: np.ndarray, eps: float, prompts: int, tokens: int) -> dict[str, Any]:
    """How often the drafter's proposal equals the target's greedy token, over the target's own
    greedy generations (the first draft of every round faces exactly this)."""
    from safetensors.numpy import load_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    embed = weights["language_model.model.embed_tokens.weight"]
    head = weights["language_model.lm_head.weight"]
    seq = greedy_generations(model_dir, prompts, tokens)
    drafted = drafted_tokens(seq[:, :-1], embed, head, eh_proj, eps)
    return {"positions": int(drafted.size), "greedy_agreement": round(float(np.mean(drafted == seq[:, 1:])), 4),
            "corpus_prompts": prompts, "tokens_per_prompt": tokens}


def _drafter_weights(config: dict[str, Any], eh_proj: np.ndarray) -> dict[str, np.ndarray]:
    """Every drafter parameter under its MLX name: the constructed ``eh_proj``, norms at 1, the
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
    from safetensors.numpy import save_file

    from apcctl.lab.tinymodel.fingerprint import weights_fingerprint

    target_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config = drafter_config(target_config)
    text = config["text_config"]
    eh_proj = path_eh_proj(int(text["hidden_size"]))
    report = agreement(model_dir, eh_proj, float(text.get("rms_norm_eps", 1e-6)), prompts, tokens)
    save_file(_drafter_weights(config, eh_proj), str(tmp / "model.safetensors"), metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    stamp = {
        "version": DRAFTER_VERSION,
        "target_fingerprint": weights_fingerprint(model_dir),
        "construction": "dominant path of the target (apcctl.lab.tinymodel.weights.add_dominant_path); nothing fitted",
        "fit_report": report,
    }
    (tmp / DRAFTER_STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stamp


def build_drafter(model_dir: Path, prompts: int = 32, tokens: int = 32) -> Path:
    """Build (or reuse) the MTP drafter of the tiny model in ``model_dir``; return its path.

    Written in a temporary sibling and renamed into place, like the model itself."""
    model_dir = Path(model_dir)
    out = drafter_dir(model_dir)
    if is_drafter_built(model_dir):
        return out
    from apcctl.lab.tinymodel.build import replace_dir

    def write(tmp: Path) -> None:
        _write_drafter(tmp, model_dir, prompts, tokens)
        os.chmod(tmp, 0o755)

    return replace_dir(out, write)


def fit_report(model_dir: Path) -> dict[str, Any] | None:
    """How often the drafter agreed with the target's greedy tokens when it was built, or None
    when none is built."""
    try:
        stamp = json.loads((drafter_dir(model_dir) / DRAFTER_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stamp.get("fit_report")
