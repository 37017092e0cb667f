"""HTTP by hand, for what clients refuse to send: a body that is announced but never sent, a
chunked body without end, a header without end."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterable


def request_head(path: str, key: str, *lines: str) -> bytes:
    extra = "".join(f"{line}\r\n" for line in lines)
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\n{extra}Connection: close\r\n\r\n").encode()


def exchange(url: str, head: bytes, chunks: Iterable[bytes] = (), pause: float = 0.0
             ) -> tuple[bytes, int]:
    """Send `head`, then `chunks` until the server answers: its answer and the bytes of
    `chunks` sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        sent = 0
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
            time.sleep(pause)
            if _answered(sock):
                break
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
        return answer, sent


def _answered(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)
