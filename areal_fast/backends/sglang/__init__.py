"""SGLang as an inference backend (the default ``rollout.api``; ``docs/sglang.md`` has the facts
in prose).

- ``compat.py`` - which SGLang release the embedded engine behaves as, and every behaviour that
  depends on it: the version gates, a named predicate each, asked by the engine, the rollout client
  and the weight sync (torch-free);
- ``delta.py`` - delta updates on a real SGLang server, through SGLang's external model package;
- ``models/`` - that package (``SGLANG_EXTERNAL_MODEL_PACKAGE=areal_fast.backends.sglang.models``):
  SGLang's Qwen2, Qwen3 and Llama classes with a ``load_weights`` that applies delta entries.

SGLang's HTTP API is the rollout layer's own vocabulary, so the rest lives there: its
request/answer contract is implemented by the shared rollout client (``areal_fast/rollout/client.py``,
``client_control.py``, ``answer.py``), its launch command is built in
``areal_fast/rollout/server_command.py``, and its weight-update calls are in
``areal_fast/weights/sync.py`` (and ``colocated.py``). The embedded engine (``areal_fast/embedded/``)
is SGLang's twin.

Submodules are not imported here: import the one you need.
"""
