"""The one environment parser behind every settings class."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from server_patch.envconfig import env_values, parse_bytes


@dataclass(frozen=True)
class Knobs:
    on: bool = True
    count: int = 3
    ratio: float = 0.5
    order: tuple[str, ...] = ("a", "b")
    budget_bytes: int = 1 << 30


NAMES = {"on": "X_ON", "count": "X_COUNT", "ratio": "X_RATIO", "order": "X_ORDER",
         "budget_bytes": "X_BUDGET_BYTES"}


def test_values_are_parsed_by_the_type_of_the_default():
    env = {"X_ON": "off", "X_COUNT": "7", "X_RATIO": "0.25", "X_ORDER": "c, d", "X_BUDGET_BYTES": "2G",
           "UNRELATED": "x"}
    assert env_values(Knobs, NAMES, env) == {"on": False, "count": 7, "ratio": 0.25,
                                             "order": ("c", "d"), "budget_bytes": 2 << 30}
    assert env_values(Knobs, NAMES, {"X_COUNT": " "}) == {}


@pytest.mark.parametrize("key,raw,message", [("X_ON", "maybe", "boolean"), ("X_COUNT", "1.5", "integer"),
                                             ("X_RATIO", "half", "number"), ("X_BUDGET_BYTES", "lots", "size")])
def test_bad_values_name_the_variable(key, raw, message):
    with pytest.raises(ValueError, match=f"{key}.*{message}"):
        env_values(Knobs, NAMES, {key: raw})


def test_sizes():
    assert parse_bytes("K", "512M") == 512 << 20 and parse_bytes("K", "1.5G") == 3 << 29
    assert parse_bytes("K", "4096") == 4096 and parse_bytes("K", "1TB") == 1 << 40
