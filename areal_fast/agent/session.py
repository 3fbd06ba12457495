"""One episode's chat calls: how each prompt is built from the earlier ones, and what is recorded.

::

    create(messages)  --> the closest earlier call (longest common message prefix)
        exact continuation (its messages + its answer, then new ones):
            prompt = that call's prompt_ids + output_ids (the very tokens) + close_turn + render(new)
        history edited (a message differs from the one recorded, or was removed):
            prompt = the earlier tokens up to the end of the last equal message + render(the rest)
            the call is a *break*: its trajectory starts afresh (``ChatCall.diverged_at``)
        nothing in common: render(messages) from the start (a new conversation)
      --> engine.generate (the rollout port: interrupted and resumed across weight updates,
          every token keeps the version that generated it)
      --> ChatCall: prompt/output ids, log-probs, versions, finish reason, tool calls, completion id

Continuations are never re-tokenized: the model's own tokens (not an encode of its decoded
text) are the next prompt's prefix, so what the trainer sees is exactly what was sampled and
conditioned on. :mod:`areal_fast.agent.trajectories` turns the calls into trajectories.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from areal_fast.agent.limits import TurnLimits
from areal_fast.agent.request import AnswerForm, ChatRequest, ChatRequestError, Message, ToolCall, parse_request
from areal_fast.agent.template import ChatTemplate, HistoryRendersDifferently, call_id
from areal_fast.sample import Sample

DEFAULT_MODEL = "areal-fast"


@dataclass
class ChatCall:
    """One recorded completion. ``sample`` is the engine's model turn as the rollout client filled
    it (``prompt_ids``, ``output_ids``, ``output_logprobs``, ``output_versions``)."""

    completion_id: str
    messages: tuple[Message, ...]
    tools: tuple
    sample: Sample
    message_ends: list[int]
    """Where each message of ``messages`` ends in ``sample.prompt_ids``."""
    finish_reason: str
    """The OpenAI finish reason: stop | length | tool_calls."""
    content: str
    tool_calls: list[ToolCall]
    parent: str | None = None
    """The completion this call continues token for token (None: a conversation's first call, or a break)."""
    diverged_at: int | None = None
    """Set on a break: the index of the first message that differs from the closest earlier call."""
    reward: float | None = None
    """Set by ``set_reward`` (the completion id), or the episode's final reward."""
    created: float = 0.0
    answer: AnswerForm = AnswerForm()
    """How the caller asked for the answer (stream, usage chunk, log-probs): the answer's form only."""
    reasoning_content: str | None = None
    """The reasoning the template's reasoning parser split off the output (``<think>``), else None."""

    @property
    def response(self) -> Message:
        """The assistant message returned, as the agent sends it back in the next call's history."""
        return Message(role="assistant", content=self.content, tool_calls=tuple(self.tool_calls),
                       reasoning_content=self.reasoning_content)

    @property
    def history(self) -> tuple[Message, ...]:
        return self.messages + (self.response,)

    @property
    def full_ids(self) -> array:
        return self.sample.prompt_ids + self.sample.output_ids

    @property
    def ends(self) -> list[int]:
        """Where each message of :attr:`history` ends in :attr:`full_ids`."""
        return self.message_ends + [len(self.sample.prompt_ids) + len(self.sample.output_ids)]


def _common_prefix(a: tuple[Message, ...], b: tuple[Message, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Prompt:
    ids: list[int]
    message_ends: list[int]
    parent: str | None = None
    diverged_at: int | None = None


async def build_prompt(calls: list[ChatCall], req: ChatRequest, template: ChatTemplate) -> Prompt:
    """The prompt of ``req`` given the episode's earlier ``calls`` (see the module docstring). A
    template that renders the earlier messages differently once new ones follow, with
    ``continuation='template'``: the whole conversation rendered again, a break from message 0."""
    try:
        return await _build_prompt(calls, req, template)
    except HistoryRendersDifferently:
        ids, ends = await template.render_async((), req.messages, req.tools)
        return Prompt(ids, ends, diverged_at=0)


async def _build_prompt(calls: list[ChatCall], req: ChatRequest, template: ChatTemplate) -> Prompt:
    msgs = req.messages
    best, best_n = None, 0
    for c in calls:
        if template.renders_tools and c.tools != req.tools:
            continue  # the tools are part of its context: nothing of it can be reused
        n = _common_prefix(c.history, msgs)
        if n > best_n or (n == best_n and n > 0):
            best, best_n = c, n  # ties: the latest call
    if best is not None and best_n == len(best.history) and len(msgs) > best_n:
        close = template.close_turn(best.sample.output_ids)
        head = list(best.full_ids) + close
        ends = best.message_ends + [len(head)]
        new_ids, new_ends = await template.render_async(msgs[:best_n], msgs[best_n:], req.tools)
        return Prompt(head + new_ids, ends + [len(head) + e for e in new_ends], parent=best.completion_id)
    if best is not None and best_n > 0:  # the agent edited its history: re-tokenize from the first change
        keep = best.ends[best_n - 1]
        head = list(best.full_ids[:keep])
        if best_n == len(best.history):  # it ends with the recorded answer (cut or not): close that turn
            head += template.close_turn(best.sample.output_ids)
        new_ids, new_ends = await template.render_async(msgs[:best_n], msgs[best_n:], req.tools)
        ends = best.ends[: best_n - 1] + [len(head)]
        return Prompt(head + new_ids, ends + [len(head) + e for e in new_ends], diverged_at=best_n)
    ids, ends = await template.render_async((), msgs, req.tools)
    return Prompt(ids, ends)


def _cut_at_stop(template, sample: Sample, stops: tuple[str, ...]) -> bool:
    """Cut ``sample``'s output after the first stop string it contains (tokens are kept up to the
    one that completes it; the rest was sampled after the stop and is dropped). True when cut.

    The cut is the shortest prefix of the tokens whose text holds a stop, found by bisection over
    prefix lengths: O(log n) decodes, O(n log n) in all (decoding every prefix was quadratic, on the
    event loop). Bisection finds the shortest such prefix because holding a stop is monotone in the
    prefix length: a longer prefix's text extends the shorter one's (a character cut in the middle
    of its bytes decodes to U+FFFD until its last token comes). A decoder that rewrites earlier text
    as tokens follow (Hugging Face's clean-up of spaces before punctuation) can break that; the cut
    is then still a prefix that holds a stop right after one that does not."""
    decode = template.tok.decode
    ids = list(sample.output_ids)

    def holds(k: int) -> bool:
        text = decode(ids[:k])
        return any(s in text for s in stops)

    if not ids or not holds(len(ids)):
        return False
    lo, hi = 0, len(ids)  # holds(hi); the empty prefix counts as not holding one (the cut keeps >= 1 token)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    for name in ("output_ids", "output_logprobs", "output_versions", "loss_mask"):
        setattr(sample, name, getattr(sample, name)[:hi])
    return True


def _trim_stop(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


@dataclass
class Session:
    """The calls of one episode, made through ``engine`` (an ``EpisodeEngine``)."""

    engine: object
    template: ChatTemplate
    model: str = DEFAULT_MODEL
    calls: list[ChatCall] = field(default_factory=list)
    limits: TurnLimits = field(default_factory=TurnLimits)
    """The context and the engine's stop-string support (``areal_fast.agent.limits``)."""
    responses: dict[str, list[dict]] = field(default_factory=dict)
    """The Responses API's conversations by response id, for ``previous_response_id``
    (``areal_fast.agent.responses``)."""
    final_reward: float | None = None
    """The episode's reward set over HTTP (``POST <base_url>/reward``), which also ends it."""

    async def create(self, body: dict) -> ChatCall:
        """One ``chat.completions.create``: checked, generated, recorded. ChatRequestError: a 400."""
        req = parse_request(body, self.model)
        self.template.check(req)
        prompt = await build_prompt(list(self.calls), req, self.template)  # the calls as they are now
        overrides = self._sampling(req)
        sample = await self.limits.generate(self.engine, prompt.ids, overrides, req)  # refusals: ChatRequestError
        stopped = bool(req.stop) and _cut_at_stop(self.template, sample, tuple(s for s in req.stop))
        cid = f"chatcmpl-{sample.rid or len(self.calls)}"
        answer = self.template.parse_answer(sample.output_ids, req)  # tool_choice, reasoning parser
        content = answer.content
        calls = [ToolCall(id=call_id(cid, k), name=c.name, arguments=c.arguments)
                 for k, c in enumerate(answer.tool_calls)]
        if req.stop:
            content = _trim_stop(content, req.stop)
        finish = "tool_calls" if calls else ("stop" if stopped or sample.finish_reason == "stop" else "length")
        call = ChatCall(completion_id=cid, messages=req.messages, tools=req.tools, sample=sample,
                        message_ends=prompt.message_ends, finish_reason=finish, content=content, tool_calls=calls,
                        parent=prompt.parent, diverged_at=prompt.diverged_at, created=time.time(),
                        answer=req.answer, reasoning_content=answer.reasoning)
        self.calls.append(call)
        return call

    def _sampling(self, req: ChatRequest) -> dict:
        run = getattr(self.engine, "sampling", {})
        out: dict = {}
        if req.max_tokens is not None:
            out["max_new_tokens"] = req.max_tokens
        if req.temperature is not None and req.temperature != run.get("temperature", req.temperature):
            out["temperature"] = req.temperature  # the engine handle refuses it while training
        if req.top_p is not None and req.top_p != run.get("top_p", 1.0):
            raise ChatRequestError(f"top_p: fixed for the run ({run.get('top_p', 1.0)}); the trainer recomputes "
                                   f"log-probs with it, got {req.top_p}", "top_p")
        single = [ids for ids in (self._single_token(s) for s in req.stop) if ids is not None]
        if single:  # the engine stops on the token itself
            out["stop_token_ids"] = sorted(set(run.get("stop_token_ids") or []) | set(single))
        longer = [s for s in req.stop if self._single_token(s) is None]
        if longer:  # an engine with a tokenizer stops there; the output is cut here either way
            out["stop"] = longer
        return out

    def _single_token(self, s: str) -> int | None:
        tok = getattr(self.template, "tok", None)
        try:
            ids = tok.encode(s, add_bos=False) if hasattr(tok, "chars") else tok.encode(s, add_special_tokens=False)
        except (ValueError, TypeError, AttributeError):
            return None
        return ids[0] if len(ids) == 1 else None

    def token_texts(self, ids) -> list[str]:
        """Each token's own text, decoded alone as the content is decoded (special tokens: "")."""
        decode = self.template.tok.decode
        return [decode([int(i)], skip_special_tokens=True) for i in ids]

    def set_reward(self, completion_id: str, value: float) -> None:
        """Attach ``value`` to the call whose completion id is ``completion_id`` (KeyError naming it);
        a Responses API id (``resp_<rid>``) names the same call as its ``chatcmpl-<rid>``."""
        if completion_id.startswith("resp_"):
            completion_id = "chatcmpl-" + completion_id.removeprefix("resp_")
        for c in self.calls:
            if c.completion_id == completion_id:
                c.reward = float(value)
                return
        raise KeyError(f"set_reward: no completion {completion_id!r} in this episode "
                       f"({len(self.calls)} calls: {[c.completion_id for c in self.calls][:5]}...)")
