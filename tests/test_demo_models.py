"""The embedded demo models speak: ``qwen38-tiny`` and ``glm53-tiny`` as shipped in ``zoo/assets``
(trained by ``scripts/train_demo_models.py`` on ``zoo.train.corpus``) answer in words through
``zoo generate`` and through the server with the official SDKs, and call tools on their own.

Decoding is greedy. The tool-call requests use ``tool_choice`` auto with non-strict tools: nothing
constrains or forces the output, the call is what the model wrote, parsed by the server's own
parser. What each model is held to is what its held-out evaluation supports (the closing numbers of
``scripts/train_demo_models.py``): both answer the corpus's small talk word for word and write
well-formed calls to the right tool; Qwen (the main job's model) also adds 2-digit numbers when it
thinks (100% of 100 held-out sums), copies numbers into a call's arguments and from a tool's result
into its answer, on questions whose keys are held out of training (``corpus.held_out``). Neither
adds reliably without thinking or copies names yet.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import anthropic
import openai
import pytest

import zoo
from zoo.server.app import ServerThread, create_app
from zoo.train import corpus

KEY = "demo-key"
MODELS = ("qwen38-tiny", "glm53-tiny")
SMALL_TALK = [
    ("What is your name?", "I am zoo's tiny demo model."),
    ("Hello", "Hello! How can I help you today?"),
    ("What can you do?", "I can add, subtract and compare numbers, count letters, reverse and spell words, "
                         "convert units, and call tools."),
]
TOOLS = [corpus.TOOLS[n] for n in ("get_weather", "add", "convert_units", "lookup_word")]
A, B = 30558, 24838                           # add_tool:30558:24838 is held out


def test_the_tool_questions_are_held_out():
    assert corpus.held_out(f"add_tool:{A}:{B}") and corpus.held_out("convert_tool:miles:kilometers:13")


@pytest.mark.parametrize("name", MODELS)
def test_zoo_generate_answers_in_words(name):
    question, answer = SMALL_TALK[0]
    out = subprocess.run([sys.executable, "-m", "zoo", "generate", "--model", name, "--prompt", question,
                          "--max-tokens", "64"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip().endswith(answer), out.stdout


@pytest.fixture(scope="module", params=MODELS)
def server(request):
    model = zoo.load(request.param)
    with ServerThread(create_app(model, api_key=KEY, model_name=request.param)) as s:
        s.name = request.param
        yield s


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.mark.parametrize("thinking", [True, False])
def test_server_answers_in_words(server, thinking):
    client = _openai(server)
    for question, answer in SMALL_TALK:
        r = client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=128,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        message = r.choices[0].message
        assert (message.content or "").strip() == answer and r.choices[0].finish_reason == "stop", (question, message)
        assert bool(getattr(message, "reasoning_content", None)) == thinking, message


def _call(server, question: str):
    r = _openai(server).chat.completions.create(model=server.name, messages=[{"role": "user", "content": question}],
                                                tools=TOOLS, temperature=0, max_tokens=128)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    return choice.message, call.id, call.function.name, json.loads(call.function.arguments)


def test_server_returns_the_models_own_tool_calls(server):
    """Each model calls the tool its question needs, with the arguments its schema names."""
    for question, tool, keys in [(f"What is {A} + {B}?", "add", {"a", "b"}),
                                 ("What is 13 miles in kilometers?", "convert_units", {"value", "from_unit",
                                                                                       "to_unit"}),
                                 ("What's the weather in Paris?", "get_weather", {"city"})]:
        _, _, name, args = _call(server, question)
        assert name == tool and set(args) == keys, (question, name, args)


def test_qwen_copies_arguments_and_uses_the_result():
    """Held-out numbers go into the call exactly, and the tool's result into the answer."""
    model = zoo.load("qwen38-tiny")
    with ServerThread(create_app(model, api_key=KEY, model_name="qwen38-tiny")) as s:
        s.name = "qwen38-tiny"
        message, call_id, name, args = _call(s, f"What is {A} + {B}?")
        assert (name, args) == ("add", {"a": A, "b": B})
        _, _, name, args = _call(s, "What is 13 miles in kilometers?")
        assert (name, args) == ("convert_units", {"value": 13, "from_unit": "miles", "to_unit": "kilometers"})
        messages = [{"role": "user", "content": f"What is {A} + {B}?"}, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"result": A + B})}]
        r = _openai(s).chat.completions.create(model=s.name, messages=messages, tools=TOOLS, temperature=0,
                                               max_tokens=128)
        assert r.choices[0].message.content.strip() == f"{A} + {B} = {A + B}.", r.choices[0]


def held_out_sums(n: int) -> list[tuple[int, int]]:
    """``n`` held-out 2-digit additions (``corpus.held_out``) drawn by a rule fixed in advance (seed
    0), alternately one whose units carry and one whose do not."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if corpus.held_out(f"add:{a}:{b}")]
    rng = random.Random(0)
    carry = rng.sample([p for p in pairs if p[0] % 10 + p[1] % 10 >= 10], n)
    plain = rng.sample([p for p in pairs if p[0] % 10 + p[1] % 10 < 10], n)
    return [x for pair in zip(carry, plain) for x in pair][:n]


def test_qwen_adds_held_out_numbers_when_thinking():
    """The main job's model adds 2-digit numbers it never saw added, thinking (the server's default)
    first: the reasoning works the columns, the answer is the sum."""
    model = zoo.load("qwen38-tiny")
    with ServerThread(create_app(model, api_key=KEY, model_name="qwen38-tiny")) as s:
        client = _openai(s)
        for a, b in held_out_sums(6):
            r = client.chat.completions.create(model="qwen38-tiny", temperature=0, max_tokens=128,
                                               messages=[{"role": "user", "content": f"What is {a} + {b}?"}])
            message = r.choices[0].message
            assert message.content.strip() == f"{a} + {b} = {a + b}.", (a, b, message)
            assert message.reasoning_content.strip().endswith(f"So {a + b}."), (a, b, message)


def test_anthropic_sdk_gets_a_tool_use_block(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = client.messages.create(model=server.name, max_tokens=128, tools=tools, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": f"What is {A} + {B}?"}])
    assert r.stop_reason == "tool_use", r
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "add" and set(use.input) == {"a", "b"}
