"""Requests as clients send them to vLLM: replayed histories, nulls, newer fields, unknown fields
(ignored with a warning, or refused under --strict-requests), the chat template's arguments, and
chat logprobs that describe the content. The real server, driven with the `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagellm.entrypoints.openai.chat_prompt import conversation, detect_content_format, load_chat_template
from pagellm.entrypoints.openai.protocol import ChatMessage
from tests.entrypoints.openai.server_utils import RemoteServer

MODEL = "tiny"
HI = [{"role": "user", "content": "Hi"}]
# Reads content as OpenAI's parts (auto detects it), and shows the template's other arguments.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}"
    "{% if m.reasoning_content %}[think:{{ m.reasoning_content }}]{% endif %}{% endfor %}"
    "{% for d in documents or [] %}[doc:{{ d['text'] }}]{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<nothink>{% endif %}{% endif %}{% if reasoning_effort %}<effort:{{ reasoning_effort }}>{% endif %}"
)


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "128"])
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def strict_server(llama_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "parts.jinja"
    template.write_text(PARTS_TEMPLATE)
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "64",
                                    "--strict-requests", "--chat-template", str(template)])
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def rendered(srv: RemoteServer, **body) -> str:
    """The prompt the chat template makes of ``body`` (through /tokenize and /detokenize)."""
    r = httpx.post(srv.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return httpx.post(srv.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


# ------------------------------------------------------------------ item 1: what vLLM accepts
def test_a_history_replayed_from_the_sdk_is_accepted(client):
    first = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    replayed = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= replayed.keys()  # what made it a 400
    history = [*HI, replayed, {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3)
    assert again.choices[0].message.role == "assistant" and again.usage.prompt_tokens > first.usage.prompt_tokens
    stream = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3, stream=True)
    assert [ch.choices[0].finish_reason for ch in stream if ch.choices][-1] == "length"


def test_assistant_fields_of_the_api_and_of_reasoning_servers_are_accepted(client):
    assistant = {"role": "assistant", "content": "Hello", "refusal": None, "audio": None, "tool_calls": None,
                 "annotations": [{"type": "url_citation", "url_citation": {"url": "https://a.example", "title": "a",
                                                                           "start_index": 0, "end_index": 5}}],
                 "function_call": None, "reasoning_content": "They greet me.", "reasoning": "They greet me."}
    r = client.chat.completions.create(model=MODEL, messages=[*HI, assistant, *HI], max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:  # an earlier audio answer cannot be part of the prompt
        client.chat.completions.create(model=MODEL, messages=[*HI, {**assistant, "audio": {"id": "audio_1"}}, *HI],
                                       max_tokens=2)
    assert e.value.body["param"] == "messages.1.audio"


def test_null_means_unset_and_an_integral_float_is_an_integer(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4.0, n=None, presence_penalty=None,
                                          stream=None, logprobs=None, temperature=None,
                                          extra_body={"echo": None, "top_k": None, "min_tokens": None})
    assert len(chat.choices) == 1 and chat.usage.completion_tokens <= 4 and chat.choices[0].logprobs is None
    done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4.0, n=None, presence_penalty=None,
                                     stream=None, logprobs=None, echo=None, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4 and done.choices[0].text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_unknown_fields_are_ignored_with_one_warning_naming_them(server, client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi", "frobnicate_msg": 1}],
        extra_body={"frobnicate_top": {"a": 1}, "stream_options": None})
    assert r.choices[0].finish_reason == "length"
    lines = [line for line in server.log().splitlines() if "frobnicate" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], lines
    assert "'frobnicate_top'" in lines[0] and "'messages.0.frobnicate_msg'" in lines[0]


def test_fields_that_would_change_the_output_are_still_refused(client):
    for extra in ({"allowed_token_ids": [1]}, {"chat_template": "{{ 'x' }}"},
                  {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body=extra)
        assert "not supported" in e.value.body["message"]


def test_strict_requests_refuses_unknown_fields(strict_server):
    url = strict_server.url
    for body, name in (({"prompt": "Hi", "frobnicate": 1}, "frobnicate"),
                       ({"prompt": "Hi", "str": 1}, "str"),
                       ({"prompt": "Hi", "stream_options": {"include_usage": True, "frobnicate": 1}},
                        "stream_options.frobnicate")):
        r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 400 and f"unknown field '{name}'" in r.json()["error"]["message"], r.text
    # What the API defines is no unknown field, strict or not; nor is null.
    ok = httpx.post(url + "/v1/chat/completions", json={"max_tokens": 2, "n": None, "messages": [
        *HI, {"role": "assistant", "content": "x", "refusal": None, "annotations": []}, *HI]})
    assert ok.status_code == 200, ok.text


# ----------------------------------------------------------- item 2: the template's arguments
def test_chat_template_kwargs_documents_and_openai_content_format(strict_server):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c", "reasoning_content": "r"}, {"role": "user", "content": "d"}]
    text = rendered(strict_server, messages=msgs, chat_template_kwargs={"enable_thinking": False},
                    documents=[{"title": "t", "text": "doc one"}])
    # Parts reach the template as a list (auto: it loops over content), a string as one part.
    assert text == "<|user|>a|b|<|assistant|>c|[think:r]<|user|>d|[doc:doc one]<|assistant|><nothink>"
    assert rendered(strict_server, messages=HI).endswith("<|assistant|>")
    client = openai.OpenAI(base_url=strict_server.url + "/v1", api_key="x", max_retries=0)
    effort = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, reasoning_effort="low")
    base = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert effort.usage.prompt_tokens > base.usage.prompt_tokens  # vLLM's: a variable of the template
    off = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                     "documents": [{"text": "doc one"}]})
    assert off.usage.prompt_tokens > base.usage.prompt_tokens  # the template's arguments made the prompt


def test_string_content_format_and_continue_final_message(server, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "a\nb" in rendered(server, messages=parts)  # as vLLM: text parts joined by newlines
    start = [*HI, {"role": "assistant", "content": "Once upon"}]
    text = rendered(server, messages=start, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Once upon")  # left open: no end of the message after it
    r = client.chat.completions.create(model=MODEL, messages=start, max_tokens=2,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=start, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_an_inline_chat_template_has_its_escapes_decoded_as_in_vllm(tmp_path):
    # A shell argument's \\n is a newline; characters beyond Latin-1 survive.
    assert load_chat_template("{{ 'é→' }}\\n{% for m in messages %}{{ m.content }}{% endfor %}") == (
        "{{ 'é→' }}\n{% for m in messages %}{{ m.content }}{% endfor %}")
    braces = tmp_path / "{odd}.jinja"  # a file is a file, whatever its name holds
    braces.write_text("{{ 'x' }}\\n")
    assert load_chat_template(str(braces)) == "{{ 'x' }}\\n"


def test_content_format_detection_and_message_conversion():
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    assert detect_content_format("{% set c = message.content %}{% for p in c %}{% endfor %}") == "openai"
    assert detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    assert detect_content_format("{% generation %}{% for p in m.content %}{% endfor %}{% endgeneration %}") == "openai"
    call = {"name": "f", "arguments": '{"x": 1}'}
    msgs = [ChatMessage(role="assistant", content=None, function_call=call, reasoning="r"),
            ChatMessage(role="function", name="f", content="2")]
    (assistant, result) = conversation(msgs, "string")
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert assistant["reasoning_content"] == "r" and result == {"role": "tool", "content": "2", "name": "f"}


# ----------------------------------------------- item 7: logprobs describe the content
def _joined(logprobs) -> str:
    return "".join(t.token for t in logprobs.content)


def test_chat_logprobs_leave_out_the_end_of_turn_token(client, llama_path):
    eos = AutoTokenizer.from_pretrained(str(llama_path)).eos_token_id
    kw = dict(model=MODEL, messages=HI, max_tokens=20, temperature=0, logprobs=True, top_logprobs=1,
              logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and r.usage.completion_tokens == 4  # 3 tokens, then the end of turn
    assert len(c.logprobs.content) == 3 and _joined(c.logprobs) == c.message.content
    chunks = [ch for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in c.logprobs.content]


def test_chat_logprobs_leave_out_a_stop_strings_tokens(client):
    kw = dict(model=MODEL, messages=HI, max_tokens=12, temperature=0, logprobs=True,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0]
    tokens = [t.token for t in full.logprobs.content]
    assert _joined(full.logprobs) == full.message.content and len(tokens) == 12
    # A stop string made of the 7th and 8th tokens' text: content ends before it, so do the logprobs.
    stop = tokens[6] + tokens[7]
    cut = full.message.content.index(stop)
    for stream in (False, True):
        if stream:
            chunks = [ch for ch in client.chat.completions.create(**kw, stop=[stop], stream=True) if ch.choices]
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            got = [t.token for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
        else:
            c = client.chat.completions.create(**kw, stop=[stop]).choices[0]
            content, got = c.message.content, [t.token for t in c.logprobs.content]
        assert content == full.message.content[:cut]
        assert "".join(got) == content, (stream, got, content)
