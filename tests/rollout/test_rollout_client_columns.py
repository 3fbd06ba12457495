"""The rollout client hands back its compact columns: the per-token fields of the ``Sample`` it
returns are the arrays it stitched (typecodes of ``areal_fast.columns``), equal to what the server
answered, and ``ClientRollout`` passes that very sample on (no copy, no list, no new record)."""

import asyncio
import json
from array import array

import pytest
from aiohttp import web

import areal_fast.rollout.client as client_mod
from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.columns import LOGPROB_ARRAY, TOKEN_ARRAY
from areal_fast.rollout.answer import dumps
from areal_fast.rollout.port import ClientRollout
from areal_fast.sample import Sample

PROMPT = [3, 0, 2**31 - 1, 7]  # int32's extremes: the array encoding must write them exactly
FIRST = ([11, 12, 13], [-0.1, -(0.1 + 0.2), -1e-300], "3")  # segment 0: ids, log-probs (awkward floats), version
SECOND = ([14, 15], [-2.5, -0.3333333333333333], "4")  # segment 1, after the pause and an update
MAX_NEW = 5
WAIT_S = 30.0  # generous: a safety net on a loaded machine, never a timing assertion


class _Server:
    """A fake SGLang 0.5.10 (pause mode "auto" -> abort): segment 0 of every request is held until a
    pause, then answered with its partial output (finish "abort"); segment 1 finishes the request."""

    def __init__(self):
        self.bodies: dict[str, dict] = {}  # server rid -> the /generate body it got
        self.first_held = asyncio.Event()
        self.paused = asyncio.Event()
        self.continued = asyncio.Event()
        self.continued_before_resubmit: list[bool] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    @staticmethod
    def _answer(rid: str, seg, finish: dict):
        ids, lps, version = seg
        return web.json_response({"output_ids": ids, "meta_info": {
            "id": rid, "finish_reason": finish, "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}})

    async def generate(self, request):
        body = json.loads(await request.read())
        self.bodies[body["rid"]] = body
        if body["rid"].endswith("|0|"):
            self.first_held.set()
            await self.paused.wait()
            return self._answer(body["rid"], FIRST, {"type": "abort", "message": "paused"})
        self.continued_before_resubmit.append(self.continued.is_set())
        return self._answer(body["rid"], SECOND, {"type": "length", "length": len(SECOND[0])})

    async def control(self, request):
        if request.path == "/pause_generation":
            self.paused.set()
        elif request.path == "/continue_generation":
            self.continued.set()
        return web.json_response({"success": True, "message": "", "status": "ok"})

    async def info(self, request):
        return web.json_response({"version": "0.5.10", "tp_size": 1, "weight_version": "3"})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/server_info", self.info)
        app.router.add_get("/model_info", self.info)
        app.router.add_post("/{tail:.*}", self.control)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


async def _across_a_pause(srv: _Server, client: SGLangRolloutClient, start):
    """Run ``start()`` (a coroutine that generates), pause while segment 0 is held, continue."""
    task = asyncio.create_task(start())
    await asyncio.wait_for(srv.first_held.wait(), WAIT_S)
    await client.pause_all()
    await client.continue_all()
    return await asyncio.wait_for(task, WAIT_S)


@pytest.mark.parametrize("prompt_kind", ["list", "tuple", "array"])
@pytest.mark.parametrize("encoder", ["fragment", "list"])
def test_generate_returns_the_stitched_columns(monkeypatch, prompt_kind, encoder):
    if encoder == "list":  # an orjson without Fragment, or the json fallback: the ids go as a list
        monkeypatch.setattr(client_mod, "_FRAGMENT", None)
    elif client_mod._FRAGMENT is None:
        pytest.skip("this orjson has no Fragment (or orjson is not installed): the list path is the one in use")
    prompt = {"list": list, "tuple": tuple, "array": lambda p: array(TOKEN_ARRAY, p)}[prompt_kind](PROMPT)

    async def run():
        async with _Server() as srv, SGLangRolloutClient([srv.url], gc_tuning=False) as c:
            res = await _across_a_pause(srv, c, lambda: c.generate(prompt, {"max_new_tokens": MAX_NEW}, rid="s"))
            return srv, res

    srv, res = asyncio.run(run())
    assert isinstance(res, Sample) and res.num_segments == 2 and res.finish_reason == "length"
    for name, code in (("output_ids", TOKEN_ARRAY), ("output_logprobs", LOGPROB_ARRAY),
                       ("output_versions", TOKEN_ARRAY)):
        col = getattr(res, name)
        assert type(col) is array and col.typecode == code, name
    assert list(res.output_ids) == FIRST[0] + SECOND[0]
    # float32: the JSON's values rounded once, as the trainer's float32 tensor would
    assert list(res.output_logprobs) == array(LOGPROB_ARRAY, FIRST[1] + SECOND[1]).tolist()
    assert list(res.output_versions) == [3] * len(FIRST[0]) + [4] * len(SECOND[0])
    if prompt_kind == "array":
        assert res.prompt_ids is prompt  # the caller's prompt, not copied
    assert res.prompt_ids.tolist() == PROMPT and res.loss_mask.tolist() == [1] * len(res.output_ids)
    # the resubmission: prompt + the partial output, sent after continue, asking only for the rest
    assert srv.bodies["s|0|"]["input_ids"] == PROMPT
    assert srv.bodies["s|1|"]["input_ids"] == PROMPT + FIRST[0]
    assert srv.bodies["s|1|"]["sampling_params"]["max_new_tokens"] == MAX_NEW - len(FIRST[0])
    assert srv.continued_before_resubmit == [True]


def test_client_rollout_hands_on_the_clients_sample_itself():
    async def run():
        async with _Server() as srv, SGLangRolloutClient([srv.url], gc_tuning=False) as c:
            seen: list[Sample] = []
            generate = c.generate

            async def recording(*args, **kwargs):
                seen.append(await generate(*args, **kwargs))
                return seen[-1]

            c.generate = recording
            port = ClientRollout(c)
            g = await _across_a_pause(srv, c, lambda: port.generate(PROMPT, {"max_new_tokens": MAX_NEW}, "r"))
            return g, seen

    g, seen = asyncio.run(run())
    assert isinstance(g, Sample) and len(seen) == 1
    assert g is seen[0]  # the client's record, not a copy of its columns into another
    assert list(g.output_ids) == FIRST[0] + SECOND[0] and g.finish_reason == "length"


@pytest.mark.parametrize("ids", [[], (), array(TOKEN_ARRAY)])
def test_empty_prompt_refused(ids):
    with pytest.raises(ValueError, match="input_ids must be a non-empty"):
        SGLangRolloutClient._check_request(ids, {}, "r")


@pytest.mark.parametrize("ids", ["abc", b"\x01\x02", (i for i in range(3)), 5])
def test_prompt_that_is_not_a_sequence_of_ids_refused(ids):
    with pytest.raises(TypeError, match="input_ids must be a sequence of token ids"):
        SGLangRolloutClient._check_request(ids, {}, "r")


@pytest.mark.parametrize("use_fragment", [True, False])
def test_next_segment_input_encodes_as_the_list(monkeypatch, use_fragment):
    """``_prompt_plus`` + ``dumps`` write the same JSON as the plain list, for every prompt type."""
    if not use_fragment:
        monkeypatch.setattr(client_mod, "_FRAGMENT", None)
    out = array(TOKEN_ARRAY, [2**31 - 1, 0, 9])
    for prompt in (PROMPT, tuple(PROMPT), array(TOKEN_ARRAY, PROMPT), array("q", PROMPT)):
        for partial, want in ((array(TOKEN_ARRAY), PROMPT), (out, PROMPT + list(out))):
            got = client_mod._prompt_plus(prompt, partial)
            assert json.loads(dumps({"input_ids": got})) == {"input_ids": want}, (prompt, partial)
