"""The proxy's JSON (orjson, the standard library behind it): every body reads and writes as json did."""

import json
import math

import pytest

from harness_trainer import fastjson


def test_a_call_round_trips_exactly_floats_included():
    answer = {"prompt_token_ids": list(range(50_000)), "choices": [{"logprobs": {"content": [
        {"token": "token_id:7", "logprob": -0.1234567890123456789, "bytes": [120]},
        {"token": "token_id:8", "logprob": -1e-300, "bytes": []}]}, "message": {"content": "héllo ✓"}}]}
    assert json.loads(fastjson.dumps(answer)) == answer
    assert fastjson.loads(json.dumps(answer)) == answer
    assert fastjson.loads(json.dumps(answer).encode()) == answer


@pytest.mark.parametrize("body", [b'{"temperature": NaN}', b'{"x": Infinity}', b'{"text": "\\ud800 alone"}'])
def test_what_orjson_refuses_is_read_as_json_reads_it(body):
    got, want = fastjson.loads(body), json.loads(body)
    assert repr(got) == repr(want)  # repr: NaN != NaN
    assert not isinstance(got.get("temperature"), float) or math.isnan(got["temperature"])


@pytest.mark.parametrize("value", [{"text": "\ud800 alone"}, {"n": 2 ** 70}, {1: "an int key"}])
def test_what_orjson_cannot_write_is_written_as_json_writes_it(value):
    assert fastjson.dumps(value) == json.dumps(value, separators=(",", ":")).encode()


@pytest.mark.parametrize("body", [b"", b"{", b'{"a": }', b"\xff\xfe{}"])
def test_a_body_that_is_not_json_raises_what_json_raises(body):
    with pytest.raises((ValueError, UnicodeDecodeError)):
        fastjson.loads(body)


def test_prompt_ids_are_read_into_an_array_only_where_they_are_the_answers_own():
    from array import array

    ids = list(range(200_000))
    body = fastjson.dumps({"id": "x", "prompt_token_ids": ids, "choices": [{"token_ids": [1, 2]}]})
    answer, read, _ = fastjson.loads_ids(body)
    assert read == array("i", ids) and answer["prompt_token_ids"] is None
    assert answer["choices"][0]["token_ids"] == [1, 2]
    # inside a string, nested, spaced or not ids: read as usual, nothing lost
    for odd in ({"content": '"prompt_token_ids":[1]', "prompt_token_ids": [5]},
                {"choices": [{"prompt_token_ids": [1, 2]}]}, {"prompt_token_ids": [1, None]},
                {"prompt_token_ids": [1, 2 ** 40]}):
        answer, read, _ = fastjson.loads_ids(fastjson.dumps(odd))
        assert (answer, read) == (odd, None) or (read == array("i", odd["prompt_token_ids"])
                                                 and answer == dict(odd, prompt_token_ids=None))
    assert fastjson.loads_ids(b'{"prompt_token_ids": [1, 2]}') == ({"prompt_token_ids": [1, 2]}, None, None)


def test_a_prompt_that_repeats_the_last_one_reads_only_what_it_adds_and_nothing_else_passes_for_it():
    """The known text's ids are taken as they are only when the new text starts with that whole text; a prefix
    that ends mid-id, the same length with other ids, or a known text longer than the new one: read in full."""
    from array import array

    first = list(range(100, 70_100))
    _, ids, text = fastjson.loads_ids(fastjson.dumps({"prompt_token_ids": first}))
    taken = []
    known = fastjson.IdsText(*text, ids=lambda: taken.append(1) or ids)
    for later, reused in ((first + [7, 8, 9], True), (first, True), (first[:-1] + [70_098], False),
                          (first[:-1] + [700_990, 5], False), ([1] + first, False), (first[:-3], False),
                          ([9] * len(first), False)):
        taken.clear()
        answer, read, _ = fastjson.loads_ids(fastjson.dumps({"id": 1, "prompt_token_ids": later}), known)
        assert read == array("i", later) and answer == {"id": 1, "prompt_token_ids": None}
        assert bool(taken) == reused, later[-3:]
