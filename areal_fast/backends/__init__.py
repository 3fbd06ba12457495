"""One subpackage per inference backend, holding every fact we rely on about that server: its
version gates, the request bodies we send it, its launch command, the rollout client's adapter and
its weight-update calls.

- :mod:`areal_fast.backends.sglang` - SGLang (the default ``rollout.api``);
- :mod:`areal_fast.backends.vllm` - vLLM (``rollout.api: vllm``, ``docs/vllm.md``).

The embedded engine (``areal_fast/embedded/``) imitates them: it is SGLang's twin, and with
``--api vllm`` vLLM's, whose routes are ``embedded/vllm_routes.py``, kept beside the facts
they imitate. Submodules are not imported here: some need torch, and the config loader imports
the torch-free version tables.
"""
