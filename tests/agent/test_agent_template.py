"""The Hugging Face chat-template path (a tokenizer built here, with a Qwen-style Jinja template and tools):
each turn renders only the new messages, the next prompt continues the exact tokens, Hermes tool calls
are parsed; and the http transport's SDK clients share one connection pool."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_agent_session import ScriptedRollout

from areal_fast.agent.template import HFChatTemplate, template_for
from areal_fast.workflow import EpisodeEngine

QWENISH = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(',') }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for s in ("<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=QWENISH,
                                   additional_special_tokens=["<|im_start|>"])
    return fast


def test_hf_template_renders_once_per_turn_and_parses_hermes_calls(hf_tok):
    t = template_for(hf_tok)
    assert isinstance(t, HFChatTemplate)
    enc = lambda s: hf_tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = hf_tok.eos_token_id
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    out1 = enc("ok" + call) + [eos]
    rollout = ScriptedRollout([out1, enc("3") + [eos]])
    eng = EpisodeEngine(rollout, None, hf_tok, {"max_new_tokens": 64, "temperature": 1.0}, "hf", training=True)
    client = eng.openai()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def go():
        m = [{"role": "user", "content": "1+2?"}]
        r1 = await client.chat.completions.create(model=client.model, messages=m, tools=tools)
        c = r1.choices[0].message.tool_calls[0]
        assert (c.function.name, json.loads(c.function.arguments)) == ("add", {"a": 1})
        assert r1.choices[0].message.content == "ok"
        m += [r1.choices[0].message, {"role": "tool", "tool_call_id": c.id, "content": "3"}]
        await client.chat.completions.create(model=client.model, messages=m, tools=tools)

    asyncio.run(asyncio.wait_for(go(), 30))
    first = hf_tok.apply_chat_template([{"role": "user", "content": "1+2?"}], tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    assert rollout.prompts[0] == enc(first)
    # the second prompt: the first prompt, the model's very tokens, then only the tool message rendered
    assert rollout.prompts[1] == enc(first) + out1 + enc("\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")
    assert client.calls[1].parent == client.calls[0].completion_id


def test_http_transport_episodes_share_one_connection_pool():
    openai = pytest.importorskip("openai")
    from areal_fast.agent.server import shared_server
    from areal_fast.agent.workflow import _sdk_client

    async def go():
        server = await shared_server("k")
        try:
            a = _sdk_client(openai, server).with_options(base_url=server.url + "/episodes/a/v1")
            b = _sdk_client(openai, server).with_options(base_url=server.url + "/episodes/b/v1")
            return a, b
        finally:
            await server.close()

    a, b = asyncio.run(go())
    assert a._client is b._client and str(a.base_url) != str(b.base_url)
