"""A warmed server compiles nothing (``Generator.warmup``, ``zoo.engine.compile_cache.CompileCounter``).

The app on the embedded tiny model with MTP drafts compiles its programs before it serves
(``/health``: 503 "warming up" until then); afterwards a scripted mix through both SDKs
(prompts from 1 token to near the context, logprobs 0..20, json_object / json_schema / regex
outputs, tool calls, ``n`` choices, stop strings, a thinking budget, a stream the client drops,
prompt logprobs, prefix-cache hits from the device and from host RAM, a second turn whose answer
re-emits the first's, the Responses API) compiles zero programs: the auto speculation policy's two
decode programs (drafts, drafts off) and its per-row plans included. ``/metrics`` then counts drafts
by source and position, the chosen draft lengths, inter-token latency and the ``/v1/responses`` route.
"""

from __future__ import annotations

import time

import anthropic
import httpx2 as httpx
import openai
import pytest

import zoo
from tests.support.metrics import metric_total
from zoo.engine.compile_cache import CompileCounter
from zoo.server.app import ServerThread, create_app
from zoo.train import corpus

KEY = "compile-once"
CONTEXT = 4096


@pytest.fixture(scope="module")
def server():
    model = zoo.load("qwen38-tiny", dtype="float32")
    progress = []
    app = create_app(model, api_key=KEY, spec_tokens=2, spec_policy="auto", max_batch=4, context=CONTEXT,
                     prefill_chunk=256, warmup=True, prefix_cache_gb=0.05, prefix_cache_host_gb=1,
                     on_warmup=lambda *a: progress.append(a))
    with ServerThread(app) as s:
        first = httpx.get(s.url + "/health")
        deadline = time.monotonic() + 900
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield s, app, first, progress


def text_of(n_words: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(n_words))


def test_the_server_warms_up_before_it_serves(server):
    _, app, first, progress = server
    assert first.status_code == 503 and first.json()["status"] == "warming up", first.text
    names = [p[0] for p in progress]
    assert [p[2] for p in progress] == list(range(1, len(progress) + 1)) and progress[-1][3] == len(progress)
    assert {"prefill width=256", "prefill width=16"} <= set(names)
    assert any(n.startswith("decode MTP k=2") for n in names) and "decode with token masks" in names
    assert "decode MTP drafts off" in names      # the auto speculation policy's other decode program
    gen = app.state.service.engine.generator
    assert len(gen.program_set()) == 4           # the whole-model programs: decode with and without drafts,
                                                 # two prefill widths


def test_a_warmed_server_compiles_nothing_for_any_request_mix(server):
    s, app, _, _ = server
    oa = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    an = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0, timeout=600)
    tok = app.state.service.tokenizer
    lengths = []

    def chat(content: str, **kw):
        lengths.append(len(tok.encode(content)))
        return oa.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                          max_tokens=kw.pop("max_tokens", 6), **kw)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    per_word = len(tok.encode(text_of(1000))) / 1000
    long = text_of(int(3000 / per_word))                       # ~3000 tokens of a 4096 context
    with CompileCounter() as counter:
        chat("Hi", temperature=0)
        chat(text_of(int(300 / per_word)), temperature=0.7, seed=1)
        chat(long, temperature=0)
        chat(long + " again", temperature=0)                  # a prefix hit (device tier)
        for top in (0, 5, 20):
            chat("Tell me", logprobs=True, top_logprobs=top)
        chat("JSON please", response_format={"type": "json_object"}, max_tokens=12)
        chat("Schema", response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
             max_tokens=12)
        chat("Digits", extra_body={"guided_regex": "[0-9]{3}"}, max_tokens=4)
        chat("Weather in Paris?", tools=[corpus.TOOLS["get_weather"]], max_tokens=24)
        chat("Two", n=2, temperature=0.9, seed=3)
        chat("Stop", stop=["w1", "\n"], max_tokens=10)
        chat("Think", extra_body={"thinking_budget": 2}, max_tokens=8)
        first = chat("What is 12+35?", max_tokens=40, temperature=0).choices[0].message.content
        # from here the policy decides from a table where drafting costs what drafting off does (not from
        # this machine's timings): the re-asked question's rows take lookup drafts where they expect more
        app.state.service.engine.generator.spec_policy.load(
            {f"{o}@{b}": [1.0, 9, 0] for o in ("off", "d1", "d2") for b in (1, 2, 4)})
        oa.chat.completions.create(model="m", max_tokens=40, temperature=0, messages=[       # prompt-lookup drafts
            {"role": "user", "content": "What is 12+35?"}, {"role": "assistant", "content": first},
            {"role": "user", "content": "What is 12+35?"}])
        oa.responses.create(model="m", input="Hello", max_output_tokens=8)
        with oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "Stream"}], max_tokens=50,
                                        stream=True) as stream:
            for i, _ in enumerate(stream):
                if i == 2:
                    break                                       # dropped: the row is cancelled
        oa.completions.create(model="m", prompt="one two three", max_tokens=0, echo=True, logprobs=3)
        an.messages.create(model="m", max_tokens=6, messages=[{"role": "user", "content": "Hello"}])
        with an.messages.stream(model="m", max_tokens=6, messages=[{"role": "user", "content": "Hey"}]) as st:
            "".join(st.text_stream)
        gen = app.state.service.engine.generator
        gen.prefix.fit_device(0)                                # every cached prefix to host RAM
        chat(long + " once more", temperature=0)                # a hit restored from host RAM
        stats = gen.prefix.stats
    assert counter.compiled == 0 and counter.loaded == 0, (counter.compiled, counter.loaded)
    assert stats.hits >= 2 and stats.demoted > 0, stats
    assert min(lengths) <= 2 and max(lengths) > 2500


def test_metrics_count_speculation_latency_and_routes(server):
    """After the mix above (same module: the server's counters hold it)."""
    s, app, _, _ = server
    text = httpx.get(s.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text

    def total(name, **labels):
        return metric_total(text, name, **labels)
    assert total("zoo_spec_position_drafts_total", source="mtp", position="1") > 0
    assert total("zoo_spec_position_accepted_total", source="mtp", position="1") > 0
    assert total("zoo_spec_position_drafts_total", source="lookup", position="1") > 0
    drafts = total("zoo_spec_position_drafts_total")
    assert 0 < total("zoo_spec_position_accepted_total") <= drafts
    assert total("zoo_spec_draft_length_count") > 0 and total("zoo_inter_token_latency_seconds_count") > 0
    assert total("zoo_http_requests_total", route="/v1/responses", status="200") == 1
    gen = app.state.service.engine.generator
    assert total("zoo_engine_decode_steps_total") == gen.steps > 0 and total("zoo_engine_rows_moved_total") == 0
    assert total("zoo_engine_decode_steps_total", rows="narrow") == 0          # no narrow rows here
    assert total("zoo_engine_prefills_total") == gen.prefills > 0 and total("zoo_engine_prefill_tokens_total") > 0
    policy = gen.spec_policy
    assert policy.mode == "auto" and policy.chosen["off"] > 0 and sum(policy.chosen.values()) > policy.chosen["off"]
