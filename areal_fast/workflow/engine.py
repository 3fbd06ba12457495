"""The engine handle a workflow receives: model turns, tokenizer, rewards and tools of one episode.

One :class:`EpisodeEngine` per episode. It owns nothing: it forwards to the controller's ports
(rollout, reward) and counts tool outcomes into a dict the controller reports. Request ids are
``<episode id>-<turn>``, unique across the run and its restarts (the episode id carries the
controller's incarnation), so a resumed run never collides with requests of the one before.

The episode's OpenAI-style chat client (:meth:`EpisodeEngine.openai`) is made by the ``chat_client``
factory its maker passes (``areal_fast.agent.client.AgentClient.for_engine``: the agent package sits
above this one and is never imported from here).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from areal_fast.columns import tokens
from areal_fast.data.tokenizer import encode_text
from areal_fast.rollout.config import UNTRUNCATED
from areal_fast.rollout.staleness import ADMISSION_ORDER
from areal_fast.sample import Sample
from areal_fast.workflow.api import ToolResult

TOOL_TIMEOUT_S = 10.0


class EpisodeEngine:
    """See the module docstring. ``sampling`` is the run's sampling (greedy during evaluation);
    ``training`` is False during evaluation (a workflow may, e.g., skip exploration then)."""

    def __init__(self, rollout, reward, tokenizer, sampling: dict, episode_id: str, *,
                 training: bool = True, eval_reward: str | None = None, tool_timeout_s: float = TOOL_TIMEOUT_S,
                 tool_counts: Counter | None = None, reward_counts: Counter | None = None, version=lambda: 0,
                 chat_client: Callable[..., Any] | None = None):
        self._rollout, self._reward, self.tokenizer = rollout, reward, tokenizer
        self.sampling = dict(sampling)
        self.episode_id = episode_id
        self.training = training
        self.eval_reward = eval_reward
        self.tool_timeout_s = tool_timeout_s
        self.tool_counts = tool_counts if tool_counts is not None else Counter()
        self.reward_counts = reward_counts if reward_counts is not None else Counter()
        self._version = version
        # the admission number of the group this episode belongs to (None outside one): every model turn
        # carries it, whichever task asks for the turn (an agent endpoint's handler too): rollout.staleness
        self.admission_order = ADMISSION_ORDER.get()
        self._turn = 0
        self._chat = None  # the episode's chat client (openai()), made on first use
        self._chat_client = chat_client  # its factory: chat_client(engine, **options)

    @property
    def api_key(self) -> str | None:
        """The run's API key (the rollout port's; None when the servers need none)."""
        return getattr(self._rollout, "api_key", None)

    def openai(self, **options):
        """This episode's chat client, which behaves as ``openai.AsyncOpenAI`` for
        ``chat.completions.create`` (``areal_fast.agent``, ``docs/agents.md``): every call goes through
        :meth:`generate` and is recorded. One per episode (``options`` count on the first call only).
        Made by the engine's ``chat_client`` factory (the controller passes ``AgentClient.for_engine``)."""
        if self._chat is None:
            if self._chat_client is None:
                raise RuntimeError("EpisodeEngine.openai: this engine handle was made without a chat client "
                                   "(pass chat_client=areal_fast.agent.client.AgentClient.for_engine)")
            self._chat = self._chat_client(self, **options)
        return self._chat

    @property
    def version(self) -> int:
        """The controller's weight version now (the tokens of a turn carry their own versions)."""
        return self._version()

    # ------------------------------------------------------------------ tokens
    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, encoded as the single-turn rollout does (with BOS where the
        tokenizer adds one)."""
        return list(self.tokenizer.encode(text))

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """Token ids of text that continues a sequence (tool output, feedback): no BOS, and plain
        text: the text of a special token (``<|im_start|>``, ``<eos>``) in a tool's output is spelled
        with ordinary tokens, never turned into the control token. ``special_tokens=True``: the
        tokenizer's own encoding, for a workflow that writes a chat template's turn markers itself
        (only ever on text the workflow wrote, never on what a model or a tool did)."""
        if special_tokens:
            return list(self.tokenizer.encode(text, add_bos=False))
        return encode_text(self.tokenizer, text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    # ------------------------------------------------------------------ model
    async def generate(self, input_ids, **sampling: Any) -> Sample:
        """One model turn continuing ``input_ids``: the :class:`~areal_fast.sample.Sample` the rollout
        client filled (``prompt_ids`` the context, the turn's ``output_*`` columns, loss mask 1).
        Return it as the episode's trajectory, or append it to one with ``add_model``. An
        ``array('i')`` (``traj.context_ids``) is passed on as it is. Keyword arguments override the
        run's sampling for this turn (e.g. ``max_new_tokens``, ``stop_token_ids``); while training the
        temperature cannot change (the trainer recomputes at the run's) and no truncation can be
        asked (top_p, top_k, min_p: the trainer's log-probs are over the whole softmax)."""
        if "temperature" in sampling and self.training and sampling["temperature"] != self.sampling.get("temperature"):
            raise ValueError("EpisodeEngine.generate: temperature is fixed for the run (rollout.temperature); "
                             "the trainer recomputes log-probs at that temperature")
        if self.training:
            for key, off in UNTRUNCATED.items():
                if sampling.get(key, off) not in (off, self.sampling.get(key, off)):
                    raise ValueError(f"EpisodeEngine.generate: {key}={sampling[key]!r} while training: the server "
                                     f"would sample from a truncated distribution and the trainer recomputes "
                                     f"log-probs over the whole softmax, biasing every token's weight "
                                     f"(docs/config.md, 'Sampling in a training run')")
        rid = f"{self.episode_id}-{self._turn}"
        self._turn += 1
        order = ADMISSION_ORDER.set(self.admission_order)
        try:
            return await self._rollout.generate(tokens(input_ids, "input_ids"), {**self.sampling, **sampling},
                                                rid=rid)
        finally:
            ADMISSION_ORDER.reset(order)

    # ------------------------------------------------------------------ rewards and tools
    async def reward(self, task: dict, completion: str):
        """Score ``completion`` with the task's reward (the configured one; ``eval.reward`` during
        evaluation). Returns the reward service's result (``.value``, ``.status``)."""
        if not self.training and self.eval_reward:
            task = {**task, "reward": self.eval_reward}
        res = await self._reward.score(task, completion)
        self.reward_counts[getattr(res, "status", "ok")] += 1
        return res

    async def tool(self, name: str, call: str, *, timeout_s: float | None = None, **fields) -> ToolResult:
        """Run tool ``name`` ('package.module:function', called as ``fn(fields, call)``) in the
        reward service's worker processes, with a time limit. Never raises for the tool's own
        failures: a tool that hangs is killed (status 'timeout'), one that raises or crashes its
        worker gives status 'error'; every outcome is counted (``tool/<status>`` in the metrics)."""
        task = {**fields, "reward": name, "timeout_s": float(timeout_s or self.tool_timeout_s)}
        res = await self._reward.score(task, call)
        status = getattr(res, "status", "ok")
        self.tool_counts[status] += 1
        out = getattr(res, "detail", "")
        return ToolResult(status=status, output=out if status == "ok" else (out or status))
