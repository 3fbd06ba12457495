"""A neighbour who takes a starting server's port never gets the run's key.

The launcher names the port on the server's command line (readable in /proc) before the server
binds it. A neighbour that binds it first and answers ``/health`` must be found out before any
request with ``Authorization: Bearer <key>`` goes there: every socket listening on the port must be
the server's own (``elastic.port_owner``). Nobody listening is no proof: a neighbour that closes its
socket while answering ``/health`` and binds again a moment later is refused too.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading

import pytest

from areal_fast.elastic.port_owner import NOBODY, OTHER, OWN, PortTaken, listener_state, process_tree
from areal_fast.launch.local import LocalLauncher

_LISTENER = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
             "print(s.getsockname()[1], flush=True); time.sleep(60)")


class _Neighbour(http.server.BaseHTTPRequestHandler):
    """Answers 200 to everything and writes down every Authorization header it was sent."""

    seen: list = []

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture()
def neighbour():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Neighbour)
    _Neighbour.seen = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_a_process_owns_its_listening_socket_and_no_other_process_does():
    child = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        assert listener_state(child.pid, port) == OWN
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert listener_state(other.pid, port) == OTHER
        finally:
            other.kill()
            other.wait()
        # a wrapper's child holding the socket counts (a server started through a shell or launcher)
        assert child.pid in process_tree(child.pid)
    finally:
        child.kill()
        child.wait()


def test_the_start_up_wait_refuses_a_port_taken_by_a_neighbour_and_sends_it_no_key(tmp_path, neighbour):
    port = neighbour.server_address[1]
    with LocalLauncher(tmp_path / "logs") as launcher:
        # "our server": still loading its model, not listening yet; the neighbour answers on its port
        p = launcher.start("server0", [sys.executable, "-c", "import time; time.sleep(60)"],
                           url=f"http://127.0.0.1:{port}", critical=False)
        with pytest.raises(PortTaken, match=f"port {port}"):
            launcher.wait_healthy([p], timeout=30)
        assert not p.alive()  # stopped
    assert _Neighbour.seen and all(auth is None for _, auth in _Neighbour.seen), _Neighbour.seen


def test_the_start_up_wait_takes_a_server_listening_itself(tmp_path):
    """The check does not refuse the real thing: a process serving /health on its own port."""
    code = ("import http.server, sys\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers()\n"
            "    def log_message(self, *a): pass\n"
            "s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
            "s.serve_forever()\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with LocalLauncher(tmp_path / "logs") as launcher:
        p = launcher.start("server0", [sys.executable, "-c", code, str(port)], url=f"http://127.0.0.1:{port}",
                           critical=False)
        launcher.wait_healthy([p], timeout=60)
        assert p.alive()


def test_nobody_listening_or_a_listener_beside_the_servers_own_is_no_proof():
    child = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with socket.socket() as held:  # bound, never listened on: nobody listens on its port meanwhile
            held.bind(("127.0.0.1", 0))
            assert listener_state(child.pid, held.getsockname()[1]) == NOBODY
        with socket.socket() as beside:  # another process's listener on the same port, another address
            beside.bind(("127.0.0.2", port))
            beside.listen()
            assert listener_state(child.pid, port) == OTHER
        assert listener_state(child.pid, port) == OWN
    finally:
        child.kill()
        child.wait()


class _Squatter:
    """A neighbour that answers the first ``/health`` while closing its listening socket (nobody listens
    when the launcher looks), then binds the port again ``rebind_s`` later and answers everything,
    writing down every Authorization header it is sent."""

    def __init__(self, rebind_s: float):
        self.first = socket.create_server(("127.0.0.1", 0))
        self.port = self.first.getsockname()[1]
        self.rebind_s = rebind_s
        self.seen: list = []
        self.srv: http.server.ThreadingHTTPServer | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        conn, _ = self.first.accept()
        self.first.close()  # nobody listens on the port from here until the rebind
        self.seen.append((conn.recv(65536).split(b"\r\n")[0].decode(), None))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        conn.close()
        if self._closed.wait(self.rebind_s):  # the squatter's own pause, part of the scenario; or the test ended
            return
        seen = self.seen

        class H(_Neighbour):
            def do_GET(self):
                seen.append((self.path, self.headers.get("Authorization")))
                super().do_GET()

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), H)
        self.srv.serve_forever()

    def close(self):
        self._closed.set()
        if self.srv is not None:
            self.srv.shutdown()
            self.srv.server_close()


@pytest.mark.parametrize("rebind_s", [0.5, None])
def test_a_neighbour_that_stops_listening_while_answering_health_is_refused(tmp_path, rebind_s):
    """It answers /health, closes its socket, and binds the port again half a second later (or never):
    the start-up wait must not take the silence for the server's own socket."""
    squatter = _Squatter(rebind_s if rebind_s is not None else 3600)
    try:
        with LocalLauncher(tmp_path / "logs") as launcher:
            p = launcher.start("server0", [sys.executable, "-c", "import time; time.sleep(60)"],
                               url=f"http://127.0.0.1:{squatter.port}", critical=False)
            silent = rebind_s is None  # refused at the deadline, as nobody's socket; else as another's
            with pytest.raises(PortTaken, match=rf"port {squatter.port} \(nobody listened" if silent else
                               f"another process listens on port {squatter.port}"):
                launcher.wait_healthy([p], timeout=2 if silent else 30)
            assert not p.alive()  # stopped
        assert squatter.seen and all(auth is None for _, auth in squatter.seen), squatter.seen
    finally:
        squatter.close()
