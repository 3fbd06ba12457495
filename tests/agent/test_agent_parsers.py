"""Tool-call parsers chosen by name (Hermes, Qwen3-Coder's XML, plain JSON) with ``tool_choice`` and
parallel calls, the ``<think>`` reasoning parser, and a conversation that goes on token for token on
a template that drops earlier reasoning (Qwen3's rule), or is rendered again with
``continuation='template'``. Through the openai SDK over HTTP where the answer is what an agent sees."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_agent_session import ScriptedRollout

from areal_fast.agent.client import AgentClient
from areal_fast.agent.reasoning import split_think
from areal_fast.agent.request import ChatRequestError, Tool
from areal_fast.agent.server import AgentServer
from areal_fast.agent.tool_parsers import TOOL_PARSERS, parse_json, parse_qwen3_coder, tool_parser
from areal_fast.workflow import EpisodeEngine

# Qwen3's rule, written small: an assistant message after the last user message shows its reasoning in
# <think>, an earlier one only its answer (so the history renders differently once a user message follows)
QWEN3ISH = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{%- set reasoning = m.reasoning_content or '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}<think>{{ reasoning }}</think>{%- endif %}{{ content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments }}}</tool_call>{%- endfor %}"
    "{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def qwen3_tok():
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for s in ("<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=QWEN3ISH,
                                   additional_special_tokens=["<|im_start|>"])


def _client(tok, outputs, **options):
    rollout = ScriptedRollout(outputs)
    eng = EpisodeEngine(rollout, None, tok, {"max_new_tokens": 512, "temperature": 1.0}, "p", training=True,
                        chat_client=AgentClient.for_engine)
    return eng.openai(**options), rollout


async def _over_http(client, body):
    import openai

    async with AgentServer() as server:
        sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
        try:
            return await body(sdk)
        finally:
            await sdk.close()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


# ------------------------------------------------------------------ continuing past dropped reasoning
def test_second_user_turn_continues_token_for_token_where_the_template_drops_earlier_reasoning(qwen3_tok):
    pytest.importorskip("openai")
    enc = lambda s: qwen3_tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = qwen3_tok.eos_token_id
    out1 = enc("<think>2 and 2</think>4") + [eos]
    client, rollout = _client(qwen3_tok, [out1, enc("6") + [eos]], reasoning_parser="think")

    async def body(sdk):
        m = [{"role": "user", "content": "2+2?"}]
        r1 = await sdk.chat.completions.create(model=client.model, messages=m)
        msg = r1.choices[0].message
        assert (msg.content, msg.reasoning_content) == ("4", "2 and 2")
        m += [msg.model_dump(exclude_none=True), {"role": "user", "content": "3+3?"}]
        r2 = await sdk.chat.completions.create(model=client.model, messages=m)
        r2_msg = r2.choices[0].message
        assert r2_msg.content == "6" and getattr(r2_msg, "reasoning_content", None) is None
        return r1

    r1 = _run(_over_http(client, body))
    first = qwen3_tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                          add_generation_prompt=True)
    # the model's very tokens, the end of its turn, then only the new user message as the template writes it
    assert rollout.prompts[1] == enc(first) + out1 + enc("\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert client.calls[1].parent == r1.id and client.calls[1].diverged_at is None


def test_template_continuation_renders_the_history_again_as_a_new_trajectory(qwen3_tok):
    enc = lambda s: qwen3_tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = qwen3_tok.eos_token_id
    client, rollout = _client(qwen3_tok, [enc("<think>hm</think>4") + [eos], enc("6") + [eos]],
                              continuation="template")

    async def go():
        m = [{"role": "user", "content": "2+2?"}]
        r1 = await client.chat.completions.create(model=client.model, messages=m)
        assert r1.choices[0].message.content == "<think>hm</think>4"  # no reasoning parser: all content
        m += [r1.choices[0].message, {"role": "user", "content": "3+3?"}]
        await client.chat.completions.create(model=client.model, messages=m)
        return [dict(x) if isinstance(x, dict) else x.model_dump(exclude_none=True) for x in m]

    msgs = _run(go())
    whole = qwen3_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "hm" not in whole and rollout.prompts[1] == enc(whole)  # the template's view: reasoning dropped
    c1, c2 = client.calls
    assert c2.parent is None and c2.diverged_at == 0  # a new trajectory


def test_split_think():
    assert split_think("<think>a</think>\n\nb") == ("a", "b")
    assert split_think("a</think>b") == ("a", "b")  # the template opened <think> in the generation prompt
    assert split_think("  <think>cut at max_tokens") == ("cut at max_tokens", "")
    assert split_think("no reasoning") == (None, "no reasoning")


# ------------------------------------------------------------------ tool parsers
WEATHER = Tool(name="weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}}})
ADD = Tool(name="add", parameters={"type": "object", "properties": {"a": {"type": "number"}}})

XML_TWO = ("Let me check.\n<tool_call>\n<function=weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[6, 18]\n"
           "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n2.5\n</parameter>\n"
           "</function>\n</tool_call>")


def test_qwen3_coder_xml_calls_typed_by_the_schema_in_order():
    content, calls = parse_qwen3_coder(XML_TWO, (WEATHER, ADD))
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "São Paulo", "days": 3, "metric": True, "hours": [6, 18]}), ("add", {"a": 2.5})]
    # a function not offered, or a block that is no call, stays text
    text = "<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>"
    assert parse_qwen3_coder(text, (WEATHER,)) == (text, [])
    assert parse_qwen3_coder("<tool_call><function=weather", (WEATHER,)) == ("<tool_call><function=weather", [])


def test_json_calls_one_or_a_list_and_anything_else_is_text():
    content, calls = parse_json('```json\n[{"name": "add", "arguments": {"a": 1}}, '
                                '{"name": "weather", "parameters": {"city": "x"}}]\n```', (WEATHER, ADD))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}),
                                                                                     ("weather", {"city": "x"})]
    for text in ('{"name": "sub", "arguments": {}}', "add 1", '{"name": "add", "arguments": 3}', "[1, 2]"):
        assert parse_json(text, (ADD,)) == (text, [])


def test_parsers_are_chosen_by_name_and_unknown_names_refused():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "json"} and tool_parser("json") is parse_json
    with pytest.raises(ValueError, match="tool_parser.*qwen3_coder"):
        tool_parser("xml")


def _hf_tools():
    return [t.to_dict() for t in (WEATHER, ADD)]


def test_qwen3_coder_parallel_calls_and_tool_choice_through_the_sdk(qwen3_tok):
    openai = pytest.importorskip("openai")
    enc = lambda s: qwen3_tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = qwen3_tok.eos_token_id
    client, rollout = _client(qwen3_tok, [enc(XML_TWO) + [eos]] * 5, tool_parser="qwen3_coder")
    user = [{"role": "user", "content": "weather?"}]

    async def body(sdk):
        out = {}
        for name, extra in (("auto", {}), ("required", {"tool_choice": "required"}),
                            ("none", {"tool_choice": "none"}),
                            ("named", {"tool_choice": {"type": "function", "function": {"name": "add"}}}),
                            ("serial", {"parallel_tool_calls": False})):
            out[name] = (await sdk.chat.completions.create(model=client.model, messages=user, tools=_hf_tools(),
                                                           **extra)).choices[0]
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.chat.completions.create(model=client.model, messages=user, tools=_hf_tools(),
                                              tool_choice={"type": "function", "function": {"name": "sub"}})
        assert e.value.param == "tool_choice"
        return out

    out = _run(_over_http(client, body))
    names = {k: [c.function.name for c in (ch.message.tool_calls or [])] for k, ch in out.items()}
    assert names == {"auto": ["weather", "add"], "required": ["weather", "add"], "none": [], "named": ["add"],
                     "serial": ["weather"]}
    assert out["auto"].finish_reason == "tool_calls" and out["none"].finish_reason != "tool_calls"
    assert out["none"].message.content == XML_TWO  # no call parsed: the text as written
    ids = [c.id for c in out["auto"].message.tool_calls]
    assert len(set(ids)) == 2


def test_unknown_tool_choice_is_refused():
    client, _ = _client(None, [], template=_NoTemplate())
    with pytest.raises(ChatRequestError) as e:
        _run(client.chat.completions.create(model=client.model, messages=[{"role": "user", "content": "x"}],
                                            tools=_hf_tools(), tool_choice="any"))
    assert e.value.param == "tool_choice"


class _NoTemplate:
    renders_tools = False

    def check(self, req):
        return None


# ------------------------------------------------------------------ JSON nested past the decoder's limit
DEEP = "[" * 5000 + "]" * 5000  # json.loads raises RecursionError on it (not ValueError)


@pytest.mark.parametrize("text", [f"<tool_call>{DEEP}</tool_call>",
                                  f'<tool_call>{{"name": "add", "arguments": {DEEP}}}</tool_call>',
                                  f'<tool_call>{{"name": "add", "arguments": {json.dumps(DEEP)}}}</tool_call>',
                                  f'before <tool_call>{{"name": "add", "arguments": {{"a": {DEEP}}}}}</tool_call>'])
def test_hermes_block_nested_past_the_decoders_limit_is_malformed_text(text):
    assert tool_parser("hermes")(text, (ADD,)) == (text, [])


@pytest.mark.parametrize("text", [DEEP, f'{{"name": "add", "arguments": {DEEP}}}',
                                  f'[{{"name": "add", "arguments": {json.dumps(DEEP)}}}]'])
def test_json_output_nested_past_the_decoders_limit_is_text(text):
    assert parse_json(text, (ADD,)) == (text, [])


def test_qwen3_coder_value_nested_past_the_decoders_limit_stays_text():
    """As any value that does not read as its schema's type: the parameter's text."""
    text = f"<tool_call>\n<function=weather>\n<parameter=hours>\n{DEEP}\n</parameter>\n</function>\n</tool_call>"
    content, (call,) = parse_qwen3_coder(text, (WEATHER,))
    assert content == "" and json.loads(call.arguments) == {"hours": DEEP}


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_turn_whose_tool_call_nests_past_the_decoders_limit_is_recorded(qwen3_tok, parser):
    """The malformed call is the turn's text, the turn is recorded, the agent gets an answer."""
    enc = lambda s: qwen3_tok.encode(s, add_special_tokens=False)  # noqa: E731
    written = {"hermes": f'<tool_call>{{"name": "add", "arguments": {DEEP}}}</tool_call>', "json": DEEP,
               "qwen3_coder": f"<tool_call>\n<function=add>\n<parameter=a>\n{DEEP}\n</parameter>\n</function>\n"
                              "</tool_call>"}[parser]
    client, _ = _client(qwen3_tok, [enc(written) + [qwen3_tok.eos_token_id]], tool_parser=parser)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "array"}}}}}]
    r = _run(client.chat.completions.create(model=client.model, messages=[{"role": "user", "content": "?"}],
                                            tools=tools, max_tokens=2 * len(written)))
    (call,) = client.calls
    if parser == "qwen3_coder":  # a value that does not read as its type stays text
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"a": DEEP}
    else:
        assert r.choices[0].message.content == written and not r.choices[0].message.tool_calls
        assert call.content == written and call.tool_calls == []
