"""The fakes that several test files share, one home for each behaviour.

Where two fakes differ on purpose they both live here under names that say how (``MatchReward``
scores the answer, ``ConstantReward`` does not look at it). A test that needs one behaviour of its own
subclasses a fake here in its own file.

* prompts: :class:`Row`, :class:`Prompts`;
* tokenizers: :class:`ParityTok` (the controller tests': the answer is "x" or "y" by the last
  token's parity, so a reward sees both), :class:`LetterTok` (the workflow tests': a BOS switch and
  one letter per token, so multi-turn text differs turn by turn);
* rewards: :class:`MatchReward`, :class:`ConstantReward`, :class:`LengthReward`;
* weight sync: :class:`VersionSync` (tells the fake servers the new version, checking that
  generation is paused when asked to);
* trainers: :class:`GroupListTrainer` (its weights are the list of group positions it trained:
  saved, checked and loaded, so a resume can be checked exactly), :class:`RecordingTrainer` (keeps
  every sample, optionally the trainer batch code's tensors, and can hold a step back),
  :class:`UpdateRecordingTrainer` (the weight port's side: records each ``update_weights``);
* servers: :class:`ServerState` with :class:`VersionTaggingRollout` (generation in process, each
  token tagged with the version the servers hold, interrupted by a pause) and :func:`make_controller`
  (a Controller over them with the production gate, the bound asserted); :class:`FakeServer` (one
  SGLang server's weight-update endpoints over real HTTP, below).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist
from packaging.version import Version

from areal_fast.controller import Controller, ControllerSettings
from areal_fast.rollout.staleness import StalenessManager
from areal_fast.sample import Sample
from areal_fast.trainer.batch import as_sample, to_seq

# ----------------------------------------------------------------------------- prompts


@dataclass
class Row:
    index: int
    text: str
    task: dict


class Prompts:
    """Prompt ``pos`` is row ``pos % n``: text ``p<i>``, answer ``x``."""

    def __init__(self, n: int = 1000):
        self.n = n

    def at(self, pos):
        i = pos % self.n
        return Row(i, f"p{i}", {"answer": "x"})


# ----------------------------------------------------------------------------- tokenizers


class ParityTok:
    """BOS 1, one id per character; decodes any answer to "x" (last id odd) or "y"."""

    eos_token_id = 0

    def encode(self, text):
        return [1] + [ord(c) % 50 + 2 for c in text]

    def decode(self, ids):
        return "x" if ids and ids[-1] % 2 else "y"


class LetterTok:
    """BOS 1 when ``add_bos``, one id per character, EOS 2; decodes each id but EOS to a letter."""

    eos_token_id = 2

    def encode(self, text, add_bos=True):
        return ([1] if add_bos else []) + [10 + ord(c) % 40 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids if i != self.eos_token_id)


# ----------------------------------------------------------------------------- rewards


@dataclass
class Score:
    value: float
    status: str = "ok"
    detail: str = ""


class MatchReward:
    """1.0 when the completion is the task's answer, else 0.0."""

    async def score(self, task, completion):
        return Score(1.0 if completion == task["answer"] else 0.0)


class ConstantReward:
    """The same value whatever the completion."""

    def __init__(self, value: float = 1.0):
        self.value = value

    async def score(self, task, completion):
        return Score(self.value)


class LengthReward:
    """The completion's length modulo 3 (0, 1 or 2: groups get different rewards)."""

    async def score(self, task, completion):
        return Score(float(len(completion) % 3))


# ----------------------------------------------------------------------------- weight sync


class VersionSync:
    """Sets ``target.version`` (the fake servers' weights). With ``paused`` (a check of the target),
    asserts that generation is paused during the sync; ``delay_s`` lets other tasks run meanwhile."""

    def __init__(self, target, paused: Callable[[], bool] | None = None, delay_s: float = 0.0):
        self.target, self.paused, self.delay_s = target, paused, delay_s

    async def sync(self, version):
        if self.paused is not None:
            assert self.paused(), "weights must be synced while generation is paused"
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.target.version = version
        return {}


# ----------------------------------------------------------------------------- trainers


class GroupListTrainer:
    """Its 'weights' are the list of group positions trained so far (saved, checked and loaded)."""

    def __init__(self):
        self.trained: list[int] = []
        self.steps: list[dict] = []

    def train(self, samples, version):
        groups = sorted({s.group_id for s in samples})
        self.trained.extend(groups)
        self.steps.append({"groups": groups, "versions": [v for s in samples for v in s.output_versions]})
        return {"loss": 0.0}

    def save(self, path: Path, version: int):
        path.mkdir(parents=True, exist_ok=True)
        (path / "t.json").write_text(json.dumps(self.trained))

    def check(self, path: Path):
        json.loads((path / "t.json").read_text())

    def load(self, path: Path):
        self.trained = json.loads((path / "t.json").read_text())


HOLD_WAIT_S = 60.0  # limit of a held step's wait (fake generations take milliseconds)


class RecordingTrainer:
    """Keeps every sample handed to it; with ``keep_seqs`` also what the trainer's batch code makes
    of each (``seqs``). With ``hold_until`` set, a step returns only once that condition holds
    (checked on the controller's state from the trainer's thread), e.g. so that a checkpoint surely
    holds a buffered group."""

    def __init__(self, keep_seqs: bool = False):
        self.samples: list[Sample] = []
        self.seqs = []
        self.keep_seqs = keep_seqs
        self.hold_until: Callable[[], bool] | None = None

    def train(self, samples, version):
        deadline = time.monotonic() + HOLD_WAIT_S
        while self.hold_until is not None and not self.hold_until():
            assert time.monotonic() < deadline, "the condition the trainer waited for never held"
            time.sleep(0.001)
        self.samples += samples
        if self.keep_seqs:
            self.seqs += [to_seq(as_sample(s, i)) for i, s in enumerate(samples)]
        return {}

    def save(self, path: Path, version: int):
        path.mkdir(parents=True, exist_ok=True)

    def load(self, path: Path):
        pass


class UpdateRecordingTrainer:
    """The trainer side of the weight port: records ``(spec, version)`` of each update; ``fail``
    maps a spec to the exception to raise (or None)."""

    def __init__(self, fail=None):
        self.calls: list = []
        self.fail = fail or (lambda spec: None)

    def update_weights(self, spec, version):
        self.calls.append((spec, version))
        err = self.fail(spec)
        if err is not None:
            raise err


class ServerListPool:
    """The pool side of the weight port and rank 0's watchdog: a list of server urls; ``dead`` are
    the ones ``is_dead`` reports; ``removed`` records ``remove_server`` calls; ``allow_empty`` as
    the rollout port's (rank 0 sets it when the pool may become empty)."""

    def __init__(self, urls=(), dead=()):
        self._urls, self.dead = list(urls), set(dead)
        self.removed: list[str] = []
        self.allow_empty = False

    @property
    def urls(self):
        return list(self._urls)

    def is_dead(self, url):
        return url in self.dead

    def remove_server(self, url):
        self._urls.remove(url)
        self.removed.append(url)
        return True

    async def add_server(self, url):
        self._urls.append(url)


# ----------------------------------------------------------------------------- in-process servers


class ServerState:
    """What the fake servers share: the weight version they hold and whether they are paused."""

    def __init__(self):
        self.version = 0
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()


class VersionTaggingRollout:
    """Each sample takes a random number of 'decode steps'; tokens carry the server version at the
    moment they are made, and a pause interrupts and resumes them (like the real client).
    ``slow_positions`` keep generating until the version is 3 (a long tail); ``fail_position`` raises."""

    def __init__(self, server: ServerState, seed=0, slow_positions=(), fail_position=None):
        self.server, self.rng = server, random.Random(seed)
        self.slow, self.fail = set(slow_positions), fail_position

    async def generate(self, input_ids, sampling, rid):
        pos = int(rid.split("-")[1]) if "eval" not in rid else -1
        if pos == self.fail:
            raise RuntimeError("generation failed on purpose")
        n = self.rng.choice([1, 2, 3, 8])
        out, vers = [], []
        while len(out) < n or (pos in self.slow and self.server.version < 3):
            await self.server.resumed.wait()
            await asyncio.sleep(0.001)
            out.append(self.rng.randrange(1, 9))
            vers.append(self.server.version)
        return Sample(prompt_ids=input_ids, output_ids=out, output_logprobs=[-0.5] * len(out),
                      output_versions=vers, finish_reason="stop")

    async def pause(self):
        self.server.paused = True
        self.server.resumed.clear()

    async def resume(self):
        self.server.paused = False
        self.server.resumed.set()


class CheckedGate(StalenessManager):
    """The production gate, asserting the staleness bound after every admission."""

    def try_admit(self):
        ok = super().try_admit()
        if ok:
            assert self.accepted + self.running <= (self.max_staleness + self.version + 1) * self.batch_size
        return ok


def make_controller(tmp_path, *, eta=2, steps=6, B=2, n=2, strict=False, ckpt=0, seed=0, gate=None, rollout_kw=None,
                    server=None, resume_key=None):
    """A Controller over in-process fakes: ``(controller, GroupListTrainer, ServerState)``."""
    server = server or ServerState()
    s = ControllerSettings(batch_size=B, group_size=n, total_steps=steps,
                           sampling={"max_new_tokens": 8}, eval_sampling={"temperature": 0.0},
                           eval_every=0, eval_at_start=False, checkpoint_every=ckpt,
                           output_dir=tmp_path, resume_key=resume_key or {"seed": 0})
    trainer = GroupListTrainer()
    gate = gate or CheckedGate(B, eta, max_concurrent=16, strict=strict)
    rollout = VersionTaggingRollout(server, seed, **(rollout_kw or {}))
    sync = VersionSync(server, paused=lambda: server.paused, delay_s=0.001)
    ctl = Controller(s, Prompts(), ParityTok(), rollout, MatchReward(), trainer, sync, gate)
    return ctl, trainer, server


# ----------------------------------------------------------------------------- an SGLang server's weight endpoints
# An in-process stand-in for one SGLang server's weight-update endpoints (tests only).
#
# A threaded HTTP server on 127.0.0.1 that behaves, for the endpoints weight sync uses, the way
# SGLang of ``version`` does:
#
# * ``/server_info`` (and ``/get_server_info``) with tp/dp/pp sizes and the version;
# * ``--api-key`` semantics: with ``api_key`` set every endpoint but ``/health`` needs
#   ``Authorization: Bearer KEY`` (401 otherwise);
# * sessions from 0.5.21: a second begin, an end without begin, and a distributed or tensor
#   update outside a session are refused with 400 and success=false, *before* taking part in
#   any broadcast; disk updates need no session;
# * ``/init_weights_update_group`` joins the group as rank ``rank_offset`` (tp 1) through the same
#   ``tcp://`` rendezvous as SGLang (so ``TORCHELASTIC_USE_AGENT_STORE`` affects it the same way)
#   and the same store keys; the gloo backend is built directly because torch refuses two
#   groups of one name in one process (the trainer's and this one); then
#   ``/update_weights_from_distributed`` receives flattened buckets or per-tensor broadcasts
#   into ``received``;
# * ``refuse_bucket_with`` (a tensor name): the first bucket holding it is received, then refused.
#
# Every request is recorded in ``calls`` as ``(path, body, authorization header)``.


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
