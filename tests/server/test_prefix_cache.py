"""Prefix caching as the API surfaces report it, over real HTTP on 127.0.0.1 with the official
``openai`` and ``anthropic`` SDKs, on the embedded tiny model with a plain ChatML template: an agent-like
conversation resent whole every turn reads its earlier turns from the cache
(``usage.prompt_tokens_details.cached_tokens``, responses' ``input_tokens_details``, Anthropic's
``cache_read_input_tokens`` / ``cache_creation_input_tokens`` with ``cache_control`` marks), the
answers equal those of a server without the cache (greedy), and ``/metrics`` counts it.

ChatML renders an earlier assistant turn exactly as it was generated, so a resent conversation
matches the cache to the end of the previous answer. The model's own template drops earlier turns'
reasoning (as Qwen's does): a resent conversation then leaves the cached path where the previous
prompt opened its reasoning block, and reads back what came before it."""

from __future__ import annotations

import anthropic
import httpx2 as httpx
import openai
import pytest

import zoo
from tests.support.random_checkpoints import CHATML
from tests.support.server_helpers import checkpoint_with_template
from zoo.server.app import ServerThread, create_app

KEY = "prefix-key"
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i}: answer briefly and exactly." for i in range(12))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return zoo.load(checkpoint_with_template(tmp_path_factory.mktemp("chatml"), CHATML), dtype="float32")


@pytest.fixture(scope="module")
def cached(model):
    with ServerThread(create_app(model, api_key=KEY, model_name="tiny", keepalive_s=0.1, prefill_chunk=64)) as s:
        yield s


@pytest.fixture(scope="module")
def uncached(model):
    with ServerThread(create_app(model, api_key=KEY, model_name="tiny", keepalive_s=0.1, prefill_chunk=64,
                                 prefix_cache_gb=0)) as s:
        yield s


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat(server, messages, **kw):
    return oai(server).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, **kw)


def test_openai_chat_turns_read_the_earlier_turns_from_the_cache(cached, uncached):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    usages, answers = [], []
    for turn in range(3):
        out = chat(cached, messages, prompt_cache_key="conversation-1")
        ref = chat(uncached, messages)
        assert out.choices[0].message.content == ref.choices[0].message.content
        assert ref.usage.prompt_tokens_details.cached_tokens == 0
        usages.append(out.usage)
        answers.append(out.choices[0].message.content)
        messages += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": f"follow-up {turn}"}]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for before, now in zip(usages, usages[1:]):
        # at least the whole previous prompt (the snapshot at its end) is read back
        assert before.prompt_tokens <= now.prompt_tokens_details.cached_tokens < now.prompt_tokens, (before, now)


def test_streamed_usage_and_responses_report_cached_tokens(cached):
    messages = [{"role": "system", "content": "Streaming. " + SYSTEM}, {"role": "user", "content": "hi"}]
    chat(cached, messages)
    stream = oai(cached).chat.completions.create(model="tiny", messages=messages + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}], max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    client = oai(cached)
    instructions = "Responses. " + SYSTEM       # no prefix in common with the others
    first = client.responses.create(model="tiny", instructions=instructions, input="what now?", max_output_tokens=8,
                                    temperature=0, prompt_cache_key="k")
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = client.responses.create(model="tiny", instructions=instructions, input="what next?",
                                     max_output_tokens=8, temperature=0)
    assert 0 < second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens


def test_a_responses_chain_reads_each_earlier_turn_from_the_cache(cached, uncached):
    """Ten turns by ``previous_response_id``: each prompt reads at least the previous turn's prompt
    back from the cache, and the answers are the uncached server's."""
    answers, usages = {}, []
    for server in (cached, uncached):
        prev, answers[server] = None, []
        for i in range(10):
            r = oai(server).responses.create(model="tiny", input=f"step {i}: go on", previous_response_id=prev,
                                             instructions="Chain. " + SYSTEM, max_output_tokens=6, temperature=0)
            prev = r.id
            answers[server].append(r.output_text)
            if server is cached:
                usages.append(r.usage)
    assert answers[cached] == answers[uncached]
    for before, now in zip(usages, usages[1:]):
        assert before.input_tokens <= now.input_tokens_details.cached_tokens < now.input_tokens, (before, now)


def test_anthropic_cache_control_marks_creation_and_reads(cached):
    client = anthropic.Anthropic(base_url=cached.url, api_key=KEY, max_retries=0)
    system = [{"type": "text", "text": "Anthropic. " + SYSTEM, "cache_control": {"type": "ephemeral"}}]

    def ask(question):
        messages = [{"role": "user", "content": question}]
        n = client.messages.count_tokens(model="tiny", system=system, messages=messages).input_tokens
        return client.messages.create(model="tiny", max_tokens=8, system=system, messages=messages), n

    first, n1 = ask("tell me about the weather in a few words")
    u = first.usage
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 20
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == n1
    second, n2 = ask("and about the sea?")
    u2 = second.usage
    # the snapshot kept at the end of the marked system text is read back; nothing new is marked
    assert u2.cache_read_input_tokens == u.cache_creation_input_tokens and u2.cache_creation_input_tokens == 0
    assert u2.input_tokens + u2.cache_read_input_tokens == n2
    with client.messages.stream(model="tiny", max_tokens=4, system=system,
                                messages=[{"role": "user", "content": "and about the sea?"}]) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens >= u2.cache_read_input_tokens


def test_metrics_count_hits_and_tiers(cached):
    chat(cached, [{"role": "user", "content": "metrics please"}])
    text = httpx.get(cached.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("zoo_prefix_cache") and not line.startswith("#")}
    assert values["zoo_prefix_cache_hit_tokens_total"] > 0 and values["zoo_prefix_cache_miss_tokens_total"] > 0
    assert values['zoo_prefix_cache_bytes{tier="device"}'] > 0
    assert values['zoo_prefix_cache_entries{kind="snapshots"}'] > 0
