"""Embedded SGLang-compatible inference engine (the HTTP subset in ``docs/sglang.md``).

Launch it
---------
Command line (one server per process; shared flags have SGLang's names, and
``areal_fast.backends.sglang.server_command.sglang_server_command("embedded", ...)`` builds it)::

    python -m areal_fast.embedded --model-path PATH --host 127.0.0.1 --port N \\
        [--sglang-version 0.5.23] [--device cpu|cuda] [--dtype auto|float32|bfloat16] \\
        [--random-seed 0] [--max-running-requests 256] [--weight-version default] \\
        [--load-format auto|safetensors|dummy] [--api-key KEY] [--skip-tokenizer-init] \\
        [--dist-timeout 120] [--api sglang|vllm] [--vllm-version 0.33.0] \\
        [--enable-return-routed-experts]

``--api vllm`` serves vLLM's HTTP API of ``--vllm-version`` instead of SGLang's (the vLLM twin:
``embedded/vllm_routes.py``, docs/vllm.md).

``--enable-return-routed-experts`` records the routed experts of every forwarded token of a MoE
model and returns them to the requests that ask, in SGLang's or vLLM's format
(``embedded/routing_capture.py``, docs/moe.md).

From Python (``areal_fast.embedded.launch``)::

    from areal_fast.embedded import launch_engine_subprocess, start_engine_in_thread

    h = launch_engine_subprocess(model_path, port=None, device="cpu")  # waits for /health == 200
    h.url          # "http://127.0.0.1:PORT"
    h.stop()       # SIGTERM then SIGKILL; h.kill() kills at once (failure tests)

    h = start_engine_in_thread(model_path, sglang_version="0.5.6")  # in this process (port 0 allowed)

Both take ``device``, ``dtype``, ``seed``, ``max_running_requests``, ``weight_version``, ``api_key``,
``sglang_version``. ``launch_engine_subprocess`` also takes ``env``, ``log_path`` and
``startup_timeout`` (s); ``start_engine_in_thread`` passes other keywords to ``EngineServer``
(``health_check_timeout_s``, ``dist_timeout_s``, ``load_format``, ...).

What it serves, as the chosen SGLang release does (docs/sglang.md has the version table):
/generate, /abort_request, /pause_generation, /continue_generation, /flush_cache,
/init_weights_update_group, /update_weights_from_distributed (per tensor and flattened_bucket),
/destroy_weights_update_group, /update_weights_from_disk, /begin_weight_update and
/end_weight_update (0.5.21+), /health, /health_generate, /model_info, /server_info (and the
deprecated /get_model_info, /get_server_info; ``engine`` "areal_fast.embedded").
"""

from areal_fast.embedded.launch import EngineHandle, launch_engine_subprocess, start_engine_in_thread

__all__ = ["EngineHandle", "launch_engine_subprocess", "start_engine_in_thread"]
