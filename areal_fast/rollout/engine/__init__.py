"""Embedded SGLang-compatible inference engine (the HTTP subset in ``docs/sglang.md``).

Launch it
---------
Command line (one server per process)::

    python -m areal_fast.rollout.engine --model PATH --host 127.0.0.1 --port N \\
        [--device cpu|cuda] [--dtype auto|float32|bfloat16] [--seed 0] \\
        [--max-running-requests 256] [--weight-version default] [--api-key KEY]

From Python (``areal_fast.rollout.engine.launch``)::

    from areal_fast.rollout.engine import launch_engine_subprocess, start_engine_in_thread

    h = launch_engine_subprocess(model_path, port=None, device="cpu")  # waits for /health == 200
    h.url          # "http://127.0.0.1:PORT"
    h.stop()       # SIGTERM then SIGKILL; h.kill() kills at once (failure tests)

    h = start_engine_in_thread(model_path)  # same handle, server inside this process (port 0 allowed)

Both take ``device``, ``dtype``, ``seed``, ``max_running_requests``, ``weight_version``, ``api_key``.
``launch_engine_subprocess`` also takes ``env`` (extra environment, e.g. CUDA_VISIBLE_DEVICES),
``log_path`` (server stdout/stderr; a temp file by default) and ``startup_timeout`` (s).

What it serves: /generate, /abort_request, /pause_generation, /continue_generation, /flush_cache,
/init_weights_update_group, /update_weights_from_distributed (per-tensor and flattened_bucket),
/destroy_weights_update_group, /begin_weight_update, /end_weight_update, /update_weights_from_disk,
/health, /health_generate, /get_model_info, /get_server_info (``version`` "0.5.23", the SGLang
contract it follows; ``engine`` "areal_fast.embedded").
"""

from areal_fast.rollout.engine.launch import EngineHandle, launch_engine_subprocess, start_engine_in_thread

__all__ = ["EngineHandle", "launch_engine_subprocess", "start_engine_in_thread"]
