"""The chat templates the trained demo models ship, and the special tokens each needs.

Two formats, picked by ``chat_format(name)`` (``"qwen"`` / ``"glm"``, an architecture id such as
``"qwen38"``, or a model name such as ``"glm53-tiny"``: the format named like the architecture
table's ``tool_format`` of its row):

    qwen   Qwen3.x ChatML. ``<|im_start|>ROLE\\n ... <|im_end|>\\n``; tools listed in the system turn;
           an assistant turn after the last user message is ``<think>\\nREASONING\\n</think>\\n\\n``
           + content + calls ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
           </function>\\n</tool_call>``, then ``<|im_end|>``; tool results are a user turn of
           ``<tool_response>`` blocks. The generation prompt opens the reasoning
           (``<|im_start|>assistant\\n<think>\\n``), or with ``enable_thinking=False`` gives it empty
           (``<think>\\n\\n</think>\\n\\n``), as the Qwen3.5 templates do.
    glm    GLM-4.7 / GLM-5 style. ``[gMASK]<sop>``, then ``<|system|>\\n``, ``<|user|>\\n`` turns;
           assistant ``<|assistant|><think>REASONING</think>`` (or ``</think>`` alone when it has
           none) + content + calls ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>
           </tool_call>``; tool results ``<|observation|><tool_response>...</tool_response>``. The
           generation prompt is ``<|assistant|><think>`` (reasoning open) or ``<|assistant|></think>``
           (``enable_thinking=False``). An assistant turn has no closing token: the model ends it by
           writing the next role token, ``<|user|>`` after an answer, ``<|observation|>`` after a
           tool call, so the model config's ``eos_token_id`` must list both (``ChatFormat.stops``).

Tools (OpenAI function form, JSON Schema parameters) are listed in the system turn one per line as
``name(key: type, ...) - description``, a compact form that keeps the tiny models' sequences short;
argument values that are not strings are written as JSON. ``render_chat`` renders with
``zoo.text.tokenizer.Tokenizer.apply_chat_template`` exactly as the server does; ``turn_pieces``
splits a conversation into what the prompt gives and what the model writes, checking that each
turn's prompt plus its generated text renders as the whole conversation does, so what a model is
trained on is what the server later feeds it.

``ChatFormat.special`` lists the tokens a tokenizer for the format must have as single special
tokens, in id order: the markers the server's parsers read (``zoo.server.service.KEEP``: reasoning,
tool calls, GLM's argument tags) and the template's control tokens. ``build_tokenizer(name, texts)``
trains such a tokenizer (byte-level BPE) on e.g. ``zoo.train.corpus.corpus_text``; it splits text
as Qwen2's tokenizer does (digits one by one; a run of newlines is one piece whatever follows it, so
a prompt ending in ``</think>\\n\\n`` tokenizes as it does inside the whole dialogue, which GPT-2's
split does not do).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from zoo.models.architectures import ARCHITECTURES, BY_MODEL_NAME
from zoo.text.reasoning_parser import ReasoningParser
from zoo.text.tokenizer import Tokenizer
from zoo.text.tool_calls import CALL_CLOSE, CALL_OPEN, ToolCallFormat
from zoo.text.tool_calls import FORMATS as TOOL_CALL_FORMATS

# a tool as one line: name(key: type, ...) - description
_SIGNATURE = r"""
{%- macro signature(tool) -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{{- fn.name + '(' -}}
{%- for key, p in ((fn.parameters or {}).properties or {}).items() -%}
{%- set kind = p.type if p.type is string else (p.type | join('|') if p.type else 'any') -%}
{{- (', ' if not loop.first else '') + key + ': ' + kind -}}
{%- endfor -%}
{{- ')' + (' - ' + fn.description if fn.description else '') -}}
{%- endmacro -%}
{%- set system_text = messages[0].content if messages and messages[0].role == 'system' else '' -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
"""

QWEN_TEMPLATE = _SIGNATURE + r"""
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if system_text -%}{{- system_text + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou can call these functions:' -}}
{%- for tool in tools -%}{{- '\n' + signature(tool) -}}{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set content = m.content or '' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.index0 > ns.last_user -%}
{{- '<think>\n' + (m.reasoning_content or '').strip('\n') + '\n</think>\n\n' -}}
{%- endif -%}
{{- content -}}
{%- for tc in m.tool_calls or [] -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{{- ('\n\n' if content else '') if loop.first else '\n' -}}
{{- '<tool_call>\n<function=' + fn.name + '>\n' -}}
{%- for key, value in (fn.arguments or {}).items() -%}
{{- '<parameter=' + key + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' -}}
{%- endfor -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{{- '<think>\n\n</think>\n\n' if (enable_thinking is defined and not enable_thinking) else '<think>\n' -}}
{%- endif -%}
"""

GLM_TEMPLATE = _SIGNATURE + r"""
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>\n' -}}
{%- if system_text -%}{{- system_text + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou can call these functions:' -}}
{%- for tool in tools -%}{{- '\n' + signature(tool) -}}{%- endfor -%}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|system|>\n' + messages[0].content -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
{{- '<|' + m.role + '|>\n' + m.content -}}
{%- elif m.role == 'assistant' -%}
{{- '<|assistant|>' -}}
{%- if loop.index0 > ns.last_user and m.reasoning_content -%}
{{- '<think>' + m.reasoning_content.strip() + '</think>' -}}
{%- else -%}
{{- '</think>' -}}
{%- endif -%}
{{- (m.content or '').strip() -}}
{%- for tc in m.tool_calls or [] -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{{- '<tool_call>' + fn.name -}}
{%- for key, value in (fn.arguments or {}).items() -%}
{{- '<arg_key>' + key + '</arg_key><arg_value>' + (value if value is string else value | tojson) + '</arg_value>' -}}
{%- endfor -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
{{- '<tool_response>' + m.content + '</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' + ('</think>' if (enable_thinking is defined and not enable_thinking) else '<think>') -}}
{%- endif -%}
"""

MARKERS = ReasoningParser.MARKERS + (CALL_OPEN, CALL_CLOSE)     # read by the server's parsers in both formats
GLM_ARG_MARKERS = tuple(m for m in TOOL_CALL_FORMATS["glm"].markers if m not in MARKERS)   # GLM's argument tags


@dataclass(frozen=True)
class ChatFormat:
    """One model family's chat format.

    name         "qwen" | "glm"
    tool_calls   the tool-call format the template writes (``zoo.text.tool_calls.FORMATS`` of the
                 same name): the server's parser of the model's calls
    template     the jinja chat template
    special      tokens the tokenizer must have as single special tokens (in id order, pad first)
    stops        the tokens that end an assistant turn (the model writes one, then stops)
    final_stop   the stop written after an answer (ends a dialogue's last turn); the tokenizer
                 config's ``eos_token``, while the model config's ``eos_token_id`` lists all ``stops``
    """
    name: str
    tool_calls: ToolCallFormat
    template: str
    special: tuple[str, ...]
    stops: tuple[str, ...]
    final_stop: str


QWEN = ChatFormat(
    "qwen", TOOL_CALL_FORMATS["qwen"], QWEN_TEMPLATE,
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>") + ReasoningParser.MARKERS
    + TOOL_CALL_FORMATS["qwen"].markers + ("<tool_response>", "</tool_response>"),
    stops=("<|im_end|>",), final_stop="<|im_end|>")
GLM = ChatFormat(
    "glm", TOOL_CALL_FORMATS["glm"], GLM_TEMPLATE,
    special=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
    + ReasoningParser.MARKERS + TOOL_CALL_FORMATS["glm"].markers + ("<tool_response>", "</tool_response>"),
    stops=("<|user|>", "<|observation|>"), final_stop="<|user|>")
FORMATS = {"qwen": QWEN, "glm": GLM}


def chat_format(name: str) -> ChatFormat:
    """The format of ``name``: "qwen" / "glm", or an architecture id or registry model name (the
    format of its row's ``tool_format``: "qwen38", "glm53-tiny"); ValueError for anything else."""
    row = ARCHITECTURES.get(name) or BY_MODEL_NAME.get(name)
    key = row.tool_format if row is not None else name
    if key not in FORMATS:
        raise ValueError(f"no chat format for {name!r}; known: {', '.join(FORMATS)}, the architecture ids "
                         f"{', '.join(ARCHITECTURES)} and their model names")
    return FORMATS[key]


# Qwen2's pre-tokenizer split: letters with one leading non-letter, single digits, punctuation runs
# (with the newlines after them), newline runs, other whitespace
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(name: str, texts, vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE tokenizer for format ``name`` trained on ``texts`` (an iterable of strings):
    the format's special tokens take ids 0.., then the 256 byte symbols, then merges up to
    ``vocab_size``; split with ``PRETOKENIZE``; the format's template, ``eos_token`` its final stop,
    ``pad_token`` ``<|endoftext|>``. ``Tokenizer.save(dir)`` writes it as a checkpoint's files."""
    fmt = chat_format(name)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(fmt.special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)
    config = {"eos_token": fmt.final_stop, "pad_token": "<|endoftext|>", "bos_token": None}
    return Tokenizer(hf, config, fmt.template)


@functools.lru_cache(maxsize=8)
def _renderer(template: str) -> Tokenizer:
    """A ``Tokenizer`` with no vocabulary holding ``template``: renders exactly as the server does."""
    return Tokenizer(HFTokenizer(models.BPE()), {}, template)


def render_chat(name: str, messages: list[dict], *, tools: list[dict] | None = None, thinking: bool | None = None,
                generation: bool = False, template: str | None = None) -> str:
    """``messages`` rendered with ``template`` (None: format ``name``'s); ``thinking`` the
    template's ``enable_thinking`` (None: left to the template), ``generation`` its
    ``add_generation_prompt``."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    return _renderer(template or chat_format(name).template).apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation, **kwargs)


def turn_pieces(name: str, messages: list[dict], *, tools: list[dict] | None = None, thinking: bool | None = None,
                template: str | None = None) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, generated) pieces: ``generated`` on what the model
    writes in each assistant turn, i.e. the text after that turn's prompt (the messages before it
    with the generation prompt), through the end-of-turn token (for glm the next role token; after
    the last turn ``final_stop``). ValueError if the template does not render a turn as its prompt
    followed by the generated text, or a turn is not followed by an end-of-turn token."""
    fmt = chat_format(name)
    text = lambda msgs, generation: render_chat(name, msgs, tools=tools, thinking=thinking, generation=generation,
                                                template=template)
    pieces, done = [], ""
    for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
        head, full = text(messages[:i], True), text(messages[:i + 1], False)
        if not (head.startswith(done) and full.startswith(head)):
            raise ValueError(f"the template does not render message {i} as its prompt followed by the answer")
        pieces += [[head[len(done):], False], [full[len(head):], True]]
        done = full
    pieces.append([text(messages, False)[len(done):], False])
    for k, (body, generated) in enumerate(pieces):
        if not generated:
            continue
        hits = sorted((body.find(s) + len(s), s) for s in fmt.stops if s in body)
        if hits:                                    # the turn renders its own end (qwen: <|im_end|>)
            cut = hits[0][0]
            pieces[k][0], pieces[k + 1][0] = body[:cut], body[cut:] + pieces[k + 1][0]
            continue
        after = pieces[k + 1][0]                    # glm: the next role token ends the turn
        stop = next((s for s in fmt.stops if after.startswith(s)), None if after else fmt.final_stop)
        if stop is None:
            raise ValueError(f"an assistant turn is followed by {after[:20]!r}, not by an end-of-turn token")
        pieces[k][0], pieces[k + 1][0] = body + stop, after.removeprefix(stop)
    return [(piece, generated) for piece, generated in pieces if piece]
