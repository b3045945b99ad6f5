"""JSON where it is heavy: orjson, 3-10x the standard library on what calls and traces carry (prompt token ids by
the ten thousand, a 400 KB conversation), with the standard library behind it for what orjson refuses and an
agent may still send (NaN, a lone surrogate escape): a body reads and writes as it did before, only faster.

Measured in docs/benchmarks.md: parsing the engine's answer was half of a 200 KB call through the proxy."""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class IdsText:
    """An answer's prompt ids as the engine wrote them: the text's length and hash, and how to get its ids back.
    A session's next prompt repeats its last one and adds to it; an answer whose id text starts with this one
    reads only what follows (2 ms less per call at 51k ids, a 200 KB conversation). The hash is the
    interpreter's keyed one (random per process), so an agent that steers its prompt cannot forge a match."""
    size: int
    digest: int
    ids: Callable[[], Sequence[int]]


def loads_ids(data: bytes, known: IdsText | None = None) -> tuple[object, array | None, tuple[int, int] | None]:
    """`loads(data)`, with an engine answer's top-level prompt ids read straight into an array (None: read as
    usual, the ids left in the object), and their text's (size, digest) for the next answer's `known`.

    Parsed whole, a prompt's ids are a list of int objects, ~36 bytes an id: a 240k-token prompt was 9 MB for
    each call in flight, the proxy's memory peak; read a piece at a time they cost their array's 4 bytes. The
    key is sought in the raw bytes (JSON escapes a quote inside a string, so a match is a key) and must turn
    out to be the top-level one, or the whole body is read as usual."""
    start = data.find(IDS_KEY)
    end = data.find(b"]", start) if start > 0 else -1
    if end < 0:
        return loads(data), None, None
    obj = loads(data[:start + len(IDS_KEY) - 1] + b"null" + data[end + 1:])
    if not isinstance(obj, dict) or "prompt_token_ids" not in obj or obj["prompt_token_ids"] is not None:
        return loads(data), None, None
    span = data[start + len(IDS_KEY):end]
    head, at = _known_head(span, known)
    packed = []
    try:  # each piece packed as C ints at once: 3x faster than array.extend, which converts one id at a time
        while at < len(span):
            cut = span.find(b",", at + IDS_PIECE)
            cut = len(span) if cut < 0 else cut
            piece = orjson.loads(b"[" + span[at:cut] + b"]")
            packed.append(struct.pack(f"{len(piece)}i", *piece))
            at = cut + 1
    except (orjson.JSONDecodeError, struct.error):  # not a list of ids: the object as it came
        return loads(data), None, None
    ids = array("i") if head is None else array("i", head)  # a copy (a memcpy): the known ids stay as they are
    ids.frombytes(b"".join(packed))
    return obj, ids, (len(span), known.digest if head is not None and at > len(span) else hash(span))


def _known_head(span: bytes, known: IdsText | None) -> tuple[array | None, int]:
    """The ids `span` starts with when it begins with `known`'s whole text (then a comma or its end), and where
    the rest begins; (None, 0) otherwise: read it all."""
    if known is None or not 0 < known.size <= len(span) or span[known.size:known.size + 1] not in (b"", b","):
        return None, 0
    if hash(span[:known.size]) != known.digest:
        return None, 0
    head = known.ids()
    return (head, known.size + 1) if isinstance(head, array) and head.typecode == "i" else (None, 0)
