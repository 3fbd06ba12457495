"""Agents written with the OpenAI SDK as workflows (``docs/agents.md``).

- ``engine.openai()`` in a workflow: the episode's chat client (``client.AgentClient``), which
  behaves as ``openai.AsyncOpenAI`` for ``chat.completions.create``;
- ``server.AgentServer``: the same API over HTTP (``base_url``) for frameworks that build their
  own client, behind a key of each episode's own (never the run's key);
- ``workflow.openai_agent``: the workflow that runs an agent function and trains on its calls
  (``trajectories.assemble``); ``template``: the chat templates; ``session``: what is recorded;
  ``completion`` / ``stream``: the answer, whole or as ``stream=True`` chunks;
- ``responses``: the Responses API (``client.responses.create``) on the same recording;
- ``process``: an agent that runs as its own process (any language) given its episode's
  ``base_url`` and key, which ends its episode with ``POST <base_url>/reward``.

Nothing here imports ``openai`` at import time.
"""

_EXPORTS = {
    "AgentClient": "areal_fast.agent.client", "ChatRequestError": "areal_fast.agent.request",
    "AgentServer": "areal_fast.agent.server", "openai_agent": "areal_fast.agent.workflow",
    "assemble": "areal_fast.agent.trajectories", "TinyChatTemplate": "areal_fast.agent.template",
    "HFChatTemplate": "areal_fast.agent.template", "ChatCall": "areal_fast.agent.session",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'areal_fast.agent' has no attribute {name!r}")
