"""Structured output through the server and the official openai client: response_format
(json_schema, json_object), vLLM's guided_* extras (guided_grammar included), recursive and
range-bounded schemas, and tool calls (a named function and "required"), streamed and not; bad
schemas, grammars and unsupported tool choices are 400s."""
import json
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from minillm import LLM  # noqa: E402
from minillm.serving.server import ServerThread, build_app  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"enum": ["France", "Japan", "Peru"]}},
        "required": ["city", "country"]}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET", "JST"]}},
                   "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    llm = LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64)
    with ServerThread(build_app(llm, served_model_name="smollm2")) as server:
        yield SimpleNamespace(client=openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0))


def test_response_format_json_schema_and_json_object(served):
    r = served.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a city in JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    assert r.choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].text for c in served.client.completions.create(
        model="smollm2", prompt="A JSON object describing a cat:", max_tokens=60, temperature=0, stream=True,
        extra_body={"response_format": {"type": "json_object"}}) if c.choices)
    assert isinstance(json.loads(text), dict)


def test_vllm_guided_extras(served):
    r = served.client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=10, temperature=0,
                                              extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert r.choices[0].message.content in ("sunny", "rainy", "cloudy")
    r = served.client.completions.create(model="smollm2", prompt="The year is", max_tokens=10, temperature=0.7,
                                         seed=1, extra_body={"guided_regex": "1[89][0-9]{2}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:2] in ("18", "19")
    r = served.client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                              extra_body={"guided_json": CITY})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


RANGED = {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2025},
                                           "rating": {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
                                           "released": {"type": "string", "format": "date"}},
          "required": ["year", "rating", "released"]}
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                     "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
    "required": ["name", "children"]}}}


def test_range_bounded_and_recursive_schemas(served):
    r = served.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A film as JSON: year, rating out of 5, release date."}],
        max_tokens=60, temperature=0, response_format={"type": "json_schema",
                                                       "json_schema": {"name": "film", "schema": RANGED}})
    assert r.choices[0].finish_reason == "stop"
    film = json.loads(r.choices[0].message.content)
    jsonschema.validate(film, RANGED, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    nested = 0
    for seed in range(3):          # sampled: the model nests, and may nest past max_tokens (then: a prefix)
        r = served.client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "A folder tree as JSON."}], max_tokens=120,
            temperature=0.8, seed=seed, extra_body={"guided_json": TREE})
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text), TREE)
        else:
            assert r.choices[0].finish_reason == "length" and text.startswith('{"name": "')
        nested = max(nested, text.count('"children": [{'))
    assert nested >= 2


def test_guided_grammar(served):
    grammar = 'root ::= answer ", because " reason "."\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,40}'
    r = served.client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, temperature=0,
                                              extra_body={"guided_grammar": grammar})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"(yes|no), because [a-z ]{3,40}\.", r.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_tool_calls_are_constrained_by_the_function_parameters(served, stream, tool_choice):
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else "required"
    kwargs = dict(model="smollm2", messages=ASK, max_tokens=60, temperature=0, tools=[TIME_TOOL, WEATHER_TOOL],
                  tool_choice=choice)
    if not stream:
        r = served.client.chat.completions.create(**kwargs)
        (call,) = r.choices[0].message.tool_calls
        finish, name, arguments = r.choices[0].finish_reason, call.function.name, call.function.arguments
        assert call.id and call.type == "function"
    else:
        name, arguments, finish, ids = None, "", None, []
        for chunk in served.client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                for piece in c.delta.tool_calls or []:
                    ids += [piece.id] if piece.id else []
                    name = piece.function.name or name
                    arguments += piece.function.arguments or ""
                finish = c.finish_reason or finish
        assert len(ids) == 1
    assert finish == "tool_calls"
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[name]
    if tool_choice == "named":
        assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("kwargs, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "multipleOf": 2}}}), "'multipleOf'"),
    (dict(extra_body={"guided_grammar": 'root ::= root "x" | "y"'}), "left recursion"),
    (dict(extra_body={"guided_regex": "a(b"}), "missing )"),
    (dict(tools=[WEATHER_TOOL], tool_choice="auto"), "'auto' is not"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "give one of them"),
])
def test_bad_constraints_are_400s(served, kwargs, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        served.client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, **kwargs)
