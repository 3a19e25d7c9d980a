"""``APC_INFERENCE_MAX_BODY_BYTES`` and ``APC_INFERENCE_MAX_JSON_DEPTH``: the inference body caps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from server_patch.infra.guard import drain_bytes_for, limits_from_env

PREFIX = "APC_INFERENCE_"


@dataclass(frozen=True)
class IntakeLimits:
    """How big and how deep an inference request body may be.

    50 MiB is OpenAI's own cap on a request's payload (images included); 128 levels hold any
    real tool schema and stay far below the recursion limits of json, pydantic and Jinja.
    """

    max_body_bytes: int = 50 << 20
    max_json_depth: int = 128

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "IntakeLimits":
        return limits_from_env(cls, PREFIX, env)

    @property
    def drain_bytes(self) -> int:
        return drain_bytes_for(self.max_body_bytes)
