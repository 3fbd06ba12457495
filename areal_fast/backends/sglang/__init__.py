"""SGLang as an inference backend (the default ``rollout.api``; ``docs/sglang.md`` has the facts
in prose).

- ``compat.py`` - which SGLang release the embedded engine behaves as, and every behaviour that
  depends on it: the version gates, a named predicate each, asked by the engine, the rollout client
  and the weight sync (torch-free);
- ``delta.py`` - delta updates on a real SGLang server, through SGLang's external model package;
- ``models/`` - that package (``SGLANG_EXTERNAL_MODEL_PACKAGE=areal_fast.backends.sglang.models``):
  SGLang's Qwen2, Qwen3 and Llama classes with a ``load_weights`` that applies delta entries.

- ``client.py`` - the rollout client's SGLang adapter (``SGLangRolloutClient``; also the embedded
  engine's client);
- ``server_command.py`` - SGLang's and the embedded engine's command line, and the start of a real
  SGLang server;
- ``weight_sync.py``, ``colocated.py`` - SGLang's weight-update calls (broadcast, disk, sessions; the
  colocated update through CUDA IPC); ``lora_sync.py`` - its adapter swap of a LoRA run.

The embedded engine (``areal_fast/embedded/``) is SGLang's twin.

Submodules are not imported here: import the one you need.
"""
