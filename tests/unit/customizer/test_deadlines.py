"""Slow and unfinished requests (issue 50, defect 8): headers that never finish, or trickle in,
and bodies that never finish, are answered 408 and their connection closed within the server's
deadlines, instead of being held open forever."""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.helpers.customizer import AUTH, TOKEN

DEADLINE = 0.4


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _read_until_closed(sock: socket.socket, limit: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took
    (bounded: `limit` seconds at most)."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit)
    while time.monotonic() - start < limit:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def _status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["detail"]


def test_headers_that_never_finish_are_cut_off(start_server):
    """Before: the connection stayed open as long as the client wanted, bytes trickling or not."""
    server = start_server(header_timeout=DEADLINE, token=TOKEN)
    silent = _connect(server.url)  # connects and sends nothing
    trickle = _connect(server.url)
    trickle.sendall(b"POST /v1/namespaces HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):  # a byte now and then does not push the deadline back
        time.sleep(DEADLINE / 4)
        trickle.sendall(b"X")
    answer, waited = _read_until_closed(trickle)
    assert _status_and_error(answer) == (408, f"request headers not complete within {DEADLINE} s")
    assert waited < 2
    assert _read_until_closed(silent)[0].startswith(b"HTTP/1.1 408")
    assert httpx.get(server.url + "/v1/customization/jobs", headers=AUTH).status_code == 200


def test_a_body_that_never_finishes_is_answered_408_and_closed(start_server):
    """Before: a request declaring 100 bytes and sending 10 was waited for forever."""
    server = start_server(body_timeout=DEADLINE, token=TOKEN)
    sock = _connect(server.url)
    auth = AUTH["Authorization"].encode()
    sock.sendall(
        b"POST /v1/namespaces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: " + auth + b"\r\nContent-Length: 100\r\n\r\n" + b'{"id": "ab'
    )
    answer, waited = _read_until_closed(sock)
    status, message = _status_and_error(answer)
    assert status == 408 and message == f"request body not received whole within {DEADLINE} s"
    assert b"connection: close" in answer.lower() and waited < 2
    assert not server.store.namespaces


def test_an_unauthenticated_body_is_never_read(start_server):
    """A 401 closes the connection at once: the server does not wait for the declared body."""
    server = start_server(body_timeout=30, token=TOKEN)
    sock = _connect(server.url)
    sock.sendall(b"POST /v1/namespaces HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{")
    answer, waited = _read_until_closed(sock)
    assert _status_and_error(answer)[0] == 401 and waited < 2
