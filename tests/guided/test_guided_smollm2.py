"""Structured outputs on the real SmolLM2: every output of a suite of schemas parses and
validates with jsonschema, greedy and sampled; a cut by max_tokens leaves a valid prefix;
jump-forward saves model steps and keeps outputs valid."""
import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

from minillm import LLM, GuidedDecodingParams, SamplingParams  # noqa: E402
from minillm.guided.guide import compile_guide  # noqa: E402

SUITE = [
    ("Describe a fictional person.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                       "age": {"type": "integer"},
                                       "email": {"type": "string", "maxLength": 30}},
      "required": ["name", "age"]}),                                      # an optional field
    ("Describe a book with its author and a few genres.",
     {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 24},
         "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 16},
                                                     "last": {"type": "string", "maxLength": 16}},
                    "required": ["first", "last"]},
         "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "poetry"]},
                    "minItems": 1, "maxItems": 3}},
      "required": ["title", "author", "genres"]}),                        # nested object, array, enum
    ("Give the weather in Paris: temperature in Celsius and humidity.",
     {"type": "object", "properties": {"city": {"const": "Paris"}, "celsius": {"type": "number"},
                                       "humidity": {"type": "integer"},
                                       "sky": {"enum": ["sunny", "cloudy", "rain"]}},
      "required": ["city", "celsius", "humidity", "sky"]}),               # numbers, const, enum
    ('Quote a famous sentence that contains "double quotes" and a backslash \\ in it.',
     {"type": "object", "properties": {"quote": {"type": "string", "minLength": 3, "maxLength": 40},
                                       "famous": {"type": "boolean"}},
      "required": ["quote", "famous"]}),                                  # strings with escapes
    ("List two points of a triangle.",
     {"type": "object", "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/p"},
                                                  "maxItems": 3}},
      "required": ["points"],
      "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"]}}}),                         # array of nested objects, $ref
    ("Is the sky blue? Answer with a value.", {"anyOf": [{"type": "boolean"}, {"type": "null"}]}),
    ("Rate a film you like out of 5, with the year it came out.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                       "year": {"type": "integer", "minimum": 1900, "maximum": 2025},
                                       "stars": {"type": "number", "minimum": 0, "maximum": 5},
                                       "seen": {"type": "string", "format": "date"}},
      "required": ["title", "year", "stars", "seen"]}),                   # numeric ranges, a format
]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def small_llm(smollm2_path):
    return LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=96)


def prompts(llm):
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q + " Reply in JSON."}])
            for q, _ in SUITE]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_output_of_the_schema_suite_validates(small_llm, temperature):
    params = [SamplingParams(temperature=temperature, seed=7, max_tokens=MAX_TOKENS,
                             guided_decoding=GuidedDecodingParams(json=schema)) for _, schema in SUITE]
    outs = small_llm.generate(prompts(small_llm), params, use_tqdm=False)
    for out, (_, schema) in zip(outs, SUITE):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


COMMENTS = {"$ref": "#/$defs/comment", "$defs": {"comment": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 30},
                                     "replies": {"type": "array", "items": {"$ref": "#/$defs/comment"}, "maxItems": 2}},
    "required": ["text", "replies"]}}}


def test_a_recursive_schema_nests_and_every_output_is_a_document_or_a_prefix(small_llm):
    """A comment with replies that are comments: no regex can say this. Sampled, the model nests
    (depth 2 at least somewhere); each output either stopped and validates, or was cut by
    max_tokens and is a live prefix of the grammar (the model may keep nesting: that is its choice)."""
    question = small_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short comment thread: a comment and its replies. Reply in JSON."}])
    guided = GuidedDecodingParams(json=COMMENTS)
    outs = small_llm.generate([question] * 3, [SamplingParams(temperature=0.8, seed=s, max_tokens=MAX_TOKENS,
                                                              guided_decoding=guided) for s in range(3)],
                              use_tqdm=False)
    automaton = compile_guide(guided, small_llm.tokenizer, small_llm.config.vocab_size).automaton
    for out in outs:
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), COMMENTS)
        else:
            state = automaton.start
            for b in completion.text.encode():
                state = automaton.step(state, b)
            assert state != automaton.dead
    assert max(o.outputs[0].text.count('"replies": [{') for o in outs) >= 2


def test_json_requests_batched_with_free_text_requests(small_llm):
    """The mix production engines have shipped bugs in: free-text and JSON-guided requests in the
    same steps. Free rows are token-for-token what they are alone; JSON rows too, and validate."""
    ps = prompts(small_llm)
    free = SamplingParams(temperature=0, max_tokens=24)
    guided = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, guided_decoding=GuidedDecodingParams(json=s))
              for _, s in SUITE[:2]]
    params = [free, guided[0], free, guided[1]]
    mixed = small_llm.generate(ps[:4], params, use_tqdm=False)
    for prompt, p, out in zip(ps[:4], params, mixed):
        assert out.outputs[0].token_ids == small_llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    for out, (_, schema) in zip((mixed[1], mixed[3]), SUITE[:2]):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_every_corpus_schema_generates_documents_that_validate(small_llm):
    """The corpus of bench grammar (minillm/course/benchmarks/schema_corpus.py), sampled: every output
    that stopped validates with jsonschema and its format checker; one cut by max_tokens is a live
    prefix (a recursive schema may keep nesting, an unbounded string may run on). Half of them stop
    at least."""
    from minillm.course.benchmarks.schema_corpus import SCHEMAS, format_checker

    names = list(SCHEMAS)
    question = "Reply with an example JSON value for a record called {}."
    ps = [small_llm.tokenizer.apply_chat_template([{"role": "user", "content": question.format(n)}]) for n in names]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=160, guided_decoding=GuidedDecodingParams(json=s))
              for i, s in enumerate(SCHEMAS.values())]
    outs = small_llm.generate(ps, params, use_tqdm=False)
    stopped = 0
    for name, out in zip(names, outs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(completion.text), SCHEMAS[name], format_checker=format_checker())
        else:
            automaton = compile_guide(GuidedDecodingParams(json=SCHEMAS[name]), small_llm.tokenizer,
                                      small_llm.config.vocab_size).automaton
            state = automaton.start
            for b in completion.text.encode():
                state = automaton.step(state, b)
            assert state != automaton.dead, (name, completion.text)
    assert stopped >= len(names) // 2


def test_json_with_speculative_decoding_is_token_identical(small_llm, smollm2_path):
    """Drafts checked against the schema's grammar and verified with masked rows: n-gram drafts
    (the keys repeat) give exactly plain guided greedy's tokens, and some of them are accepted."""
    spec = LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=96,
               speculative_method="ngram", num_speculative_tokens=4, speculative_policy="always")
    _, schema = SUITE[1]                                   # a book: nested keys, an array of enums
    ps = prompts(small_llm)[1:2]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, guided_decoding=GuidedDecodingParams(json=schema))
    want = small_llm.generate(ps, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(ps, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    jsonschema.validate(json.loads(got.text), schema)
    assert spec.engine.speculation.accepted > 0


def test_cut_by_max_tokens_is_a_valid_prefix(small_llm):
    """finish_reason 'length' and the text is a prefix of some valid document: the DFA is not dead."""
    _, schema = SUITE[1]
    guided = GuidedDecodingParams(json=schema)
    (out,) = small_llm.generate(prompts(small_llm)[1:2], SamplingParams(temperature=0, max_tokens=9,
                                                                        guided_decoding=guided), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    automaton = compile_guide(guided, small_llm.tokenizer, small_llm.config.vocab_size).automaton
    state = automaton.start
    for b in out.outputs[0].text.encode():
        state = automaton.step(state, b)
    assert state != automaton.dead and not automaton.is_accepting(state)


def test_jump_forward_saves_steps_and_stays_valid(small_llm):
    """Long fixed keys are forced text: jump-forward appends them unsampled. The tokens differ from
    plain guided decoding (the forced text is tokenised as a whole), so the equality that holds is
    validity, not token ids; the outputs are checked on the contiguous path and the engine."""
    schema = {"type": "object", "properties": {"the_name_of_the_city": {"type": "string", "maxLength": 20},
                                               "the_country_it_is_in": {"enum": ["France", "Japan", "Peru"]}},
              "required": ["the_name_of_the_city", "the_country_it_is_in"]}
    question = small_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a city as JSON."}])
    base = SamplingParams(temperature=0, max_tokens=60, guided_decoding=GuidedDecodingParams(json=schema))
    jump = SamplingParams(temperature=0, max_tokens=60,
                          guided_decoding=GuidedDecodingParams(json=schema, jump_forward=True))
    reqs = small_llm.make_requests([question], jump)
    for _ in small_llm.stream_request(reqs[0]):                  # one request, to read its guide's counter
        pass
    plain = small_llm.generate([question], base, use_tqdm=False)[0].outputs[0]
    forced = reqs[0].guide.num_forced_tokens
    assert forced > 0
    jsonschema.validate(json.loads(reqs[0].text), schema)
    jsonschema.validate(json.loads(plain.text), schema)
    engine = small_llm.generate([question, question], jump, use_tqdm=False)   # several tokens per step
    for out in engine:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert engine[0].outputs[0].token_ids == reqs[0].output_token_ids
