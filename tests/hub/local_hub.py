"""A local model hub for tests: the HTTP endpoints ``huggingface_hub`` downloads through (a model's
info with its files, ``resolve`` with ETags and commit headers, byte ranges), serving repositories from
folders, selected with ``HF_ENDPOINT``. It can refuse a repository without a token (a gated one),
answer 404 for what it lacks, cut a file's first transfer short (an interrupted download) and then go
down (503) until told otherwise (a download the next start must finish)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    folder: Path
    gated: bool = False  # 401 without an Authorization header
    revisions: tuple[str, ...] = ("main",)
    sha: str = field(default="")

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file())


@dataclass
class LocalHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    # file name -> bytes to send before cutting the connection, once per file
    cut_once: dict[str, int] = field(default_factory=dict)
    # After a cut, the hub goes down (503 to everything) until ``down`` is set back to False: the
    # client's own retries fail too, and the download must wait for the next start.
    down_after_cut: bool = False
    down: bool = False
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range)
    server_url: str = ""

    def add(self, repo_id: str, folder: Path, **kwargs) -> Repo:
        repo = Repo(folder, **kwargs)
        repo.sha = hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = repo
        return repo

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.server_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self.server_url

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ routes
    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        if self.down:
            return self.error(h, 503, "ServiceUnavailable", "the hub is down")
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if info:
            return self.info(h, info.group(1), info.group(2) or "main")
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
        if tree:
            return self.tree(h, tree.group(1), tree.group(2))
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve:
            return self.resolve(h, resolve.group(1), resolve.group(2), resolve.group(3), head)
        self.error(h, 404, "EntryNotFound", "no such route")

    def repo(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self.error(h, 404, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
            return None
        if repo.gated and not h.headers.get("Authorization"):
            self.error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted. You must be authenticated.")
            return None
        if revision not in repo.revisions and revision != repo.sha:
            self.error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def info(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> None:
        repo = self.repo(h, repo_id, revision)
        if repo is None:
            return
        siblings = [{"rfilename": f, "size": (repo.folder / f).stat().st_size} for f in repo.files()]
        self.json(h, {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                      "gated": "auto" if repo.gated else False, "siblings": siblings})

    def tree(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> None:
        repo = self.repo(h, repo_id, revision)
        if repo is None:
            return
        entries = [{"type": "file", "path": f, "size": (repo.folder / f).stat().st_size,
                    "oid": hashlib.sha1((repo.folder / f).read_bytes()).hexdigest()} for f in repo.files()]
        self.json(h, entries)

    @staticmethod
    def json(h: BaseHTTPRequestHandler, value: object) -> None:
        body = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def resolve(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, name: str, head: bool) -> None:
        repo = self.repo(h, repo_id, revision)
        if repo is None:
            return
        file = repo.folder / name
        if not file.is_file():
            self.error(h, 404, "EntryNotFound", f"{name} does not exist")
            return
        data = file.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        start = 0
        ranged = h.headers.get("Range")
        if ranged and not head:
            start = int(re.fullmatch(r"bytes=(\d+)-(\d*)", ranged).group(1))
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("X-Linked-Etag", f'"{etag}"')
        h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        cut = self.cut_once.pop(name, None)
        if cut is not None:
            h.wfile.write(data[start:start + cut])
            h.wfile.flush()
            self.down = self.down_after_cut
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(data[start:])

    @staticmethod
    def error(h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
