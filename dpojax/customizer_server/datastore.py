"""Datastore routes of the local server: the namespace form endpoint and the HF Hub subset under
`/v1/hf` used by huggingface_hub's `create_repo`, `upload_file` (preupload + commit, regular
uploads only), `repo_info` and file downloads (`resolve`).

Every name that becomes a directory and every file path in a commit is checked against the safe
alphabet (`dpojax.customizer_server.models`); a commit is parsed and decoded whole (invalid
base64 is refused) before anything is written, and then written all or nothing
(`store.Repo.commit`).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import ValidationError

from dpojax.customizer_server.common import NO_RETRY, error
from dpojax.customizer_server.guard import check_json
from dpojax.customizer_server.models import (
    COMMIT_BODY_SCHEMA,
    NAMESPACE_FORM_SCHEMA,
    SAFE_NAME,
    CommitDeletion,
    CommitFile,
    CommitHeader,
    CommitLine,
    IdPath,
    NamePath,
    PreuploadIn,
    RepoCreateIn,
    RepoTypePath,
)
from dpojax.customizer_server.store import CommitConflict, Store, safe_relpath

HF = "/v1/hf"


def add_datastore_routes(app: FastAPI, store: Store) -> None:
    """Register the Datastore endpoints on `app`: the namespace form and the HF Hub subset."""
    _add_namespace_route(app, store)
    _add_hf_routes(app, store)


def _repo_url(request: Request, repo_type: str, repo_id: str) -> str:
    base = str(request.base_url).rstrip("/")
    prefix = "" if repo_type == "model" else f"{repo_type}s/"
    return f"{base}{HF}/{prefix}{repo_id}"


def _add_namespace_route(app: FastAPI, store: Store) -> None:
    @app.post("/v1/datastore/namespaces", status_code=201, openapi_extra=NAMESPACE_FORM_SCHEMA)
    async def create_datastore_namespace(request: Request):
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        ns = (form.get("namespace") or [""])[0]
        if not re.fullmatch(SAFE_NAME, ns):
            return error(422, f"form field 'namespace' must match {SAFE_NAME}")
        with store.lock:
            if ns in store.datastore_namespaces:
                return error(409, f"namespace {ns!r} already exists", NO_RETRY)
            store.datastore_namespaces.add(ns)
        return JSONResponse({"namespace": ns}, status_code=201)


class BadCommit(ValueError):
    """A commit body that cannot be applied (answered with a 422)."""


def _decode_file(value: dict[str, Any]) -> tuple[str, bytes]:
    item = CommitFile.model_validate(value)
    path = str(safe_relpath(item.path))
    if item.encoding == "base64":
        try:
            return path, base64.b64decode(item.content, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadCommit(f"file {path}: content is not valid base64 ({exc})") from None
    return path, item.content.encode()


def parse_commit(body: bytes) -> tuple[str, dict[str, bytes], list[str], list[str]]:
    """(summary, files, deleted files, deleted folders) of an NDJSON commit body; `BadCommit`
    (or a pydantic `ValidationError`) for anything malformed, before anything is written."""
    summary, files, deleted, folders = "", {}, [], []
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadCommit("commit body is not UTF-8") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = check_json(line)
        except ValueError as exc:
            raise BadCommit(f"line {number} is not JSON: {exc}") from None
        item = CommitLine.model_validate(raw)
        if item.key == "header":
            summary = CommitHeader.model_validate(item.value).summary
        elif item.key == "file":
            path, data = _decode_file(item.value)
            files[path] = data
        else:
            path = str(safe_relpath(CommitDeletion.model_validate(item.value).path))
            (deleted if item.key == "deletedFile" else folders).append(path)
    return summary, files, deleted, folders


def _add_hf_routes(app: FastAPI, store: Store) -> None:
    """`create_repo`, `upload_file` (preupload + commit), `repo_info` and `resolve` downloads."""
    hf = HF

    @app.post(f"{hf}/api/repos/create")
    async def hf_create_repo(body: RepoCreateIn, request: Request):
        name, ns = body.name, body.organization
        repo_type = body.type or "model"
        if "/" in name:
            if ns:
                return error(422, "give the namespace in 'name' or in 'organization', not both")
            ns, name = name.split("/", 1)
        ns = ns or "default"
        try:
            repo, created = store.create_repo(repo_type, ns, name)
        except ValueError as exc:
            return error(422, str(exc))
        url = _repo_url(request, repo_type, repo.repo_id)
        if not created:
            return error(409, f"repository {repo.repo_id} already exists", NO_RETRY, url=url)
        return {"url": url, "name": repo.repo_id, "id": repo.repo_id}

    def find_repo(rtype: str, ns: str, name: str):
        repo = store.repo(rtype[:-1], ns, name)
        if repo is None:
            return error(404, f"repository {ns}/{name} not found", {"X-Error-Code": "RepoNotFound"})
        return repo

    @app.post(hf + "/api/{rtype}/{ns}/{name}/preupload/{revision}")
    async def hf_preupload(
        body: PreuploadIn,
        rtype: RepoTypePath,
        ns: NamePath,
        name: NamePath,
        revision: IdPath,
    ):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        try:
            paths = [str(safe_relpath(f.path)) for f in body.files]
        except ValueError as exc:
            return error(422, str(exc))
        files = [{"path": p, "uploadMode": "regular", "shouldIgnore": False} for p in paths]
        return {"files": files, "commitOid": repo.head}

    @app.post(hf + "/api/{rtype}/{ns}/{name}/commit/{revision}", openapi_extra=COMMIT_BODY_SCHEMA)
    async def hf_commit(
        request: Request,
        rtype: RepoTypePath,
        ns: NamePath,
        name: NamePath,
        revision: IdPath,
    ):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        try:
            summary, files, deleted, folders = parse_commit(await request.body())
        except (BadCommit, ValidationError, ValueError) as exc:
            return error(422, f"malformed commit body: {_first_line(exc)}")
        try:
            with store.lock:
                oid = repo.commit(summary, files, deleted, folders)
        except CommitConflict as exc:
            return error(422, str(exc))
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        return {
            "commitUrl": f"{prefix}{repo.repo_id}/commit/{oid}",
            "commitOid": oid,
            "pullRequestUrl": None,
        }

    @app.get(hf + "/api/{rtype}/{ns}/{name}")
    @app.get(hf + "/api/{rtype}/{ns}/{name}/revision/{revision}")
    async def hf_repo_info(
        rtype: RepoTypePath, ns: NamePath, name: NamePath, revision: str = "main"
    ):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        return {
            "id": repo.repo_id,
            "sha": repo.head,
            "private": False,
            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
        }

    resolve = hf + "/{rtype}/{ns}/{name}/resolve/{revision}/{path:path}"

    @app.get(resolve, operation_id="hf_resolve_get")
    @app.head(resolve, operation_id="hf_resolve_head")
    async def hf_resolve(
        path: str, rtype: RepoTypePath, ns: NamePath, name: NamePath, revision: IdPath
    ):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        if path not in repo.files:  # only paths a commit checked and wrote
            return error(
                404, f"{path} not found in {repo.repo_id}", {"X-Error-Code": "EntryNotFound"}
            )
        headers = {"ETag": f'"{repo.files[path]}"', "X-Repo-Commit": repo.head}
        return FileResponse(repo.directory / path, headers=headers)


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in exc.errors()[:3]
        )
    return (str(exc).splitlines() or [type(exc).__name__])[0]
