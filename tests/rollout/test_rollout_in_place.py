"""``rollout.pause_mode: in_place`` end to end (docs/pause_modes.md).

- config: refused at load where a server cannot keep every token's version exact (the embedded
  engine as SGLang < 0.5.19; launched SGLang without --disable-overlap-schedule or
  --disable-radix-cache, or installed < 0.5.19); accepted otherwise, and then updates never flush;
- client: an in_place pause is refused for such a server before anything is paused;
- client + engine: requests in flight across an in_place update keep running on their KV, nothing
  is resubmitted, lost or duplicated, and every token carries the version of the weights that made
  it: the tokens after the update are exactly what the new weights decode on the old weights' KV;
- a shrunken training run with in_place and the distributed weight sync finishes every step.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _shared import engine_twins, serve_app, until_running
from packaging.version import Version

from areal_fast.backends import checks
from areal_fast.backends.checks import check_rollout_servers
from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.backends.sglang.compat import IN_PLACE_SERVER_FLAGS, in_place_server_refusal
from areal_fast.data.tiny_models import build_tiny_qwen2, hf_greedy, load_hf, perturbed_state_dict, save_state_dict
from areal_fast.rollout.client import RolloutError
from areal_fast.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256
FLAGS = ["--disable-overlap-schedule", "--disable-radix-cache"]


# ----------------------------------------------------------------------------- config


def _check(rollout: RolloutConfig) -> None:
    """The load-time check of what the servers serve (the assembler asks it; the section names no backend)."""
    check_rollout_servers(rollout, "distributed")


@pytest.mark.parametrize("version,ok", [("0.5.6", False), ("0.5.18", False), ("0.5.19", True), ("0.5.23", True)])
def test_config_in_place_per_embedded_engine_version(version, ok):
    kw = dict(pause_mode="in_place", server_args=["--sglang-version", version])
    if ok:
        _check(RolloutConfig(**kw))
    else:
        with pytest.raises(ValueError, match=r"pause_mode: 'in_place' refused .*one weight_version per request"):
            _check(RolloutConfig(**kw))
    # the last --sglang-version wins, as in the engine's own parser
    _check(RolloutConfig(pause_mode="in_place",
                         server_args=[f"--sglang-version={version}", "--sglang-version", "0.5.23"]))


def test_config_in_place_for_launched_sglang_needs_its_flags_and_a_release_with_spans(monkeypatch):
    monkeypatch.setattr(checks, "installed_sglang", lambda server: "0.5.23")
    for missing in FLAGS:
        with pytest.raises(ValueError, match=f"needs {missing} in rollout.server_args"):
            _check(RolloutConfig(pause_mode="in_place", server="sglang",
                                 server_args=[f for f in FLAGS if f != missing]))
    _check(RolloutConfig(pause_mode="in_place", server="sglang", server_args=FLAGS))
    monkeypatch.setattr(checks, "installed_sglang", lambda server: "0.5.18")
    with pytest.raises(ValueError, match="SGLang 0.5.18 answers one weight_version"):
        _check(RolloutConfig(pause_mode="in_place", server="sglang", server_args=FLAGS))
    # servers the run does not launch: checked by the client before its first pause
    _check(RolloutConfig(pause_mode="in_place", server="sglang", servers=["http://127.0.0.1:1"]))
    with pytest.raises(ValueError, match=r"one of \('auto', 'abort', 'retract', 'in_place'\)"):
        RolloutConfig(pause_mode="sometimes")


def test_in_place_run_config_sends_updates_without_flush():
    from areal_fast.config import load_config

    example = str(ROOT / "examples" / "tiny_reverse.yaml")
    assert load_config(example, ["rollout.pause_mode=in_place"]).weights.flush_cache is False
    assert load_config(example, ["rollout.pause_mode=retract"]).weights.flush_cache is True


def test_server_refusal_reads_version_and_flags():
    flags = dict.fromkeys(IN_PLACE_SERVER_FLAGS, True)
    assert in_place_server_refusal(flags, Version("0.5.19")) is None
    assert "one weight_version" in in_place_server_refusal(flags, Version("0.5.18"))
    assert "--disable-radix-cache" in in_place_server_refusal({"disable_overlap_schedule": True}, Version("0.5.23"))
    assert "--disable-overlap-schedule" in in_place_server_refusal({}, Version("0.5.23"))
    assert in_place_server_refusal({"engine": "areal_fast.embedded"}, Version("0.5.23")) is None


# ----------------------------------------------------------------------------- client + engine


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny")), vocab_size=VOCAB)
    sd = perturbed_state_dict(base, seed=77)
    return base, sd, save_state_dict(sd, base, str(tmp_path_factory.mktemp("v1")))


@pytest.fixture(scope="module")
def twins(dirs):
    yield from engine_twins(dirs[0])


def _run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _post(url: str, body: dict) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


def test_client_refuses_in_place_on_a_server_without_spans_before_pausing(twins):
    h = twins("0.5.18")

    async def run():
        async with SGLangRolloutClient([h.url]) as c:
            with pytest.raises(RolloutError, match=r"'in_place' refused for .*0\.5\.19"):
                await c.pause_all("in_place")
            return c.is_paused, h.server.scheduler.paused

    assert _run(run()) == (False, False)


def test_client_refuses_in_place_on_sglang_without_its_flags_before_pausing():
    from aiohttp import web

    paused = []

    async def info(request):
        return web.json_response({"version": "0.5.23", "disable_overlap_schedule": True, "weight_version": "0"})

    async def model_info(request):
        return web.json_response({"weight_version": "0"})

    async def pause(request):
        paused.append(await request.json())
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/server_info", info)
    app.router.add_get("/model_info", model_info)
    app.router.add_post("/pause_generation", pause)

    async def run():
        async with serve_app(app) as url, SGLangRolloutClient([url]) as c:
            with pytest.raises(RolloutError, match="--disable-radix-cache"):
                await c.pause_all("in_place")
            await c.pause_all("retract")  # the other modes are unaffected
            return c.server_pause_modes

    assert _run(run()) and paused == [{"mode": "retract"}]


def _in_place_reference(old, new, prompt: list[int], out: list[int], k: int) -> list[int]:
    """Greedy tokens k..len(out)-1 when the KV of prompt + out[:k-1] was computed by ``old`` and
    everything from out[k-1] on by ``new`` (the engine feeds out[k-1] in the first step after the update)."""
    import torch

    with torch.no_grad():
        cache = old(torch.tensor([prompt + out[: k - 1]]), use_cache=True).past_key_values
        nxt, got = out[k - 1], []
        for _ in range(len(out) - k):
            logits = new(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache, nxt = logits.past_key_values, int(logits.logits[0, -1].argmax())
            got.append(nxt)
    return got


def test_requests_in_flight_keep_going_across_an_in_place_update_with_exact_versions(twins, dirs):
    base, sd, new_dir = dirs
    h = twins("0.5.23")
    prompts = [[11, 4, 9], [23, 8, 1], [5, 5, 30]]  # equal lengths: one prefill, no padding
    n = 40

    async def run():
        await _post(h.url + "/update_weights_from_disk", {"model_path": base, "weight_version": "0",
                                                          "flush_cache": True})
        async with SGLangRolloutClient([h.url], pause_mode="in_place") as c:
            tasks = [asyncio.create_task(c.generate(p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
                                                    rid=f"ip{i}")) for i, p in enumerate(prompts)]
            sched = h.server.scheduler
            await until_running(h, 5, count=len(prompts))
            await c.pause_all()  # the client's configured mode: in_place
            kept = len(sched._rows)
            upd = await _post(h.url + "/update_weights_from_disk", {"model_path": new_dir, "weight_version": "1",
                                                                    "flush_cache": False})
            await c.continue_all()
            samples = await asyncio.gather(*tasks)
        await _post(h.url + "/update_weights_from_disk", {"model_path": base, "weight_version": "0",
                                                          "flush_cache": True})
        return kept, upd, samples

    kept, upd, samples = _run(run())
    assert kept == len(prompts) and upd[0] == 200, upd
    old, new = load_hf(base), load_hf(base, sd)
    for p, s in zip(prompts, samples):
        out, versions = list(s.output_ids), list(s.output_versions)
        assert len(out) == n and s.finish_reason == "length" and not s.aborted
        assert s.num_segments == 1  # kept on the server: nothing came back, nothing was resubmitted
        k = versions.index(1)
        assert 5 <= k < n and versions == [0] * k + [1] * (n - k)
        assert out[:k] == hf_greedy(old, p, k)  # made by the old weights
        # made by the new weights, decoding on the KV the old weights computed before the update
        assert out[k:] == _in_place_reference(old, new, p, out, k)


# ----------------------------------------------------------------------------- a training run


@pytest.mark.slow  # a shrunken `areal-fast train` through the CLI (~30-90 s on a busy 2-core machine)
def test_a_training_run_with_in_place_pauses_finishes_every_step(tmp_path):
    """The example with in_place pauses and its distributed (gloo) weight sync: every update goes in
    without a flush while requests keep running (with a flush the engine would refuse the update,
    as SGLang 0.5.22+ does, and the run would fail)."""
    out = tmp_path / "run"
    tiny = ["model.warm_start.steps=10", "model.warm_start.hidden_size=32", "model.warm_start.intermediate_size=64",
            "model.warm_start.num_hidden_layers=1", "model.warm_start.num_attention_heads=2",
            "model.warm_start.num_key_value_heads=1", "data.synthetic.max_len=6", "data.synthetic.n_train=200",
            "data.synthetic.n_eval=8", "rollout.group_size=2", "rollout.max_new_tokens=16", "rollout.max_staleness=2",
            "rollout.max_concurrent=8", "train.batch_size=2", "eval.every_steps=0", "checkpoint.every_steps=0",
            "log.tensorboard=false", "log.progress=false", "log.plots=false", "reward.workers=1", "log.samples=true"]
    steps = 8
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", str(ROOT / "examples" / "tiny_reverse.yaml"),
           f"experiment.output_dir={out}", *tiny, f"experiment.total_steps={steps}", "rollout.pause_mode=in_place",
           "weights.method=distributed"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == list(range(1, steps + 1))
    dumped = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.strip()]
    versions = [s["versions"] for r in dumped for g in r["groups"] for s in g["samples"]]
    assert versions and all(v == sorted(v) for v in versions)  # a token's version never goes back
