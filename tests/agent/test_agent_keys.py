"""Per-episode keys on the agent endpoint, through the openai SDK: an episode's key opens its own
routes only (chat completions, responses, models, reward); on another episode's routes it is a 401
(``openai.AuthenticationError``), as on any path of the listener that is not an episode's; keys are
compared in constant time (``hmac.compare_digest``); a closed episode's key opens nothing. The engine
refusing the agent's key is ``test_agent_engine.py``'s."""

from __future__ import annotations

import hmac

import pytest
from test_agent_responses import client_for
from test_agent_session import EOS, MODEL, ids, run

from areal_fast.agent.server import AgentServer
from areal_fast.http import auth

USER = [{"role": "user", "content": "1="}]
NOT_EPISODE_ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/models", "/", "/episodes", "/health", "/metrics"]


def test_a_key_opens_its_own_episode_only_and_no_other_route(monkeypatch):
    openai = pytest.importorskip("openai")
    aiohttp = pytest.importorskip("aiohttp")
    compared = []
    real_compare = hmac.compare_digest

    def recording_compare(a, b):
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording_compare)
    a, _ = client_for([ids("1") + [EOS]] * 3)
    b, b_rollout = client_for([ids("2") + [EOS]])

    async def go():
        async with AgentServer() as server, aiohttp.ClientSession() as http:
            url_a, url_b = server.open(a), server.open(b)
            assert a.api_key != b.api_key and len(a.api_key) == 64
            own = openai.AsyncOpenAI(base_url=url_a, api_key=a.api_key, max_retries=0)
            r = await own.chat.completions.create(model=MODEL, messages=USER)
            assert r.choices[0].message.content == "1"
            await own.responses.create(model=MODEL, input="1=")
            assert [m.id for m in (await own.models.list()).data] == [MODEL]
            # A's key on B's routes
            stolen = openai.AsyncOpenAI(base_url=url_b, api_key=a.api_key, max_retries=0)
            for call in (lambda: stolen.chat.completions.create(model=MODEL, messages=USER),
                         lambda: stolen.responses.create(model=MODEL, input="1="), lambda: stolen.models.list()):
                with pytest.raises(openai.AuthenticationError):
                    await call()
            statuses = {}
            headers = {"Authorization": f"Bearer {a.api_key}"}
            async with http.post(url_b + "/reward", json={"reward": 1.0}, headers=headers) as resp:
                statuses["B's reward"] = resp.status
            for path in NOT_EPISODE_ROUTES:  # no key opens a path that is not an episode's
                async with http.post(server.url + path, json={}, headers=headers) as resp:
                    statuses[path] = resp.status
            server.close_episode(url_a)
            with pytest.raises(openai.NotFoundError):  # a closed episode: its key opens nothing
                await own.chat.completions.create(model=MODEL, messages=USER)
            for c in (own, stolen):
                await c.close()
            return statuses

    statuses = run(go())
    assert statuses == {path: 401 for path in ["B's reward", *NOT_EPISODE_ROUTES]}
    assert b_rollout.prompts == [] and b.session.final_reward is None  # B never generated, never ended
    # every key check went through the constant-time comparison, against the episode's own key
    assert {want for _, want in compared} == {f"Bearer {k}".encode() for k in (a.api_key, b.api_key)}
    assert len(compared) >= 6
