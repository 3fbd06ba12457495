"""SGLang's own code judges what we send it, for the oldest and newest release we support.

(a) A recorder server captures every body the rollout client sends (generate, pause in each mode,
    continue, flush, abort). Each body is parsed the way SGLang's HTTP server parses it: pydantic
    validation into the request
    type of ``sglang.srt.managers.io_struct`` (what FastAPI does with the handler's argument),
    plus for /generate ``GenerateReqInput.normalize_batch_and_arguments`` and
    ``SamplingParams(**params).normalize(None)`` / ``.verify(vocab)``, and on 0.5.22+ the schema
    check of ``sglang.srt.entrypoints.api_contract``. Every key we send must also be a field of
    that type: SGLang ignores unknown keys, so a misspelt option would silently do nothing.
(c) Our SGLang launch command (``sglang_server_command("sglang", ...)``) parsed by
    ``ServerArgs.add_cli_args`` + ``ServerArgs.from_cli_args``; the form the launcher uses, with the
    API key in a ``--config`` file, parsed by SGLang's own ``prepare_server_args``, which must find
    the key; and the embedded engine reads such a file exactly as SGLang does.
The weight sync's bodies (init group, begin/end, buckets, destroy, disk update) are judged the same
way in test_weights_sglang_requests.py, and (b), our bucket unpacked by SGLang's
``FlattenedTensorBucket``, in test_weights_sglang_bucket.py.

The wheels (and the plain-CPU packages io_struct imports) are installed by tests/sglang_wheel.py;
a test skips, with the reason, only when that install fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

import pytest
from packaging.version import Version

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _shared import wait_until  # noqa: E402
from sglang_wheel import sglang_module  # noqa: E402

from areal_fast.backends.keyfile import write_api_key_file  # noqa: E402
from areal_fast.backends.sglang.client import SGLangRolloutClient  # noqa: E402
from areal_fast.backends.sglang.compat import in_place_refusal  # noqa: E402
from areal_fast.backends.sglang.server_command import sglang_server_command  # noqa: E402
from areal_fast.rollout.calls import RolloutError  # noqa: E402

VERSIONS = ("0.5.6", "0.5.23")
VOCAB = 256
IO_TYPES = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}
NO_BODY = {"/flush_cache", "/server_info", "/get_server_info", "/model_info", "/health"}


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)  # msgspec.Struct (0.5.21+)


def _parse_like_sglang(version: str, path: str, body: dict | None) -> None:
    """Parse one recorded body the way SGLang ``version``'s HTTP server does; raise on refusal."""
    from pydantic import TypeAdapter

    io = sglang_module(version, "sglang.srt.managers.io_struct")
    if path == "/generate":
        if Version(version) >= Version("0.5.22"):
            contract = sglang_module(version, "sglang.srt.entrypoints.api_contract")
            err = contract.generate_contract_error(body)
            assert err is None, f"SGLang {version} schema refuses our /generate body: {err}"
        extra = set(body) - _fields(io.GenerateReqInput)
        assert not extra, f"/generate keys SGLang {version} does not know (silently ignored): {extra}"
        obj = TypeAdapter(io.GenerateReqInput).validate_python(body)
        obj.normalize_batch_and_arguments()
        sp_mod = sglang_module(version, "sglang.srt.sampling.sampling_params")
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        for p in params:
            sp = sp_mod.SamplingParams(**(p or {}))
            sp.normalize(None)
            sp.verify(VOCAB)
        return
    if path in NO_BODY:
        return
    cls = getattr(io, IO_TYPES[path], None)
    assert cls is not None, f"SGLang {version} has no request type for {path}"
    extra = set(body or {}) - _fields(cls)
    assert not extra, f"{path} keys SGLang {version} does not know (silently ignored): {extra}"
    TypeAdapter(cls).validate_python(body or {})


# ----------------------------------------------------------------------------- (a) rollout client
def _record_client_calls(version: str) -> list[tuple[str, dict | None]]:
    """Drive the rollout client against a recorder that answers as SGLang ``version`` would."""
    from aiohttp import web

    async def run():
        calls: list[tuple[str, dict | None]] = []
        release = asyncio.Event()

        async def info(request):
            calls.append((request.path, None))
            # launched as in_place needs (docs/pause_modes.md), so the in_place body is sent where it can be
            return web.json_response({"version": version, "tp_size": 1, "weight_version": "0",
                                      "disable_overlap_schedule": True, "disable_radix_cache": True})

        async def post(request):
            body = await request.json() if request.can_read_body else None
            calls.append((request.path, body))
            if request.path == "/generate":
                if body["rid"].startswith("held"):
                    await release.wait()  # in flight until the test has aborted it
                n = body["sampling_params"]["max_new_tokens"]
                return web.json_response({"output_ids": [7] * n, "meta_info": {
                    "id": body["rid"], "finish_reason": {"type": "length", "length": n}, "weight_version": "0",
                    "output_token_logprobs": [[-0.1, 7, None]] * n}})
            return web.json_response({"success": True, "message": "ok", "status": "ok"})

        app = web.Application()
        for p in ("/server_info", "/model_info"):
            app.router.add_get(p, info)
        app.router.add_post("/{tail:.*}", post)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with SGLangRolloutClient([url], api_key="k") as c:
                await c.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                             "min_p": 0.05, "stop_token_ids": [2], "ignore_eos": True}, rid="g0")
                held = asyncio.create_task(c.generate([4, 5], {"max_new_tokens": 3}, rid="held-1"))
                await wait_until(lambda: any(p == "/generate" and b["rid"].startswith("held") for p, b in calls),
                                 "the held request at the server")
                await c.abort("held-1")
                release.set()
                await held
                for mode in ("abort", "retract", "in_place"):
                    if mode == "in_place" and in_place_refusal(Version(version)):
                        with pytest.raises(RolloutError, match="in_place"):  # never sent to this release
                            await c.pause_all(mode)
                        continue
                    await c.pause_all(mode)
                    if c.may_flush:
                        await c.flush_cache_all(timeout_s=5)
                    await c.continue_all()
                await c.abort_all()
        finally:
            await runner.cleanup()
        return calls

    return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("version", VERSIONS)
def test_rollout_client_bodies_parse_with_sglang_types(version):
    calls = _record_client_calls(version)
    sent = {p for p, _ in calls}
    assert {"/generate", "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request"} <= sent
    modes = [b.get("mode") for p, b in calls if p == "/pause_generation"]
    assert modes == ["abort", "retract"] + ([] if in_place_refusal(Version(version)) else ["in_place"])
    for path, body in calls:
        _parse_like_sglang(version, path, body)


# ----------------------------------------------------------------------------- (c) launch command
@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_launch_command_parses_with_sglang_server_args(version, monkeypatch):
    cmd = sglang_server_command("sglang", "/models/qwen", "127.0.0.1", 30001, tp_size=2, api_key="key",
                         weight_version="0", load_format="dummy", dtype="bfloat16", seed=3,
                         max_running_requests=64, mem_fraction_static=0.7, disable_radix_cache=True,
                         enable_memory_saver=True, skip_server_warmup=True)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    server_args = sglang_module(version, "sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(cmd[3:])  # argparse exits (a test failure) on any flag SGLang does not know
    # __post_init__ probes the hardware (CUDA, HPU, ...), which this machine may not have; the field
    # mapping of from_cli_args is what we check, so the probe is switched off
    monkeypatch.setattr(server_args.ServerArgs, "__post_init__", lambda self: None, raising=False)
    sa = server_args.ServerArgs.from_cli_args(ns)
    assert (sa.model_path, sa.host, sa.port, sa.tp_size) == ("/models/qwen", "127.0.0.1", 30001, 2)
    assert (sa.api_key, sa.weight_version, sa.load_format, sa.dtype) == ("key", "0", "dummy", "bfloat16")
    assert (sa.random_seed, sa.max_running_requests, sa.mem_fraction_static) == (3, 64, 0.7)
    assert sa.skip_tokenizer_init and sa.disable_radix_cache and sa.enable_memory_saver and sa.skip_server_warmup


def _prepare_server_args(version: str, argv: list[str], monkeypatch):
    """SGLang ``version``'s own ``prepare_server_args(argv)`` (what ``sglang.launch_server`` runs on
    its command line: ``--config`` merged, then parsed), with the hardware probe switched off."""
    server_args = sglang_module(version, "sglang.srt.server_args")
    monkeypatch.setattr(server_args.ServerArgs, "__post_init__", lambda self: None, raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return server_args.prepare_server_args(list(argv))
    finally:  # 0.5.23 calls logging.basicConfig(force=True): give pytest its handlers back
        root.handlers[:], root.level = handlers, level


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_reads_the_api_key_from_the_config_file_we_pass(version, tmp_path, monkeypatch):
    key = os.urandom(16).hex()
    key_file = write_api_key_file(tmp_path / "secrets", key)
    cmd = sglang_server_command("sglang", "/models/qwen", "127.0.0.1", 30001, tp_size=2, api_key_file=key_file,
                         weight_version="0", seed=3)
    assert key not in " ".join(cmd) and "--api-key" not in cmd
    sa = _prepare_server_args(version, cmd[3:], monkeypatch)
    assert sa.api_key == key
    assert (sa.model_path, sa.port, sa.tp_size, sa.weight_version, sa.random_seed) == ("/models/qwen", 30001, 2,
                                                                                        "0", 3)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_engine_reads_a_config_file_as_sglang_does(version, tmp_path, monkeypatch):
    """The same argv and file give the same values to SGLang and to the embedded engine: the file's
    options, under the command line's (``--port`` is in both; the command line wins)."""
    from areal_fast.embedded.__main__ import parse_args

    monkeypatch.delenv("AREAL_FAST_API_KEY", raising=False)
    f = tmp_path / "server.yaml"
    f.write_text("api-key: abc123\nport: 1111\nmax-running-requests: 8\nskip-tokenizer-init: true\n"
                 "random-seed: 5\n")
    argv = ["--model-path", "/models/qwen", "--port", "30001", "--config", str(f), "--random-seed", "9"]
    sa = _prepare_server_args(version, argv, monkeypatch)
    ours = parse_args(argv)
    want = ("abc123", 30001, 8, True, 9)
    assert (sa.api_key, sa.port, sa.max_running_requests, sa.skip_tokenizer_init, sa.random_seed) == want
    assert (ours.api_key, ours.port, ours.max_running_requests, ours.skip_tokenizer_init, ours.seed) == want


@pytest.mark.parametrize("version,error", [("0.5.6", TypeError), ("0.5.23", AssertionError)])
def test_the_judge_refuses_an_unknown_sampling_key(version, error):
    """The parse above can fail: SGLang's own code refuses what our client refuses before sending
    (0.5.6: ``SamplingParams(**params)`` raises TypeError, SGLang's bare 500; 0.5.23: its schema)."""
    with pytest.raises(error, match="bogus"):
        _parse_like_sglang(version, "/generate", {"input_ids": [1, 2], "sampling_params": {"bogus": 1}})
    with pytest.raises(AssertionError, match="silently ignored"):
        _parse_like_sglang(version, "/pause_generation", {"mode": "abort", "flush": True})
