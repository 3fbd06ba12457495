"""A real agent framework plugged in through ``base_url``: the openai-agents SDK (pypi
``openai-agents``, installed by the ``dev`` extra) runs an agent with a function tool against the
agent endpoint, with its default model (the Responses API) and with its chat-completions model, over
HTTP and on the in-process client. The framework runs the tool and sends its result back; the
recording is the one ``chat.completions`` makes by hand: the second turn continues the first's exact
tokens, and only the model's tokens are trained."""

from __future__ import annotations

import pytest
from test_agent_responses import client_for
from test_agent_session import EOS, ids, run

from areal_fast.agent.server import AgentServer
from areal_fast.agent.trajectories import assemble

OUTPUTS = [ids("43*7") + [EOS], ids("238") + [EOS]]


def _calculator_agent(agents, model):
    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate a product written right to left (the tiny model's order)."""
        a, b = expression[::-1].split("*")
        return str(int(a) * int(b))

    return agents.Agent(name="calculator", model=model, tools=[calculator])


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.parametrize("transport", ["http", "inprocess"])
def test_openai_agents_runs_a_tool_agent_through_base_url(api, transport):
    agents = pytest.importorskip("agents", reason="the openai-agents package (pip install openai-agents)")
    import openai

    agents.set_tracing_disabled(True)  # nothing leaves the machine: no trace export to OpenAI
    client, rollout = client_for(OUTPUTS)

    async def go():
        server = sdk = None
        if transport == "http":
            server = await AgentServer().start()
            sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
        model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        model = model_cls(model="areal-fast", openai_client=sdk or client)
        try:
            result = await agents.Runner.run(_calculator_agent(agents, model), "7*34=")
        finally:
            if sdk is not None:
                await sdk.close()
                await server.close()
        return result.final_output

    assert run(go()) == "238"
    c1, c2 = client.calls
    assert c1.tool_calls[0].name == "calculator" and c2.parent == c1.completion_id
    assert rollout.prompts[1] == rollout.prompts[0] + OUTPUTS[0] + ids("238")
    (traj,) = assemble(client.calls)
    assert traj.loss_mask.tolist() == [1] * len(OUTPUTS[0]) + [0] * 3 + [1] * len(OUTPUTS[1])
