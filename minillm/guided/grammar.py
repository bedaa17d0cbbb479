"""Context-free grammars (lesson 12): EBNF text -> rules -> one byte automaton per rule.

A regex cannot say "as many } as there were {": JSON nests without bound, so a JSON schema with
recursion ($ref to itself), JSON itself, or a grammar a user sends needs a stack. A grammar is a
set of named rules; each rule's right-hand side is a regular expression over bytes AND calls of
other rules. So each rule compiles to an ordinary DFA (regex.py) with one extra column per rule it
calls, and the stack of pushdown.py keeps, per open call, where its caller resumes.

The syntax is llama.cpp's GBNF, which xgrammar (and vLLM's guided_grammar through it) reads too:

    root   ::= "[" (item ("," item)*)? "]"      # the start rule is `root`
    item   ::= [0-9]+ | root                    # a rule may call itself (not on its left edge)

    "text"     a literal (escapes \\n \\t \\r \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH)
    [a-z\\n]    a character class, [^...] negated;  .  any character but newline
    name       a call of that rule;  ( ... )  a group;  a | b  alternatives
    x* x+ x? x{m} x{m,} x{m,n}   repetition;   # to the end of a line is a comment

Checked at compile time, each with an error naming the rule: a call of an undefined rule, a rule
that derives no finite string (`a ::= "x" a`), and left recursion (`a ::= a "x" | "y"`, which
would push forever before reading a byte).
"""
from __future__ import annotations

from dataclasses import dataclass

from .regex import CLASS_ESCAPES, DFA, MAX_REPEAT, _Parser, compile_tree, merge, negate
from .utf8 import MAX_CODE_POINT

START = "root"
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
LITERAL_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "\\": 0x5C, '"': 0x22, "[": 0x5B, "]": 0x5D, "-": 0x2D,
                   "/": 0x2F, "'": 0x27, "b": 0x08, "f": 0x0C, "v": 0x0B, "0": 0x00}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


# ---- parsing: EBNF text -> {name: tree} ---------------------------------------------------

class _EBNF(_Parser):
    """regex.py's parser with whitespace and comments between items, rule names and "literals";
    alternation is inherited (it calls concatenation, which here stops where the next rule starts)."""

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise ValueError(f"a grammar must be EBNF text; got {type(text).__name__}")
        self.p, self.i = text, 0

    def error(self, what: str):
        line = self.p.count("\n", 0, self.i) + 1
        raise ValueError(f"grammar: {what} at line {line} (position {self.i}); expected GBNF rules "
                         f"`name ::= ...` with \"literals\", [classes], rule names, ( ), |, * + ? {{m,n}}")

    def skip(self):
        while self.i < len(self.p):
            c = self.p[self.i]
            if c == "#":
                end = self.p.find("\n", self.i)
                self.i = len(self.p) if end == -1 else end
            elif c.isspace():
                self.i += 1
            else:
                break

    def peek(self) -> str | None:
        self.skip()
        return self.p[self.i] if self.i < len(self.p) else None

    def name(self) -> str:
        self.skip()
        j = self.i
        while j < len(self.p) and self.p[j] in NAME_CHARS:
            j += 1
        if j == self.i:
            self.error("a rule name was expected")
        name, self.i = self.p[self.i:j], j
        return name

    def at_rule_start(self) -> bool:
        """Is the next thing `name ::=` (where the current rule ends)?"""
        save = self.i
        try:
            self.skip()
            j = self.i
            while j < len(self.p) and self.p[j] in NAME_CHARS:
                j += 1
            k = j
            while k < len(self.p) and self.p[k] in " \t":
                k += 1
            return j > self.i and self.p.startswith("::=", k)
        finally:
            self.i = save

    def rules(self) -> dict[str, tuple]:
        out: dict[str, tuple] = {}
        while self.peek() is not None:
            name = self.name()
            self.skip()
            if not self.p.startswith("::=", self.i):
                self.error(f"'::=' was expected after rule name {name!r}")
            self.i += 3
            if name in out:
                self.error(f"rule {name!r} is defined twice")
            out[name] = self.alternation()
        if not out:
            self.error("the grammar has no rules")
        return out

    def concatenation(self):
        parts = []
        while self.peek() not in (None, "|", ")") and not self.at_rule_start():
            parts.append(self.repetition())
        return parts[0] if len(parts) == 1 else ("cat", tuple(parts))

    def repetition(self):
        node = self.atom()
        while self.peek() in ("*", "+", "?", "{"):
            c = self.p[self.i]
            self.i += 1
            if c == "{":
                end = self.p.find("}", self.i)
                lo, comma, hi = (self.p[self.i:end] if end != -1 else "").replace(" ", "").partition(",")
                if end == -1 or not lo.isdigit() or (hi and not hi.isdigit()):
                    self.error("a repetition must read {m}, {m,} or {m,n}")
                self.i = end + 1
                lo, hi = int(lo), (int(hi) if hi else (None if comma else int(lo)))
                if (hi is not None and hi < lo) or max(lo, hi or 0) > MAX_REPEAT:
                    self.error(f"repetition bounds must satisfy m <= n <= {MAX_REPEAT}")
            else:
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            node = ("rep", node, lo, hi)
        return node

    def atom(self):
        c = self.peek()
        if c == "(":
            self.i += 1
            node = self.alternation()
            if self.peek() != ")":
                self.error("missing )")
            self.i += 1
            return node
        if c == '"':
            self.i += 1
            return self.literal()
        if c == "[":
            self.i += 1
            return ("set", self.char_class())
        if c == ".":
            self.i += 1
            return ("set", negate([(0x0A, 0x0A)]))
        if c is not None and c in NAME_CHARS:
            return ("ref", self.name())
        self.error(f"unexpected {c!r}" if c else "unexpected end of grammar")

    def code_point(self) -> int:
        """One character of a literal or class, escapes decoded."""
        if self.i >= len(self.p):
            self.error("unexpected end inside a literal or class")
        c = self.p[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        e = self.p[self.i:self.i + 1]
        self.i += 1
        if e in HEX_ESCAPES:
            digits = self.p[self.i:self.i + HEX_ESCAPES[e]]
            if len(digits) != HEX_ESCAPES[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                self.error(f"\\{e} needs {HEX_ESCAPES[e]} hex digits")
            self.i += len(digits)
            code = int(digits, 16)
            if code > MAX_CODE_POINT:
                self.error(f"\\{e}{digits} is beyond Unicode")
            return code
        if e not in LITERAL_ESCAPES:
            self.error(f"unknown escape \\{e}")
        return LITERAL_ESCAPES[e]

    def literal(self):
        chars = []
        while self.p[self.i:self.i + 1] != '"':
            if self.i >= len(self.p) or self.p[self.i] == "\n":
                self.error("unterminated string literal")
            chars.append(self.code_point())
        self.i += 1
        return ("cat", tuple(("set", ((c, c),)) for c in chars))

    def char_class(self) -> tuple:
        negated = self.p[self.i:self.i + 1] == "^"
        self.i += negated
        ranges = []
        while self.p[self.i:self.i + 1] != "]":
            if self.i >= len(self.p):
                self.error("unterminated character class")
            e = self.p[self.i + 1:self.i + 2]
            if self.p[self.i] == "\\" and e and e.lower() in CLASS_ESCAPES:      # \d \w \s as in a regex
                ranges += negate(CLASS_ESCAPES[e.lower()]) if e.isupper() else CLASS_ESCAPES[e]
                self.i += 2
                continue
            lo = self.code_point()
            if self.p[self.i:self.i + 1] == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.code_point()
                if hi < lo:
                    self.error("a class range must read a-z with a <= z")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        self.i += 1
        if not ranges and not negated:
            self.error("empty character class")
        ranges = merge(ranges)
        return negate(ranges) if negated else ranges


def parse_grammar(text: str) -> dict[str, tuple]:
    """EBNF text -> {rule name: syntax tree} (regex.py's trees plus ("ref", name) leaves)."""
    return _EBNF(text).rules()


# ---- compiling: rules -> checked -> inlined -> one DFA per remaining rule ------------------

@dataclass
class Rule:
    name: str
    dfa: DFA                       # columns 256 + k: after calling callees[k]
    callees: list[int]             # rule ids, by call column

    def calls(self, state: int) -> list[tuple[int, int]]:
        """(callee rule id, state to resume in) for each call the rule can make from `state`."""
        row = self.dfa.transitions[state]
        return [(r, row[256 + k]) for k, r in enumerate(self.callees) if row[256 + k] != self.dfa.dead]


class Grammar:
    """Compiled rules; rule 0 is the start rule.

    A call costs at run time: the stack grows, and a token that crosses the end of a called rule
    depends on the caller (an "uncertain" token, pushdown.py). So rules that are not recursive are
    inlined into their callers at compile time, and of each cycle of rules only one stays a call
    (a loop breaker, preferably one that ends with a fixed byte such as "}"): JSON's string and
    number rules become part of the object's DFA, and only the brackets push."""

    def __init__(self, text: str):
        trees = parse_grammar(text)
        if START not in trees:
            raise ValueError(f"grammar: there is no start rule `{START} ::= ...` (rules: {', '.join(trees)})")
        _check(trees)
        self.text = text
        kept, bodies = _inline(trees)
        names = [START] + [n for n in kept if n != START]
        self.ids = {n: i for i, n in enumerate(names)}
        self._dfas: dict[tuple, DFA] = {}
        self.rules = [self._compile(n, bodies[n]) for n in names]

    def _compile(self, name: str, tree) -> Rule:
        callees: list[int] = []

        def lower(node):                                   # ("ref", name) -> ("call", column)
            kind = node[0]
            if kind == "ref":
                rid = self.ids[node[1]]
                if rid not in callees:
                    callees.append(rid)
                return ("call", callees.index(rid))
            if kind in ("cat", "alt"):
                return (kind, tuple(lower(n) for n in node[1]))
            if kind == "rep":
                return ("rep", lower(node[1]), node[2], node[3])
            return node

        lowered = lower(tree)
        key = (lowered, len(callees))     # rules that differ only in which rules they call share a DFA
        if key not in self._dfas:
            self._dfas[key] = compile_tree(lowered, f"grammar rule {name!r}", len(callees))
        return Rule(name, self._dfas[key], callees)

    def __repr__(self) -> str:
        return f"Grammar({len(self.rules)} rules, {sum(r.dfa.num_states for r in self.rules)} states)"


def _refs(node) -> set[str]:
    kind = node[0]
    if kind == "ref":
        return {node[1]}
    if kind in ("cat", "alt"):
        return set().union(*(_refs(n) for n in node[1]))
    return _refs(node[1]) if kind == "rep" else set()


def _derives(node, done: set[str], empty_only: bool) -> bool:
    """Can node derive a finite string (the empty one, if empty_only) using rules in `done`?"""
    kind = node[0]
    if kind == "set":
        return not empty_only
    if kind == "ref":
        return node[1] in done
    if kind == "cat":
        return all(_derives(n, done, empty_only) for n in node[1])
    if kind == "alt":
        return any(_derives(n, done, empty_only) for n in node[1])
    return node[2] == 0 or _derives(node[1], done, empty_only)


def _fixed_point(trees: dict, empty_only: bool) -> set[str]:
    done: set[str] = set()
    while True:
        new = {n for n, t in trees.items() if n not in done and _derives(t, done, empty_only)}
        if not new:
            return done
        done |= new


def _left_refs(node, nullable: set[str]) -> set[str]:
    """Rules node may call before reading any byte."""
    kind = node[0]
    if kind == "ref":
        return {node[1]}
    if kind == "alt":
        return set().union(*(_left_refs(n, nullable) for n in node[1]))
    if kind == "rep":
        return _left_refs(node[1], nullable) if node[3] != 0 else set()
    out = set()
    for part in node[1] if kind == "cat" else ():
        out |= _left_refs(part, nullable)
        if not _derives(part, nullable, empty_only=True):
            break
    return out


def _check(trees: dict) -> None:
    """Refuse undefined rules, rules that derive nothing and left recursion, naming them."""
    for name, tree in trees.items():
        for ref in sorted(_refs(tree) - set(trees)):
            raise ValueError(f"grammar: rule {name!r} calls {ref!r}, which is not defined")
    productive = _fixed_point(trees, empty_only=False)
    dead = [n for n in trees if n not in productive]
    if dead:
        raise ValueError(f"grammar: rule(s) {', '.join(dead)} derive no finite string (every alternative "
                         f"calls a rule that never ends); give each a base case")
    nullable = _fixed_point(trees, empty_only=True)
    left = {n: _left_refs(t, nullable) for n, t in trees.items()}
    for first in trees:
        cycle = _cycle_through(first, left)
        if cycle:
            raise ValueError(f"grammar: left recursion {' -> '.join(cycle)}: a rule calls itself before reading "
                             f"any byte; rewrite it with repetition (a ::= a \"x\" | \"y\"  is  a ::= \"y\" \"x\"*)")


def _cycle_through(first: str, edges: dict[str, set[str]]) -> list[str] | None:
    """A path first -> ... -> first along edges, or None (breadth first: the shortest)."""
    parent: dict[str, str] = {}
    todo, seen = [first], {first}
    while todo:
        nxt = []
        for n in todo:
            for m in sorted(edges.get(n, ())):
                if m == first:
                    chain = [n]
                    while chain[-1] != first:
                        chain.append(parent[chain[-1]])
                    return chain[::-1] + [first]
                if m not in seen:
                    seen.add(m)
                    parent[m] = n
                    nxt.append(m)
        todo = nxt
    return None


MAX_INLINED_COST = 4_000     # automaton states a rule's inlined body may need before it stays a call
MAX_INLINED_DEPTH = 64       # and nesting (a long chain of small rules is split into calls too)


def _measure(node, stats: dict) -> tuple[int, int]:
    """(cost, depth) of a body: cost ~ the automaton states it builds (a repetition builds its
    copies), depth the nesting; a ref counts with its rule's measured body, in `stats`."""
    kind = node[0]
    if kind == "ref":
        return stats.get(node[1], (1, 1))
    if kind in ("cat", "alt"):
        parts = [_measure(n, stats) for n in node[1]]
        return 1 + sum(c for c, _ in parts), 1 + max((d for _, d in parts), default=0)
    if kind == "rep":
        cost, depth = _measure(node[1], stats)
        return 1 + cost * max(1, node[3] if node[3] is not None else node[2] + 1), 1 + depth
    return len(node[1]), 1


def _ends_with_a_byte(node) -> bool:
    if node[0] == "set":
        return True
    return node[0] == "cat" and bool(node[1]) and _ends_with_a_byte(node[1][-1])


def _split_recursive_alternatives(trees: dict) -> dict:
    """value ::= object | array | number  ->  value ::= value#1 | value#2 | value#3, each option its
    own rule, for every rule on a cycle: the loop breaker can then be the bracketed option
    (object, ending with "}") while the number is inlined where value is called."""
    edges = {n: _refs(t) for n, t in trees.items()}
    out = dict(trees)
    for name, tree in trees.items():
        if tree[0] == "alt" and name != START and _cycle_through(name, edges):
            parts = [f"{name}#{i}" for i in range(len(tree[1]))]
            out.update(zip(parts, tree[1]))
            out[name] = ("alt", tuple(("ref", p) for p in parts))
    return out


def _inline(trees: dict) -> tuple[list[str], dict]:
    """(rules that stay calls, their bodies with every other rule substituted in)."""
    trees = _split_recursive_alternatives(trees)
    edges = {n: _refs(t) for n, t in trees.items()}
    # a loop breaker ends with a fixed byte ("}" rather than a number), so few tokens cross its end
    bracketed = {n for n, t in trees.items() if _ends_with_a_byte(t)}
    kept = {START}
    while True:
        inner = {n: {m for m in e if m not in kept} for n, e in edges.items() if n not in kept}
        cycle = next((c for n in inner if (c := _cycle_through(n, inner))), None)
        if cycle is None:
            break
        kept.add(min(cycle[:-1], key=lambda n: (n not in bracketed, cycle.index(n))))
    bodies: dict[str, tuple] = {}
    stats: dict[str, tuple[int, int]] = {}

    def substitute(node):
        kind = node[0]
        if kind == "ref":
            return node if node[1] in kept else bodies[node[1]]
        if kind in ("cat", "alt"):
            return (kind, tuple(substitute(n) for n in node[1]))
        return ("rep", substitute(node[1]), node[2], node[3]) if kind == "rep" else node

    for name in _callees_first(edges, kept):           # no cycles among the rest: each body once
        bodies[name] = substitute(trees[name])
        cost, depth = _measure(trees[name], stats)
        if name not in kept and (cost > MAX_INLINED_COST or depth > MAX_INLINED_DEPTH):
            kept.add(name)                              # too big to copy into every caller: a call
            stats[name] = (1, 1)
        else:
            stats[name] = (cost, depth)
    out, todo = {}, [START]
    while todo:                                         # the kept rules reachable from the start
        name = todo.pop()
        if name not in out:
            out[name] = bodies[name]
            todo += [m for m in _refs(out[name]) if m not in out]
    return list(out), out


def _callees_first(edges: dict[str, set[str]], kept: set[str]) -> list[str]:
    """Every rule, each after the rules it inlines (a call of a kept rule is not followed: it is
    where the cycles are broken), without recursion, so that long chains of rules are fine."""
    order, state = [], {}
    for root in edges:
        stack = [(root, iter(sorted(edges[root])))]
        if root in state:
            continue
        state[root] = "open"
        while stack:
            name, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                state[name] = "done"
                order.append(name)
            elif child not in kept and child not in state:
                state[child] = "open"
                stack.append((child, iter(sorted(edges[child]))))
    return order


# ---- the definition: a naive matcher over the rule trees (what the automata are tested against) ----

def naive_match(text: str, data: str) -> tuple[bool, bool]:
    """(is `data` in the grammar's language, is it a prefix of something in it), by trying every
    parse: the end positions each node can reach from each position. Exponential in the worst
    case and characters, not bytes: a baseline for short tests, nothing else."""
    trees = parse_grammar(text)
    memo: dict[tuple[str, int], tuple[frozenset, bool]] = {}

    def ends(node, i: int) -> tuple[set, bool]:
        """Positions where `node` can end when started at i; and whether the data ran out while
        `node` could still have read more (then `data` is a prefix)."""
        kind = node[0]
        if kind == "set":
            if i == len(data):
                return set(), True
            c = ord(data[i])
            return ({i + 1} if any(lo <= c <= hi for lo, hi in node[1]) else set()), False
        if kind == "ref":
            key = (node[1], i)
            if key not in memo:
                memo[key] = (frozenset(), False)          # a call of itself at i is left recursion: refused
                got, out = ends(trees[node[1]], i)
                memo[key] = (frozenset(got), out)
            got, out = memo[key]
            return set(got), out
        if kind == "alt":
            got, out = set(), False
            for option in node[1]:
                g, o = ends(option, i)
                got |= g
                out |= o
            return got, out
        if kind == "cat":
            return _sequence(list(node[1]), i)
        _, sub, lo, hi = node                                # ("rep", sub, lo, hi)
        got, out, here, count = ({i} if lo == 0 else set()), False, {i}, 0
        while here and (hi is None or count < hi):
            count += 1
            nxt = set()
            for p in here:
                g, o = ends(sub, p)
                nxt |= g
                out |= o
            here = nxt - (got if count > lo else set()) if hi is None else nxt
            if count >= lo:
                got |= nxt
            if hi is None and count > len(data) + lo + 1:
                break
        return got, out

    def _sequence(parts: list, i: int) -> tuple[set, bool]:
        here, out = {i}, False
        for part in parts:
            nxt = set()
            for p in here:
                g, o = ends(part, p)
                nxt |= g
                out |= o
            here = nxt
        return here, out

    got, out = ends(("ref", START), 0)
    return len(data) in got, out or len(data) in got
