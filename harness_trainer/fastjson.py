"""JSON where it is heavy: orjson, 3-10x the standard library on what calls and traces carry (prompt token ids by
the ten thousand, a 400 KB conversation), with the standard library behind it for what orjson refuses and an
agent may still send (NaN, a lone surrogate escape): a body reads and writes as it did before, only faster.

Measured in docs/benchmarks.md: parsing the engine's answer was half of a 200 KB call through the proxy."""

from __future__ import annotations

import json
import struct
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


IDS_KEY = b'"prompt_token_ids":['
IDS_PIECE = 65536  # bytes of the id list parsed at once


def loads_ids(data: bytes) -> tuple[object, array | None]:
    """`loads(data)`, with an engine answer's top-level prompt ids read straight into an array (None: read as
    usual, the ids left in the object). Parsed whole, a prompt's ids are a list of int objects, ~36 bytes an id:
    a 240k-token prompt was 9 MB for each call in flight, the proxy's memory peak; read a piece at a time they
    cost their array's 4 bytes. The key is sought in the raw bytes (JSON escapes a quote inside a string, so a
    match is a key) and must turn out to be the top-level one, or the whole body is read as usual."""
    start = data.find(IDS_KEY)
    end = data.find(b"]", start) if start > 0 else -1
    if end < 0:
        return loads(data), None
    obj = loads(data[:start + len(IDS_KEY) - 1] + b"null" + data[end + 1:])
    if not isinstance(obj, dict) or "prompt_token_ids" not in obj or obj["prompt_token_ids"] is not None:
        return loads(data), None
    packed, span, at = [], data[start + len(IDS_KEY):end], 0
    try:  # each piece packed as C ints at once: 3x faster than array.extend, which converts one id at a time
        while at < len(span):
            cut = span.find(b",", at + IDS_PIECE)
            cut = len(span) if cut < 0 else cut
            piece = orjson.loads(b"[" + span[at:cut] + b"]")
            packed.append(struct.pack(f"{len(piece)}i", *piece))
            at = cut + 1
    except (orjson.JSONDecodeError, struct.error):  # not a list of ids: the object as it came
        return loads(data), None
    ids = array("i")
    ids.frombytes(b"".join(packed))
    return obj, ids
