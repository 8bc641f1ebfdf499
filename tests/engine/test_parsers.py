"""The output parsers on real model-shaped strings: whole text and the same text streamed in
random chunk sizes must give the same answer, and a stream never shows a partial tag."""
from __future__ import annotations

import json
import random

import pytest

from engine.server.chat import end_of_turn_ids, normalize_messages, render, think_opened
from engine.server.detok import Detokenizer, hidden_token_ids
from engine.server.parsers import (OutputParser, ReasoningSplitter, StopMatcher, ToolCallParser, assemble,
                                   parse_tool_call, string_params_of)

WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]

# What the models print, in their own formats.
HERMES = ('<think>\nThe user wants the weather; I should call the tool.\n</think>\n\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
GLM = ('The user wants the weather in Paris.</think>\n'
       '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
       '<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>')
REASONED = "<think>17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391.</think>\n\n391"


def pieces_whole(text, **kw):
    p = OutputParser(**kw)
    return p.feed(text) + p.finish()


def pieces_streamed(text, rng, **kw):
    p = OutputParser(**kw)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.extend(p.feed(text[i:i + n]))
        i += n
    return out + p.finish()


def merged(pieces):
    """Adjacent text pieces of one kind joined (chunking may split them differently); calls without ids."""
    out = []
    for p in pieces:
        if p.kind == "tool_call":
            out.append(("tool_call", p.call.name, json.loads(p.call.arguments)))
        elif out and out[-1][0] == p.kind:
            out[-1] = (p.kind, out[-1][1] + p.text)
        else:
            out.append((p.kind, p.text))
    return out


CASES = [
    (HERMES, dict(think_opened=False, tools=True)),
    (GLM, dict(think_opened=True, tools=True, string_params=string_params_of(WEATHER_TOOL))),
    (REASONED, dict(think_opened=False)),
    (REASONED, dict(think_opened=True)),            # a generated <think> after the template's is dropped
    ("Red, yellow, blue.", dict(think_opened=False)),
    ("plain <tool_call>{not json}</tool_call> text", dict(tools=True)),
    ("a<b </thin and <tool_ca but never tags", dict(think_opened=False, tools=True)),
    ("unclosed <tool_call>{\"name\": \"get_weather\"", dict(tools=True)),
]


@pytest.mark.parametrize("text,kw", CASES)
def test_streamed_in_random_chunks_equals_whole(text, kw):
    whole = merged(pieces_whole(text, **kw))
    for seed in range(40):
        assert merged(pieces_streamed(text, random.Random(seed), **kw)) == whole


@pytest.mark.parametrize("text,kw", CASES[:5])     # the texts whose only think-tag text is whole tags
def test_no_partial_tag_ever_leaks(text, kw):
    for seed in range(20):
        for p in pieces_streamed(text, random.Random(seed), **kw):
            if p.kind != "tool_call":
                for frag in ("<think", "</th", "</think"):
                    assert frag not in p.text
                assert "<tool_call" not in p.text


def test_hermes_tool_call_with_reasoning():
    m = assemble(pieces_whole(HERMES, think_opened=False, tools=True))
    assert m.reasoning == "The user wants the weather; I should call the tool.\n"
    assert m.content is None                        # only whitespace beside the call
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert m.tool_calls[0].id.startswith("call_")
    assert m.tool_calls[0].openai()["type"] == "function"


def test_glm_tool_call_values_follow_the_schema():
    m = assemble(pieces_whole(GLM, think_opened=True, tools=True, string_params=string_params_of(WEATHER_TOOL)))
    assert m.reasoning == "The user wants the weather in Paris."
    args = json.loads(m.tool_calls[0].arguments)
    assert args == {"city": "Paris", "days": 2}     # days parsed as JSON (an integer); city stays text


def test_glm_values_become_json_unless_declared_string():
    body = 'f<arg_key>n</arg_key><arg_value>17</arg_value><arg_key>xs</arg_key><arg_value>[1, 2]</arg_value>' \
           '<arg_key>code</arg_key><arg_value>007</arg_value><arg_key>s</arg_key><arg_value>17</arg_value>'
    call = parse_tool_call(body, {"f": {"s"}})
    assert json.loads(call.arguments) == {"n": 17, "xs": [1, 2], "code": "007", "s": "17"}


def test_glm_call_without_arguments_and_two_calls_in_a_row():
    text = "<tool_call>now</tool_call>\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
    m = assemble(pieces_whole(text, tools=True))
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("now", {}), ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in m.tool_calls}) == 2


def test_hermes_arguments_as_a_json_string_and_parameters_alias():
    assert json.loads(parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}').arguments) == {"a": 1}
    assert json.loads(parse_tool_call('{"name": "f", "parameters": {"a": 1}}').arguments) == {"a": 1}


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": 1}',          # truncated JSON
    '{"arguments": {"a": 1}}',                      # no name
    '{"name": "f", "arguments": [1]}',              # arguments not an object
    'two words<arg_key>a</arg_key><arg_value>1</arg_value>',
    'f<arg_key>a</arg_key><arg_value>1</arg_value> trailing junk',
    'f<arg_key>a</arg_key>',                        # key without value
    '',
])
def test_malformed_tool_call_stays_content(body):
    text = f"Let me see. <tool_call>{body}</tool_call> done"
    m = assemble(pieces_whole(text, tools=True))
    assert m.tool_calls == []
    assert m.content == text


def test_streamed_tool_call_delta_has_openais_shape():
    from engine.server.endpoints import delta_of
    (p,) = [p for p in pieces_whole(HERMES, tools=True) if p.kind == "tool_call"]
    d = delta_of(p, 1)
    assert d == {"tool_calls": [{"index": 1, "id": p.call.id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]}


def test_tools_off_leaves_tool_call_text_as_content():
    m = assemble(pieces_whole('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tools=False))
    assert m.tool_calls == [] and m.content == '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


def test_reasoning_split_variants():
    # template opened <think>: everything up to </think> is reasoning
    assert assemble(pieces_whole("step one</think>answer", think_opened=True)).__dict__ == \
        {"reasoning": "step one", "content": "answer", "tool_calls": []}
    # no <think> anywhere: all content, no reasoning
    m = assemble(pieces_whole("just an answer", think_opened=False))
    assert (m.reasoning, m.content) == (None, "just an answer")
    # empty thinking (GLM with thinking off)
    m = assemble(pieces_whole("<think></think>\nhi", think_opened=False))
    assert (m.reasoning, m.content) == (None, "hi")
    # reasoning cut by the length limit: all of it is reasoning, content empty
    m = assemble(pieces_whole("thinking forever", think_opened=True))
    assert (m.reasoning, m.content) == ("thinking forever", "")
    # stray think tags never reach content
    m = assemble(pieces_whole("a</think>b<think>c</think>d", think_opened=True))
    assert (m.reasoning, m.content) == ("a", "bcd")


def test_partial_close_tag_is_held_then_released():
    s = ReasoningSplitter(opened=True)
    assert [(p.kind, p.text) for p in s.feed("391 is it</thi")] == [("reasoning", "391 is it")]
    assert [(p.kind, p.text) for p in s.feed("nk>The answer")] == [("content", "The answer")]
    s = ReasoningSplitter(opened=True)
    s.feed("x</thi")
    assert [(p.kind, p.text) for p in s.feed("s is not a tag")] == [("reasoning", "</this is not a tag")]


def test_partial_tool_call_tag_is_held():
    t = ToolCallParser()
    assert [p.text for p in t.feed("Sure <tool_")] == ["Sure "]
    assert t.feed('call>{"name": "f", "arguments": {}}') == []
    out = t.feed("</tool_call>")
    assert out[0].kind == "tool_call" and out[0].call.name == "f"


def test_stop_strings_cut_at_the_first_match_and_hold_partials():
    s = StopMatcher(["\n\n", "END"])
    assert s.feed("one two E") == "one two "
    assert s.feed("N") == ""
    assert s.feed("Xtra\n") == "ENXtra"
    assert s.feed("\nmore") == ""
    assert s.stopped and s.feed("after") == ""
    s = StopMatcher(["END"])
    assert s.feed("almost EN") == "almost " and s.finish() == "EN"     # no match by the end: released
    assert StopMatcher([]).feed("x") == "x"


# --- the chat template and the detokenizer, on the tiny checkpoints' real tokenizers --------------

@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def tokenizer(request, tiny_checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_checkpoint(request.param))


def test_template_renders_tools_and_opens_think(tokenizer):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]}]
    text = render(tokenizer, msgs, WEATHER_TOOL)
    assert "get_weather" in text and "Weather in Paris?" in text
    assert think_opened(text)
    assert not think_opened(text + "</think>")


def test_tool_call_arguments_as_json_string_render_as_objects(tokenizer):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 17}'}]
    assert normalize_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = render(tokenizer, msgs, WEATHER_TOOL)
    assert "Paris" in text.split("Weather in Paris?")[1]      # the call itself is in the prompt
    assert '{"temp_c": 17}' in text


def test_detokenizer_streams_exactly_the_decoded_text(tokenizer):
    text = "Once upon a time — a kiln «by the river» 17°C, émigré 🔥 <think>x</think><tool_call>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    hidden = hidden_token_ids(tokenizer)
    d = Detokenizer(tokenizer, hidden)
    parts = [d.add(i) for i in ids] + [d.finish()]
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)              # a multi-byte character is never split


def test_detokenizer_hides_role_tags_but_shows_parser_tags(tokenizer):
    vocab = tokenizer.get_vocab()
    hidden = hidden_token_ids(tokenizer)
    assert vocab["<think>"] not in hidden and vocab["<tool_call>"] not in hidden
    assert vocab["<|im_end|>"] in hidden and vocab["<|assistant|>"] in hidden
    d = Detokenizer(tokenizer, hidden)
    ids = [vocab["<|im_start|>"], vocab["<think>"], *tokenizer("hi", add_special_tokens=False)["input_ids"]]
    assert "".join(d.add(i) for i in ids) + d.finish() == "<think>hi"
    assert set(end_of_turn_ids(tokenizer)) >= {vocab["<|im_end|>"], vocab["<|observation|>"]}
