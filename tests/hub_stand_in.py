"""A stand-in for the Hugging Face Hub's file endpoint, for ``HF_ENDPOINT``: nothing here can reach the Hub.

It answers ``huggingface_hub``'s own requests (``HEAD`` then ``GET`` of ``/{repo}/resolve/{revision}/{file}``)
with the headers that library reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``) and its error codes: a
gated repository answers only to its token (``X-Error-Code: GatedRepo`` otherwise), an unknown one
``RepoNotFound``. What reaches the Hub client is what the Hub would send for a config.json.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class HubStandIn:
    files: dict[str, dict[str, bytes]]
    """Repository id -> file name -> content."""
    tokens: dict[str, str] = field(default_factory=dict)
    """Gated repositories: repository id -> the one token that may read it."""
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    """(method, path, Authorization header) of every request, for the tests to read."""
    url: str = ""

    def answer(self, method: str, path: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((method, path, authorization))
        repo, _, rest = path.lstrip("/").partition("/resolve/")
        _revision, _, name = rest.partition("/")
        if repo not in self.files:
            return 404, {"X-Error-Code": "RepoNotFound"}, b"Repository not found"
        token = self.tokens.get(repo)
        if token is not None and authorization != f"Bearer {token}":
            return 403, {"X-Error-Code": "GatedRepo"}, b"Access to this gated repository is restricted"
        content = self.files[repo].get(name)
        if content is None:
            return 404, {"X-Error-Code": "EntryNotFound"}, b"Entry not found"
        commit = hashlib.sha1(repo.encode()).hexdigest()
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(content).hexdigest()}"'}, content


@contextmanager
def hub_stand_in(files: dict[str, dict[str, bytes]], tokens: dict[str, str] | None = None) -> Iterator[HubStandIn]:
    """The stand-in, serving on a free port of 127.0.0.1 while the context lasts (``.url`` for HF_ENDPOINT)."""
    hub = HubStandIn(files, dict(tokens or {}))

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: bool) -> None:
            status, headers, content = hub.answer(self.command, self.path, self.headers.get("Authorization"))
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(content))}.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(content)

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self._reply(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._reply(body=True)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
