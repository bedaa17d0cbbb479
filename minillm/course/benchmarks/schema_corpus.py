"""A corpus of JSON schemas and documents for checking a structured-output engine (lesson 12):
the schemas cover what OpenAI's structured outputs accept (nesting, recursion, numeric ranges,
formats, patterns, prefixItems, enums, anyOf); the documents are generated from each schema
(valid ones by a random walk of the schema, invalid ones by adversarial edits of valid ones:
one past a bound, a calendar date that does not exist, a leading zero, a missing or extra key,
one item too many, a wrong type, a truncated text). jsonschema (with its format checker) is the
judge of which is which, in json.dumps's layout (the one minillm generates: a text in another
layout counts as invalid). Objects with properties say additionalProperties: false, as OpenAI's
strict mode requires (minillm generates only the listed keys either way).

    for name, schema in SCHEMAS.items():
        for text, valid in documents(schema, seed): ...
"""
from __future__ import annotations

import datetime
import copy
import json
import random
import re
import string
import uuid

from minillm.guided.regex import parse

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}},
        "required": ["name", "age"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}, "starts": {"type": "string", "format": "time"},
        "created": {"type": "string", "format": "date-time"}, "id": {"type": "string", "format": "uuid"},
        "host": {"type": "string", "format": "ipv4"}},
        "required": ["day", "starts", "created", "id", "host"], "additionalProperties": False},
    "tree": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
        "required": ["name", "children"], "additionalProperties": False}}},
    "expression": {"anyOf": [{"type": "integer", "minimum": -99, "maximum": 99}, {
        "type": "object", "properties": {"op": {"enum": ["+", "-", "*"]}, "left": {"$ref": "#"},
                                         "right": {"$ref": "#"}}, "required": ["op", "left", "right"],
        "additionalProperties": False}]},
    "point": {"type": "object", "properties": {
        "xy": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False,
               "minItems": 2},
        "label": {"type": ["string", "null"]}}, "required": ["xy"], "additionalProperties": False},
    "measure": {"type": "object", "properties": {
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
        "celsius": {"type": "number", "minimum": -40.5, "maximum": 50},
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000}},
        "required": ["score", "celsius", "count"], "additionalProperties": False},
    "codes": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "slug": {"type": "string", "pattern": "^[a-z0-9]+(-[a-z0-9]+)*$", "minLength": 3, "maxLength": 16},
        "note": {"type": "string", "pattern": "ok"}},
        "required": ["sku", "slug", "note"], "additionalProperties": False},
    "inventory": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                                          "maxItems": 3}, "minItems": 1, "maxItems": 3},
    "status": {"type": "object", "properties": {
        "state": {"enum": ["on", "off", 0, None, True]}, "version": {"const": "v1"},
        "owner": {"type": ["string", "null"]}},
        "required": ["state", "version"], "additionalProperties": False},
    "anything": {},
}
STRING_CHARS = string.ascii_letters + string.digits + ' -_.,!?"\\/\n\té€日😀'


class _Writer:
    """Random instances of a schema (the keywords json_schema.py supports)."""

    def __init__(self, root: dict, rng: random.Random):
        self.root, self.rng = root, rng

    def value(self, schema, depth: int = 0):
        r = self.rng
        if schema is True or schema == {}:
            return self.any(depth)
        if "$ref" in schema:
            ref = schema["$ref"]
            return self.value(self.root if ref == "#" else self.root[ref.split("/")[1]][ref.split("/")[2]], depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return r.choice(schema["enum"])
        if "anyOf" in schema:
            options = schema["anyOf"]
            return self.value(options[0] if depth > 3 else r.choice(options), depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.value({**schema, "type": r.choice(kind)}, depth)
        if kind == "object":
            props = schema.get("properties")
            if props is None:
                return {self.text(8): self.value(schema.get("additionalProperties", {}), depth + 1)
                        for _ in range(r.randint(0, 3))}
            required = schema.get("required", [])
            return {k: self.value(s, depth + 1) for k, s in props.items() if k in required or r.random() < 0.6}
        if kind == "array":
            prefix = schema.get("prefixItems", [])
            lo, hi = schema.get("minItems", 0), schema.get("maxItems", len(prefix) + 3)
            if schema.get("items") is False:
                hi = min(hi, len(prefix))
            n = r.randint(lo, hi) if depth < 4 else lo
            items = schema.get("items", {})
            return [self.value(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(n)]
        if kind == "string":
            if "format" in schema:
                return self.formatted(schema["format"])
            if "pattern" in schema:
                return self.matching(schema)
            return self.text(r.randint(schema.get("minLength", 0), schema.get("maxLength", 12)))
        if kind == "integer":
            lo = schema.get("minimum", schema.get("exclusiveMinimum", -10 ** 6 - 1) + 1)
            hi = schema.get("maximum", schema.get("exclusiveMaximum", 10 ** 6 + 1) - 1)
            return r.choice([lo, hi, r.randint(lo, hi)])
        if kind == "number":
            lo = schema.get("minimum", schema.get("exclusiveMinimum", -1000))
            hi = schema.get("maximum", schema.get("exclusiveMaximum", 1000))
            v = round(r.uniform(lo, hi), r.choice([0, 1, 2, 3]))
            return v if (("exclusiveMinimum" not in schema or v > lo) and ("exclusiveMaximum" not in schema or v < hi)
                         and lo <= v <= hi) else schema.get("maximum", (lo + hi) / 2)
        if kind == "boolean":
            return r.random() < 0.5
        return None

    def any(self, depth: int):
        r = self.rng
        kinds = ["string", "int", "float", "bool", "null"] + (["list", "dict"] * 2 if depth < 3 else [])
        kind = r.choice(kinds)
        if kind == "list":
            return [self.any(depth + 1) for _ in range(r.randint(0, 3))]
        if kind == "dict":
            return {self.text(5): self.any(depth + 1) for _ in range(r.randint(0, 3))}
        return {"string": lambda: self.text(6), "int": lambda: r.randint(-999, 999),
                "float": lambda: round(r.uniform(-99, 99), 2), "bool": lambda: r.random() < 0.5,
                "null": lambda: None}[kind]()

    def text(self, n: int) -> str:
        return "".join(self.rng.choice(STRING_CHARS) for _ in range(n))

    def formatted(self, fmt: str) -> str:
        r = self.rng
        day = datetime.date(1900, 1, 1) + datetime.timedelta(days=r.randint(0, 200 * 365))
        clock = f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}" + r.choice(["", ".5", ".123"])
        zone = r.choice(["Z", "+01:00", "-08:30"])
        return {"date": day.isoformat(), "time": clock + zone, "date-time": f"{day.isoformat()}T{clock}{zone}",
                "uuid": str(uuid.UUID(int=r.getrandbits(128))),
                "ipv4": ".".join(str(r.randint(0, 255)) for _ in range(4)),
                "email": f"{self.word()}.{self.word()}@{self.word()}.{r.choice(['com', 'org', 'co.uk'])}"}[fmt]

    def word(self) -> str:
        return "".join(self.rng.choice(string.ascii_lowercase) for _ in range(self.rng.randint(1, 6)))

    def matching(self, schema: dict) -> str:
        """A random string the pattern matches and the lengths allow (rejection sampling)."""
        pattern = schema["pattern"]
        body = pattern.lstrip("^").rstrip("$")
        tree = parse(body)
        for _ in range(200):
            s = self.from_tree(tree)
            if not pattern.startswith("^"):
                s = self.word() + s
            if not pattern.endswith("$"):
                s += self.word()
            if schema.get("minLength", 0) <= len(s) <= schema.get("maxLength", 10 ** 9):
                return s
        raise ValueError(f"no sample of {pattern!r} fits the lengths")

    def from_tree(self, node) -> str:
        r, kind = self.rng, node[0]
        if kind == "set":
            lo, hi = r.choice(node[1])
            return chr(r.randint(lo, min(hi, lo + 100)))
        if kind == "cat":
            return "".join(self.from_tree(n) for n in node[1])
        if kind == "alt":
            return self.from_tree(r.choice(node[1]))
        _, sub, lo, hi = node
        return "".join(self.from_tree(sub) for _ in range(r.randint(lo, hi if hi is not None else lo + 3)))


def _edits(doc, schema, rng: random.Random) -> list:
    """Adversarial variants of a valid document (most invalid; jsonschema decides)."""
    out = []
    if isinstance(doc, dict):
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        for key in list(doc)[:3]:
            out.append({k: v for k, v in doc.items() if k != key})                     # a key missing
            sub = props.get(key, {})
            for bad in _bad_values(doc[key], sub):
                out.append({**doc, key: bad})
        out.append({**doc, "unexpected": 1})                                          # an extra key
    if isinstance(doc, list):
        out += [doc + doc[:1] * 3, doc[:-1], doc + ["x"]]                            # counts, a wrong type
    out += ["text", 3.5, None]
    return out


def _bad_values(value, schema: dict) -> list:
    out = []
    if isinstance(value, bool) or value is None:
        return ["true", 0]
    if isinstance(value, int):
        out += [schema.get("minimum", 0) - 1, schema.get("maximum", 0) + 1, schema.get("exclusiveMinimum", 0),
                schema.get("exclusiveMaximum", 0), str(value), value + 0.5]
    elif isinstance(value, float):
        out += [schema.get("maximum", 0) + 0.001, schema.get("minimum", 0) - 0.5, schema.get("exclusiveMinimum", 0),
                str(value)]
    elif isinstance(value, str):
        fmt = schema.get("format")
        out += {"date": ["2023-02-29", "2024-04-31", "2024-13-01", "24-01-01"],
                "time": ["24:00:00Z", "12:00:00", "12:60:00Z"],
                "date-time": ["2023-02-29T10:00:00Z", "2024-01-01 10:00:00Z"],
                "uuid": [value[:-1] + "g", value.replace("-", "")],
                "ipv4": ["256.1.1.1", "01.2.3.4", "1.2.3"],
                "email": ["no-at-sign", "a@b", "@x.com"]}.get(fmt, [])
        if "pattern" in schema:
            out += [value + "!", value[1:], "", value.lower() + "a" * 20]
        if "maxLength" in schema:
            out.append(value + "z" * (schema["maxLength"] + 1 - len(value)))
        out.append(7)
    elif isinstance(value, list):
        out += [value + value[:1] * 4, [], [[]] if value else ["x"]]
    elif isinstance(value, dict):
        out += [{}, {"x": "y"}]
    return out


EMAIL = re.compile(r"[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+(\.[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+)*"
                   r"@[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*")


def format_checker():
    """jsonschema's 2020-12 format checker, with "email" held to RFC 5321's dot-atom @ domain
    (jsonschema's own check is only that an "@" occurs, so it passes "@x.com")."""
    import jsonschema

    checker = copy.deepcopy(jsonschema.Draft202012Validator.FORMAT_CHECKER)
    checker.checks("email")(lambda s: not isinstance(s, str) or EMAIL.fullmatch(s) is not None)
    return checker


def documents(schema: dict, seed: int, valid_count: int = 12) -> list[tuple[str, bool]]:
    """(JSON text, valid) pairs: generated documents, their adversarial edits and texts that are
    not JSON in our layout (cut short, a trailing comma, a leading zero, a raw newline). Valid:
    it parses, json.dumps writes it back the same, and jsonschema accepts it."""
    import jsonschema

    checker = jsonschema.Draft202012Validator(schema, format_checker=format_checker())

    def judge(text: str) -> bool:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            return False
        return json.dumps(doc, ensure_ascii=False) == text and checker.is_valid(doc)

    rng = random.Random(seed)
    writer = _Writer(schema, rng)
    texts: list[str] = []
    for _ in range(valid_count):
        doc = writer.value(schema)
        text = json.dumps(doc, ensure_ascii=False)
        texts += [text] + [json.dumps(bad, ensure_ascii=False) for bad in _edits(doc, schema, rng)]
        texts += [text[:len(text) // 2],                                                  # cut short
                  text.replace("]", ", ]", 1).replace("}", ", }", 1) if "]" in text or "}" in text else text + ",",
                  text.replace(": 1", ": 01", 1) if ": 1" in text else "01",            # a leading zero
                  text.replace('"', '"\n', 1)]                                          # a raw newline in a string
    return [(t, judge(t)) for t in dict.fromkeys(texts)]
