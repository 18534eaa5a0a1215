"""A real HTTP server on loopback that answers GET requests from a function of the path: what the TUI tests stand
up where a real engine cannot run (twenty engines at once, an engine newer than this bsr)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[str], tuple[bytes, str] | None]  # path (no query) -> (body, content type), or None for a 404


def json_answer(body: Any) -> tuple[bytes, str] | None:
    """``body`` as a JSON answer; None (a 404) when there is none."""
    return None if body is None else (json.dumps(body).encode(), "application/json")


class AnsweringServer:
    def __init__(self, answer: Answer) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                found = answer(self.path.split("?", 1)[0])
                body, ctype = found if found is not None else (b"", "text/plain")
                self.send_response(200 if found is not None else 404)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """The process is gone: the port refuses connections from now on."""
        self.server.shutdown()
        self.server.server_close()
