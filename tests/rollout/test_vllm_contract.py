"""vLLM's own code judges what we send it, for the oldest and newest release we support.

Every body built by ``areal_fast.backends.vllm.requests`` is parsed the way vLLM's HTTP server
parses it: /v1/completions bodies by pydantic validation into vLLM's ``CompletionRequest`` (what
FastAPI does with the handler's argument), and every key we send must be one of its fields (vLLM
accepts unknown keys and ignores them: a misspelt option would silently do nothing). The control
and weight bodies are checked against the parameters of vLLM's route handlers, read from the
release's sources (the routes are FastAPI functions whose signature is the contract), and our
launch command's flags must all be flags of that release's argument parser.

The wheels' Python sources are downloaded by tests/vllm_wheel.py (cached); a test skips, with the
reason, only when the download fails. The first import of vLLM's protocol module takes ~10-30 s.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_wheel import source_dir_or_skip, unknown_vllm_flags, vllm_module  # noqa: E402

from areal_fast.backends.vllm import requests as vr  # noqa: E402
from areal_fast.backends.vllm.compat import CONTRACT_VERSIONS, VLLMBehaviour  # noqa: E402
from areal_fast.backends.vllm.server_command import vllm_server_command  # noqa: E402

pytestmark = pytest.mark.slow  # downloads (once) and imports vLLM's protocol module per version
SAMPLING = {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "stop_token_ids": [2],
            "ignore_eos": False, "skip_special_tokens": True, "sampling_seed": 3, "min_new_tokens": 1,
            "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def _completion_type(version: str):
    for name in ("vllm.entrypoints.openai.completion.protocol", "vllm.entrypoints.openai.protocol"):
        src = source_dir_or_skip(version) / (name.replace(".", "/") + ".py")
        if src.is_file():
            return vllm_module(version, name).CompletionRequest
    raise AssertionError(f"no CompletionRequest module found in vLLM {version}")


def _bodies(version: str) -> list[dict]:
    b = VLLMBehaviour.of(version)
    return [vr.completion_body([5, 6, 7], SAMPLING, "rid|0|", b, priority=7),
            vr.completion_body([1], {"max_new_tokens": 1, "top_k": -1}, "r2|3|", b)]


@pytest.mark.parametrize("version", CONTRACT_VERSIONS)
def test_completion_bodies_parse_as_vllm_completion_request(version):
    cls = _completion_type(version)
    fields = set(cls.model_fields)
    for body in _bodies(version):
        extra = set(body) - fields
        assert not extra, f"/v1/completions keys vLLM {version} does not know (silently ignored): {extra}"
        req = cls.model_validate(body)
        assert req.prompt == body["prompt"] and req.return_token_ids is True and req.logprobs == 0
        assert req.max_tokens == body["max_tokens"] and req.stream is False
        assert getattr(req, "request_id", body["request_id"]) == body["request_id"]
    if VLLMBehaviour.of(version).token_weight_versions:
        assert cls.model_validate(_bodies(version)[0]).return_weight_versions is True
    assert cls.model_validate(_bodies(version)[0]).priority == 7  # the group's admission order


@pytest.mark.parametrize("version", CONTRACT_VERSIONS)
def test_a_misspelt_key_is_caught_by_the_field_check(version):
    """The field check can fail: vLLM itself would accept (and ignore) this body."""
    cls = _completion_type(version)
    body = {**_bodies(version)[0], "return_token_id": True}
    cls.model_validate(body)  # accepted by vLLM ...
    assert set(body) - set(cls.model_fields) == {"return_token_id"}  # ... and caught by our check


def _route_params(version: str, path: str) -> tuple[str, str] | None:
    """The handler's parameter list of ``@router.post(path)`` in the release's sources, or None."""
    root = source_dir_or_skip(version) / "vllm" / "entrypoints"
    pat = re.compile(r'@(?:router|app)\.post\(\s*"' + re.escape(path)
                     + r'"[^)]*\)\s*\n\s*async def \w+\((.*?)\)\s*(?:->[^:]*)?:', re.S)
    for f in root.rglob("*.py"):
        m = pat.search(f.read_text(encoding="utf-8"))
        if m:
            return m.group(1), f.read_text(encoding="utf-8")[m.end():m.end() + 3000]
    return None


@pytest.mark.parametrize("version", CONTRACT_VERSIONS)
def test_control_and_weight_bodies_match_the_route_handlers(version):
    b = VLLMBehaviour.of(version)
    pause = _route_params(version, "/pause")
    assert (pause is not None) == b.has_pause, f"vLLM {version}: /pause exists: {pause is not None}"
    if b.has_pause:
        for key in vr.pause_query("abort", b):
            assert key in pause[0], f"/pause of vLLM {version} takes no query parameter {key!r}"
        if b.has_pause_modes:
            assert "PauseMode" in pause[0] or "mode" in pause[0]
            assert set(vr.pause_query("in_place", b)) <= {"mode", "clear_cache"}
            assert "clear_cache" in pause[0] or "clear_cache" not in vr.pause_query("in_place", b)
        abort = _route_params(version, "/abort_requests")
        assert (abort is not None) == b.has_abort_requests or abort is not None and "tokens_only" in abort[1]
        if b.has_abort_requests:
            assert 'body.get("request_ids")' in abort[1]
    else:
        with pytest.raises(ValueError, match="no /pause"):
            vr.pause_query("abort", b)
    rpc = _route_params(version, "/collective_rpc")
    assert rpc is not None and 'body.get("method")' in rpc[1] and 'body.get("kwargs"' in rpc[1]
    worker = (source_dir_or_skip(version) / "vllm/v1/worker/gpu_model_runner.py").read_text(encoding="utf-8")
    for call in vr.disk_update_calls("/ckpt/step1", b):
        assert f"def {call['method']}(" in worker, f"vLLM {version} workers have no {call['method']}"
        if "weights_path" in call.get("kwargs", {}):
            assert re.search(r"def reload_weights\([^)]*weights_path", worker, re.S)
    init = _route_params(version, "/init_weight_transfer_engine")
    assert (init is not None) == b.has_weight_transfer
    if init is not None:
        assert "init_info" in init[0] and "Body(embed=True)" in init[0]
        assert set(vr.init_transfer_body("h", 1, 1, 2)) == {"init_info"}
        upd = _route_params(version, "/update_weights")
        assert "update_info" in upd[0]
    finish = _route_params(version, "/finish_weight_update")
    assert (finish is not None) == b.weight_update_sessions
    if finish is not None and b.labels_weight_version:
        assert "weight_version" in finish[0] and vr.finish_transfer_body("3", b) == {"weight_version": "3"}
    label = _route_params(version, "/update_weight_version")
    assert (label is not None) == b.labels_weight_version
    if label is not None:
        assert set(vr.weight_version_body("3")) <= set(re.findall(r"(\w+): Annotated", label[0]))


@pytest.mark.parametrize("version", CONTRACT_VERSIONS)
def test_server_command_flags_are_vllm_flags(version):
    b = VLLMBehaviour.of(version)
    cmd = vllm_server_command("/m", "127.0.0.1", 8000, version=version, api_key_file="/k.yaml", dtype="bfloat16",
                              seed=1, max_num_seqs=8, load_format="auto", weight_transfer=b.has_weight_transfer)
    # vLLM derives most flags from its config dataclasses' field names; --config is its argparse extension
    assert unknown_vllm_flags(version, cmd) == [], f"vLLM {version} has no such flags"
    # the check can fail: a prefix of a real flag and SGLang's spelling are not vLLM flags
    assert unknown_vllm_flags(version, [*cmd, "--load", "--model-path"]) == ["--load", "--model-path"]
    assert (source_dir_or_skip(version) / "vllm/entrypoints/openai/api_server.py").is_file()
    # the value of --scheduling-policy is one of vLLM's policies (its config's Literal, which the parser takes)
    policy = cmd[cmd.index("--scheduling-policy") + 1]
    literal = re.search(r"SchedulerPolicy = Literal\[(.*?)\]",
                        (source_dir_or_skip(version) / "vllm/config/scheduler.py").read_text())
    assert literal and f'"{policy}"' in literal.group(1), f"vLLM {version}: no scheduling policy {policy!r}"


def _dataclass_fields(text: str, cls: str) -> set[str]:
    """The annotated field names of ``class cls`` in a source text (up to the next class)."""
    m = re.search(rf"^class {cls}\b.*?(?=^class |\Z)", text, re.S | re.M)
    assert m, f"class {cls} not found"
    return set(re.findall(r"^    (\w+): ", m.group(0), re.M))


@pytest.mark.parametrize("version", CONTRACT_VERSIONS)
def test_nccl_transfer_infos_are_vllm_dataclass_fields(version):
    """init_info / update_info are plain dicts at the HTTP layer; the NCCL engine builds its
    dataclasses from them, so every key we send must be a field (and every required one sent)."""
    b = VLLMBehaviour.of(version)
    wt = source_dir_or_skip(version) / "vllm/distributed/weight_transfer"
    if not b.has_weight_transfer:
        assert not wt.is_dir() or not list(wt.glob("nccl*.py"))
        return
    text = "\n".join(p.read_text(encoding="utf-8") for p in wt.glob("nccl*.py"))
    init = vr.init_transfer_body("10.0.0.1", 29500, 1, 2)["init_info"]
    assert set(init) <= _dataclass_fields(text, "NCCLWeightTransferInitInfo")
    upd = vr.update_transfer_body(["w"], ["float32"], [[2, 3]])["update_info"]
    assert set(upd) <= _dataclass_fields(text, "NCCLWeightTransferUpdateInfo")
    assert {"names", "dtype_names", "shapes"} == set(upd)
