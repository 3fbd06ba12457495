"""The chat API over HTTP, for agent frameworks that build their own OpenAI client (``base_url``).

::

    server = await AgentServer(api_key).start()        # 127.0.0.1, a free port
    base_url = server.open(client)                      # http://127.0.0.1:P/episodes/<token>/v1
    openai.AsyncOpenAI(base_url=base_url, api_key=api_key)   # -> POST <base_url>/chat/completions
    server.close_episode(base_url)

One listener serves every episode of a process; each episode has its own ``base_url`` (a random
token in the path), so an agent's calls land in its own episode's record. Routes, under
``/episodes/<token>/v1``: ``POST /chat/completions`` (the same checks and answer as the in-process
client: ``areal_fast.agent.request``, ``areal_fast.agent.completion``; with ``stream=True`` a
``text/event-stream`` of the whole answer once generated, ``areal_fast.agent.stream``) and
``GET /models``.

Every request needs the run's key (``Authorization: Bearer <key>``), checked by the one check of
our listeners (``areal_fast.rollout.auth``): 401 otherwise. A run without a key gets a fresh
random one for this listener (``AgentServer(None)``), handed to the agent with ``base_url``. The
listener binds 127.0.0.1 unless told otherwise. Errors have the OpenAI API's shape
(``{"error": {"message", "type", "param", "code"}}``): 400 for a refused request (the SDK raises
``BadRequestError``), 401 for the key, 404 for an episode that is over or never was.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import weakref

from aiohttp import web

from areal_fast.agent.completion import completion_dict
from areal_fast.agent.request import ChatRequestError
from areal_fast.agent.stream import chunk_dicts, sse_body
from areal_fast.rollout.auth import authorized

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20  # a long conversation with tool results; more is a mistake


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


class AgentServer:
    """See the module docstring."""

    def __init__(self, api_key: str | None, host: str = "127.0.0.1", port: int = 0):
        self.api_key = api_key or secrets.token_hex(32)
        self.host, self.port = host, port
        self._clients: dict[str, object] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> AgentServer:
        app = web.Application(middlewares=[self._auth], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/episodes/{token}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{token}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

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
        """Serve ``client`` (an ``AgentClient``) under a new ``base_url``, returned and set on it."""
        token = secrets.token_urlsafe(12)
        self._clients[token] = client
        client.base_url, client.api_key = f"{self.url}/episodes/{token}/v1", self.api_key
        return client.base_url

    def close_episode(self, base_url: str) -> None:
        """Stop serving the episode at ``base_url`` (later requests: 404)."""
        self._clients.pop(base_url.rstrip("/").split("/")[-2], None)

    # ------------------------------------------------------------------ routes
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if not authorized(self.api_key, request.path, request.headers.get("Authorization")):
            return _error(401, "invalid or missing API key (Authorization: Bearer <the run's key>)",
                          "invalid_request_error", code="invalid_api_key")
        return await handler(request)

    def _client(self, request: web.Request):
        client = self._clients.get(request.match_info["token"])
        if client is None:
            raise web.HTTPNotFound(text=json.dumps({"error": {"message": "no such episode (it is over, or this "
                                                              "base_url was never handed out)",
                                                              "type": "invalid_request_error", "param": None,
                                                              "code": "episode_not_found"}}),
                                   content_type="application/json")
        return client

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        client = self._client(request)
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return _error(400, f"the request body is not JSON: {e}", "invalid_request_error")
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

    async def _models(self, request: web.Request) -> web.Response:
        model = self._client(request).session.model
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                               "owned_by": "areal_fast"}]})


_shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def shared_server(api_key: str | None) -> AgentServer:
    """The listener of this event loop for the run's key, started on first use (episodes of one
    process share it; it closes with the process)."""
    starts = _shared.setdefault(asyncio.get_running_loop(), {})
    start = starts.get(api_key)
    if start is None:  # concurrent first episodes wait for the same start
        start = starts[api_key] = asyncio.ensure_future(AgentServer(api_key).start())
    try:
        return await asyncio.shield(start)
    except Exception:
        if start.done():
            starts.pop(api_key, None)  # the next episode tries again
        raise
