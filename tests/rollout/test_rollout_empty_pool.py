"""The rollout client when a server leaves its pool. With an empty pool (``allow_empty``:
``elastic.empty_pool``) a request whose server died waits for a server instead of failing, keeps the
tokens of its earlier segments, and finishes on the server that joins; without ``allow_empty`` the
last server cannot be removed. A request in flight on a hung server (it never answers, its
connection stays open) fails over as soon as the server is dropped, not at its deadline."""

from __future__ import annotations

import asyncio

import pytest
from _shared import serve_app, stays_pending

from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.rollout.port import ClientRollout


def _app(name: str, calls: list, answers: list):
    """A fake server: /generate answers with the next of ``answers`` ((status, ids, version, finish),
    or an ``asyncio.Event`` to hang on until it is set), the last one repeated."""
    from aiohttp import web

    async def info(request):
        return web.json_response({"version": "0.5.20", "tp_size": 1, "weight_version": "0"})

    async def post(request):
        body = await request.json() if request.can_read_body else {}
        if request.path != "/generate":
            return web.json_response({"success": True, "message": "", "status": "ok"})
        calls.append((name, list(body["input_ids"]), body["sampling_params"]["max_new_tokens"]))
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, asyncio.Event):  # a hung server: no answer until the test lets it go
            await answer.wait()
            return web.json_response({"error": {"message": "too late"}}, status=503)
        status, ids, version, finish = answer
        if status != 200:
            return web.json_response({"error": {"message": "gone"}}, status=status)
        return web.json_response({"output_ids": ids, "meta_info": {
            "id": body["rid"], "finish_reason": {"type": finish, "length": len(ids)}, "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}})

    app = web.Application()
    app.router.add_get("/server_info", info)
    app.router.add_get("/model_info", info)
    app.router.add_post("/{tail:.*}", post)
    return app


async def _until(cond, timeout_s: float = 10.0):
    async with asyncio.timeout(timeout_s):  # the watchdog of these tests
        while not cond():
            await asyncio.sleep(0.01)


def test_a_request_waits_through_an_empty_pool_and_finishes_on_the_server_that_joins():
    calls: list = []

    async def run():
        # A: one segment interrupted (2 tokens at version 3), then it fails (503) as a dying server does
        a_app = _app("A", calls, [(200, [7, 8], "3", "abort"), (503, [], "3", "")])
        b_app = _app("B", calls, [(200, [9, 9, 9], "4", "length")])
        async with serve_app(a_app) as a, serve_app(b_app) as b:
            async with SGLangRolloutClient([a], down_cooldown_s=0.05, retry_backoff_s=0.01, max_attempts=3) as c:
                port = ClientRollout(c)
                port.allow_empty = True
                task = asyncio.create_task(c.generate([1, 2], {"max_new_tokens": 5}, rid="r"))
                await _until(lambda: len(calls) >= 2)  # the second segment failed on A
                assert port.remove_server(a) and port.urls == []  # the watchdog drops it: the pool is empty
                # it waits for a server, its attempts not spent: spending them would end it within
                # max_attempts retries' worth of backoff
                spent_s = sum(c.retry_backoff_s * (a + 1) for a in range(c.max_attempts))
                await stays_pending(task, 5 * spent_s, "a request while the pool is empty")
                await port.add_server(b)
                return await asyncio.wait_for(task, 10)

    res = asyncio.run(run())
    assert list(res.output_ids) == [7, 8, 9, 9, 9]  # A's segment kept, B's appended: nothing lost or twice
    assert list(res.output_versions) == [3, 3, 4, 4, 4]
    assert calls[-1] == ("B", [1, 2, 7, 8], 3)  # B continues from the prompt plus A's tokens
    assert all(name == "A" for name, _, _ in calls[:-1]) and not res.aborted


def test_the_last_server_stays_without_allow_empty():
    async def run():
        async with serve_app(_app("A", [], [(200, [1], "0", "length")])) as a:
            async with SGLangRolloutClient([a]) as c:
                port = ClientRollout(c)
                assert not port.allow_empty
                with pytest.raises(RuntimeError, match="last inference server"):
                    port.remove_server(a)
                with pytest.raises(Exception, match="last server"):
                    c.remove_server(a)
                assert port.urls == [a]

    asyncio.run(run())


def test_a_request_on_a_hung_server_fails_over_as_soon_as_the_server_is_dropped():
    calls: list = []

    async def run():
        hang = asyncio.Event()
        a_app = _app("A", calls, [hang])
        b_app = _app("B", calls, [(200, [9, 9, 9], "4", "length")])
        async with serve_app(a_app) as a, serve_app(b_app) as b:
            try:
                # its deadline is an hour: only the drop can end the wait on A within the 10 s below
                async with SGLangRolloutClient([a], request_timeout_s=3600.0, down_cooldown_s=0.05,
                                         retry_backoff_s=0.01) as c:
                    port = ClientRollout(c)
                    task = asyncio.create_task(c.generate([1, 2], {"max_new_tokens": 3}, rid="h"))
                    await _until(lambda: len(calls) == 1)  # on A, which will not answer
                    await port.add_server(b)
                    assert port.remove_server(a)  # the watchdog found it hung
                    return await asyncio.wait_for(task, 10)
            finally:
                hang.set()  # A's handler returns: the server can shut down

    res = asyncio.run(run())
    assert list(res.output_ids) == [9, 9, 9] and list(res.output_versions) == [4, 4, 4] and not res.aborted
    assert [name for name, _, _ in calls] == ["A", "B"] and calls[-1] == ("B", [1, 2], 3)
