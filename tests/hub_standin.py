"""A local stand-in for the Hugging Face Hub's model API (HF_ENDPOINT=its url): no network in the tests.

It serves model folders the tests build under repo ids, with the routes huggingface_hub's snapshot_download
uses and the Hub's own error headers, so the client raises what it raises against the real Hub:

    GET  /api/models/OWNER/NAME/revision/REV         repo info (sha) | 404 RepoNotFound | 404 RevisionNotFound
    GET  /api/models/OWNER/NAME/tree/SHA?recursive=  the files
    HEAD/GET /OWNER/NAME/resolve/REV/FILE            the file | 401 GatedRepo without the repo's token

A scripted stand-in, not the Hub: it exists because the real one cannot be reached here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    folder: Path
    sha: str
    token: str | None = None  # gated: downloads need "Authorization: Bearer <token>"


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo_id: str, folder: Path, token: str | None = None) -> str:
        """Serve `folder` as `repo_id`; returns its commit sha (a hash of the files)."""
        digest = hashlib.sha1()
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                digest.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
        self.repos[repo_id] = Repo(folder, digest.hexdigest(), token)
        return self.repos[repo_id].sha

    def __enter__(self) -> HubStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._route(head=True)

            def do_GET(self):
                self._route(head=False)

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, message: str, head: bool):
                self._send(status, json.dumps({"error": message}).encode(),
                           {"X-Error-Code": code, "X-Error-Message": message,
                            "Content-Type": "application/json"}, head)

            def _route(self, head: bool):
                path = unquote(urlparse(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                parts = path.strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                repo_id = "/".join(parts[2:4] if api else parts[:2])
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found", head)
                rest = parts[4:] if api else parts[2:]
                if api and rest[:1] == ["revision"]:
                    if rest[1] not in ("main", repo.sha):
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}", head)
                    siblings = [{"rfilename": f} for f in self._files(repo)]
                    return self._json({"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                                       "gated": "auto" if repo.token else False, "siblings": siblings}, head)
                if api and rest[:1] == ["tree"]:
                    return self._json([{"type": "file", "path": f, "size": (repo.folder / f).stat().st_size,
                                        "oid": self._oid(repo.folder / f)} for f in self._files(repo)], head)
                if not api and rest[:1] == ["resolve"] and len(rest) >= 3:
                    if rest[1] not in ("main", repo.sha):
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}", head)
                    if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                        return self._error(401, "GatedRepo", "Access to model is restricted: you must have access "
                                                             "to it and be authenticated", head)
                    file = repo.folder / "/".join(rest[2:])
                    if not file.is_file():
                        return self._error(404, "EntryNotFound", "Entry not found", head)
                    body = file.read_bytes()
                    return self._send(200, body, {"X-Repo-Commit": repo.sha, "ETag": f'"{self._oid(file)}"',
                                                  "Content-Type": "application/octet-stream"}, head)
                return self._error(404, "EntryNotFound", f"no route {path}", head)

            def _json(self, value, head: bool):
                self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"}, head)

            @staticmethod
            def _files(repo: Repo) -> list[str]:
                return sorted(p.relative_to(repo.folder).as_posix() for p in repo.folder.rglob("*") if p.is_file())

            @staticmethod
            def _oid(path: Path) -> str:
                return hashlib.sha1(path.read_bytes()).hexdigest()

        return Handler
