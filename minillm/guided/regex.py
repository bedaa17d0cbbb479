"""A small regular-expression engine: pattern -> syntax tree -> NFA -> DFA over UTF-8 bytes.

The supported subset (enough for JSON schemas, choices and everyday patterns):

    abc          literals (any character, including non-ASCII)
    \\. \\* \\\\ ...  an escaped punctuation character is itself
    \\n \\t \\r \\f \\v  control characters;  \\xHH and \\uHHHH by code point
    \\d \\w \\s       ASCII digit [0-9], word [A-Za-z0-9_], space [ \\t\\n\\r\\f\\v] (and \\D \\W \\S)
    [a-z0-9_] [^"]  classes and negated classes (a negated class holds every other character
                    of Unicode, newline included)
    .            any character except newline
    * + ? {m} {m,} {m,n}   greedy repetition (m, n <= MAX_REPEAT)
    a|b  (ab)  (?:ab)      alternation and groups (groups do not capture)

The whole string must match (there are no anchors: ^ and $ are refused, as are lazy
quantifiers, backreferences and lookaround, which a DFA cannot express or does not need).

Why bytes, not characters: SmolLM2's tokenizer is byte-level BPE, so a token may end in the
middle of a character (the 3-byte "€" can be split over two tokens). A DFA over characters
could not say whether such a token is allowed. A DFA over UTF-8 bytes can: a token is a byte
string, and walking its bytes through the DFA is exact whatever character boundaries it
crosses. Each character class becomes byte-range sequences (minillm/guided/utf8.py), so the
byte DFA accepts exactly the UTF-8 encodings of the strings the pattern matches.

Pipeline: parse() builds a tree of ("set", ranges) / ("cat", parts) / ("alt", options) /
("rep", node, min, max); _NFA builds Thompson's construction (epsilon moves plus byte-range
edges); determinize() is the subset construction (each DFA state = the set of NFA states the
input could be in), then every state from which no accepting state can be reached is merged
into one dead state and equivalent states are merged (Moore's partition refinement), so
later per-state work (token masks) is done once per distinct future.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .utf8 import MAX_CODE_POINT, utf8_sequences

MAX_REPEAT = 1000            # {m,n} bounds: each repeat copies the sub-automaton
MAX_NFA_STATES = 200_000     # refuse patterns whose automaton would not fit a few MB
MAX_DFA_STATES = 20_000

DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = ((0x09, 0x0D), (0x20, 0x20))
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
META = set("\\.^$|?*+()[]{}")


def escape(text: str) -> str:
    """A pattern that matches `text` literally."""
    return "".join("\\" + c if c in META else c for c in text)


def negate(ranges) -> tuple:
    """Every code point not in ranges (sorted, merged)."""
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


def merge(ranges) -> tuple:
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


# ---- parsing: pattern -> tree -------------------------------------------------------------

class _Parser:
    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise ValueError(f"a regex must be a string; got {type(pattern).__name__}")
        self.p, self.i = pattern, 0

    def error(self, what: str):
        raise ValueError(f"regex {self.p!r}: {what} at position {self.i}; supported: literals, escapes, "
                         f"[classes], ., * + ? {{m,n}}, | and (groups); the whole string must match")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.peek()
        if c is None:
            self.error("unexpected end of pattern")
        self.i += 1
        return c

    def parse(self):
        tree = self.alternation()
        if self.peek() is not None:
            self.error(f"unbalanced {self.peek()!r}")
        return tree

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else ("alt", tuple(options))

    def concatenation(self):
        parts = []
        while self.peek() not in (None, "|", ")"):
            parts.append(self.repetition())
        return parts[0] if len(parts) == 1 else ("cat", tuple(parts))

    def repetition(self):
        node = self.atom()
        if self.peek() in ("*", "+", "?", "{"):
            c = self.take()
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(c) or self.bounds()
            if self.peek() in ("?", "+"):
                self.error("lazy and possessive quantifiers are not supported")
            node = ("rep", node, lo, hi)
        return node

    def bounds(self) -> tuple[int, int | None]:
        end = self.p.find("}", self.i)
        body = self.p[self.i:end] if end != -1 else ""
        lo, comma, hi = body.partition(",")
        if end == -1 or not lo.isdigit() or (hi and not hi.isdigit()):
            self.error("a repetition must read {m}, {m,} or {m,n}")
        self.i = end + 1
        lo, hi = int(lo), (int(hi) if hi else (None if comma else int(lo)))
        if (hi is not None and hi < lo) or max(lo, hi or 0) > MAX_REPEAT:
            self.error(f"repetition bounds must satisfy m <= n <= {MAX_REPEAT}")
        return lo, hi

    def atom(self):
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.error("only non-capturing groups (?:...) are supported")
            node = self.alternation()
            if self.peek() != ")":
                self.error("missing )")
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", negate([(0x0A, 0x0A)]))
        if c == "\\":
            return ("set", self.escape_ranges())
        if c in "^$":
            self.error("anchors are not supported (the whole string always has to match)")
        if c in "*+?{":
            self.error(f"nothing to repeat before {c!r}")
        if c in ")]}":
            self.error(f"unbalanced {c!r}")
        return ("set", ((ord(c), ord(c)),))

    def escape_ranges(self) -> tuple:
        c = self.take()
        if c.lower() in CLASS_ESCAPES:
            ranges = CLASS_ESCAPES[c.lower()]
            return negate(ranges) if c.isupper() else ranges
        if c in CONTROL_ESCAPES:
            code = ord(CONTROL_ESCAPES[c])
        elif c in ("x", "u"):
            digits = self.p[self.i:self.i + (2 if c == "x" else 4)]
            if len(digits) != (2 if c == "x" else 4) or not all(d in "0123456789abcdefABCDEF" for d in digits):
                self.error(f"\\{c} needs {2 if c == 'x' else 4} hex digits")
            self.i += len(digits)
            code = int(digits, 16)
        elif not c.isalnum():
            code = ord(c)
        else:
            self.error(f"unknown escape \\{c}")
        return ((code, code),)

    def char_class(self) -> tuple:
        negated = self.peek() == "^"
        self.i += negated
        ranges = []
        while True:
            c = self.take()
            if c == "]" and ranges:
                break
            if c == "]":
                self.error("empty class (write \\] for a literal ])")
            lo_ranges = self.escape_ranges() if c == "\\" else ((ord(c), ord(c)),)
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", "") and len(lo_ranges) == 1 \
                    and lo_ranges[0][0] == lo_ranges[0][1]:
                self.i += 1
                d = self.take()
                hi_ranges = self.escape_ranges() if d == "\\" else ((ord(d), ord(d)),)
                lo, hi = lo_ranges[0][0], hi_ranges[0][1]
                if len(hi_ranges) != 1 or hi_ranges[0][0] != hi or hi < lo:
                    self.error("a class range must read a-z with a <= z")
                ranges.append((lo, hi))
            else:
                ranges += lo_ranges
        ranges = merge(ranges)
        return negate(ranges) if negated else ranges


def parse(pattern: str):
    """pattern -> syntax tree; ValueError naming the position of anything unsupported."""
    return _Parser(pattern).parse()


# ---- Thompson's construction: tree -> NFA over bytes -------------------------------------

class _NFA:
    def __init__(self, pattern: str):
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []       # (byte lo, byte hi, target)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise ValueError(f"{self.pattern} is too large: its automaton exceeds {MAX_NFA_STATES} "
                             f"states; use smaller repetition bounds")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        """A fragment (entry, exit) matching node."""
        kind = node[0]
        start, end = self.state(), self.state()
        if kind == "call":                      # a grammar rule's call of another rule (grammar.py): one symbol
            self.edges[start].append((256 + node[1], 256 + node[1], end))
        elif kind == "set":
            for seq in (s for lo, hi in node[1] for s in utf8_sequences(lo, hi)):
                at = start
                for i, (blo, bhi) in enumerate(seq):
                    nxt = end if i == len(seq) - 1 else self.state()
                    self.edges[at].append((blo, bhi, nxt))
                    at = nxt
        elif kind == "cat":
            at = start
            for part in node[1]:
                a, b = self.build(part)
                self.eps[at].append(a)
                at = b
            self.eps[at].append(end)
        elif kind == "alt":
            for option in node[1]:
                a, b = self.build(option)
                self.eps[start].append(a)
                self.eps[b].append(end)
        else:                                   # ("rep", node, lo, hi): lo copies, then optional ones
            _, sub, lo, hi = node
            at = start
            for _ in range(lo):
                a, b = self.build(sub)
                self.eps[at].append(a)
                at = b
            if hi is None:                      # a loop: sub*
                a, b = self.build(sub)
                self.eps[at] += [a, end]
                self.eps[b] += [a, end]
            else:                               # nested optionals: (sub(sub)?)? ; each may stop early
                for _ in range(hi - lo):
                    a, b = self.build(sub)
                    self.eps[at] += [a, end]
                    at = b
                self.eps[at].append(end)
        return start, end


# ---- subset construction: NFA -> DFA -----------------------------------------------------

@dataclass
class DFA:
    """A complete DFA over bytes: transitions[s][b] is the next state; `dead` loops to itself and
    is the only state from which no accepting state can be reached. A grammar rule's DFA
    (grammar.py) has one more column per rule it calls: transitions[s][256 + k] is where the
    rule continues after its k-th callee has matched."""
    transitions: list[list[int]]
    accepting: list[bool]
    start: int
    dead: int

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = self.transitions[state][b]
        return state

    def matches(self, text: str) -> bool:
        return self.accepting[self.walk(self.start, text.encode())]


def compile_regex(pattern: str) -> DFA:
    """pattern -> DFA over UTF-8 bytes (ValueError for anything outside the supported subset)."""
    return compile_tree(parse(pattern), f"regex {pattern[:80]!r}")


def compile_tree(tree, name: str, num_calls: int = 0) -> DFA:
    """A syntax tree (with ("call", k) leaves, k < num_calls, for a grammar rule) -> its DFA;
    `name` says what it is in errors."""
    nfa = _NFA(name)
    start, end = nfa.build(tree)
    return _determinize(nfa, start, end, 256 + num_calls)


def _determinize(nfa: _NFA, start: int, end: int, width: int) -> DFA:
    closures: dict[frozenset, frozenset] = {}

    def closure(states: frozenset) -> frozenset:
        if states not in closures:
            seen, todo = set(states), list(states)
            while todo:
                for t in nfa.eps[todo.pop()]:
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            closures[states] = frozenset(seen)
        return closures[states]

    first = closure(frozenset([start]))
    index, order, rows = {first: 0}, [first], []
    while len(rows) < len(order):
        moves: dict[int, set] = {}
        for s in order[len(rows)]:
            for lo, hi, t in nfa.edges[s]:
                for b in range(lo, hi + 1):
                    moves.setdefault(b, set()).add(t)
        row = [-1] * width                      # -1: no move (the dead state, numbered below)
        for b, targets in moves.items():
            nxt = closure(frozenset(targets))
            if nxt not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"{nfa.pattern} is too large: its DFA exceeds {MAX_DFA_STATES} "
                                     f"states")
                index[nxt] = len(order)
                order.append(nxt)
            row[b] = index[nxt]
        rows.append(row)
    accepting = [end in s for s in order]
    return _prune(rows, accepting)


def _prune(rows: list[list[int]], accepting: list[bool]) -> DFA:
    """Merge the states that cannot reach acceptance into one dead state (the last index)."""
    n = len(rows)
    incoming: list[set] = [set() for _ in range(n)]
    for s, row in enumerate(rows):
        for t in row:
            if t >= 0:
                incoming[t].add(s)
    live = {s for s in range(n) if accepting[s]}
    todo = list(live)
    while todo:
        for s in incoming[todo.pop()]:
            if s not in live:
                live.add(s)
                todo.append(s)
    if 0 not in live:                           # the pattern matches nothing at all
        return DFA([[0] * len(rows[0])], [False], start=0, dead=0)
    keep = sorted(live)
    new = {s: i for i, s in enumerate(keep)}
    dead = len(keep)
    transitions = [[new.get(t, dead) for t in rows[s]] for s in keep] + [[dead] * len(rows[0])]
    return _minimize(transitions, [accepting[s] for s in keep] + [False])


def _minimize(transitions: list[list[int]], accepting: list[bool]) -> DFA:
    """Moore's algorithm: start from {accepting, not}, split classes by where each byte leads
    until stable; each final class is one state. Each round is one vectorised pass: a state's
    signature is its class and the classes of its 256 successors. The start state keeps number 0."""
    table = torch.tensor(transitions)                                    # (S, 256)
    cls = torch.tensor(accepting, dtype=torch.long)                      # (S,)
    count = len(set(accepting))
    while True:
        signature = torch.cat([cls[:, None], cls[table]], dim=1)         # (S, 257)
        cls = torch.unique(signature, dim=0, return_inverse=True)[1]     # (S,)
        new_count = int(cls.max()) + 1
        if new_count == count:
            break
        count = new_count
    first_seen: dict[int, int] = {}                                      # renumber by first state: start is 0
    number = [first_seen.setdefault(c, len(first_seen)) for c in cls.tolist()]
    rows, accept = [None] * count, [False] * count
    for s, row in enumerate(transitions):
        if rows[number[s]] is None:
            rows[number[s]] = [number[t] for t in row]
            accept[number[s]] = accepting[s]
    return DFA(rows, accept, start=0, dead=number[len(transitions) - 1])
