"""vLLM as an inference backend (``rollout.api: vllm``; ``docs/vllm.md`` has the facts in prose).

- ``compat.py`` - which vLLM release a server behaves as, and every behaviour of vLLM's HTTP API
  that depends on it: the version gates, read from vLLM's own sources (torch-free: the config
  loader imports it);
- ``requests.py`` - every request body we send to a vLLM server, and the reading of its
  /v1/completions answer (torch-free);
- ``client.py`` - the vLLM adapter of the rollout client (``VLLMRolloutClient``): the shared client
  core of ``rollout/client.py`` with what vLLM spells differently;
- ``server_command.py`` - the command line and environment of one real vLLM server;
- ``disk.py`` - disk weight updates on vLLM servers (``weights.method: disk``);
- ``transfer.py`` - the trainer's side of vLLM's weight transfer (``weights.method: distributed``,
  vLLM 0.16.0 on; needs torch);
- ``lora_sync.py`` - its adapter swap of a LoRA run.

The embedded engine is vLLM's twin with ``--api vllm``: vLLM's HTTP routes over the engine's model
and scheduler, ``areal_fast/embedded/vllm_routes.py``.

Submodules are not imported here: import the one you need.
"""
