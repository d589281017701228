"""Passing file descriptors to another process over a Unix socket (``SCM_RIGHTS``).

How a worker gets its shared memory: the parent sends the memfds of its ring and of the
shared datasets as one message on the control pipe (a multiprocess duplex ``Pipe`` is a
Unix socket pair), between the pipe's ordinary framed messages. The receiver gets new
descriptors of the same files, close-on-exec, so a subprocess a worker starts does not
keep the memory alive.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Sequence
from typing import Any

from zephon.errors import ShmError

MAX_FDS = 253  # SCM_MAX_FD: the most descriptors the kernel carries in one message
_INT_BYTES = array.array("i").itemsize


def _socket(conn: Any) -> socket.socket:
    """A socket object over a duplicate of ``conn``'s descriptor (``conn`` stays as it is)."""
    return socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)


def send_fds(conn: Any, fds: Sequence[int]) -> None:
    """Sends ``fds`` as one message on ``conn`` (a multiprocess Connection over a Unix
    socket, or a socket); the other side calls :func:`recv_fds` at the same point of the
    stream. The caller keeps its own descriptors.

    Raises:
        OSError: the peer is gone (e.g. ``BrokenPipeError``).
    """
    if not 1 <= len(fds) <= MAX_FDS:
        raise ValueError(f"send_fds sends 1 to {MAX_FDS} descriptors at a time; got {len(fds)}")
    with _socket(conn) as sock:
        socket.send_fds(sock, [bytes([len(fds)])], list(fds))


def recv_fds(conn: Any) -> list[int]:
    """The descriptors of the next :func:`send_fds` message on ``conn``; the caller owns them.

    Raises:
        EOFError: the peer closed the connection first.
        ShmError: the message is not what ``send_fds`` sends (any descriptors that came
            with it are closed).
    """
    # Not socket.recv_fds: it drops its flags argument (CPython 3.11), and with it
    # MSG_CMSG_CLOEXEC.
    with _socket(conn) as sock:
        msg, ancillary, flags, _ = sock.recvmsg(
            1, socket.CMSG_SPACE(MAX_FDS * _INT_BYTES), socket.MSG_CMSG_CLOEXEC
        )
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not msg and not fds:
        raise EOFError("the peer closed the connection before sending descriptors")
    if flags & socket.MSG_CTRUNC or not fds or len(msg) != 1 or msg[0] != len(fds):
        for fd in fds:
            os.close(fd)
        raise ShmError(
            f"expected a message of descriptors (count byte {msg!r}) but got {len(fds)} "
            f"descriptors (flags {flags:#x}); both ends must call send_fds/recv_fds at the same "
            "point of the stream"
        )
    return list(fds)
