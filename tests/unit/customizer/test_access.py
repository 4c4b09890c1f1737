"""Who may use the local server (issue 50, defect 8): with a token, every request but the health
probes needs it (401 with a JSON error otherwise); without one it listens on loopback only; the
token comes from DPOJAX_SERVER_TOKEN or --token-file; the submitter sends it to both hosts."""

from __future__ import annotations

import httpx
import pytest

from dpojax.customizer.client import RequestRejectedError, submit
from dpojax.customizer_server import main, serve_in_thread
from dpojax.customizer_server.access import (
    TOKEN_ENV,
    AccessError,
    bearer_matches,
    check_listen,
    resolve_server_token,
)
from tests.helpers.customizer import AUTH, TOKEN, make_pairs, settings_for

WRONG = [
    {},
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
]


def test_without_the_token_every_call_is_401_and_changes_nothing(start_server):
    """Before: any token or none was accepted, and the namespace was created."""
    server = start_server(token=TOKEN)
    calls = [
        ("POST", "/v1/namespaces", {"id": "intruder"}),
        ("POST", "/v1/hf/api/repos/create", {"name": "intruder/ds", "type": "dataset"}),
        ("GET", "/v1/customization/jobs", None),
        ("GET", "/_admin/state", None),
        ("GET", "/openapi.json", None),
    ]
    client = httpx.Client(timeout=10)
    for headers in WRONG:
        for method, path, body in calls:
            answer = client.request(method, server.url + path, json=body, headers=headers)
            assert answer.status_code == 401, (headers, path, answer.text)
            error = answer.json()
            assert error["detail"] == error["error"] and "token" in error["detail"]
            assert answer.headers["www-authenticate"].startswith("Bearer")
        assert client.get(server.url + "/health", headers=headers).status_code == 200  # probes
    assert not server.store.namespaces and not server.store.repos
    created = client.post(server.url + "/v1/namespaces", json={"id": "ok"}, headers=AUTH)
    assert created.status_code == 201 and list(server.store.namespaces) == ["ok"]


def test_the_token_is_compared_whole_in_constant_time(monkeypatch):
    import hmac

    compared, original = [], hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr("dpojax.customizer_server.access.hmac.compare_digest", spy)
    headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
    assert bearer_matches(headers, TOKEN.encode())
    assert compared == [(TOKEN.encode(), TOKEN.encode())]
    assert not bearer_matches(headers, TOKEN.encode() + b"x")
    assert not bearer_matches([(b"authorization", b"bearer")], TOKEN.encode())
    assert not bearer_matches([], TOKEN.encode())


def test_a_submission_without_the_token_is_refused_clearly(start_server, tmp_path):
    server = start_server(token=TOKEN)  # test_submit's full flow passes with the token
    small = {"epochs": 1, "batch_size": 2}
    with pytest.raises(RequestRejectedError) as info:
        settings = settings_for(server, hf_token="", hyperparameters=small)
        submit(make_pairs(8), settings, workdir=tmp_path, environ={})
    assert info.value.status_code == 401 and "missing token" in info.value.message


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "example.org"])
def test_listening_beyond_loopback_needs_a_token(host):
    """Before: `--host 0.0.0.0` started an open server without a word."""
    with pytest.raises(AccessError) as info:
        check_listen(host, None)
    assert "--token-file" in str(info.value) and TOKEN_ENV in str(info.value)
    check_listen(host, TOKEN)
    for loopback in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"):
        check_listen(loopback, None)


def test_serve_in_thread_and_the_command_line_refuse_an_open_public_server(tmp_path, capsys):
    with pytest.raises(AccessError):
        serve_in_thread(tmp_path / "root", host="0.0.0.0")
    code = main(["--host", "0.0.0.0", "--root", str(tmp_path / "root")], environ={})
    assert code == 2
    err = capsys.readouterr().err
    assert "refusing to listen on '0.0.0.0' without a token" in err and TOKEN_ENV in err


def test_token_from_the_environment_or_a_file(tmp_path):
    file = tmp_path / "token"
    file.write_text(TOKEN + "\n")
    assert resolve_server_token(None, {}) is None
    assert resolve_server_token(None, {TOKEN_ENV: f" {TOKEN} "}) == TOKEN
    assert resolve_server_token(file, {}) == TOKEN
    problems = {
        "both --token-file and": lambda: resolve_server_token(file, {TOKEN_ENV: TOKEN}),
        "use at least 16": lambda: resolve_server_token(None, {TOKEN_ENV: "short"}),
        "visible ASCII": lambda: resolve_server_token(None, {TOKEN_ENV: "a b" * 8}),
        "cannot read it": lambda: resolve_server_token(tmp_path / "missing", {}),
    }
    for expected, call in problems.items():
        with pytest.raises(AccessError, match=expected):
            call()
    file.write_text("\n")
    with pytest.raises(AccessError, match=f"--token-file {file}: the file is empty"):
        resolve_server_token(file, {})
