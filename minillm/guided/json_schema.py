"""JSON schema -> a grammar (grammar.py's EBNF text) whose strings are exactly the JSON texts we generate.

Whitespace policy (fixed, so the automaton stays small and jump-forward has long fixed runs):
the layout of Python's json.dumps defaults, on one line: ", " between items, ": " after a key,
no space inside brackets, no newlines.  {"name": "Ada", "tags": ["a", "b"]}
Strings are written as json.dumps(ensure_ascii=False) writes them: only ", \\ and control
characters escaped.

Supported keywords (what OpenAI's structured outputs accept, and a little more; anything else
is refused with a ValueError naming it):
    type            "object", "array", "string", "integer", "number", "boolean", "null", or a list
    object          properties (in the given order), required (the others may be left out),
                    additionalProperties: false (also what an absent one means beside properties),
                    or, without properties, a schema for the values of arbitrary keys
    array           items, prefixItems, minItems, maxItems
    string          minLength, maxLength, pattern (ECMA-style: unanchored unless ^...$; beside
                    minLength / maxLength it generates ASCII characters only), format: date,
                    time, date-time, email, uuid, ipv4
    integer         minimum, maximum, exclusiveMinimum, exclusiveMaximum
    number          the same bounds (a bounded number is written without an exponent)
    enum, const     any JSON values;  anyOf (and a type list) as alternatives
    $ref            local "#/$defs/..." or "#/definitions/..." or "#", recursion included
    title, description, default, examples, $schema, $id, $comment: ignored (no effect on output)

{} or true means any JSON value, nested without bound (a grammar can count brackets).
"""
from __future__ import annotations

import json
from decimal import Decimal

from .regex import compile_tree, parse

IGNORED = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
           "strict"}
BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
SUPPORTED = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "prefixItems", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength", "pattern", "format"},
    "integer": {"type"} | BOUNDS, "number": {"type"} | BOUNDS, "boolean": {"type"}, "null": {"type"},
}
COMMON = {"enum", "const", "anyOf", "$ref", "type"}
ITEM_SEP, KEY_SEP = ", ", ": "

# the building blocks, in GBNF
CHAR = r'([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))'
BUILTIN = {
    "json-value": "json-object | json-array | json-string | json-number | json-boolean | json-null",
    "json-object": '"{" (json-string ": " json-value (", " json-string ": " json-value)*)? "}"',
    "json-array": '"[" (json-value (", " json-value)*)? "]"',
    "json-string": '"\\"" ' + CHAR + '* "\\""',
    "json-number": 'json-integer ("." [0-9]+)? ([eE] [+-]? [0-9]+)?',
    "json-integer": '"-"? ("0" | [1-9] [0-9]*)',
    "json-boolean": '"true" | "false"',
    "json-null": '"null"',
}
USES = {"json-value": ["json-object", "json-array", "json-string", "json-number", "json-boolean", "json-null"],
        "json-object": ["json-string", "json-value"], "json-array": ["json-value"], "json-number": ["json-integer"]}
TYPE_RULES = {"string": "json-string", "integer": "json-integer", "number": "json-number",
              "boolean": "json-boolean", "null": "json-null"}

# formats: RFC 3339 dates (real calendars, leap years) and times (no leap second: Python's and
# jsonschema's validators refuse :60), RFC 5321 addresses (dot-atom @ domain labels), RFC 4122
# UUIDs, dotted-quad IPv4 without leading zeros
YEAR = '([1-9] [0-9]{3} | "0" [1-9] [0-9]{2} | "00" [1-9] [0-9] | "000" [1-9])'
LEAP_YEAR = '([0-9]{2} ("0" [48] | [2468] [048] | [13579] [26]) | ("0" [48] | [2468] [048] | [13579] [26]) "00")'
MONTH_DAY = ('(("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | "1" [0-9] | "2" [0-8]) | ("0" [13-9] | "1" [0-2]) "-" '
             '("29" | "30") | ("0" [13578] | "1" [02]) "-31")')
DATE = f'({YEAR} "-" {MONTH_DAY} | {LEAP_YEAR} "-02-29")'
TIME = ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]+)? '
        '("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])')
ATOM = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+"
LABEL = "[a-zA-Z0-9] ([a-zA-Z0-9-]* [a-zA-Z0-9])?"
OCTET = '("25" [0-5] | "2" [0-4] [0-9] | "1" [0-9]{2} | [1-9] [0-9] | [0-9])'
FORMATS = {
    "date": DATE,
    "time": TIME,
    "date-time": f'{DATE} "T" {TIME}',
    "email": f'{ATOM} ("." {ATOM})* "@" {LABEL} ("." {LABEL})*',
    "uuid": '[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}',
    "ipv4": f'{OCTET} ("." {OCTET}){{3}}',
}
JSON_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
MAX_PATTERN_STATES = 20_000       # pattern x length: states of the product automaton
CHUNK = 64                        # string characters per rule of a long length-bounded string


def literal(text: str) -> str:
    """A GBNF literal matching `text` exactly."""
    out = []
    for c in text:
        o = ord(c)
        out.append('\\"' if c == '"' else "\\\\" if c == "\\" else f"\\x{o:02x}" if o < 0x20 or o == 0x7F else c)
    return '"' + "".join(out) + '"'


def value_literal(value) -> str:
    """A GBNF literal matching the JSON text of value in our layout."""
    return literal(json.dumps(value, ensure_ascii=False))


def schema_to_grammar(schema) -> str:
    """schema (a dict or its JSON text) -> GBNF text with start rule `root`; ValueError naming what is
    not supported."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided json: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"guided json: a schema must be a JSON object; got {type(schema).__name__}")
    conv = _Converter(schema)
    root = conv.convert(schema, "#")
    return conv.text(root)


def any_object_grammar() -> str:
    """json_object=True: any JSON object."""
    conv = _Converter({})
    return conv.text(conv.builtin("json-object"))


class _Converter:
    def __init__(self, root):
        self.root = root
        self.rules: dict[str, str] = {}
        self.ref_rules: dict[str, str] = {}
        self.count = 0

    def error(self, path: str, what: str):
        raise ValueError(f"guided json: schema at {path}: {what}")

    def text(self, root_expr: str) -> str:
        return "\n".join([f"root ::= {root_expr}"] + [f"{n} ::= {body}" for n, body in self.rules.items()]) + "\n"

    def builtin(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = BUILTIN[name]
            for used in USES.get(name, []):
                self.builtin(used)
        return name

    def new_rule(self, stem: str, body: str | None = None) -> str:
        self.count += 1
        name = f"{stem}-{self.count}"
        self.rules[name] = body if body is not None else ""
        return name

    def convert(self, schema, path: str) -> str:
        if schema is True or schema == {}:
            return self.builtin("json-value")
        if schema is False:
            self.error(path, "false (no value allowed) cannot be generated")
        if not isinstance(schema, dict):
            self.error(path, f"must be an object; got {schema!r}")
        if "$ref" in schema:
            return self.ref(schema, path)
        if "const" in schema:
            return value_literal(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                self.error(path, "enum must be a non-empty list")
            return "(" + " | ".join(value_literal(v) for v in values) + ")"
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                self.error(path, "anyOf must be a non-empty list of schemas")
            rest = {k: v for k, v in schema.items() if k != "anyOf" and k not in IGNORED}
            if rest:
                self.error(path, f"anyOf beside {sorted(rest)} is not supported; put those inside each option")
            return "(" + " | ".join(self.convert(o, f"{path}/anyOf/{i}") for i, o in enumerate(options)) + ")"
        kind = schema.get("type")
        if kind is None:
            self.check_keys(schema, path, set())
            return self.builtin("json-value")
        if isinstance(kind, list):
            if not kind:
                self.error(path, "type must not be an empty list")
            return "(" + " | ".join(self.convert({**schema, "type": k}, path) for k in kind) + ")"
        if kind not in SUPPORTED:
            self.error(path, f"type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
        self.check_keys(schema, path, SUPPORTED[kind])
        if kind == "object":
            return self.object(schema, path)
        if kind == "array":
            return self.array(schema, path)
        if kind == "string":
            return self.string(schema, path)
        if kind in ("integer", "number") and BOUNDS & set(schema):
            return self.bounded(schema, path, kind)
        return self.builtin(TYPE_RULES[kind])

    def check_keys(self, schema: dict, path: str, allowed: set) -> None:
        for key in schema:
            if key not in allowed and key not in IGNORED and key not in COMMON:
                kind = schema.get("type", "untyped")
                self.error(path, f"keyword {key!r} is not supported for {kind} schemas; supported: "
                                 f"{', '.join(sorted(allowed - {'type'})) or '-'} (and enum, const, anyOf, $ref)")

    def ref(self, schema: dict, path: str) -> str:
        ref = schema["$ref"]
        parts = ref.split("/") if isinstance(ref, str) else []
        if ref == "#":
            target = self.root
        elif len(parts) == 3 and parts[0] == "#" and parts[1] in ("$defs", "definitions"):
            target = self.root.get(parts[1], {}).get(parts[2]) if isinstance(self.root, dict) else None
            if target is None:
                self.error(path, f"$ref {ref!r} names no definition")
        else:
            self.error(path, f"$ref {ref!r} is not supported; supported: '#', '#/$defs/NAME' or "
                             f"'#/definitions/NAME'")
        if ref not in self.ref_rules:               # named before converting, so a recursive ref finds it
            stem = "".join(c if c.isalnum() else "-" for c in (parts[-1] if ref != "#" else "root"))
            name = self.ref_rules[ref] = self.new_rule("def-" + stem)
            self.rules[name] = self.convert(target, ref)
        return self.ref_rules[ref]

    def object(self, schema: dict, path: str) -> str:
        props = schema.get("properties", {})
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", not props)   # absent: any object if no properties
        if not isinstance(props, dict) or not isinstance(required, list):
            self.error(path, "properties must be an object and required a list")
        missing = [r for r in required if r not in props]
        if missing:
            self.error(path, f"required names {missing} that properties does not define")
        if not props:
            if extra is False:
                return '"{}"'
            if extra is True:
                return self.builtin("json-object")
            values = self.convert(extra, f"{path}/additionalProperties")
            member = f'{self.builtin("json-string")} ": " {values}'
            return f'"{{" ({member} (", " {member})*)? "}}"'
        if extra is not False:
            self.error(path, "additionalProperties other than false beside properties is not supported "
                             "(only the listed properties are generated)")
        fields = [(value_literal(name) + ' ": " ' + self.convert(sub, f"{path}/properties/{name}"), name in required)
                  for name, sub in props.items()]
        return '"{" ' + _members(fields) + ' "}"'

    def array(self, schema: dict, path: str) -> str:
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            self.error(path, "prefixItems must be a list of schemas")
        heads = [self.convert(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix)]
        items = schema.get("items", True)
        rest = None if items is False else self.convert(items, f"{path}/items")
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            self.error(path, f"minItems/maxItems must be integers with 0 <= minItems <= maxItems; got {lo}, {hi}")
        if rest is None:
            hi = len(heads) if hi is None else min(hi, len(heads))
            if lo > hi:
                self.error(path, f"minItems {lo} is more than the {len(heads)} prefixItems with items: false")
        options = []
        for n in range(lo, min(len(heads), hi if hi is not None else len(heads)) + 1):
            if n < len(heads) or rest is None:      # exactly n of the prefix items, nothing after
                options.append(" ".join(_joined(heads[:n])) if n else '""')
        if rest is not None and (hi is None or hi > len(heads)):
            m_lo, m_hi = max(lo - len(heads), 0), (None if hi is None else hi - len(heads))
            options.append(_repeated(heads, rest, m_lo, m_hi))
        return '"[" (' + " | ".join(options) + ') "]"'

    def string(self, schema: dict, path: str) -> str:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            self.error(path, f"minLength/maxLength must be integers with 0 <= minLength <= maxLength; got {lo}, {hi}")
        if "format" in schema:
            fmt = schema["format"]
            if fmt not in FORMATS:
                self.error(path, f"format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
            if set(schema) & {"pattern", "minLength", "maxLength"}:
                self.error(path, "format together with pattern, minLength or maxLength is not supported")
            return f'"\\"" {FORMATS[fmt]} "\\""'
        if "pattern" in schema:
            return self.pattern(schema["pattern"], lo, hi, path)
        if lo == 0 and hi is None:
            return self.builtin("json-string")
        return f'"\\"" {self.chars(lo, hi)} "\\""'

    def chars(self, lo: int, hi: int | None) -> str:
        """lo to hi JSON string characters. Past CHUNK, a chain of rules, CHUNK characters each (one
        automaton of maxLength copies would be thousands of states): the next link is entered only
        once this one is full, so every length is written one way."""
        if max(lo, hi or 0) <= CHUNK:
            return f"{CHAR}{{{lo},{'' if hi is None else hi}}}"
        name = self.new_rule("chars")
        rest = self.chars(max(lo - CHUNK, 0), None if hi is None else hi - CHUNK)
        full = f"{CHAR}{{{CHUNK}}} {rest}"
        self.rules[name] = full if lo >= CHUNK else f"{full} | {CHAR}{{{lo},{CHUNK - 1}}}"
        return name

    def pattern(self, pattern, lo: int, hi: int | None, path: str) -> str:
        if not isinstance(pattern, str):
            self.error(path, f"pattern must be a string; got {pattern!r}")
        body = pattern[1:] if pattern.startswith("^") else pattern
        anchored_end = body.endswith("$") and not body.endswith("\\$")
        body = body[:-1] if anchored_end else body
        try:
            tree = parse(body)
        except ValueError as e:
            self.error(path, f"pattern {pattern!r}: {e}")
        free = ("rep", ("set", ((0, 0x10FFFF),)), 0, None)     # an unanchored side matches anything
        tree = ("cat", ((free,) if not pattern.startswith("^") else ()) + (tree,) + (() if anchored_end else (free,)))
        if lo == 0 and hi is None:
            return '"\\"" ' + _json_text(tree) + ' "\\""'
        return '"\\"" ' + self.length_bounded(tree, lo, hi, pattern, path) + ' "\\""'

    def length_bounded(self, tree, lo: int, hi: int | None, pattern: str, path: str) -> str:
        """pattern AND lo <= length <= hi: the product of the pattern's DFA with a character counter,
        written as right-linear rules (one per product state). ASCII patterns only (a byte is a char)."""
        dfa = compile_tree(_ascii_only(tree), f"pattern {pattern!r}")
        cap = lo if hi is None else hi
        states = [(q, n) for q in range(dfa.num_states) if q != dfa.dead for n in range(cap + 1)]
        if len(states) > MAX_PATTERN_STATES:
            self.error(path, f"pattern {pattern!r} with lengths up to {cap} needs more than {MAX_PATTERN_STATES} "
                             f"states; use a smaller maxLength")

        def moves(q, n):
            if hi is not None and n == hi:
                return {}
            out: dict[tuple, list[int]] = {}
            for b in range(128):
                t = dfa.transitions[q][b]
                if t != dfa.dead:
                    out.setdefault((t, min(n + 1, cap)), []).append(b)
            return out

        def ends(q, n):
            return dfa.accepting[q] and n >= lo

        live = {s for s in states if ends(*s)}                      # states that can still finish
        changed = True
        while changed:
            changed = False
            for s in states:
                if s not in live and any(t in live for t in moves(*s)):
                    live.add(s)
                    changed = True
        if (dfa.start, 0) not in live:
            self.error(path, f"no ASCII string matches pattern {pattern!r} with length in [{lo}, {hi}] (with "
                             f"minLength/maxLength, a pattern generates ASCII characters only)")
        names = {s: self.new_rule("pattern") for s in sorted(live)}
        for (q, n), name in names.items():
            options = [f"{_byte_class(bs)} {names[t]}" for t, bs in moves(q, n).items() if t in live]
            if ends(q, n):
                options.append('""')
            self.rules[name] = " | ".join(options)
        return names[(dfa.start, 0)]

    def bounded(self, schema: dict, path: str, kind: str) -> str:
        bounds = {}
        for key in BOUNDS & set(schema):
            v = schema[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                self.error(path, f"{key} must be a number; got {v!r}")
            bounds[key] = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
        lo, lo_strict = _tighter(bounds.get("minimum"), bounds.get("exclusiveMinimum"), max)
        hi, hi_strict = _tighter(bounds.get("maximum"), bounds.get("exclusiveMaximum"), min)
        if kind == "integer":
            ilo = None if lo is None else int(lo) + 1 if lo_strict and lo == int(lo) else _ceil(lo)
            ihi = None if hi is None else int(hi) - 1 if hi_strict and hi == int(hi) else _floor(hi)
            if ilo is not None and ihi is not None and ilo > ihi:
                self.error(path, f"no integer lies within the bounds {schema_bounds(schema)}")
            return "(" + int_range(ilo, ihi) + ")"
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_strict or hi_strict))):
            self.error(path, f"no number lies within the bounds {schema_bounds(schema)}")
        return "(" + _NumberRange(self).expr(lo, lo_strict, hi, hi_strict) + ")"


def schema_bounds(schema: dict) -> str:
    return ", ".join(f"{k}={schema[k]}" for k in sorted(BOUNDS & set(schema)))


def _tighter(inclusive, exclusive, pick):
    """The binding bound of an inclusive and an exclusive one: (value, strict) or (None, False)."""
    if inclusive is None and exclusive is None:
        return None, False
    if exclusive is None:
        return inclusive, False
    if inclusive is None or pick(inclusive, exclusive) == exclusive and exclusive != inclusive:
        return exclusive, True
    return inclusive, inclusive == exclusive


def _floor(d: Decimal) -> int:
    return int(d.to_integral_value(rounding="ROUND_FLOOR"))


def _ceil(d: Decimal) -> int:
    return int(d.to_integral_value(rounding="ROUND_CEILING"))


def _joined(parts: list[str]) -> list[str]:
    out = []
    for i, p in enumerate(parts):
        out += ([ '", "' ] if i else []) + [p]
    return out


def _repeated(heads: list[str], item: str, m_lo: int, m_hi: int | None) -> str:
    """All the prefix items, then between m_lo and m_hi more `item`s, comma-separated."""
    if m_hi == 0:
        return " ".join(_joined(heads)) if heads else '""'
    more = f'(", " {item})'
    if heads:
        return " ".join(_joined(heads)) + f" {more}{{{m_lo},{'' if m_hi is None else m_hi}}}"
    tail = f"{more}{{{max(m_lo - 1, 0)},{'' if m_hi is None else m_hi - 1}}}"
    return f"({item} {tail})" + ("?" if m_lo == 0 else "")


def _members(fields: list[tuple[str, bool]]) -> str:
    """Object members in order, separated by ", ", where optional ones may be missing.
    first(i): members i.. with no separator before the first present one;
    rest(i): members i.., each present one preceded by the separator."""
    def rest(i: int) -> str:
        if i == len(fields):
            return ""
        member, required = fields[i]
        return f'(", " {member})' + ("" if required else "?") + " " + rest(i + 1)

    def first(i: int) -> str:
        if i == len(fields):
            return '""'
        member, required = fields[i]
        if required:
            return f"{member} {rest(i + 1)}"
        return f"({member} {rest(i + 1)} | {first(i + 1)})"

    return first(0)


# ---- patterns: a regex tree -> GBNF over JSON text (characters JSON must escape are escaped) ----

def _ascii_only(node):
    """The tree with every class cut to ASCII (the free sides of an unanchored pattern included)."""
    if node[0] == "set":
        return ("set", tuple((lo, min(hi, 0x7F)) for lo, hi in node[1] if lo <= 0x7F))
    if node[0] in ("cat", "alt"):
        return (node[0], tuple(_ascii_only(n) for n in node[1]))
    return ("rep", _ascii_only(node[1]), node[2], node[3])


def _class(ranges) -> str:
    def ch(c: int) -> str:
        return chr(c) if 0x20 < c < 0x7F and chr(c) not in "\\]^-[\"" else \
            f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"
    return "[" + "".join(ch(lo) if lo == hi else f"{ch(lo)}-{ch(hi)}" for lo, hi in ranges) + "]"


def _json_char(ranges) -> str:
    """A GBNF expression for the JSON text of one character drawn from `ranges` (code points)."""
    plain, escaped = [], []
    for lo, hi in ranges:
        cuts = [c for c in sorted(JSON_ESCAPES.keys() | set(range(0x20))) if lo <= c <= hi]
        escaped += cuts
        start = lo
        for c in cuts:
            if c > start:
                plain.append((start, c - 1))
            start = c + 1
        if start <= hi:
            plain.append((start, hi))
    options = [_class(plain)] if plain else []
    options += [literal(JSON_ESCAPES.get(c, f"\\u{c:04x}")) for c in sorted(set(escaped))]
    if not options:
        raise ValueError("guided json: a pattern class matches no character")
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _json_text(node) -> str:
    kind = node[0]
    if kind == "set":
        return _json_char(node[1])
    if kind == "cat":
        return "(" + " ".join(_json_text(n) for n in node[1]) + ")" if node[1] else '""'
    if kind == "alt":
        return "(" + " | ".join(_json_text(n) for n in node[1]) + ")"
    _, sub, lo, hi = node
    return f"({_json_text(sub)}){{{lo},{'' if hi is None else hi}}}"


def _byte_class(codes: list[int]) -> str:
    """The JSON text of one ASCII character from `codes` (a pattern x length edge)."""
    ranges, start = [], codes[0]
    for a, b in zip(codes, codes[1:] + [None]):
        if b != a + 1:
            ranges.append((start, a))
            start = b
    return _json_char(ranges)


# ---- numeric ranges: canonical decimal text whose value lies within bounds ----

def _digits_between(lo: str, hi: str) -> str:
    """Digit strings of len(lo) == len(hi) whose value is in [lo, hi] (leading zeros allowed)."""
    if not lo:
        return '""'
    if lo == hi:
        return literal(lo)
    k = len(lo) - 1
    if k == 0:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return f"{literal(lo[0])} {_digits_between(lo[1:], hi[1:])}"
    first, last = int(lo[0]), int(hi[0])         # digits free after them: [first-last] [0-9]{k}
    options = []
    if lo[1:] != "0" * k:                         # lo's first digit needs the rest >= lo[1:]
        options.append(f'{literal(lo[0])} ({_digits_between(lo[1:], "9" * k)})')
        first += 1
    tail = []
    if hi[1:] != "9" * k:                         # hi's first digit needs the rest <= hi[1:]
        tail.append(f'{literal(hi[0])} ({_digits_between("0" * k, hi[1:])})')
        last -= 1
    if first <= last:
        options.append((f"[{first}-{last}]" if first < last else literal(str(first))) + f" [0-9]{{{k}}}")
    return "(" + " | ".join(options + tail) + ")"


def nonneg_range(lo: int, hi: int | None) -> str:
    """Canonical non-negative integers (no leading zeros) in [lo, hi] (hi None: no upper bound)."""
    options = []
    n_lo = len(str(lo))
    n_hi = len(str(hi)) if hi is not None else n_lo
    for n in range(n_lo, n_hi + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = 10 ** n - 1 if hi is None else min(hi, 10 ** n - 1)
        if a <= b:
            options.append(_digits_between(str(a), str(b)))
    if hi is None:
        options.append(f"[1-9] [0-9]{{{n_lo},}}")
    return " | ".join(options)


def int_range(lo: int | None, hi: int | None) -> str:
    """Canonical JSON integers in [lo, hi] (either may be None: unbounded); "-0" is not written."""
    options = []
    if lo is None or lo < 0:            # negatives: "-" then a magnitude in [max(1, -hi), -lo]
        m_lo = 1 if hi is None or hi >= 0 else -hi
        options.append(f'"-" ({nonneg_range(m_lo, None if lo is None else -lo)})')
    if hi is None or hi >= 0:
        options.append(nonneg_range(max(lo or 0, 0), hi))
    return " | ".join(options)


class _NumberRange:
    """Decimal text -?int(.digits)? whose value lies in a range, as grammar rules: the integer part
    by int_range, the fraction by right-linear rules that track whether the digits so far are
    still equal to the bound's (the same idea as comparing two numbers digit by digit)."""

    def __init__(self, conv: _Converter):
        self.conv = conv
        self.states: dict[tuple, str] = {}

    def expr(self, lo, lo_strict, hi, hi_strict) -> str:
        options = []
        if lo is None or lo < 0:            # negatives: magnitudes in [-hi, -lo], never zero
            m_lo, m_lo_strict = (Decimal(0), True) if hi is None or hi >= 0 else (-hi, hi_strict)
            m_hi, m_hi_strict = (None, False) if lo is None else (-lo, lo_strict)
            options.append('"-" (' + self.magnitude(m_lo, m_lo_strict, m_hi, m_hi_strict) + ")")
        if hi is None or hi > 0 or (hi == 0 and not hi_strict):
            a, a_strict = (Decimal(0), False) if lo is None or lo < 0 else (lo, lo_strict)
            options.append(self.magnitude(a, a_strict, hi, hi_strict))
        return " | ".join(options)

    def magnitude(self, a: Decimal, a_strict: bool, b, b_strict: bool) -> str:
        """Non-negative decimals in [a, b] (strict ends where said; b None: unbounded)."""
        ia, ib = _floor(a), (None if b is None else _floor(b))
        fa, fb = a - ia, (None if b is None else b - ib)
        if ib is not None and ia == ib:
            return f"{literal(str(ia))} {self.fraction(fa, a_strict, fb, b_strict)}"
        options = [f"{literal(str(ia))} {self.fraction(fa, a_strict, None, False)}"]
        mid_hi = None if ib is None else ib - 1
        if mid_hi is None or mid_hi >= ia + 1:
            options.append(f'({nonneg_range(ia + 1, mid_hi)}) ("." [0-9]+)?')
        if ib is not None and not (fb == 0 and b_strict):      # b itself excluded: nothing starts with ib
            options.append(f"{literal(str(ib))} {self.fraction(Decimal(0), False, fb, b_strict)}")
        return "(" + " | ".join(options) + ")"

    def fraction(self, fa: Decimal, a_strict: bool, fb, b_strict: bool) -> str:
        """"" or "." digits, with fa <= 0.digits <= fb (strict where said; fb None: any below 1)."""
        low = _frac_digits(fa)
        high = None if fb is None else _frac_digits(fb)
        zero_ok = (fa == 0 and not a_strict) and (fb is None or fb > 0 or not b_strict)
        tail = self.state(low, a_strict, high, b_strict, nonempty=True)
        if tail is None:
            return '""'
        return f'("" | "." {tail})' if zero_ok else f'"." {tail}'

    def state(self, low, a_strict, high, b_strict, nonempty: bool) -> str:
        """Digits t (one at least if nonempty) continuing a prefix that equals `low`'s so far (low
        None: already above) and `high`'s so far (high None: already below)."""
        key = (low, a_strict, high, b_strict, nonempty)
        if key in self.states:
            return self.states[key]
        if low is None and high is None:
            return "[0-9]+" if nonempty else "[0-9]*"
        if high == "" and (b_strict or (low == "" and a_strict)):
            return None         # equal to the upper bound whatever follows (zeros), which is excluded
        name = self.states[key] = self.conv.new_rule("fraction")
        options = []
        if not nonempty:
            low_ok = low is None or (low == "" and not a_strict)
            high_ok = high is None or high != "" or not b_strict
            if low_ok and high_ok:
                options.append('""')
        groups: dict[tuple, list[int]] = {}
        for d in range(10):
            lo_d = int(low[0]) if low else 0
            hi_d = int(high[0]) if high else 0
            if (low is not None and d < lo_d) or (high is not None and d > hi_d):
                continue
            nl = None if low is None or d > lo_d else low[1:]
            nh = None if high is None or d < hi_d else high[1:]
            groups.setdefault((nl, nh), []).append(d)
        loop = None
        for (nl, nh), ds in groups.items():
            cls = f"[{ds[0]}-{ds[-1]}]" if len(ds) > 1 else literal(str(ds[0]))
            if (nl, a_strict, nh, b_strict, False) == key:          # a "0" that changes nothing: a loop
                loop = cls
                continue
            after = self.state(nl, a_strict, nh, b_strict, nonempty=False)
            if after is not None:
                options.append(f"{cls} {after}")
        if not options:
            self.conv.rules.pop(name)
            del self.states[key]
            return None
        body = " | ".join(options)
        self.conv.rules[name] = f"{loop}* ({body})" if loop else body      # regular: no call back to itself
        return name


def _frac_digits(f: Decimal) -> str:
    """0 <= f < 1 -> its digits after the point, without trailing zeros ("" for 0)."""
    text = format(f, "f")
    return text.split(".")[1].rstrip("0") if "." in text else ""
