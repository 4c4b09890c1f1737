"""A small Hugging Face Hub look-alike for the tests, on 127.0.0.1 (standard library only).

It serves what `huggingface_hub` (snapshot_download, hf_hub_download, create_repo, upload_folder)
and `datasets.load_dataset` ask of the Hub: repository info by revision, file resolution (HEAD
and GET with the ETag / X-Repo-Commit headers), trees and paths-info, repository creation,
preupload and commit (regular, base64-inline uploads), model-card YAML validation. Private repositories need the server's
token as a Bearer header. Every request is recorded in `requests`; `fail` makes the next N
requests whose path contains a given string answer 503 (to test retries).

    server = HubServer(token="hf_test")
    server.add_repo("model", "org/tiny", {"config.json": b"{}"}, revision="v1")
    with server:  # serves on server.url until the block ends
        ...
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool = False
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> files
    messages: list[str] = field(default_factory=list)

    def commit(self, files: dict[str, bytes], *, branch: str = "main", message: str = "") -> str:
        base = dict(self.commits.get(self.refs.get(branch, ""), {}))
        base.update(files)
        digest = hashlib.sha1(json.dumps(sorted((k, v.hex()) for k, v in base.items())).encode())
        digest.update(str(len(self.commits)).encode())
        sha = digest.hexdigest()
        self.commits[sha] = base
        self.refs[branch] = sha
        self.messages.append(message)
        return sha

    def files(self, revision: str | None) -> tuple[str, dict[str, bytes]] | None:
        revision = revision or "main"
        sha = self.refs.get(revision, revision)
        return (sha, self.commits[sha]) if sha in self.commits else None


class HubServer:
    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.fail: dict[str, int] = {}
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add_repo(
        self,
        repo_type: str,
        repo_id: str,
        files: dict[str, bytes | str] | str | Path,
        *,
        revision: str = "main",
        private: bool = False,
    ) -> Repo:
        """Adds (or commits to) a repository; `files` maps paths to contents, or is a local
        folder whose files are all added."""
        if isinstance(files, str | Path):
            root = Path(files)
            files = {
                str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()
            }
        data = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
        repo = self.repos.setdefault((repo_type, repo_id), Repo(repo_type, repo_id, private))
        repo.commit(data, branch=revision, message=f"add {len(data)} files")
        return repo

    @property
    def url(self) -> str:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._httpd is not None
        self._httpd.shutdown()
        self._httpd.server_close()


def _handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # ---- plumbing

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, ctype=None):
            self.send_response(status)
            headers = dict(headers or {})
            headers.setdefault("Content-Type", ctype or "application/json")
            headers["Content-Length"] = str(len(body))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, obj, headers=None):
            self._send(status, json.dumps(obj).encode(), headers)

        def _error(self, status: int, message: str, code: str | None = None):
            headers = {"X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._json(status, {"error": message}, headers)

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _authorized(self, repo: Repo) -> bool:
            if not repo.private:
                return True
            return self.headers.get("Authorization") == f"Bearer {server.token}"

        def _repo(self, repo_type: str, repo_id: str) -> Repo | None:
            repo = server.repos.get((repo_type, repo_id))
            if repo is None or not self._authorized(repo):
                status = 401 if repo is not None or not self.headers.get("Authorization") else 404
                self._error(status, f"Repository {repo_id} not found", "RepoNotFound")
                return None
            return repo

        def _dispatch(self):
            url = urlparse(self.path)
            path = unquote(url.path)
            with server.lock:
                server.requests.append((self.command, path, self.headers.get("Authorization")))
                for needle, count in list(server.fail.items()):
                    if needle in path and count > 0:
                        server.fail[needle] = count - 1
                        self._body()
                        return self._error(503, "temporarily unavailable")
            parts = [p for p in path.split("/") if p]
            query = parse_qs(url.query)
            if parts[:1] == ["api"]:
                return self._api(parts[1:], query)
            repo_type = "model"
            if parts[:1] in (["datasets"], ["spaces"]):
                repo_type, parts = parts[0][:-1], parts[1:]
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(repo_type, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
            return self._error(404, f"no route {path}")

        do_GET = do_HEAD = do_POST = _dispatch

        # ---- files

        def _resolve(self, repo_type: str, repo_id: str, revision: str, filename: str):
            repo = self._repo(repo_type, repo_id)
            if repo is None:
                return None
            found = repo.files(revision)
            if found is None:
                return self._error(404, f"revision {revision} not found", "RevisionNotFound")
            sha, files = found
            if filename not in files:
                return self._error(404, f"{filename} not found", "EntryNotFound")
            data = files[filename]
            etag = '"' + hashlib.sha1(data).hexdigest() + '"'
            return self._send(
                200, data, {"ETag": etag, "X-Repo-Commit": sha}, "application/octet-stream"
            )

        # ---- API

        def _api(self, parts: list[str], query):
            if parts == ["repos", "create"]:
                return self._create()
            if parts == ["validate-yaml"]:
                self._body()
                return self._json(200, {"errors": [], "warnings": []})
            if parts[:1] == ["whoami-v2"]:
                return self._json(200, {"name": "tester", "type": "user", "orgs": []})
            if not parts or parts[0] not in ("models", "datasets", "spaces") or len(parts) < 3:
                return self._error(404, "no such API route")
            repo_type = parts[0][:-1]
            repo_id = "/".join(parts[1:3])
            rest = parts[3:]
            repo = self._repo(repo_type, repo_id)
            if repo is None:
                return None
            if not rest:
                return self._info(repo, None)
            if rest[0] == "revision":
                return self._info(repo, "/".join(rest[1:]))
            if rest[0] == "tree":
                recursive = query.get("recursive", ["false"])[0].lower() == "true"
                return self._tree(repo, rest[1], "/".join(rest[2:]), recursive)
            if rest[0] == "paths-info":
                return self._paths_info(repo, rest[1])
            if rest[0] == "preupload":
                body = json.loads(self._body() or b"{}")
                files = [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                    for f in body.get("files", [])
                ]
                return self._json(200, {"files": files, "commitOid": repo.refs.get("main")})
            if rest[0] == "commit":
                return self._commit(repo, "/".join(rest[1:]))
            return self._error(404, "no such API route")

        def _info(self, repo: Repo, revision: str | None):
            found = repo.files(revision)
            if found is None:
                return self._error(404, f"revision {revision} not found", "RevisionNotFound")
            sha, files = found
            siblings = [{"rfilename": p, "size": len(files[p])} for p in sorted(files)]
            return self._json(
                200,
                {
                    "id": repo.repo_id,
                    "_id": repo.repo_id,
                    "sha": sha,
                    "private": repo.private,
                    "gated": False,
                    "disabled": False,
                    "siblings": siblings,
                    "tags": [],
                    "downloads": 0,
                    "likes": 0,
                    "lastModified": "2025-01-01T00:00:00.000Z",
                    "createdAt": "2025-01-01T00:00:00.000Z",
                    "cardData": {},
                },
            )

        def _entries(self, files: dict[str, bytes], prefix: str, recursive: bool) -> list[dict]:
            prefix = prefix.strip("/")
            out, dirs = [], set()
            for p in sorted(files):
                if prefix and not p.startswith(prefix + "/"):
                    continue
                rel = p[len(prefix) + 1 :] if prefix else p
                head = rel.split("/")
                for i in range(1, len(head)):
                    d = "/".join(([prefix] if prefix else []) + head[:i])
                    if (recursive or i == 1) and d not in dirs:
                        dirs.add(d)
                        out.append({"type": "directory", "path": d, "oid": "0" * 40, "size": 0})
                if recursive or len(head) == 1:
                    out.append(self._file_entry(p, files[p]))
            return out

        def _file_entry(self, path: str, data: bytes) -> dict:
            return {
                "type": "file",
                "path": path,
                "size": len(data),
                "oid": hashlib.sha1(data).hexdigest(),
            }

        def _tree(self, repo: Repo, revision: str, prefix: str, recursive: bool):
            found = repo.files(revision)
            if found is None:
                return self._error(404, f"revision {revision} not found", "RevisionNotFound")
            return self._json(200, self._entries(found[1], prefix, recursive))

        def _paths_info(self, repo: Repo, revision: str):
            raw = self._body().decode()
            ctype = self.headers.get("Content-Type", "")
            if "json" in ctype:
                paths = json.loads(raw or "{}").get("paths", [])
            else:
                paths = parse_qs(raw).get("paths", [])
            found = repo.files(revision)
            if found is None:
                return self._error(404, f"revision {revision} not found", "RevisionNotFound")
            files = found[1]
            out = []
            for p in paths if isinstance(paths, list) else [paths]:
                p = p.strip("/")
                if p in files:
                    out.append(self._file_entry(p, files[p]))
                elif any(f.startswith(p + "/") for f in files):
                    out.append({"type": "directory", "path": p, "oid": "0" * 40, "size": 0})
            return self._json(200, out)

        def _create(self):
            body = json.loads(self._body() or b"{}")
            if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                return self._error(401, "Invalid credentials in Authorization header")
            name, org = body.get("name", ""), body.get("organization")
            repo_id = f"{org}/{name}" if org else name
            repo_type = body.get("type") or "model"
            key = (repo_type, repo_id)
            prefix = "" if repo_type == "model" else f"{repo_type}s/"
            url = f"{server.url}/{prefix}{repo_id}"
            if key in server.repos:
                message = "You already created this model repo"
                headers = {"X-Error-Message": message, "X-Error-Code": "RepoExists"}
                return self._json(409, {"error": message, "url": url}, headers)
            private = bool(body.get("private")) or body.get("visibility") == "private"
            repo = Repo(repo_type, repo_id, private)
            server.repos[key] = repo
            return self._json(200, {"url": url, "name": repo_id, "id": repo_id})

        def _commit(self, repo: Repo, revision: str):
            message, files = "", {}
            for line in self._body().decode().splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                value = item.get("value") or {}
                if item.get("key") == "header":
                    message = value.get("summary", "")
                elif item.get("key") == "file":
                    content = value.get("content", "")
                    files[value["path"]] = (
                        base64.b64decode(content)
                        if value.get("encoding") == "base64"
                        else content.encode()
                    )
                else:
                    return self._error(422, f"unsupported commit operation {item.get('key')}")
            sha = repo.commit(files, branch=revision or "main", message=message)
            prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
            return self._json(
                200,
                {
                    "commitUrl": f"{server.url}/{prefix}{repo.repo_id}/commit/{sha}",
                    "commitOid": sha,
                    "pullRequestUrl": None,
                },
            )

    return Handler
