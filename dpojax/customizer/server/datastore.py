"""Datastore routes of the local server: the namespace form endpoint and the HF Hub subset under
`/v1/hf` used by huggingface_hub's `create_repo`, `upload_file` (preupload + commit, regular
uploads only), `repo_info` and file downloads (`resolve`).
"""

from __future__ import annotations

import base64
import json
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from dpojax.customizer.server.common import NO_RETRY, error, json_body
from dpojax.customizer.server.store import Store, safe_relpath

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
    @app.post("/v1/datastore/namespaces")
    async def create_datastore_namespace(request: Request):
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        ns = (form.get("namespace") or [""])[0]
        if not ns:
            return error(422, "form field 'namespace' is required")
        with store.lock:
            if ns in store.datastore_namespaces:
                return error(409, f"namespace {ns!r} already exists", NO_RETRY)
            store.datastore_namespaces.add(ns)
        return JSONResponse({"namespace": ns}, status_code=201)


def _add_hf_routes(app: FastAPI, store: Store) -> None:
    """`create_repo`, `upload_file` (preupload + commit), `repo_info` and `resolve` downloads."""
    hf = HF

    @app.post(f"{hf}/api/repos/create")
    async def hf_create_repo(request: Request):
        body = await json_body(request)
        name, ns = body.get("name"), body.get("organization")
        repo_type = body.get("type") or "model"
        if not name:
            return error(422, "field 'name' is required")
        if not ns and "/" in name:
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
        repo_type = rtype[:-1] if rtype.endswith("s") else rtype
        repo = store.repo(repo_type, ns, name)
        if repo is None:
            return error(404, f"repository {ns}/{name} not found", {"X-Error-Code": "RepoNotFound"})
        return repo

    @app.post(hf + "/api/{rtype}/{ns}/{name}/preupload/{revision}")
    async def hf_preupload(rtype: str, ns: str, name: str, revision: str, request: Request):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        body = await json_body(request)
        files = [
            {"path": f.get("path"), "uploadMode": "regular", "shouldIgnore": False}
            for f in body.get("files", [])
        ]
        return {"files": files, "commitOid": repo.head}

    @app.post(hf + "/api/{rtype}/{ns}/{name}/commit/{revision}")
    async def hf_commit(rtype: str, ns: str, name: str, revision: str, request: Request):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        summary, files, deleted = "", {}, []
        try:
            for line in (await request.body()).decode("utf-8").splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                key, value = item.get("key"), item.get("value") or {}
                if key == "header":
                    summary = value.get("summary", "")
                elif key == "file":
                    path = str(safe_relpath(value["path"]))
                    content = value.get("content", "")
                    if value.get("encoding") == "base64":
                        files[path] = base64.b64decode(content)
                    else:
                        files[path] = content.encode()
                elif key in ("deletedFile", "deletedFolder"):
                    deleted.append(str(safe_relpath(value["path"])))
                else:
                    return error(422, f"commit operation {key!r} is not supported here")
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            return error(422, f"malformed commit body: {exc}")
        with store.lock:
            oid = repo.commit(summary, files, deleted)
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        return {
            "commitUrl": f"{prefix}{repo.repo_id}/commit/{oid}",
            "commitOid": oid,
            "pullRequestUrl": None,
        }

    @app.get(hf + "/api/{rtype}/{ns}/{name}")
    @app.get(hf + "/api/{rtype}/{ns}/{name}/revision/{revision}")
    async def hf_repo_info(rtype: str, ns: str, name: str, revision: str = "main"):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        return {
            "id": repo.repo_id,
            "sha": repo.head,
            "private": False,
            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
        }

    @app.api_route(
        hf + "/{rtype}/{ns}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"]
    )
    async def hf_resolve(rtype: str, ns: str, name: str, revision: str, path: str):
        repo = find_repo(rtype, ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        if path not in repo.files:
            return error(
                404, f"{path} not found in {repo.repo_id}", {"X-Error-Code": "EntryNotFound"}
            )
        headers = {"ETag": f'"{repo.files[path]}"', "X-Repo-Commit": repo.head}
        return FileResponse(repo.directory / path, headers=headers)
