"""An in-process stand-in for one SGLang server's weight-update endpoints (tests only).

A threaded HTTP server on 127.0.0.1 that behaves, for the endpoints weight sync uses, the way
SGLang of ``version`` does:

* ``/server_info`` (and ``/get_server_info``) with tp/dp/pp sizes and the version;
* ``--api-key`` semantics: with ``api_key`` set every endpoint but ``/health`` needs
  ``Authorization: Bearer KEY`` (401 otherwise);
* sessions from 0.5.21: a second begin, an end without begin, and a distributed or tensor
  update outside a session are refused with 400 and success=false, *before* taking part in
  any broadcast; disk updates need no session;
* ``/init_weights_update_group`` joins the group as rank ``rank_offset`` (tp 1) through the same
  ``tcp://`` rendezvous as SGLang (so ``TORCHELASTIC_USE_AGENT_STORE`` affects it the same way)
  and the same store keys; the gloo backend is built directly because torch refuses two
  groups of one name in one process (the trainer's and this one); then
  ``/update_weights_from_distributed`` receives flattened buckets or per-tensor broadcasts
  into ``received``;
* ``refuse_bucket_with`` (a tensor name): the first bucket holding it is received, then refused.

Every request is recorded in ``calls`` as ``(path, body, authorization header)``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist
from packaging.version import Version


def _join_gloo_group(master: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float):
    """The server side of a gloo weight group, with the keys ``_new_process_group_helper`` uses
    (``PrefixStore(group_name)`` as SGLang wraps it, then ``{group_name}/`` and ``cpu/``)."""
    import datetime

    from torch.distributed.distributed_c10d import PrefixStore, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master}:{port}", rank, world_size, timeout=timeout))
    store = PrefixStore("cpu/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast(pg, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([t], opts).wait()


class FakeServer:
    def __init__(self, version: str = "0.5.23", tp: int = 1, dp: int = 1, pp: int = 1, api_key: str | None = None,
                 refuse_bucket_with: str | None = None, refuse_begin: bool = False, down: bool = False):
        self.version, self.tp, self.dp, self.pp = version, tp, dp, pp
        self.api_key = api_key
        self.refuse_bucket_with = refuse_bucket_with
        self.refuse_begin = refuse_begin
        self.down = down  # answer 503 everywhere, like a server still starting
        self.sessions = Version(version) >= Version("0.5.21")
        self.session_open = False
        self.calls: list[tuple[str, dict | None, str | None]] = []
        self.received: dict[str, torch.Tensor] = {}
        self.weight_version = "default"
        self.pg = None
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def paths(self) -> list[str]:
        return [p for p, _b, _a in self.calls]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.pg = None

    # ------------------------------------------------------------------------------------------
    def _answer(self, path: str, body: dict | None) -> tuple[int, dict]:
        if self.down:
            return 503, {"error": "starting"}
        if path in ("/server_info", "/get_server_info"):
            return 200, {"version": self.version, "tp_size": self.tp, "dp_size": self.dp, "pp_size": self.pp,
                         "weight_version": self.weight_version}
        if path == "/begin_weight_update" and self.sessions:
            if self.refuse_begin:
                return 400, {"success": False, "message": "begin refused (test)"}
            with self.lock:
                if self.session_open:
                    return 400, {"success": False, "message": "a weight-update session is already open; "
                                 "call end_weight_update() first"}
                self.session_open = True
            return 200, {"success": True, "message": "Success"}
        if path == "/end_weight_update" and self.sessions:
            with self.lock:
                if not self.session_open:
                    return 400, {"success": False, "message": "no weight-update session is open"}
                self.session_open = False
            return 200, {"success": True, "message": "Success"}
        if path == "/init_weights_update_group":
            if body.get("backend") != "gloo":
                return 400, {"success": False, "message": f"test server joins gloo groups only, got {body}"}
            self.pg = _join_gloo_group(body["master_address"], body["master_port"], body["world_size"],
                                       body["rank_offset"], body["group_name"], 60)
            return 200, {"success": True, "message": "ok"}
        if path == "/destroy_weights_update_group":
            self.pg = None
            return 200, {"success": True, "message": "ok"}
        if path == "/update_weights_from_distributed":
            if self.sessions and not self.session_open:
                return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                             "begin_weight_update() and end_weight_update()"}
            got = self._receive(body)
            if self.refuse_bucket_with in got:
                self.refuse_bucket_with = None  # once
                return 400, {"success": False, "message": "Failed to update parameter online: test refusal"}
            self.received.update(got)
            self.weight_version = body.get("weight_version") or self.weight_version
            return 200, {"success": True, "message": "ok"}
        if path == "/update_weights_from_disk":
            self.weight_version = body.get("weight_version") or self.weight_version
            return 200, {"success": True, "message": "ok", "num_paused_requests": 0}
        return 404, {"detail": "Not Found"}

    def _receive(self, body: dict) -> dict[str, torch.Tensor]:
        metas = [(n, getattr(torch, d), torch.Size(s)) for n, d, s in zip(body["names"], body["dtypes"],
                                                                        body["shapes"])]
        if body.get("load_format") == "flattened_bucket":  # back to back, as SGLang unpacks it
            total = sum(dt.itemsize * s.numel() for _n, dt, s in metas)
            buf = torch.empty(total, dtype=torch.uint8)
            _broadcast(self.pg, buf)
            out, off = {}, 0
            for n, dt, s in metas:
                nb = dt.itemsize * s.numel()
                out[n] = buf[off : off + nb].view(dt).view(s).clone()
                off += nb
            return out
        out = {}
        for n, dt, s in metas:
            t = torch.empty(s, dtype=dt)
            _broadcast(self.pg, t)
            out[n] = t
        return out

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _do(self, method: str):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                auth = self.headers.get("Authorization")
                path = self.path.split("?")[0]
                server.calls.append((path, body, auth))
                if server.api_key and path not in ("/health", "/health_generate") and \
                        auth != f"Bearer {server.api_key}":
                    code, ans = 401, {"error": "Unauthorized"}
                else:
                    try:
                        code, ans = server._answer(path, body)
                    except Exception as e:  # noqa: BLE001 - the test sees it as success=false
                        code, ans = 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
                raw = json.dumps(ans).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._do("GET")

            def do_POST(self):
                self._do("POST")

        return Handler
