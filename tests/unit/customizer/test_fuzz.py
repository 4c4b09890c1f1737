"""Schema-driven fuzzing of the local server from its own OpenAPI schema (schemathesis), plus
structured fuzzing of commit bodies (hypothesis) and of numeric extremes in every JSON body
(1e400, -0.0, integers of hundreds and thousands of digits): a few hundred requests to 127.0.0.1, bounded
and derandomised, and no answer may be a 5xx, no file may appear outside the root, and the list
endpoints must answer afterwards. A server with a token is fuzzed without it and with wrong ones
(every answer but the health probes' must be 401, and nothing may be stored), and with slow and
unfinished requests (each must be answered 408 or dropped within its deadline while the server
keeps answering others)."""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import socket
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from dpojax.customizer_server import serve_in_thread  # noqa: E402
from dpojax.customizer_server.access import OPEN_PATHS  # noqa: E402
from dpojax.customizer_server.backends import SimulateBackend  # noqa: E402
from tests.helpers.customizer import AUTH, TOKEN  # noqa: E402
from tests.unit.customizer.test_hostile_requests import (  # noqa: E402
    _files_outside,
    _healthy,
    _upload_dataset,
)

EXAMPLES = 8  # per operation and generation mode
FIXED = {"ns": "fz", "name": "ds", "rtype": "datasets", "revision": "main"}


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx, value):  # the commit body: the schema describes it as a string
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else b""


def _settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )


def _fuzz_operations(server, counts: collections.Counter, failures: list) -> None:
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    for result in schema.get_all_operations():
        operation = result.ok()
        names = {p.name for p in operation.path_parameters}
        variants = [{}] + ([{k: v for k, v in FIXED.items() if k in names}] if names else [])
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for fixed in variants:
                strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed)

                @_settings(EXAMPLES)
                @given(strategy)
                def one(case):
                    response = case.call(base_url=server.url, timeout=10)
                    counts[response.status_code] += 1
                    if response.status_code >= 500:
                        failures.append((case.operation.label, case.path_parameters, case.body))

                # Unsatisfiable: no invalid input exists for an operation without parameters.
                with contextlib.suppress(Unsatisfiable):
                    one()


# Numbers that Python's JSON parser reads as infinity (1e400), as a signed zero, as integers too
# long to convert (over 4300 digits) or merely huge; and the placeholder that marks their place.
EXTREMES = ["1e400", "-1e400", "-0.0", "1e-400", "9" * 400, "-" + "9" * 4400, "1" * 20]
_HOLE = "\u0000extreme"


def _holed(value, rng):
    """`value` with some of its numbers, and one unknown field of each object, replaced by
    the placeholder."""
    if isinstance(value, dict):
        out = {k: _holed(v, rng) for k, v in value.items()}
        out["extra_number"] = _HOLE
        return out
    if isinstance(value, list):
        return [_holed(v, rng) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool) and rng.random() < 0.7:
        return _HOLE
    return value


def _fuzz_numeric_extremes(server, counts: collections.Counter, failures: list) -> None:
    """Every JSON-body operation of the schema, with valid bodies whose numbers and an extra
    field hold a numeric extreme: none may answer 5xx, and nothing non-finite may be stored."""
    import random

    schema = schemathesis.openapi.from_dict(server.app.openapi())
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "POST" or not operation.body:
            continue
        names = {p.name for p in operation.path_parameters}
        fixed = {k: v for k, v in FIXED.items() if k in names}
        strategy = operation.as_strategy(
            generation_mode=schemathesis.GenerationMode.POSITIVE, path_parameters=fixed
        )

        @_settings(EXAMPLES)
        @given(strategy, st.sampled_from(EXTREMES), st.integers(0, 1000))
        def one(case, literal, seed):
            if not isinstance(case.body, dict):
                return
            text = json.dumps(_holed(case.body, random.Random(seed)))
            text = text.replace(json.dumps(_HOLE), literal)
            response = httpx.post(
                server.url + case.formatted_path,
                content=text,
                headers={"content-type": "application/json"},
                timeout=10,
            )
            counts[response.status_code] += 1
            if response.status_code >= 500:
                failures.append((case.operation.label, literal, text[:300]))

        one()


_PATHS = st.lists(
    st.sampled_from(["a", "b", "..", ".", "", "x.jsonl", "é", "a b", "\x00", "training"]),
    min_size=1,
    max_size=4,
).map("/".join)
_FILE = st.fixed_dictionaries(
    {"path": _PATHS, "content": st.text(max_size=20)},
    optional={"encoding": st.sampled_from(["base64", "utf-8", "gzip", None])},
)
_LINE = st.one_of(
    st.fixed_dictionaries({"key": st.just("file"), "value": _FILE}),
    st.fixed_dictionaries(
        {
            "key": st.sampled_from(["deletedFile", "deletedFolder"]),
            "value": st.fixed_dictionaries({"path": _PATHS}),
        }
    ),
    st.fixed_dictionaries(
        {
            "key": st.just("header"),
            "value": st.dictionaries(st.text(max_size=5), st.text(max_size=5)),
        }
    ),
    st.fixed_dictionaries(
        {"key": st.text(max_size=8), "value": st.none() | st.integers() | st.text()}
    ),
)


def _fuzz_commits(server, counts: collections.Counter, failures: list) -> None:
    url = f"{server.url}/v1/hf/api/datasets/fz/ds/commit/main"

    @_settings(150)
    @given(st.lists(_LINE, max_size=5), st.booleans())
    def one(lines, encode_valid):
        for line in lines:
            value = line.get("value")
            if encode_valid and isinstance(value, dict) and value.get("encoding") == "base64":
                value["content"] = base64.b64encode(value["content"].encode()).decode()
        body = "".join(json.dumps(line) + "\n" for line in lines)
        response = httpx.post(url, content=body, timeout=10)
        counts[response.status_code] += 1
        if response.status_code >= 500:
            failures.append(("commit", lines))

    one()


@pytest.mark.slow
def test_fuzz_from_the_openapi_schema(tmp_path):
    root = tmp_path / "a" / "b" / "root"
    server = serve_in_thread(root, SimulateBackend(seconds_per_epoch=0.05), max_body_bytes=1 << 20)
    try:
        _upload_dataset(server.url, "fz", "ds")  # something for the fixed path parameters to hit
        counts: collections.Counter = collections.Counter()
        failures: list = []
        _fuzz_operations(server, counts, failures)
        _fuzz_commits(server, counts, failures)
        _fuzz_numeric_extremes(server, counts, failures)
        total = sum(counts.values())
        print(f"fuzz: {total} requests, statuses {dict(sorted(counts.items()))}")
        assert total >= 300
        assert not failures, failures[:5]
        assert sum(n for code, n in counts.items() if code >= 500) == 0
        assert not _files_outside(tmp_path, root)
        for repo in server.store.repos.values():
            assert repo.directory.resolve().is_relative_to(root.resolve())
        _healthy(server.url)
        listed = httpx.get(server.url + "/v1/deployment/model-deployments?page_size=100").json()
        json.dumps(listed, allow_nan=False)  # nothing non-finite was stored
        for path in ("/v1/customization/jobs", "/v1/namespaces/fz", "/v1/datasets/fz/ds"):
            answer = httpx.get(server.url + path)
            assert answer.status_code in (200, 404), (path, answer.text)
        json.dumps(server.store.snapshot(), allow_nan=False)
        for job in server.store.jobs.values():
            json.dumps(job.hyperparameters, allow_nan=False)
    finally:
        server.stop()


WRONG_AUTH = [{}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}]


def _fuzz_unauthenticated(server, counts: collections.Counter, failures: list) -> None:
    """Every operation, valid inputs, without the token or with a wrong one: 401 (the health
    probes: 200)."""
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    client = httpx.Client(timeout=10)
    for result in schema.get_all_operations():
        operation = result.ok()
        names = {p.name for p in operation.path_parameters}
        fixed = {k: v for k, v in FIXED.items() if k in names}
        strategy = operation.as_strategy(
            generation_mode=schemathesis.GenerationMode.POSITIVE, path_parameters=fixed
        )

        @_settings(1)
        @given(strategy)
        def one(case):
            body, content = case.body, None
            if isinstance(body, str):
                content = body.encode("utf-8", "surrogatepass")
            elif isinstance(body, dict | list | int | float | bool):
                content = json.dumps(body).encode()
            for headers in WRONG_AUTH:
                response = client.request(
                    case.method,
                    server.url + case.formatted_path,
                    params=case.query or None,
                    content=content,
                    headers=headers,
                )
                counts[response.status_code] += 1
                expected = 200 if case.formatted_path in OPEN_PATHS else 401
                if response.status_code != expected:
                    failures.append((case.operation.label, headers, response.status_code))

        one()


SLOW = 0.5  # the header and body deadlines of the slow-request server, in seconds
_HEAD = b"POST /v1/namespaces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
_AUTH_LINE = b"Authorization: " + AUTH["Authorization"].encode() + b"\r\n"
UNFINISHED = {
    "silent": [b""],
    "half a request line": [b"POST /v1/name"],
    "headers trickling": [_HEAD] + [b"X"] * 20,
    "headers never ended": [_HEAD + _AUTH_LINE],
    "body never sent": [_HEAD + _AUTH_LINE + b"Content-Length: 50\r\n\r\n"],
    "body trickling": [_HEAD + _AUTH_LINE + b"Content-Length: 50\r\n\r\n"] + [b" "] * 20,
    "chunked, never ended": [_HEAD + _AUTH_LINE + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{"],
    "unauthenticated body": [_HEAD + b"Content-Length: 1000000\r\n\r\n{"],
    "oversized headers": [_HEAD + b"X-Pad: " + b"a" * 70_000],
}


def _open(server, parts: list[bytes]) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setblocking(False)
    return sock


def _drive_unfinished(server, counts: collections.Counter, failures: list) -> None:
    """All of UNFINISHED at once, bytes trickling every 0.05 s: each connection must be answered
    (408, 401 or 400) and closed within the deadlines plus a margin, and the server must answer a
    normal request meanwhile."""
    socks = {name: (_open(server, parts), list(parts)) for name, parts in UNFINISHED.items()}
    answers = {name: b"" for name in socks}
    closed: dict[str, float] = {}
    start = time.monotonic()
    while len(closed) < len(socks) and time.monotonic() - start < 4 * SLOW + 3:
        for name, (sock, parts) in socks.items():
            if name in closed:
                continue
            if parts:
                with contextlib.suppress(OSError):
                    sock.sendall(parts.pop(0))
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            answers[name] += chunk
            if not chunk:
                closed[name] = time.monotonic() - start
        time.sleep(0.05)
    healthy = httpx.get(server.url + "/v1/customization/jobs", headers=AUTH, timeout=5)
    for name, (sock, _) in socks.items():
        sock.close()
        status = answers[name].split(b" ", 2)[1:2]
        counts[int(status[0]) if status else "dropped"] += 1
        if name not in closed or closed[name] > 2 * SLOW + 2:
            failures.append((name, "still open", answers[name][:80]))
        elif status and status[0] not in (b"400", b"401", b"408", b"413", b"431"):
            failures.append((name, answers[name][:80]))
    if healthy.status_code != 200:
        failures.append(("a normal request meanwhile", healthy.status_code))


@pytest.mark.slow
def test_fuzz_unauthenticated_slow_and_unfinished_requests(tmp_path):
    """A server with a token (loopback only): every operation without it or with a wrong one
    is 401 and stores nothing; slow and unfinished requests are cut off within their deadlines.
    A few seconds in all."""
    root = tmp_path / "root"
    server = serve_in_thread(
        root, SimulateBackend(), token=TOKEN, header_timeout=SLOW, body_timeout=SLOW
    )
    try:
        counts: collections.Counter = collections.Counter()
        failures: list = []
        began = time.monotonic()
        _fuzz_unauthenticated(server, counts, failures)
        _drive_unfinished(server, counts, failures)
        print(f"fuzz: {dict(counts)} in {time.monotonic() - began:.1f} s")
        assert not failures, failures[:5]
        assert counts[401] >= 30
        snapshot = server.store.snapshot()
        assert not snapshot["namespaces"] and not snapshot["repos"] and not snapshot["jobs"]
        assert not server.store.datasets and not server.store.deployments
    finally:
        server.stop()
