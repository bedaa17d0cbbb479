"""The grammar engine (minillm/guided/grammar.py, pushdown.py) against its definition, the naive
matcher over the rule trees; the token masks (with the per-frame cache) against walking every
token's bytes; the schema compiler's numeric ranges, formats, arrays, patterns and recursion
against Python's own arithmetic, datetime / ipaddress / uuid and jsonschema."""
import datetime
import ipaddress
import json
import random
import re
import uuid
from decimal import Decimal

import pytest

from minillm.guided.grammar import Grammar, naive_match
from minillm.guided.json_schema import schema_to_grammar
from minillm.guided.pushdown import DEAD, PushdownAutomaton
from minillm.guided.token_automaton import TokenVocabulary

GRAMMARS = {
    "nested lists": 'root ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9]+ | root',
    "expressions": 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [a-c] | "(" expr ")"',
    "nullable calls": 'root ::= a b\na ::= "x"*\nb ::= "y" b "z" | ""',
    "balanced": 'root ::= s\ns ::= "(" s ")" s | ""',
    "shared prefixes": 'root ::= ("ab" | "a" rest)+\nrest ::= "b"? "c"',
    "bounded repeats": 'root ::= x{2,3} "."\nx ::= [ab] | "(" root ")"   # a comment',
}
PIECES = ["[", "]", ",", "1", "12", "[1", "],", "+", "(", ")", "a", "b", "c", "ab", "bc", "x", "y", "z", "yz",
          "(a", "))", ".", "a.", "((", "xy", "]]", "1,", "c)"]


def walk(pda: PushdownAutomaton, text: str) -> int:
    config = pda.start
    for b in text.encode():
        config = pda.step(config, b)
    return config


@pytest.mark.parametrize("name", GRAMMARS)
def test_pushdown_automaton_equals_the_naive_matcher(name):
    """On random strings: in the language, a live prefix, or neither; and each token of a small
    vocabulary is allowed iff prefix + token is still a live prefix (EOS iff in the language)."""
    text = GRAMMARS[name]
    vocab = [p.encode() for p in PIECES] + [b""]
    pda = PushdownAutomaton(Grammar(text), TokenVocabulary(vocab, eos_token_id=len(vocab) - 1))
    alphabet = sorted({c for p in PIECES for c in p} | {"-", "9"})
    rng = random.Random(name)
    live = 0
    for _ in range(600):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7)))
        full, prefix = naive_match(text, s)
        config = walk(pda, s)
        assert (config != DEAD and pda.is_accepting(config), config != DEAD) == (full, prefix), s
        if prefix:
            live += 1
            mask = pda.mask(config)
            expected = [naive_match(text, s + p)[1] for p in PIECES] + [full]
            assert mask.tolist() == expected, s
    assert live > 30


def test_masks_equal_a_token_by_token_walk_on_a_json_grammar():
    """The per-frame cache (accepted / uncertain split) must not change any mask: on a JSON grammar
    and a random vocabulary whose tokens cross rule boundaries, in every configuration a random
    walk visits, mask == walk each token's bytes from the configuration."""
    rng = random.Random(0)
    pieces = [c for c in '{}[]":, 0123abé'] + ['": ', '", "', '"}', "]}", "[{", '{"', "1, ", "é"[:1]]
    vocab = [b""] + sorted({"".join(rng.choice(pieces) for _ in range(rng.randint(1, 4))).encode()
                            for _ in range(500)})
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}},
                                               "b": {"type": "integer", "minimum": -3, "maximum": 120},
                                               "c": {"type": "string"}}}
    pda = PushdownAutomaton(Grammar(schema_to_grammar(schema)), TokenVocabulary(vocab, eos_token_id=0))
    visited = 0
    for _ in range(40):
        config = pda.start
        for _ in range(30):
            expected = [bool(b) and pda.next_state(config, t) != DEAD for t, b in enumerate(vocab)]
            expected[0] = pda.is_accepting(config)
            if not any(expected):
                break
            assert pda.mask(config).tolist() == expected
            visited += 1
            token = rng.choice([t for t, ok in enumerate(expected) if ok])
            if token == 0:
                break
            config = pda.next_state(config, token)
    assert visited > 200 and pda.stats()["frames_cached"] > 5


@pytest.mark.parametrize("text, words", [
    ('root ::= a\na ::= "x" a', "derive no finite string"),
    ('root ::= a "x" | "y"\na ::= b\nb ::= "z"? root', "left recursion root -> a -> b -> root"),
    ('root ::= b', "calls 'b', which is not defined"),
    ('start ::= "a"', "no start rule"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('root ::= "a" (', "line 1"),
    ('root ::= "a"\n\nx ::= "unterminated', "line 3"),
    ('root ::= [z-a]', "a <= z"),
    ('root ::= "a"{3,1}', "m <= n"),
    ('root = "a"', "'::='"),
])
def test_bad_grammars_are_value_errors_naming_the_problem(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        Grammar(text)


def test_deep_nesting_uses_the_stack_and_long_lists_do_not():
    """200 levels of brackets: far past any regex; a 2,000-item list: the tail call keeps one
    frame, so the stack nodes do not grow with the length."""
    pda = PushdownAutomaton(Grammar(schema_to_grammar({})), TokenVocabulary([b"x"], None))
    deep = json.dumps(json.loads("[" * 200 + "1" + "]" * 200))
    assert pda.is_accepting(walk(pda, deep))
    assert walk(pda, deep[:-1]) != DEAD and not pda.is_accepting(walk(pda, deep[:-1]))
    assert walk(pda, deep + "]") == DEAD
    grammar = 'root ::= "[" items "]"\nitems ::= [0-9] ("," items)?'
    pda = PushdownAutomaton(Grammar(grammar), TokenVocabulary([b"x"], None))
    assert pda.is_accepting(walk(pda, "[" + ",".join("7" * 50) + "]"))
    before = len(pda.nodes)
    assert pda.is_accepting(walk(pda, "[" + ",".join("7" * 2000) + "]"))
    assert len(pda.nodes) == before


# ---- the schema compiler ----------------------------------------------------------------

def accepts(schema):
    pda = PushdownAutomaton(Grammar(schema_to_grammar(schema)), TokenVocabulary([b"x"], None))
    return lambda text: pda.is_accepting(walk(pda, text))


@pytest.mark.parametrize("bounds", [dict(minimum=-5, maximum=120), dict(minimum=7, maximum=7), dict(maximum=-7),
                                    dict(exclusiveMinimum=-31, exclusiveMaximum=-4), dict(minimum=3),
                                    dict(minimum=100, maximum=1999), dict(exclusiveMinimum=2.5, maximum=40.9)])
def test_integer_ranges_are_exact(bounds):
    ok = accepts({"type": "integer", **bounds})
    lo = bounds.get("minimum", bounds.get("exclusiveMinimum", -10 ** 9))
    hi = bounds.get("maximum", bounds.get("exclusiveMaximum", 10 ** 9))
    for v in range(-2100, 2100):
        inside = (v > lo if "exclusiveMinimum" in bounds else v >= lo) and \
                 (v < hi if "exclusiveMaximum" in bounds else v <= hi)
        assert ok(str(v)) == inside, v
    assert not ok("-0") and not ok("007") and not ok("1e2")


NUMBERS = sorted({i + f for i in ["0", "1", "2", "3", "5", "10", "-0", "-1", "-2", "-3", "-10", "01"]
                  for f in ["", ".0", ".5", ".05", ".50", ".25", ".2", ".9", ".99", ".999", ".001", ".000", ".4999",
                            ".5001"]})


@pytest.mark.parametrize("bounds", [dict(minimum=0.5, maximum=2), dict(exclusiveMinimum=0.5, maximum=2),
                                    dict(minimum=0.5, exclusiveMaximum=2), dict(minimum=-2.5, maximum=-0.25),
                                    dict(exclusiveMinimum=-1, exclusiveMaximum=1), dict(minimum=0),
                                    dict(exclusiveMinimum=0), dict(maximum=0), dict(exclusiveMaximum=0),
                                    dict(minimum=1.25, maximum=1.5), dict(minimum=-3.05, exclusiveMaximum=10.5)])
def test_number_ranges_are_exact(bounds):
    ok = accepts({"type": "number", **bounds})
    for text in NUMBERS:
        v = Decimal(text)
        canonical = not re.match(r"-?0[0-9]", text) and not (text.startswith("-") and v == 0)
        inside = all([v >= Decimal(str(bounds["minimum"])) if "minimum" in bounds else True,
                      v <= Decimal(str(bounds["maximum"])) if "maximum" in bounds else True,
                      v > Decimal(str(bounds["exclusiveMinimum"])) if "exclusiveMinimum" in bounds else True,
                      v < Decimal(str(bounds["exclusiveMaximum"])) if "exclusiveMaximum" in bounds else True])
        assert ok(text) == (canonical and inside), text


def test_date_format_knows_the_calendar():
    ok = accepts({"type": "string", "format": "date"})
    day = datetime.date(1899, 12, 25)
    while day.year < 2102:                                  # 1900 and 2100 are not leap years, 2000 is
        assert ok(f'"{day.isoformat()}"'), day
        day += datetime.timedelta(days=1)
    for bad in ["1900-02-29", "2023-02-29", "2100-02-29", "2024-04-31", "2024-13-01", "2024-00-10", "0000-01-01",
                "2024-1-01", "2024-01-32"]:
        assert not ok(f'"{bad}"'), bad
    assert ok('"2000-02-29"') and ok('"2024-02-29"') and ok('"0004-02-29"')


@pytest.mark.parametrize("fmt, make, check", [
    ("ipv4", lambda r: ".".join(r.choice([str(r.randint(0, 300)), "0" + str(r.randint(0, 9))]) for _ in range(4)),
     lambda s: _valid(ipaddress.IPv4Address, s)),
    ("uuid", lambda r: r.choice([str(uuid.UUID(int=r.getrandbits(128))), str(uuid.UUID(int=r.getrandbits(128)))[:-1]
                                 + "g", "1234"]), lambda s: _valid(uuid.UUID, s) and len(s) == 36),
])
def test_formats_against_python(fmt, make, check):
    ok = accepts({"type": "string", "format": fmt})
    rng = random.Random(fmt)
    for _ in range(400):
        s = make(rng)
        assert ok(json.dumps(s)) == check(s), s


def _valid(parse, s) -> bool:
    try:
        parse(s)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("fmt, good, bad", [
    ("time", ["00:00:00Z", "23:59:59.123+05:30", "12:30:00-08:00"], ["24:00:00Z", "12:60:00Z", "12:00:00", "1:00:00Z"]),
    ("date-time", ["2024-02-29T23:59:59Z", "1999-12-31T00:00:00.5+01:00"], ["2023-02-29T00:00:00Z",
                                                                           "2024-01-01 00:00:00Z"]),
    ("email", ["ada@example.com", "a.b+c@x-y.co.uk", "a@b"], ["ada", "@x.com", "a..b@x.com", "a@-x.com", "a@x."]),
])
def test_formats_against_jsonschema(fmt, good, bad):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("rfc3339_validator")            # jsonschema checks times only with it
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    ok = accepts({"type": "string", "format": fmt})
    for s in good:
        assert ok(json.dumps(s)) and checker.conforms(s, fmt), s
    for s in bad:
        assert not ok(json.dumps(s)), s


def test_arrays_prefix_items_and_counts():
    ok = accepts({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                  "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4})
    for doc, valid in [([1], True), ([1, "a"], True), ([1, "a", True, False], True), ([1, "a", True, False, True], False),
                       ([], False), (["a"], False), ([1, "a", 3], False)]:
        assert ok(json.dumps(doc)) == valid, doc
    closed = accepts({"type": "array", "prefixItems": [{"const": 1}, {"const": 2}], "items": False})
    assert [closed(json.dumps(d)) for d in ([], [1], [1, 2], [1, 2, 3])] == [True, True, True, False]


def test_patterns_unanchored_escaped_and_length_bounded():
    ok = accepts({"type": "string", "pattern": "ab"})                  # ECMA: matches anywhere
    assert ok('"xxabyy"') and ok('"ab"') and not ok('"a b"')
    ok = accepts({"type": "string", "pattern": '^[a"\\\\]+$'})           # quote and backslash escaped in JSON
    assert ok(json.dumps('a"\\a')) and not ok('"a"a"')
    ok = accepts({"type": "string", "pattern": "^[a-z]+[0-9]*$", "minLength": 2, "maxLength": 4})
    for s in ["a", "ab", "a1", "abc9", "abcd", "abcde", "a123", "a1234", "1a"]:
        assert ok(json.dumps(s)) == (2 <= len(s) <= 4 and re.fullmatch("[a-z]+[0-9]*", s) is not None), s


def test_recursive_schemas_and_any_json():
    tree = {"$ref": "#/$defs/t", "$defs": {"t": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "required": ["v"]}}}
    ok = accepts(tree)
    doc = {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": [{"v": 4}]}]}, {"v": 5}]}
    assert ok(json.dumps(doc)) and not ok(json.dumps({"v": 1, "kids": [{"kids": []}]}))
    ok = accepts({})
    for doc in [1, "s", None, [], {}, {"a": [1, {"b": [[[]]]}, "c"], "d": -2.5e3}, [[[[[[["deep"]]]]]]]]:
        assert ok(json.dumps(doc)), doc
    assert not ok("{'a': 1}") and not ok("[1,2]")          # the layout is json.dumps's: ", " between items


def test_mask_for_a_context_dependent_token_follows_the_real_stack():
    """']}' closes the inner bracket and then the outer one: allowed in '{[a', not in '[[a'. For
    the frame cache it is uncertain (it leaves the inner call); the real stack decides."""
    grammar = 'root ::= "{" x "}" | "[" x "]"\nx ::= "a" | root'
    vocab = [b"]}", b"]]", b"a", b"]", b""]
    pda = PushdownAutomaton(Grammar(grammar), TokenVocabulary(vocab, eos_token_id=4))
    assert [r.name for r in pda.grammar.rules] == ["root"]           # x is inlined; root calls itself
    in_braces, in_brackets = walk(pda, "{[a"), walk(pda, "[[a")
    assert pda.mask(in_braces).tolist() == [True, False, False, True, False]
    assert pda.mask(in_brackets).tolist() == [False, True, False, True, False]
    assert any(uncertain for _, uncertain, _ in pda.frame_masks.values())     # the split did have uncertain tokens


def test_non_recursive_rules_are_inlined_and_one_rule_per_cycle_stays_a_call():
    text = 'root ::= value\nvalue ::= obj | num\nobj ::= "{" value ("," value)* "}"\nnum ::= [0-9]+'
    assert [r.name for r in Grammar(text).rules] == ["root", "obj"]    # obj ends with "}": the loop breaker
    assert [r.name for r in Grammar(schema_to_grammar({"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "number"}}})).rules] == ["root"]


def test_long_length_bounds_compile_as_chains_of_rules():
    """maxLength 200 is one automaton of 200 character copies if written out; chained rules of 64
    characters each keep every DFA small and every length still written exactly one way. A
    pattern with maxLength 300 is a chain of product states: split into calls, not a deep copy."""
    ok = accepts({"type": "string", "maxLength": 200})
    assert [ok(json.dumps("a" * n)) for n in (0, 63, 64, 65, 128, 199, 200, 201)] == [True] * 7 + [False]
    ok = accepts({"type": "string", "minLength": 130})
    assert [ok(json.dumps("é" * n)) for n in (129, 130, 400)] == [False, True, True]
    schema = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 300}
    assert max(r.dfa.num_states for r in Grammar(schema_to_grammar(schema)).rules) < 200
    ok = accepts(schema)
    assert [ok(json.dumps("q" * n)) for n in (0, 1, 300, 301)] == [False, True, True, False]
