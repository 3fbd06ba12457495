"""A chat call's model turn within what the engine accepts: the context, stop strings, its refusals.

What an inference server refuses is the agent's request, never a server fault, so it must reach the
agent as a 400 naming the parameter (``openai.BadRequestError``; in process ``ChatRequestError``),
not as a 500 that the SDK sends twice more. :meth:`TurnLimits.generate` runs one turn:

- **The context.** With the model's context length known (given, or learned from the engine's
  first refusal), the prompt is checked before it is sent: a prompt that fills the context is a 400
  naming ``messages``; a ``max_tokens`` the agent asked for that does not fit after the prompt is a
  400 naming ``max_tokens`` (as the OpenAI API answers); without ``max_tokens`` the run's
  ``max_new_tokens`` is capped to what is left of the context (as AReaL caps it), so a long
  conversation's last turn is generated as far as it fits (``finish_reason`` ``length``).
  The engines refuse an overflow with a message naming their context ("maximum context length of
  N", SGLang and the embedded engine; "maximum context length is N", vLLM): the number is read from
  it, and the turn checked and sent again (once per episode).
- **Stop strings.** A stop string of several tokens is sent to the engine so that it stops there;
  an engine that cannot match strings (a checkpoint without a tokenizer) refuses it, and the turn
  is sent again without it: the session cuts the output at the stop string itself
  (``session._cut_at_stop``), so ``stop`` works either way (the tokens sampled after it are dropped).
- **Any other refusal** of the engine (its 4xx, ``rollout.calls.RequestError``) is a 400 with the
  engine's message, naming the parameter it is about where that is clear.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal_fast.agent.request import ChatRequest, ChatRequestError

_CONTEXT = re.compile(r"context length (?:of |is |\()(\d+)")
_PARAMS = (("max_new_tokens", "max_tokens"), ("stop", "stop"), ("temperature", "temperature"),
           ("top_p", "top_p"), ("input_ids", "messages"), ("context", "messages"))
MAX_SENDS = 3  # the first send, then once more after learning the context and once without stop strings


def _engine_message(e) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg if msg is not None else body.get("detail", body))
    return str(body if body is not None else e)


def _param(message: str) -> str | None:
    for needle, param in _PARAMS:
        if needle in message:
            return param
    return None


@dataclass
class TurnLimits:
    """What one episode knows of the engine's limits (see the module docstring)."""

    context_length: int | None = None
    """The model's context in tokens (prompt + output); None until known."""
    engine_matches_stop_strings: bool = True
    """False once the engine refused a stop string (no tokenizer): the session cuts at it alone."""

    def fit(self, n_prompt: int, req: ChatRequest, overrides: dict, run: dict) -> dict:
        """The turn's sampling overrides within the context; ChatRequestError when it cannot fit."""
        out = dict(overrides)
        if not self.engine_matches_stop_strings:
            out.pop("stop", None)
        ctx = self.context_length
        if ctx is None:
            return out
        if n_prompt >= ctx:
            raise ChatRequestError(f"messages: the conversation is {n_prompt} tokens and the model's context is "
                                   f"{ctx} tokens: no room to generate", "messages")
        room = ctx - n_prompt
        if req.max_tokens is not None:
            if req.max_tokens > room:
                raise ChatRequestError(f"max_tokens: {req.max_tokens} tokens after a conversation of {n_prompt} "
                                       f"tokens exceed the model's context of {ctx} tokens (at most {room} fit)",
                                       "max_tokens")
            return out
        run_max = out.get("max_new_tokens", run.get("max_new_tokens"))
        if run_max is None or run_max > room:
            out["max_new_tokens"] = room
        return out

    async def generate(self, engine, prompt_ids: list[int], overrides: dict, req: ChatRequest):
        """``engine.generate`` of the prompt within the limits (see the module docstring)."""
        from areal_fast.rollout.calls import RequestError

        run = getattr(engine, "sampling", {})
        for _ in range(MAX_SENDS):
            sampling = self.fit(len(prompt_ids), req, overrides, run)
            try:
                return await engine.generate(prompt_ids, **sampling)
            except ValueError as e:  # the engine handle's own refusals (the temperature is the run's)
                raise ChatRequestError(str(e), _param(str(e))) from None
            except RequestError as e:  # the server's 4xx: the request's fault
                message = _engine_message(e)
                if "stop" in sampling and "stop" in message and self.engine_matches_stop_strings:
                    self.engine_matches_stop_strings = False
                    continue
                m = _CONTEXT.search(message)
                if m and int(m.group(1)) != self.context_length:
                    self.context_length = int(m.group(1))
                    continue
                raise ChatRequestError(f"the inference server refused the request ({e.status}): {message}",
                                       _param(message)) from None
        raise ChatRequestError("the inference server kept refusing the request", None)
