"""One subpackage per inference backend, holding every fact we rely on about that server: its
version gates, the request bodies we send it, its launch command, the rollout client's adapter and
its weight-update calls.

- :mod:`areal_fast.backends.sglang` - SGLang (the default ``rollout.api``);
- :mod:`areal_fast.backends.vllm` - vLLM (``rollout.api: vllm``, ``docs/vllm.md``).

What is not one server's: ``registry.py`` (a backend's name to its client adapter and weight
transports, for the layers above), ``server_command.py`` (the one dispatcher of a launched server's
command), ``keyfile.py`` (the run's key off the command line), ``checks.py`` (what the servers can
serve, checked at load) and ``releases.py``.

The embedded engine (``areal_fast/embedded/``, a package above this one) imitates them: it is
SGLang's twin, and with ``--api vllm`` vLLM's (``embedded/vllm_routes.py``). Submodules are not
imported here: some need torch, and the config loader imports the torch-free version tables.
"""
