"""Slow tokenless sockets against a server, from a process of their own (so the attack does not share the test's
interpreter lock with the server it attacks): ``python tests/unit/loris.py HOST PORT COUNT ADDRESSES``.

COUNT sockets are spread over ADDRESSES loopback source addresses (127.0.0.2, 127.0.0.3, ...: each socket is bound
to its address before it connects, so the server sees that many clients). Half of them send the start of a request
head and then one more byte every second; the other half send nothing. A socket the server closes (or answers:
a 503 busy) is opened again at once, as an attacker holding the server's connections does. Prints ``ready`` once
every socket has connected for the first time, ``churned`` each time the server has closed as many sockets as it
holds (they were all reopened once, on average), and runs until its standard input closes; then it prints one JSON
line: how many sockets it reopened and how many answers (503 busy) it read.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import socket
import sys
import threading
import time

PARTIAL_HEAD = b"GET /bsr/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
TRICKLE_S = 1.0


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


class Attack:
    def __init__(self, host: str, port: int, count: int, addresses: int) -> None:
        self.target = (host, port)
        self.count, self.addresses = count, addresses
        self.sel = selectors.DefaultSelector()
        self.socks: dict[int, socket.socket] = {}  # by index
        self.connected: set[int] = set()
        self.reopened = 0
        self.answered = 0
        self.ever: set[int] = set()

    def open(self, i: int) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((f"127.0.0.{2 + i % self.addresses}", 0))
        err = s.connect_ex(self.target)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return
        self.socks[i] = s
        self.sel.register(s, selectors.EVENT_WRITE, i)

    def drop(self, i: int) -> None:
        s = self.socks.pop(i, None)
        self.connected.discard(i)
        if s is not None:
            self.sel.unregister(s)
            s.close()

    def on_event(self, i: int, mask: int) -> None:
        s = self.socks[i]
        if i not in self.connected:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.drop(i)
                return
            self.connected.add(i)
            self.ever.add(i)
            self.sel.modify(s, selectors.EVENT_READ, i)
            if i % 2 == 0:
                self._send(i, PARTIAL_HEAD)
            return
        try:
            data = s.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.answered += 1
        self.drop(i)  # closed or answered: the attacker comes back at once
        self.reopened += 1
        if self.reopened % self.count == 0:
            print("churned", flush=True)

    def _send(self, i: int, data: bytes) -> None:
        try:
            self.socks[i].send(data)
        except OSError:
            self.drop(i)

    def run(self, stop: threading.Event) -> None:
        for i in range(self.count):
            self.open(i)
        said_ready = False
        next_trickle = time.monotonic() + TRICKLE_S
        while not stop.is_set():
            for key, mask in self.sel.select(timeout=0.05):
                if key.data in self.socks:
                    self.on_event(key.data, mask)
            for i in range(self.count):
                if i not in self.socks:
                    self.open(i)
            if not said_ready and len(self.ever) == self.count:
                said_ready = True
                print("ready", flush=True)
            if time.monotonic() >= next_trickle:
                next_trickle += TRICKLE_S
                for i in list(self.connected):
                    if i % 2 == 0:
                        self._send(i, b"X")


def main() -> None:
    host, port, count, addresses = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    raise_fd_limit(count + 256)
    attack = Attack(host, port, count, addresses)
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    attack.run(stop)
    print(json.dumps({"reopened": attack.reopened, "answered": attack.answered}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
