"""A Hugging Face hub on loopback for the tests: the parts of the hub's HTTP API that huggingface_hub's
`model_info`, `list_repo_tree` and `snapshot_download` use (repository info, the file tree, HEAD and GET of a
file at a commit), serving folders of this machine as repositories at one commit each. Private and gated
repositories answer as the hub does (401 / 403 with its error code), unknown ones 404 RepoNotFound, unknown
revisions 404 RevisionNotFound. `requests` records each file the hub sent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class Hub:
    """`Hub({"org/name": folder})`: a running hub at `url` until `close()`."""

    def __init__(self, repos: dict[str, Path], private: tuple[str, ...] = (), gated: tuple[str, ...] = ()):
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.private, self.gated = set(private), set(gated)
        self.downloads: list[str] = []
        self.unknown: list[str] = []  # paths this hub does not serve
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def files(self, repo: str) -> list[str]:
        root = self.repos[repo]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            org, name, *tail = rest.split("/")
            repo, kind, revision = f"{org}/{name}", (tail[0] if tail else "info"), "/".join(tail[1:]) or "main"
        else:
            parts = path.lstrip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                self.unknown.append(path)
                return self.error(handler, 404, "EntryNotFound")
            org, name, kind, revision, *file = parts
            repo, file = f"{org}/{name}", "/".join(file)
        if repo not in self.repos:
            return self.error(handler, 404, "RepoNotFound")
        if repo in self.private:
            return self.error(handler, 401, "RepoNotFound")
        if repo in self.gated:
            return self.error(handler, 403, "GatedRepo")
        if revision not in ("main", self.commit(repo)):
            return self.error(handler, 404, "RevisionNotFound")
        commit = self.commit(repo)
        if path.startswith("/api/"):
            if kind in ("info", "revision"):
                payload = {"id": repo, "modelId": repo, "sha": commit, "private": False,
                           "siblings": [{"rfilename": f} for f in self.files(repo)]}
            elif kind == "tree":
                root = self.repos[repo]
                payload = [{"type": "file", "path": f, "size": (root / f).stat().st_size,
                            "oid": hashlib.sha1((root / f).read_bytes()).hexdigest()} for f in self.files(repo)]
            else:
                return self.error(handler, 404, "EntryNotFound")
            return self.send(handler, json.dumps(payload).encode(), {"Content-Type": "application/json"}, body)
        target = self.repos[repo] / file
        if not target.is_file():
            return self.error(handler, 404, "EntryNotFound")
        data = target.read_bytes()
        if body:
            self.downloads.append(file)
        self.send(handler, data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                  "Content-Type": "application/octet-stream"}, body)

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, data: bytes, headers: dict[str, str], body: bool) -> None:
        handler.send_response(200)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    @staticmethod
    def error(handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
        data = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)
