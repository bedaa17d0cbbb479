"""JSON schema -> a regular expression whose matches are exactly the JSON texts we generate.

Whitespace policy (fixed, so the automaton stays small and jump-forward has long fixed runs):
the layout of Python's json.dumps defaults, on one line: ", " between items, ": " after a key,
no space inside brackets, no newlines.  {"name": "Ada", "tags": ["a", "b"]}

Supported keywords (anything else is refused with a ValueError naming it):
    type            "object", "array", "string", "integer", "number", "boolean", "null", or a list
    object          properties (in the given order), required (the others may be left out),
                    additionalProperties: false (also what an absent one means: only the listed
                    properties are generated), or, for an object without properties, a schema for
                    the values of arbitrary keys; no properties at all: any JSON object
    array           items, minItems, maxItems (prefixItems is not supported)
    string          minLength, maxLength, pattern (anchored ^...$, using only characters that need
                    no JSON escape), enum, const
    integer/number  JSON's number grammar (minimum/maximum and friends are refused: a regex for a
                    numeric range exists but is not worth its size here)
    enum, const     any JSON values;  anyOf (and a type list) as alternatives
    $ref            local "#/$defs/..." or "#/definitions/..." (recursion is refused: not regular)
    title, description, default, examples, $schema, $id, $comment: ignored (no effect on output)

Untyped values ({} or an array without items) and {"type": "object"} mean "any JSON value"
with at most MAX_DEPTH levels of nesting: a regex cannot count brackets without bound.
"""
from __future__ import annotations

import json

from .regex import escape

MAX_DEPTH = 2               # nesting levels of an untyped value / json_object below the top object
IGNORED = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions"}
SUPPORTED = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength", "pattern"},
    "integer": {"type"}, "number": {"type"}, "boolean": {"type"}, "null": {"type"},
}
COMMON = {"enum", "const", "anyOf", "$ref", "type"}

ITEM_SEP, KEY_SEP = ", ", ": "
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"
SCALAR_TYPES = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}


def literal(value) -> str:
    """A regex matching the JSON text of value in our layout."""
    return escape(json.dumps(value, ensure_ascii=False))


def any_value(depth: int = MAX_DEPTH) -> str:
    """Any JSON value with at most `depth` levels of nested containers."""
    options = [STRING, NUMBER, BOOLEAN, NULL]
    if depth > 0:
        options += [any_object(depth - 1), any_array(depth - 1)]
    return "(?:" + "|".join(options) + ")"


def any_object(depth: int = MAX_DEPTH, values: str | None = None) -> str:
    member = STRING + KEY_SEP + (values or any_value(depth))
    return r"\{(?:" + member + "(?:" + ITEM_SEP + member + ")*)?\\}"


def any_array(depth: int = MAX_DEPTH) -> str:
    item = any_value(depth)
    return r"\[(?:" + item + "(?:" + ITEM_SEP + item + ")*)?\\]"


def schema_to_regex(schema) -> str:
    """schema (a dict or its JSON text) -> regex; ValueError naming what is not supported."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided json: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"guided json: a schema must be a JSON object; got {type(schema).__name__}")
    return _Converter(schema).convert(schema, "#", ())


class _Converter:
    def __init__(self, root: dict):
        self.root = root

    def error(self, path: str, what: str):
        raise ValueError(f"guided json: schema at {path}: {what}")

    def convert(self, schema, path: str, refs: tuple) -> str:
        if schema is True or schema == {}:
            return any_value()
        if not isinstance(schema, dict):
            self.error(path, f"must be an object; got {schema!r}")
        if "$ref" in schema:
            return self.ref(schema, path, refs)
        if "const" in schema:
            return literal(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                self.error(path, "enum must be a non-empty list")
            return "(?:" + "|".join(literal(v) for v in values) + ")"
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                self.error(path, "anyOf must be a non-empty list of schemas")
            rest = {k: v for k, v in schema.items() if k != "anyOf" and k not in IGNORED}
            if rest:
                self.error(path, f"anyOf beside {sorted(rest)} is not supported; put those inside each option")
            return "(?:" + "|".join(self.convert(o, f"{path}/anyOf/{i}", refs) for i, o in enumerate(options)) + ")"
        kind = schema.get("type")
        if kind is None:
            self.check_keys(schema, path, set())
            return any_value()
        if isinstance(kind, list):
            if not kind:
                self.error(path, "type must not be an empty list")
            return "(?:" + "|".join(self.convert({**schema, "type": k}, path, refs) for k in kind) + ")"
        if kind not in SUPPORTED:
            self.error(path, f"type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
        self.check_keys(schema, path, SUPPORTED[kind])
        if kind == "object":
            return self.object(schema, path, refs)
        if kind == "array":
            return self.array(schema, path, refs)
        if kind == "string":
            return self.string(schema, path)
        return SCALAR_TYPES[kind]

    def check_keys(self, schema: dict, path: str, allowed: set) -> None:
        for key in schema:
            if key not in allowed and key not in IGNORED and key not in COMMON:
                kind = schema.get("type", "untyped")
                self.error(path, f"keyword {key!r} is not supported for {kind} schemas; supported: "
                                 f"{', '.join(sorted(allowed - {'type'}) or ['-'])} (and enum, const, anyOf, $ref)")

    def ref(self, schema: dict, path: str, refs: tuple) -> str:
        ref = schema["$ref"]
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            self.error(path, f"$ref {ref!r} is not supported; supported: local '#/$defs/NAME' or '#/definitions/NAME'")
        if ref in refs:
            self.error(path, f"$ref {ref!r} is recursive; a recursive schema is not a regular language")
        target = self.root.get(parts[1], {}).get(parts[2])
        if target is None:
            self.error(path, f"$ref {ref!r} names no definition")
        return self.convert(target, ref, refs + (ref,))

    def object(self, schema: dict, path: str, refs: tuple) -> str:
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
                return r"\{\}"
            return any_object(values=None if extra is True else self.convert(extra, f"{path}/additionalProperties", refs))
        if extra is not False:
            self.error(path, "additionalProperties other than false beside properties is not supported "
                             "(only the listed properties are generated)")
        fields = [(literal(name) + KEY_SEP + self.convert(sub, f"{path}/properties/{name}", refs), name in required)
                  for name, sub in props.items()]
        return r"\{" + _members(fields) + r"\}"

    def array(self, schema: dict, path: str, refs: tuple) -> str:
        item = self.convert(schema.get("items", {}), f"{path}/items", refs)
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            self.error(path, f"minItems/maxItems must be integers with 0 <= minItems <= maxItems; got {lo}, {hi}")
        more = "(?:" + ITEM_SEP + item + ")"
        if hi == 0:
            return r"\[\]"
        tail = more + f"{{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        if lo == 0:
            return r"\[(?:" + item + tail + r")?\]"
        return r"\[" + item + tail + r"\]"

    def string(self, schema: dict, path: str) -> str:
        if "pattern" in schema:
            if "minLength" in schema or "maxLength" in schema:
                self.error(path, "pattern together with minLength/maxLength is not supported")
            return '"' + _json_safe_pattern(schema["pattern"], path) + '"'
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            self.error(path, f"minLength/maxLength must be integers with 0 <= minLength <= maxLength; got {lo}, {hi}")
        if lo == 0 and hi is None:
            return STRING
        return '"' + STRING_CHAR + (f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}") + '"'


def _members(fields: list[tuple[str, bool]]) -> str:
    """Object members in order, separated by ITEM_SEP, where optional ones may be missing.
    first(i): members i.. with no separator before the first present one;
    rest(i): members i.., each present one preceded by ITEM_SEP."""
    def rest(i: int) -> str:
        if i == len(fields):
            return ""
        member, required = fields[i]
        sep = "(?:" + ITEM_SEP + member + ")" + ("" if required else "?")
        return sep + rest(i + 1)

    def first(i: int) -> str:
        if i == len(fields):
            return ""
        member, required = fields[i]
        if required:
            return member + rest(i + 1)
        return "(?:" + member + rest(i + 1) + "|" + first(i + 1) + ")"

    return first(0)


def _json_safe_pattern(pattern, path: str) -> str:
    """A JSON-schema pattern, anchored ^...$, whose every character needs no escape in JSON,
    so the regex can sit between quotes as it is."""
    from .regex import parse

    if not isinstance(pattern, str) or not (pattern.startswith("^") and pattern.endswith("$")) or len(pattern) < 2:
        raise ValueError(f"guided json: schema at {path}: pattern {pattern!r} is not supported; supported: an "
                         f"anchored '^...$' pattern (JSON schema patterns match anywhere otherwise)")
    body = pattern[1:-1]

    def sets(node):
        if node[0] == "set":
            yield node[1]
        else:
            for child in (node[1] if node[0] in ("cat", "alt") else [node[1]]):
                yield from sets(child)

    for ranges in sets(parse(body)):
        if any(lo <= c <= hi for lo, hi in ranges for c in (0x22, 0x5C)) or any(lo < 0x20 for lo, _ in ranges):
            raise ValueError(f"guided json: schema at {path}: pattern {pattern!r} can produce a quote, a backslash "
                             f"or a control character, which JSON would have to escape; supported: patterns over "
                             f"characters that need no escape (e.g. [a-z0-9-] rather than . or [^...])")
    return body
