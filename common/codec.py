"""Versioned msgpack codec for every message in `common.messages` (and lists of them).

Payload layout: msgpack array `[SCHEMA_VERSION, type_name, body]`, where `body` is the message's
fields in declaration order (nested messages likewise) or, for `encode_list`, a list of such bodies.
int32/float32 arrays travel as msgpack ext types holding raw little-endian bytes, so a rollout's
token ids and log-probs cost 4 bytes per token and round-trip bit-exactly.

Decoding checks the version, the type name, every field's type and every array's byte length
against the schema, and raises `CodecError` on anything else: malformed, truncated, wrong-version or
hostile input never reaches our objects half-built, and nothing is ever executed (no pickle).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import numpy as np

from common import messages as m

T = TypeVar("T")

_EXT_INT32 = 1
_EXT_FLOAT32 = 2
_EXT_DTYPES = {_EXT_INT32: np.dtype("<i4"), _EXT_FLOAT32: np.dtype("<f4")}
_DTYPE_EXT = {np.dtype(np.int32): _EXT_INT32, np.dtype(np.float32): _EXT_FLOAT32}

MAX_PAYLOAD_BYTES = 1 << 31
"""Payloads above 2 GiB are refused before unpacking."""


class CodecError(ValueError):
    """A payload could not be decoded: malformed, truncated, wrong version, wrong type or hostile."""


class _Ext:
    """An ext value as unpacked, before the schema says which array it must be."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes):
        self.code = code
        self.data = data


def _ext_hook(code: int, data: bytes) -> _Ext:
    return _Ext(code, data)


# --------------------------------------------------------------------------------------- encoding


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        code = _DTYPE_EXT.get(obj.dtype)
        if code is None or obj.ndim != 1:
            raise CodecError(f"only 1-D int32/float32 arrays are encoded, got {obj.dtype} with shape {obj.shape}")
        return msgpack.ExtType(code, obj.astype(_EXT_DTYPES[code], copy=False).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise CodecError(f"cannot encode a value of type {type(obj).__name__}")


def _to_body(msg: Any) -> list:
    enc = _ENCODERS.get(type(msg))
    if enc is None:
        raise CodecError(f"{type(msg).__name__} is not a message type of common.messages")
    return enc(msg)


def encode(msg: Any) -> bytes:
    """One message -> bytes."""
    return msgpack.packb([m.SCHEMA_VERSION, type(msg).__name__, _to_body(msg)], default=_default, use_bin_type=True)


def encode_list(msgs: list, cls: type) -> bytes:
    """A list of messages of one type -> bytes (one payload, one call across the boundary)."""
    if cls not in _ENCODERS:
        raise CodecError(f"{cls.__name__} is not a message type of common.messages")
    bodies = []
    for x in msgs:
        if type(x) is not cls:
            raise CodecError(f"encode_list({cls.__name__}) got a {type(x).__name__}")
        bodies.append(_ENCODERS[cls](x))
    return msgpack.packb([m.SCHEMA_VERSION, "list:" + cls.__name__, bodies], default=_default, use_bin_type=True)


# --------------------------------------------------------------------------------------- decoding


def _unpack(data: bytes) -> tuple[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise CodecError(f"payload of {len(data)} bytes exceeds the {MAX_PAYLOAD_BYTES} byte limit")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_hook, use_list=True)
    except Exception as e:  # msgpack raises many types (ExtraData, StackError, ValueError, ...)
        raise CodecError(f"malformed payload: {type(e).__name__}: {e}") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise CodecError("malformed payload: expected [version, type, body]")
    version, name, body = obj
    if type(version) is not int:
        raise CodecError("malformed payload: schema version is not an integer")
    if version != m.SCHEMA_VERSION:
        raise CodecError(f"schema version {version} is not supported (this build reads version {m.SCHEMA_VERSION})")
    if not isinstance(name, str):
        raise CodecError("malformed payload: type name is not a string")
    return name, body


def decode(data: bytes, expected: type[T] | None = None) -> T:
    """bytes -> one message; with `expected`, any other message type is refused."""
    name, body = _unpack(data)
    cls = _BY_NAME.get(name)
    if cls is None:
        raise CodecError(f"unknown message type {name[:64]!r}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected a {expected.__name__}, got a {name}")
    return _DECODERS[cls](body, name)


def decode_list(data: bytes, cls: type[T]) -> list[T]:
    """bytes from `encode_list(msgs, cls)` -> list of messages."""
    name, body = _unpack(data)
    if name != "list:" + cls.__name__:
        raise CodecError(f"expected a list of {cls.__name__}, got {name[:64]!r}")
    if not isinstance(body, list):
        raise CodecError(f"{name}: body is not a list")
    dec = _DECODERS[cls]
    return [dec(b, f"{name}[{i}]") for i, b in enumerate(body)]


# ---------------------------------------------------------------------------- schema compilation

Decoder = Callable[[Any, str], Any]


def _scalar(kind: type) -> Decoder:
    def dec(v: Any, where: str) -> Any:
        if type(v) is kind:
            return v
        if kind is float and type(v) is int:
            return float(v)
        raise CodecError(f"{where}: expected {kind.__name__}, got {type(v).__name__}")

    return dec


def _array(dtype: np.dtype) -> Decoder:
    code = _DTYPE_EXT[np.dtype(dtype)]
    itemsize = _EXT_DTYPES[code].itemsize

    def dec(v: Any, where: str) -> np.ndarray:
        if not isinstance(v, _Ext) or v.code != code:
            raise CodecError(f"{where}: expected a {np.dtype(dtype).name} array")
        if len(v.data) % itemsize:
            raise CodecError(f"{where}: array byte length {len(v.data)} is not a multiple of {itemsize}")
        return np.frombuffer(v.data, dtype=_EXT_DTYPES[code])

    return dec


def _optional(inner: Decoder) -> Decoder:
    def dec(v: Any, where: str) -> Any:
        return None if v is None else inner(v, where)

    return dec


def _list_of(inner: Decoder) -> Decoder:
    def dec(v: Any, where: str) -> list:
        if not isinstance(v, list):
            raise CodecError(f"{where}: expected a list, got {type(v).__name__}")
        return [inner(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return dec


def _dict_of(inner: Decoder) -> Decoder:
    def dec(v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise CodecError(f"{where}: expected a map, got {type(v).__name__}")
        return {k: inner(x, f"{where}.{k}") for k, x in v.items() if _is_str_key(k, where)}

    return dec


def _is_str_key(k: Any, where: str) -> bool:
    if not isinstance(k, str):
        raise CodecError(f"{where}: map keys must be strings")
    return True


def _compile(tp: Any) -> Decoder:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, dtype = typing.get_args(tp)[:2]
        assert base is np.ndarray
        return _array(dtype)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(args) == 1, f"only Optional[X] unions are supported, got {tp}"
        return _optional(_compile(args[0]))
    if origin is list:
        return _list_of(_compile(typing.get_args(tp)[0]))
    if origin is dict:
        return _dict_of(_compile(typing.get_args(tp)[1]))
    if tp in (int, float, str, bool):
        return _scalar(tp)
    if dataclasses.is_dataclass(tp):
        return lambda v, where: _DECODERS[tp](v, where)
    raise TypeError(f"codec cannot handle field type {tp}")


def _make_decoder(cls: type) -> Decoder:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    decs = [_compile(hints[f.name]) for f in fields]
    n_required = sum(
        1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )

    def dec(v: Any, where: str) -> Any:
        if not isinstance(v, list):
            raise CodecError(f"{where}: expected a {cls.__name__} body (list), got {type(v).__name__}")
        if not n_required <= len(v) <= len(names):
            raise CodecError(f"{where}: {cls.__name__} has {len(names)} fields, payload has {len(v)}")
        return cls(*[d(x, f"{where}.{n}") for d, n, x in zip(decs, names, v)])

    return dec


def _make_encoder(cls: type) -> Callable[[Any], list]:
    hints = typing.get_type_hints(cls, include_extras=True)
    getters = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        getters.append((f.name, _encoder_for(tp)))

    def enc(msg: Any) -> list:
        return [g(getattr(msg, name)) for name, g in getters]

    return enc


def _encoder_for(tp: Any) -> Callable[[Any], Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _encoder_for(args[0])
        return lambda v: None if v is None else inner(v)
    if origin is list:
        inner = _encoder_for(typing.get_args(tp)[0])
        return lambda v: [inner(x) for x in v]
    if dataclasses.is_dataclass(tp):
        return lambda v: _ENCODERS[tp](v)
    if origin is typing.Annotated:
        dtype = np.dtype(typing.get_args(tp)[1])
        return lambda v: v if isinstance(v, np.ndarray) and v.dtype == dtype else _cast_array(v, dtype)
    return lambda v: v


def _cast_array(v: Any, dtype: np.dtype) -> np.ndarray:
    """Flatten and cast to the field's dtype; integers that do not fit int32 are refused, not wrapped."""
    src = np.asarray(v).reshape(-1)
    out = src.astype(dtype)
    if dtype.kind == "i" and src.size and not np.array_equal(out, src):
        raise CodecError(f"token ids do not fit {dtype.name} (range {src.min()}..{src.max()})")
    return out


_BY_NAME: dict[str, type] = {c.__name__: c for c in m.MESSAGE_TYPES}
_ENCODERS: dict[type, Callable[[Any], list]] = {}
_DECODERS: dict[type, Decoder] = {}
for _cls in m.MESSAGE_TYPES:
    _ENCODERS[_cls] = _make_encoder(_cls)
    _DECODERS[_cls] = _make_decoder(_cls)
