"""JSON where it is heavy: orjson, 3-10x the standard library on what calls and traces carry (prompt token ids by
the ten thousand, a 400 KB conversation), with the standard library behind it for what orjson refuses and an
agent may still send (NaN, a lone surrogate escape): a body reads and writes as it did before, only faster.

Measured in docs/benchmarks.md: parsing the engine's answer was half of a 200 KB call through the proxy."""

from __future__ import annotations

import json
from array import array

import orjson


def loads(data: bytes | str):
    """Raises ValueError (json.JSONDecodeError) or UnicodeDecodeError, as json.loads does."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(value) -> bytes:
    """Compact UTF-8 JSON; an array (a call's ids and logprobs, session.py) is written as a list."""
    try:
        return orjson.dumps(value, default=_plain)
    except TypeError:  # a str with a lone surrogate, an int past 64 bits, a key that is not a str
        return json.dumps(value, separators=(",", ":"), default=_plain).encode()


def _plain(value):
    if isinstance(value, array):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
