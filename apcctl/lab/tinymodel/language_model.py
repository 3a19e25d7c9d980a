"""A family's language model built from its config as mlx-vlm's ``load_model`` builds it.

Shared by the tiny models (``families.build_language_model``, seeded weights) and the model
check (``apcctl.lab.model_check``, placeholder weights); it lives here, below both, so the tiny
models never import the check.
"""

from __future__ import annotations

from typing import Any


def language_model_from_config(module: Any, config: dict[str, Any]) -> Any:
    """``Model(config).language_model`` as ``load_model`` builds it (parameters lazy, random).

    A vision family whose vision config has no defaults (a text-only config of a VLM) gets its
    language model class built from the text config alone: the vision tower holds no cache."""
    import inspect

    from mlx_vlm.utils import update_module_configs

    from server_patch.state.families import language_model_class

    config.setdefault("text_config", config.pop("llm_config", {}))
    config.setdefault("vision_config", {})
    config.setdefault("audio_config", {})
    try:
        model_config = module.ModelConfig.from_dict(config)
        model_config = update_module_configs(model_config, module, config,
                                             ["text", "vision", "perceiver", "projector", "audio"])
        return module.Model(model_config).language_model
    except TypeError:
        if not config["text_config"] or not hasattr(module, "TextConfig"):
            raise
    cls = language_model_class(module)
    text_config = module.TextConfig.from_dict(config["text_config"])
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    required = [p for p in params if p.default is inspect.Parameter.empty]
    return cls(text_config) if len(required) <= 1 else cls(text_config, None)
