"""The control socket's wire format, sans I/O: length-prefixed msgpack maps both ways.

Each message is a 4-byte big-endian length followed by that many bytes of one msgpack map. A
request is ``{"op": NAME, ...arguments}``; the reply is ``{"ok": true, ...results}`` or
``{"ok": false, "error": MESSAGE}``. A message whose body is not a msgpack map is answered
with an error and the connection goes on (its length kept the framing intact); a length past
``MAX_MESSAGE`` closes the connection, since nothing after it can be trusted.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

_LENGTH = struct.Struct(">I")

MAX_MESSAGE = 16 << 20
"""Largest message body in bytes. Requests are small except a warm-up's path list, which at
this size still holds some 200,000 paths; replies are a status or a progress map."""


class FrameTooLarge(Exception):
    """A length prefix beyond ``MAX_MESSAGE``: the stream cannot be resynchronised."""


class BadMessage(Exception):
    """A well-framed message whose body is not a msgpack map."""


def encode(message: dict[str, Any]) -> bytes:
    """One message, framed."""
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_MESSAGE:
        raise FrameTooLarge(f"message of {len(body)} bytes exceeds the {MAX_MESSAGE} byte limit")
    return _LENGTH.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """A message body as a map (raises BadMessage)."""
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadMessage(f"message is not valid msgpack ({exc})") from None
    if not isinstance(value, dict):
        raise BadMessage(f"message is a {type(value).__name__}, not a map")
    return value


class MessageReader:
    """Splits a byte stream into message bodies; feed it whatever the socket returned."""

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes of an unfinished message held back."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """The complete bodies now available, in order (raises FrameTooLarge)."""
        self._buf += data
        bodies = []
        while len(self._buf) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buf)
            if length > MAX_MESSAGE:
                raise FrameTooLarge(f"message length {length} exceeds the {MAX_MESSAGE} "
                                    "byte limit")
            end = _LENGTH.size + length
            if len(self._buf) < end:
                break
            bodies.append(bytes(self._buf[_LENGTH.size:end]))
            del self._buf[:end]
        return bodies


def ok(**results: Any) -> dict[str, Any]:
    return {"ok": True, **results}


def error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}
