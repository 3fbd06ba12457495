"""The chat API over HTTP, for agent frameworks that build their own OpenAI client (``base_url``).

::

    server = await AgentServer().start()                # 127.0.0.1, a free port
    base_url = server.open(client)                      # http://127.0.0.1:P/episodes/<token>/v1
    openai.AsyncOpenAI(base_url=base_url, api_key=client.api_key)   # -> POST <base_url>/chat/completions
    server.close_episode(base_url)

One listener serves every episode of a process; each episode has its own ``base_url`` (a random
token in the path), so an agent's calls land in its own episode's record. Routes, under
``/episodes/<token>/v1``: ``POST /chat/completions`` (the same checks and answer as the in-process
client: ``areal_fast.agent.request``, ``areal_fast.agent.completion``; with ``stream=True`` a
``text/event-stream`` of the whole answer once generated, ``areal_fast.agent.stream``),
``POST /responses`` (the Responses API on the same recording, ``areal_fast.agent.responses``),
``GET /models``, and ``POST /reward`` with ``{"reward": <number>}``: the episode's final reward,
for an agent that runs elsewhere (its own process, any language); it ends the episode (later
calls: 404, as for an episode that is over; a second reward: 409).

Each episode has a key of its own (``secrets.token_hex(32)``, made by ``open`` and set on the
client with ``base_url``): a request needs ``Authorization: Bearer <the episode's key>``, checked
by the one check of our listeners (``areal_fast.http.auth``), and the key opens that episode's
routes only; it ends with the episode. Any other path of this listener is a 401 whatever the key.
The run's key (the inference servers') is never used here
nor handed to agent code: an agent's key cannot call the engine (load weights, pause, abort).
Idle and unauthenticated connections are limited as on the engine (``areal_fast.http.conn_guard``),
the cap on connections without a key counted beyond one per open episode (the episodes' own
connections, which a loaded event loop may keep from writing their first request for seconds).
The listener binds 127.0.0.1 unless told otherwise. Errors have the OpenAI API's shape
(``{"error": {"message", "type", "param", "code"}}``): 400 for a refused request (the SDK raises
``BadRequestError``; a body that is not JSON, nested past the decoder's limit or holding an integer
of more than 4,300 digits included), 401 for the key, 404 for an episode that is over or never was
(also one that ended while the request was on its way: its reward then sets nothing).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import weakref

from aiohttp import web

from areal_fast.agent import responses
from areal_fast.agent.completion import completion_dict
from areal_fast.agent.request import ChatRequestError, culprit
from areal_fast.agent.stream import chunk_dicts, sse_body
from areal_fast.configutil import finite_number
from areal_fast.http.conn_guard import ConnLimits, authorize, start_site

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20  # a long conversation with tool results; more is a mistake


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


def _episode_not_found() -> web.HTTPNotFound:
    return web.HTTPNotFound(text=json.dumps({"error": {"message": "no such episode (it is over, or this base_url "
                                                       "was never handed out)", "type": "invalid_request_error",
                                                       "param": None, "code": "episode_not_found"}}),
                            content_type="application/json")


class AgentServer:
    """See the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, conn_limits: ConnLimits | None = None):
        self.host, self.port = host, port
        self.conn_limits = conn_limits or ConnLimits()
        self._episodes: dict[str, tuple[object, str]] = {}  # token -> (client, the episode's key)
        self._ended: dict[str, asyncio.Event] = {}  # token -> set when its reward is set over HTTP
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> AgentServer:
        app = web.Application(middlewares=[self._auth], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/episodes/{token}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{token}/v1/models", self._models)
        app.router.add_post("/episodes/{token}/v1/responses", self._responses)
        app.router.add_post("/episodes/{token}/v1/reward", self._reward)
        # each open episode may be connecting (its agent shares this event loop: on a loaded loop its
        # request can come past the cap's grace); the cap counts connections beyond those
        self._runner = await start_site(app, self.host, self.port, self.conn_limits,
                                        known_clients=lambda: len(self._episodes))
        self.port = self._runner.addresses[0][1]
        return self

    @property
    def app(self):
        """The listener's ``aiohttp`` application (None before :meth:`start`)."""
        return None if self._runner is None else self._runner.app

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> AgentServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ episodes
    def open(self, client) -> str:
        """Serve ``client`` (an ``AgentClient``) under a new ``base_url`` with a new key of its own;
        the ``base_url`` is returned, and both are set on the client (``base_url``, ``api_key``)."""
        token, key = secrets.token_urlsafe(12), secrets.token_hex(32)
        self._episodes[token] = (client, key)
        self._ended[token] = asyncio.Event()
        client.base_url, client.api_key = f"{self.url}/episodes/{token}/v1", key
        return client.base_url

    def close_episode(self, base_url: str) -> None:
        """Stop serving the episode at ``base_url`` (later requests: 404; its key opens nothing)."""
        token = _token(base_url)
        self._episodes.pop(token, None)
        self._ended.pop(token, None)

    def client_of(self, base_url: str):
        """The client (``AgentClient``) of the episode served at ``base_url`` (KeyError when none)."""
        return self._episodes[_token(base_url)][0]

    async def wait_ended(self, base_url: str) -> float:
        """Wait until the episode at ``base_url`` gets its reward over HTTP; that reward."""
        token = _token(base_url)
        session = self._episodes[token][0].session  # kept: the episode may be closed while this waits
        await self._ended[token].wait()
        return session.final_reward

    # ------------------------------------------------------------------ routes
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = request.match_info.get("token")
        if token is None:  # no episode's route: no key opens it
            return _error(401, f"{request.path} is not an episode's route; this listener serves "
                          "/episodes/<token>/v1/... only, each behind its episode's key", "invalid_request_error",
                          code="invalid_api_key")
        episode = self._episodes.get(token)
        if episode is None:
            raise _episode_not_found()
        if not authorize(request, episode[1]):  # http/auth.py's check, via http/conn_guard.py
            return _error(401, "invalid or missing API key (Authorization: Bearer <this episode's key>, "
                          "the api_key handed out with its base_url)", "invalid_request_error",
                          code="invalid_api_key")
        return await handler(request)

    def _client(self, request: web.Request):
        token = request.match_info["token"]
        episode = self._episodes.get(token)
        if episode is None or self._ended[token].is_set():  # closed or ended after its key was checked
            raise _episode_not_found()
        return episode[0]

    @staticmethod
    async def _json(request: web.Request):
        try:
            return json.loads(await request.read())
        except (ValueError, RecursionError) as e:  # RecursionError: nested past the decoder's limit
            raise web.HTTPBadRequest(text=json.dumps({"error": {
                "message": f"the request body is not JSON: {e}", "type": "invalid_request_error", "param": None,
                "code": None}}), content_type="application/json") from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        client = self._client(request)
        body = await self._json(request)
        try:
            call = await client.session.create(body)
        except ChatRequestError as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        if not call.answer.stream:
            return web.json_response(completion_dict(call, client.session))
        # checked and generated already: nothing can fail once the 200 is sent
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(sse_body(chunk_dicts(call, client.session)))
        await response.write_eof()
        return response

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        client = self._client(request)
        body = await self._json(request)
        try:
            stream = responses.wants_stream(body) if isinstance(body, dict) else False
            _, data = await responses.create_response(client.session, body)
        except ChatRequestError as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        if not stream:
            return web.json_response(data)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(b"".join(f"event: {e['type']}\ndata: ".encode() + json.dumps(e).encode() + b"\n\n"
                                      for e in responses.event_dicts(data)))
        await response.write_eof()
        return response

    async def _reward(self, request: web.Request) -> web.Response:
        token = request.match_info["token"]
        body = await self._json(request)
        # looked up after the body came: the episode may have been closed meanwhile (then a 404)
        episode, ended = self._episodes.get(token), self._ended.get(token)
        if episode is None or ended is None:
            raise _episode_not_found()
        session = episode[0].session
        value = body.get("reward") if isinstance(body, dict) else None
        if not finite_number(value):
            return _error(400, f"reward: expected a finite number, got {culprit(value)} (body: {{\"reward\": "
                          "<number>}})", "invalid_request_error", "reward")
        if ended.is_set():
            return _error(409, "this episode's reward is already set", "invalid_request_error", "reward")
        session.final_reward = float(value)
        ended.set()  # the episode is over: its routes answer 404 from now on
        return web.json_response({"reward": float(value), "calls": len(session.calls), "ended": True})

    async def _models(self, request: web.Request) -> web.Response:
        model = self._client(request).session.model
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                               "owned_by": "areal_fast"}]})


def _token(base_url: str) -> str:
    return str(base_url).rstrip("/").split("/")[-2]


_shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def shared_server() -> AgentServer:
    """The listener of this event loop, started on first use (episodes of one process share it;
    it closes with the process)."""
    loop = asyncio.get_running_loop()
    start = _shared.get(loop)
    if start is None:  # concurrent first episodes wait for the same start
        start = _shared[loop] = asyncio.ensure_future(AgentServer().start())
    try:
        return await asyncio.shield(start)
    except Exception:
        if start.done() and _shared.get(loop) is start:
            del _shared[loop]  # the next episode tries again
        raise
