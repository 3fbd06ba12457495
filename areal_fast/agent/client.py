"""The in-process chat client of an episode: behaves as ``openai.AsyncOpenAI`` for
``chat.completions.create``.

::

    client = engine.openai()                     # in a workflow (one per episode)
    r = await client.chat.completions.create(model=client.model, messages=[...], tools=[...])
    r.choices[0].message.tool_calls              # openai.types.chat.ChatCompletion when installed
    client.set_reward(r.id, 1.0)                 # per-turn reward of that completion
    async for chunk in await client.chat.completions.create(..., stream=True):   # as the SDK's AsyncStream
        chunk.choices[0].delta.content if chunk.choices else chunk.usage

``create`` takes the SDK's own keywords as ``AsyncOpenAI`` does (frameworks such as openai-agents
pass them on every call): a parameter given as ``openai.NOT_GIVEN`` or ``openai.omit`` is absent;
``extra_body``'s keys are parameters of the request, as the SDK merges them into the JSON body
(so they are checked as any other: an unknown one is a 400 naming it); ``extra_headers`` and
``extra_query`` are accepted and have nothing to act on in process (our HTTP endpoint ignores them
too); ``timeout`` (seconds, an ``httpx`` timeout whose ``read`` part counts, or None) raises
``openai.APITimeoutError`` (``TimeoutError`` without openai) when the answer takes longer. As over
HTTP, where the server finishes a turn whose client left, the turn goes on and is recorded.

Each call goes through the episode's engine handle (the rollout port: interrupted and resumed
across weight updates, each token with its version) and is recorded (``client.calls``). A refused
request raises :class:`~areal_fast.agent.request.ChatRequestError` (``status_code`` 400, ``param``)
here, and answers 400 over HTTP, where the openai SDK raises ``BadRequestError``.
:mod:`areal_fast.agent.trajectories` turns the calls into trajectories.
"""

from __future__ import annotations

from areal_fast.agent.completion import as_completion, completion_dict
from areal_fast.agent.limits import TurnLimits
from areal_fast.agent.request import ChatRequestError
from areal_fast.agent.responses import Responses
from areal_fast.agent.sdk_args import sdk_body, within
from areal_fast.agent.session import DEFAULT_MODEL, ChatCall, Session
from areal_fast.agent.stream import ChunkStream, chunk_dicts
from areal_fast.agent.template import template_for

__all__ = ["AgentClient", "ChatRequestError"]


class _Completions:
    def __init__(self, session: Session):
        self._session = session

    async def create(self, **kwargs):
        """``chat.completions.create``: ``model``, ``messages``, ``tools``, ``tool_choice`` (auto |
        none | required | a named function), ``parallel_tool_calls``, ``temperature`` (the run's while
        training), ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``n`` = 1, ``logprobs``
        (``top_logprobs`` 0), ``stream`` (a :class:`ChunkStream` of the whole answer,
        ``areal_fast.agent.stream``) and ``stream_options.include_usage``; the SDK's own keywords
        (``extra_body``, ``extra_headers``, ``extra_query``, ``timeout``, ``NOT_GIVEN``) as the SDK
        treats them (see the module docstring)."""
        body, timeout = sdk_body(kwargs)
        turn = self._session.create(body)
        call = await (turn if timeout is None else within(turn, timeout))
        if call.answer.stream:
            return ChunkStream(chunk_dicts(call, self._session))
        return as_completion(completion_dict(call, self._session))


class _Chat:
    def __init__(self, session: Session):
        self.completions = _Completions(session)


class AgentClient:
    """See the module docstring. ``base_url`` and ``api_key`` are set when the episode is also
    served over HTTP (``areal_fast.agent.server``), for frameworks that build their own client."""

    def __init__(self, session: Session):
        self.session = session
        self.chat = _Chat(session)
        self.responses = Responses(session)  # the Responses API on the same session (agent/responses.py)
        self.base_url: str | None = None
        self.api_key: str | None = None
        self.info: dict[str, float] = {}
        """Numbers the agent logs about its episode (``episode/<key>`` in the metrics)."""

    @classmethod
    def for_engine(cls, engine, *, model: str = DEFAULT_MODEL, call_marker: str | None = None,
                   tool_parser: str = "hermes", reasoning_parser: str | None = None, continuation: str = "concat",
                   context_length: int | None = None, template=None) -> AgentClient:
        """The client of one episode's engine handle; the chat template is the tokenizer's own when
        it has one (with ``tool_parser``, ``reasoning_parser`` and ``continuation``), else the tiny
        template with ``call_marker`` (``areal_fast.agent.template``). ``context_length``: the model's
        context in tokens when known (else learned from the engine's refusal: ``areal_fast.agent.limits``)."""
        template = template or template_for(engine.tokenizer, call_marker, tool_parser=tool_parser,
                                            reasoning_parser=reasoning_parser, continuation=continuation)
        return cls(Session(engine=engine, template=template, model=model,
                           limits=TurnLimits(context_length=context_length)))

    @property
    def model(self) -> str:
        """The one model name this client serves (any other is a 400)."""
        return self.session.model

    @property
    def calls(self) -> list[ChatCall]:
        return self.session.calls

    def set_reward(self, completion_id: str, value: float) -> None:
        """The reward of one completion (a per-turn reward; ``docs/agents.md`` says how it is used)."""
        self.session.set_reward(completion_id, value)
