"""The CLI's side of the control socket: find the mount a path is in, ask its daemon, get the
answer or a clear error (blocking; the CLI has nothing else to do meanwhile)."""

from __future__ import annotations

import socket
from typing import Any

from . import control_protocol as proto
from .runtime import MountRecord, control_socket_path, find_mount, live_records

CONNECT_TIMEOUT = 5.0
"""Seconds to wait for the daemon to accept; it answers from its event loop, so promptly."""
REPLY_TIMEOUT = 60.0
"""Seconds to wait for an answer to a quick request (status, progress, starting a warm-up
includes planning it, which walks the namespace once)."""


class ControlError(Exception):
    """The daemon could not be asked, or answered with an error; the message is for the user."""


class ControlClient:
    """One connection to a mount's daemon; requests are answered in order."""

    def __init__(self, record: MountRecord) -> None:
        self.record = record
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(CONNECT_TIMEOUT)
        path = control_socket_path(record.mountpoint)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise ControlError(f"cannot reach the daemon of {record.mountpoint} at {path}: "
                               f"{exc.strerror or exc}") from None
        self._reader = proto.MessageReader()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def request(self, op: str, *, timeout: float | None = REPLY_TIMEOUT,
                **args: Any) -> dict[str, Any]:
        """Send one request; the reply's results (raises ControlError for an error reply).

        ``timeout=None`` waits as long as the daemon works (``cache verify`` of a large tree).
        """
        self._sock.settimeout(timeout)
        try:
            self._sock.sendall(proto.encode({"op": op, **args}))
            reply = self._receive()
        except (OSError, proto.FrameTooLarge, proto.BadMessage) as exc:
            # socket.timeout is an OSError without strerror
            raise ControlError(f"daemon of {self.record.mountpoint} did not answer: "
                               f"{getattr(exc, 'strerror', None) or exc or 'timed out'}") from None
        if not reply.get("ok"):
            raise ControlError(str(reply.get("error", "the daemon refused without a reason")))
        return reply

    def _receive(self) -> dict[str, Any]:
        while True:
            data = self._sock.recv(65536)
            if not data:
                raise ControlError(f"daemon of {self.record.mountpoint} closed the connection")
            bodies = self._reader.feed(data)
            if bodies:
                return proto.decode_body(bodies[0])


def mount_of(path: str) -> tuple[MountRecord, str]:
    """The mount ``path`` is in, and the path inside it (raises ControlError)."""
    found = find_mount(path, live_records())
    if found is None:
        raise ControlError(f"{path} is not inside a neuralcache mount")
    return found


def only_mount() -> MountRecord:
    """The one mount on this machine (raises ControlError naming them if there are several)."""
    records = live_records()
    if not records:
        raise ControlError("no neuralcache mount is running on this machine")
    if len(records) > 1:
        names = ", ".join(r.mountpoint for r in records)
        raise ControlError(f"several neuralcache mounts ({names}); name one")
    return records[0]


def resolve_mount(path: str | None) -> MountRecord:
    """The mount named by any path in it, or the only mount when ``path`` is None."""
    return only_mount() if path is None else mount_of(path)[0]
