"""Codec: exact round trip of every message (property-based) and hostile input -> only CodecError."""

from __future__ import annotations

import dataclasses
import types
import typing

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import codec
from common import messages as m
from common.codec import CodecError, decode, decode_list, encode, encode_list

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _strategy(tp) -> st.SearchStrategy:
    """A hypothesis strategy for a message field type, derived from the dataclass annotations."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, dtype = typing.get_args(tp)[:2]
        if np.dtype(dtype) == np.int32:
            return st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20).map(m.int32_array)
        return st.lists(st.floats(width=32, allow_nan=True), max_size=20).map(m.float32_array)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return st.none() | _strategy(inner)
    if origin is list:
        return st.lists(_strategy(typing.get_args(tp)[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), _strategy(typing.get_args(tp)[1]), max_size=3)
    if tp is int:
        return st.integers(-(2**63), 2**63 - 1)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is str:
        return st.text(max_size=20)
    if tp is bool:
        return st.booleans()
    if dataclasses.is_dataclass(tp):
        return _message(tp)
    raise TypeError(tp)


def _message(cls) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: st.deferred(lambda t=hints[f.name]: _strategy(t)) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


def _same(a, b) -> bool:
    """Field-wise equality with bit-exact arrays (NaN payloads included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


ANY_MESSAGE = st.one_of(*[_message(c) for c in m.MESSAGE_TYPES])


@FAST
@given(ANY_MESSAGE)
def test_every_message_round_trips_exactly(msg):
    assert _same(decode(encode(msg), type(msg)), msg)


@FAST
@given(st.lists(_message(m.Rollout), max_size=4))
def test_lists_round_trip(rollouts):
    assert _same(decode_list(encode_list(rollouts, m.Rollout), m.Rollout), rollouts)


def _rollout(n=5) -> m.Rollout:
    return m.Rollout(m.int32_array(range(n)), m.float32_array(np.linspace(-1, 0, n)), 1.0, True, 0.5, 3, "stop")


def test_arrays_travel_as_compact_bytes():
    payload = encode(_rollout(1000))
    assert len(payload) < 8 * 1000 + 200  # 4 bytes per token id + 4 per log-prob + small header


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_codec_error(data):
    for cls in (None, m.Rollout, m.TrainingBatch):
        try:
            decode(data, cls)
        except CodecError:
            pass
    try:
        decode_list(data, m.ScoredGroup)
    except CodecError:
        pass


@FAST
@given(st.data())
def test_truncated_and_bit_flipped_payloads_raise_only_codec_error(data):
    payload = encode(m.ScoredGroup("l", "q", [_rollout(), _rollout(3)], "g", 1))
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(CodecError):
        decode(payload[:cut], m.ScoredGroup)
    flipped = bytearray(payload)
    pos = data.draw(st.integers(0, len(payload) - 1))
    flipped[pos] ^= data.draw(st.integers(1, 255))
    try:
        decoded = decode(bytes(flipped))
    except CodecError:
        return
    assert type(decoded) in m.MESSAGE_TYPES  # a flip inside a value may still decode to a valid message


def _packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    "payload, match",
    [
        (_packed([m.SCHEMA_VERSION + 1, "Question", []]), f"schema version {m.SCHEMA_VERSION + 1} is not supported"),
        (_packed(["1", "Question", []]), "schema version is not an integer"),
        (_packed([m.SCHEMA_VERSION, "Popen", []]), "unknown message type 'Popen'"),
        (_packed([m.SCHEMA_VERSION, 7, []]), "type name is not a string"),
        (_packed({"a": 1}), r"expected \[version, type, body\]"),
        (_packed([m.SCHEMA_VERSION, "Question", ["id", "p", "a"]]), "Question has 5 fields, payload has 3"),
        (_packed([m.SCHEMA_VERSION, "Question", ["id", "p", "a", [1, 2], ""]]), "prompt_ids: expected a int32 array"),
        (_packed([m.SCHEMA_VERSION, "Question", [1, "p", "a", msgpack.ExtType(1, b""), ""]]), "id: expected str"),
        (_packed([m.SCHEMA_VERSION, "Question", ["i", "p", "a", msgpack.ExtType(1, b"abc"), ""]]),
         "byte length 3 is not a multiple of 4"),
        (_packed([m.SCHEMA_VERSION, "Question", ["i", "p", "a", msgpack.ExtType(2, b""), ""]]), "expected a int32"),
        (_packed([m.SCHEMA_VERSION, "TrainingBatch", [[], 1, {1: 2.0}]]), "map key"),
        (_packed([m.SCHEMA_VERSION, "TrainingBatch", [[], 1, {"a": "x"}]]), "expected float, got str"),
        (b"\xc1", "malformed payload"),
        (b"", "malformed payload"),
        (_packed([1, "Question", []]) + b"\x00", "malformed payload"),
    ],
)
def test_hostile_payloads_say_what_is_wrong(payload, match):
    with pytest.raises(CodecError, match=match):
        decode(payload)


def test_wrong_expected_type_is_refused():
    with pytest.raises(CodecError, match="expected a Rollout, got a Question"):
        decode(encode(m.Question("q", "p", "a", m.int32_array([1]))), m.Rollout)
    with pytest.raises(CodecError, match="expected a list of Rollout"):
        decode_list(encode(_rollout()), m.Rollout)


def test_nested_bombs_raise_codec_error():
    deep = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    with pytest.raises(CodecError):
        decode(deep)
    huge_claim = b"\x93\x01\xa8Question\xdd\xff\xff\xff\xff"  # array header claiming 4G elements, no data
    with pytest.raises(CodecError):
        decode(huge_claim)
    nested_map = _packed([m.SCHEMA_VERSION, "TrainingBatch", [[], 1, {"a": {"b": {"c": 1.0}}}]])
    with pytest.raises(CodecError):
        decode(nested_map)


def test_non_bytes_and_unencodable_values():
    with pytest.raises(CodecError, match="expected bytes"):
        decode("not bytes")  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="not a message type"):
        encode(object())
    with pytest.raises(CodecError, match="token ids do not fit int32"):
        encode(m.Rollout(np.array([1, 2**40]), m.float32_array([0, 0]), 1.0, True, 0.0, 0, "stop"))
    widened = m.Rollout(np.arange(3, dtype=np.int64), np.zeros(3), 1.0, True, 0.0, 0, "stop")
    back = decode(encode(widened), m.Rollout)
    assert back.response_ids.dtype == np.int32 and back.logprobs.dtype == np.float32
    assert codec.MAX_PAYLOAD_BYTES >= 1 << 30
