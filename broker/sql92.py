"""RocketMQ 4.9.8's SQL92 message selector (MessageSelector.bySql): parse once, evaluate per message.

Pure: text in, a ``Selector`` out; ``Selector.evaluate(properties)`` on a message's properties (TAGS
among them) gives True, False or None (unknown). A message matches only on True, and a message whose
evaluation raises ``SelectorEvalError`` does not match (ExpressionMessageFilter logs and skips it).

Grammar (filter/.../SelectorParser.jj), loosest first; keywords are case-insensitive:

    or          and (OR and)*
    and         equality (AND equality)*
    equality    comparison ( = comparison | <> comparison | IS NULL | IS NOT NULL )*
    comparison  unary ( > unary | >= unary | < unary | <= unary | [NOT] BETWEEN unary AND unary
                      | [NOT] IN ( 'str' [, 'str']* ) )*
    unary       + unary | - unary | NOT unary | primary       (NOT binds tighter than =: write NOT (a = 1))
    primary     'string' ('' is a quote) | 123 | 123L | 1.5 | .5e3 | TRUE | FALSE | NULL | name | ( or )

Values are Java's: a property is a String (or null when absent); 123 is an Integer, past 2**31-1 a
Long; 1.5 a Double (0.0 and values that round to 0 or infinity are refused, as RocketMQ does). A
String compared with a number is parsed as that number's type (Integer.valueOf, Long.valueOf,
Double.valueOf), and one that does not parse is an evaluation error; two Strings are ordered as
Doubles; a Boolean against anything else but a String compares as "less". Logic is three-valued.

Deviations, each one an error where RocketMQ answers something quietly wrong: input left after a
complete expression is refused (RocketMQ ignores it: ``a = 1 b = 2`` meant ``a = 1``), and hostile
input is bounded (MAX_LENGTH characters, MAX_DEPTH nesting, MAX_OPERATORS operators).
"""
from __future__ import annotations

import functools
import math
import re
import struct

from .javanum import java_int

MAX_LENGTH = 16 * 1024      # characters; an IN list of a few hundred ids fits
MAX_DEPTH = 64              # nested parentheses and prefix operators: bounds the parser's and evaluator's recursion
MAX_OPERATORS = 256         # comparisons and logic per expression: bounds the work per message scanned
_INT_MAX = (1 << 31) - 1
_LONG_MAX = (1 << 63) - 1
_DOUBLE_MAX = 1.7976931348623157e308
_DOUBLE_MIN = 5e-324        # Java's Double.MIN_VALUE, the smallest positive double


class SelectorError(ValueError):
    """The expression does not parse (SUBSCRIPTION_PARSE_FAILED); says what and where."""


class SelectorEvalError(ValueError):
    """A message's values could not be compared (a property that is not a number compared with one)."""


class Long(int):
    """Java's Long, kept apart from Integer: a String compared with it is parsed by Long.valueOf."""
    __slots__ = ()


# ------------------------------------------------------------------ Java conversions (ComparisonExpression)
# Each run of digits can match one way only ("1." then digits, never "1" "1"): a property of 30,000 digits
# and an "x" otherwise backtracked quadratically, seconds per comparison on the event loop.
_JAVA_DOUBLE = re.compile(r"[+-]?(?:NaN|Infinity|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[fFdD]?)")
_JAVA_HEX_DOUBLE = re.compile(r"[+-]?0[xX](?:[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)[pP][+-]?[0-9]+[fFdD]?")
_JAVA_TRIM = "".join(map(chr, range(33)))      # String.trim: every char <= U+0020
_BITS = struct.Struct(">q")
_DOUBLE = struct.Struct(">d")


def _java_integer(text: str, limit: int) -> int:
    # (javanum's: no more than a Long's 19 digits reach int(), which refuses over 4300 with a plain ValueError: such
    # a value stopped every pull of its queue with a SYSTEM_ERROR instead of being passed over)
    if len(text) < 10 and text.isascii() and text.isdigit():    # the usual case: fits an Integer, no sign
        return int(text)
    value = java_int(text, 32 if limit == _INT_MAX else 64)
    if value.__class__ is int:
        return value
    raise SelectorEvalError(f"For input string: {text!r} (not {'a Long' if limit > _INT_MAX else 'an Integer'})")


def _java_double(text: str) -> float:
    s = text.strip(_JAVA_TRIM)
    if _JAVA_DOUBLE.fullmatch(s):
        s = s.rstrip("fFdD") if s[-1] not in "yN" else s    # Infinity / NaN end in y / N
        return float(s)
    if _JAVA_HEX_DOUBLE.fullmatch(s):
        try:
            return float.fromhex(s.rstrip("fFdD"))
        except OverflowError:       # Java rounds past Double.MAX_VALUE to infinity; Python refuses
            return -math.inf if s[0] == "-" else math.inf
    raise SelectorEvalError(f"For input string: {text!r} (not a Double)")


def _double_compare(a: float, b: float) -> int:
    """Double.compare: NaN equals itself and is above everything, -0.0 is below 0.0."""
    if a < b:
        return -1
    if a > b:
        return 1
    x = _BITS.unpack(_DOUBLE.pack(math.nan if a != a else a))[0]
    y = _BITS.unpack(_DOUBLE.pack(math.nan if b != b else b))[0]
    return (x > y) - (x < y)


def _compare(lv, rv) -> int:
    """ComparisonExpression.__compare with convertStringExpressions on: bring both to one type, compare."""
    lt, rt = type(lv), type(rv)
    if lt is not rt:
        if lt is bool:
            if rt is str:       # Java casts the Boolean to String here: ClassCastException
                raise SelectorEvalError(f"a Boolean cannot be compared with the String {rv!r}")
            return -1
        if lt is str:
            if rt is bool:
                lv = lv.lower() == "true"           # Boolean.valueOf
            elif rt is int:
                lv = _java_integer(lv, _INT_MAX)
            elif rt is Long:
                lv = _java_integer(lv, _LONG_MAX)
            else:
                lv = _java_double(lv)
        elif rt is str:         # a number on the left: the String becomes its type
            rv = _java_double(rv) if lt is float else _java_integer(rv, _INT_MAX if lt is int else _LONG_MAX)
        elif rt is bool:
            return -1
        elif lt is float or rt is float:
            lv, rv = float(lv), float(rv)           # int or Long to double, rounded as Java does
    if type(lv) is float:
        return _double_compare(lv, rv)
    return (lv > rv) - (lv < rv)


# ------------------------------------------------------------------ expression nodes
# kind: "const" (ConstantExpression: a number or String), "bool_const" (TRUE, FALSE, NULL), "prop"
# (PropertyExpression), "bool" (any other BooleanExpression), "value" (a negation: a number or null).
class _Node:
    __slots__ = ("kind", "fn", "value", "name", "depth", "terms")

    def __init__(self, kind, fn, depth=1, value=None, name=None, terms=None):
        self.kind, self.fn, self.depth, self.value, self.name, self.terms = kind, fn, depth, value, name, terms

    @property
    def constant(self) -> bool:
        return self.kind in ("const", "bool_const")


def _const(value, kind="const") -> _Node:
    return _Node(kind, lambda props: value, value=value)


def _prop(name: str) -> _Node:
    return _Node("prop", lambda props: props.get(name), name=name)


def _describe(node: _Node) -> str:
    if node.kind == "prop":
        return node.name
    if node.constant:
        v = node.value
        return "NULL" if v is None else ("TRUE" if v else "FALSE") if type(v) is bool else repr(v)
    return "a comparison" if node.kind == "bool" else "a negation"


def _as_boolean(node: _Node) -> _Node:
    """asBooleanExpression: a property is cast (true only if it holds a Boolean, which a String never is)."""
    if node.kind in ("bool", "bool_const"):
        return node
    if node.kind == "prop":
        get = node.fn
        return _Node("bool", lambda props: None if get(props) is None else False, node.depth + 1)
    raise SelectorError(f"{_describe(node)} will not result in a boolean value")


def _logic(op: str, left: _Node, right: _Node) -> _Node:
    """AND / OR (LogicExpression), three-valued, left to right, stopping at the first deciding value. A
    chain is one node, so a long one costs no recursion (Kleene logic is associative)."""
    left, right = _as_boolean(left), _as_boolean(right)
    terms = [*(left.terms if left.terms and left.terms[0] == op else (op, left))[1:],
             *(right.terms if right.terms and right.terms[0] == op else (op, right))[1:]]
    fns = tuple(t.fn for t in terms)
    decide = op == "OR"         # OR stops at True, AND at False

    def fn(props):
        unknown = False
        for f in fns:
            v = f(props)
            if v is decide:
                return decide
            if v is None:
                unknown = True
        return None if unknown else not decide
    return _Node("bool", fn, max(t.depth for t in terms) + 1, terms=(op, *terms))


def _not(node: _Node) -> _Node:
    f = _as_boolean(node).fn
    return _Node("bool", lambda props: None if (v := f(props)) is None else not v, node.depth + 1)


def _negate(node: _Node) -> _Node:
    f = node.fn

    def fn(props):
        v = f(props)
        t = type(v)
        if t is int or t is float:
            return -v
        return Long(-v) if t is Long else None      # a String, a Boolean or null: null
    return _Node("value", fn, node.depth + 1)


# A property's String compared with a constant of each type becomes that type (__compare's conversions).
_CONVERT = {int: lambda s: _java_integer(s, _INT_MAX), Long: lambda s: _java_integer(s, _LONG_MAX),
            float: _java_double, str: lambda s: s}


def _against_constant(left: _Node, right: _Node):
    """(property name, constant, its converter, constant on the left) when one side is a property and the
    other a number or String constant, else None: the common case, compared without _compare's dispatch (and
    the property read with one dict look-up, not through its node's function)."""
    for prop, const, const_left in ((left, right, False), (right, left, True)):
        if prop.kind == "prop" and const.kind == "const" and type(const.value) in _CONVERT:
            return prop.name, const.value, _CONVERT[type(const.value)], const_left
    return None


def _sign(a, b) -> int:
    return _double_compare(a, b) if type(a) is float else (a > b) - (a < b)


def _equal(left: _Node, right: _Node) -> _Node:
    """doCreateEqual: both null is TRUE; a null left is unknown, a null right (the left not null) FALSE."""
    fast = _against_constant(left, right)
    if fast is not None:
        name, c, convert, const_left = fast
        missing = False if const_left else None
        if type(c) is str:      # two Strings: equal or not (TAGS = 'x', the most common selector)
            def fn(props):
                v = props.get(name)
                return missing if v is None else v == c
        else:
            def fn(props):
                v = props.get(name)
                return missing if v is None else _sign(convert(v), c) == 0
        return _Node("bool", fn, 2)
    lf, rf = left.fn, right.fn

    def fn(props):
        lv, rv = lf(props), rf(props)
        if lv is None or rv is None:
            return True if lv is rv else (None if lv is None else False)
        if type(lv) is type(rv) and type(lv) is not float and lv == rv:
            return True
        return _compare(lv, rv) == 0
    return _Node("bool", fn, max(left.depth, right.depth) + 1)


def _check_equal_operands(left: _Node, right: _Node) -> None:
    for node in (left, right):
        if node.constant and node.value is None:
            raise SelectorError("NULL cannot be compared with '=' or '<>': use IS NULL or IS NOT NULL")
    if left.kind == "bool_const" and right.kind == "const":
        raise SelectorError(f"{_describe(left)} cannot be compared with {_describe(right)}")


_ORDER = {">": lambda c: c > 0, ">=": lambda c: c >= 0, "<": lambda c: c < 0, "<=": lambda c: c <= 0}


def _ordering(op: str, left: _Node, right: _Node) -> _Node:
    for node in (left, right):      # checkLessThanOperand: numbers, properties and negations only
        if node.kind in ("bool", "bool_const") or node.kind == "const" and type(node.value) not in (int, Long, float):
            raise SelectorError(f"{_describe(node)} cannot be compared with '{op}'")
    test = _ORDER[op]
    fast = _against_constant(left, right)
    if fast is not None:
        name, c, convert, const_left = fast

        def fn(props):
            v = props.get(name)
            if v is None:
                return None
            return test(_sign(c, convert(v)) if const_left else _sign(convert(v), c))
        return _Node("bool", fn, 2)
    lf, rf = left.fn, right.fn

    def fn(props):
        lv = lf(props)
        if lv is None:
            return None
        rv = rf(props)
        if rv is None:
            return None
        if type(lv) is str and type(rv) is str:     # ordering Strings: both as Doubles, or an error
            return test(_double_compare(_java_double(lv), _java_double(rv)))
        return test(_compare(lv, rv))
    return _Node("bool", fn, max(left.depth, right.depth) + 1)


def _between(value: _Node, low: _Node, high: _Node, negated: bool) -> _Node:
    if negated:
        return _logic("OR", _ordering("<", value, low), _ordering(">", value, high))
    if low.constant and high.constant:
        if low.value is None or high.value is None:
            raise SelectorError("BETWEEN bounds cannot be NULL")
        try:
            wrong_way = _compare(high.value, low.value) < 0
        except SelectorEvalError as exc:
            raise SelectorError(f"BETWEEN bounds cannot be compared: {exc}") from None
        if wrong_way:
            raise SelectorError(f"BETWEEN {_describe(low)} AND {_describe(high)}: the low bound must not exceed the high")
    return _logic("AND", _ordering(">=", value, low), _ordering("<=", value, high))


def _in(node: _Node, values: list[str], negated: bool) -> _Node:
    if node.kind != "prop":
        raise SelectorError(f"IN needs a property on its left, not {_describe(node)}")
    name, members = node.name, frozenset(values)

    def fn(props):
        v = props.get(name)
        return None if v is None else (v in members) is not negated
    return _Node("bool", fn, 2)


# ------------------------------------------------------------------ lexer (SelectorParser.jj's tokens)
_KEYWORDS = frozenset({"NOT", "AND", "OR", "BETWEEN", "IN", "TRUE", "FALSE", "NULL", "IS"})
_TOKENS = r"""
    (?P<space>[ \t\n\r\f]+ %s| /\*[^*]*\*+(?:[^/*][^*]*\*+)*/)
  | (?P<float>[0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)? | \.[0-9]+(?:[eE][+-]?[0-9]+)? | [0-9]+[eE][+-]?[0-9]+)
  | (?P<int>0 | [1-9][0-9]*[lL]?)
  | (?P<string>'(?:''|[^'])*')
  | (?P<id>[a-zA-Z_$][a-zA-Z0-9_$]*)
  | (?P<op><> | >= | <= | [=><(),+-])
"""
_TOKEN = re.compile(_TOKENS % r"| --[^\n\r]*(?:\r\n|\n|\r) ", re.VERBOSE)
# Past the text's last line break a -- starts no comment (one must end with a line break), only a minus: each
# attempt there read to the end of the text for the break, at every "-": 8,000 of them took 4.5 s to tokenize
# (a subscription or CHECK_CLIENT_CONFIG, on the loop), quadratic in the expression's length.
_TOKEN_LAST_LINE = re.compile(_TOKENS % "", re.VERBOSE)
# Inside a run of digits no float starts in, only ints: a 0 is a whole token (no leading zeros), and at each zero
# of "000...0" the float patterns read the rest of the run for a '.' or an exponent: 16,000 zeros took 4.3 s.
_INT_ONLY = re.compile(r"(?P<int>0 | [1-9][0-9]*[lL]?)", re.VERBOSE)
_DIGITS = re.compile(r"[0-9]*")


def _tokens(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, position) of each token, then ("eof", "", len). Longest match, as JavaCC's."""
    out, pos, end = [], 0, len(text)
    last_break = max(text.rfind("\n"), text.rfind("\r"))
    ints_until = -1     # the end of the digit run pos is in, when no float started at its first digit
    while pos < end:
        if pos < ints_until:
            m = _INT_ONLY.match(text, pos)
        else:
            m = (_TOKEN if pos < last_break else _TOKEN_LAST_LINE).match(text, pos)
            # A 0 with digits after it (an int ending inside a digit run; not 12L3, a new run): a float starting
            # further in the run would need what follows the run, as one starting here did, and none was found.
            if m is not None and m.lastgroup == "int" and m.group() == "0" and m.end() < end \
                    and "0" <= text[m.end()] <= "9":
                ints_until = _DIGITS.match(text, m.end()).end()
        if m is None:
            what = ("an unterminated string" if text[pos] == "'" else "an unterminated comment"
                    if text.startswith("/*", pos) else f"the character {text[pos]!r}")
            raise SelectorError(f"{what} at position {pos + 1}")
        kind = m.lastgroup
        if kind != "space":
            word = m.group()
            if kind == "id" and word.upper() in _KEYWORDS:
                kind, word = "kw", word.upper()
            out.append((kind, word, pos))
        pos = m.end()
    out.append(("eof", "", end))
    return out


def _number(kind: str, word: str) -> _Node:
    if kind == "int":
        digits = word.rstrip("lL")      # no leading zero: past 19 digits, past a Long (and int()'s digit limit)
        value = int(digits) if len(digits) <= 19 else _LONG_MAX + 1
        if value > _LONG_MAX:
            raise SelectorError(f"{word} is larger than a Long")
        return _const(value if value <= _INT_MAX else Long(value))
    value = float(word)
    if not _DOUBLE_MIN <= value <= _DOUBLE_MAX:    # as ConstantExpression.createFloat, which refuses 0.0 too
        raise SelectorError(f"{word} is outside RocketMQ's Double literals ({_DOUBLE_MIN} to {_DOUBLE_MAX}; "
                            "write 0 for zero)")
    return _const(value)


# ------------------------------------------------------------------ parser (recursive descent)
class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.i = 0
        self.nesting = 0
        self.operators = 0
        self.names: set[str] = set()     # the properties the expression reads

    def peek(self, ahead: int = 0) -> tuple[str, str, int]:
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def accept(self, word: str) -> bool:
        kind, w, _ = self.tokens[self.i]
        if w == word and kind in ("kw", "op"):
            self.i += 1
            return True
        return False

    def expect(self, word: str) -> None:
        if not self.accept(word):
            self.fail(f"expected {word}")

    def fail(self, what: str):
        kind, word, pos = self.peek()
        found = "the end" if kind == "eof" else f"{word!r} at position {pos + 1}"
        raise SelectorError(f"{what}, found {found}")

    def count(self, node: _Node) -> _Node:
        self.operators += 1
        if self.operators > MAX_OPERATORS:
            raise SelectorError(f"more than {MAX_OPERATORS} operators")
        if node.depth > MAX_DEPTH:
            raise SelectorError(f"nested more than {MAX_DEPTH} deep")
        return node

    def parse(self) -> _Node:
        node = _as_boolean(self.or_expr())
        kind, word, pos = self.peek()
        if kind != "eof":
            hint = " (a -- comment must end with a line break)" if word == "-" and self.peek(1)[1] == "-" else ""
            raise SelectorError(f"unexpected {word!r} at position {pos + 1} after a complete expression{hint}")
        return node

    def or_expr(self) -> _Node:
        left = self.and_expr()
        while self.accept("OR"):
            left = self.count(_logic("OR", left, self.and_expr()))
        return left

    def and_expr(self) -> _Node:
        left = self.equality()
        while self.accept("AND"):
            left = self.count(_logic("AND", left, self.equality()))
        return left

    def equality(self) -> _Node:
        left = self.comparison()
        while True:
            if self.accept("=") or self.accept("<>"):
                negated = self.tokens[self.i - 1][1] == "<>"
                right = self.comparison()
                _check_equal_operands(left, right)
                left = self.count(_equal(left, right))
                if negated:
                    left = _not(left)
            elif self.peek()[1] == "IS" and self.peek(1)[1] in ("NULL", "NOT"):
                self.i += 1
                negated = self.accept("NOT")
                self.expect("NULL")
                left = self.count(_equal(left, _const(None, "bool_const")))
                if negated:
                    left = _not(left)
            else:
                return left

    def comparison(self) -> _Node:
        left = self.unary()
        while True:
            kind, word, _ = self.peek()
            if kind == "op" and word in _ORDER:
                self.i += 1
                left = self.count(_ordering(word, left, self.unary()))
            elif word == "BETWEEN" or word == "NOT" and self.peek(1)[1] == "BETWEEN":
                negated = self.accept("NOT")
                self.i += 1
                low = self.unary()
                self.expect("AND")
                left = self.count(_between(left, low, self.unary(), negated))
            elif word == "IN" or word == "NOT" and self.peek(1)[1] == "IN":
                negated = self.accept("NOT")
                self.i += 1
                left = self.count(_in(left, self.string_list(), negated))
            else:
                return left

    def string_list(self) -> list[str]:
        self.expect("(")
        values = [self.string()]
        while self.accept(","):
            values.append(self.string())
        self.expect(")")
        return values

    def string(self) -> str:
        kind, word, _ = self.peek()
        if kind != "string":
            self.fail("IN takes 'quoted strings'")
        self.i += 1
        return word[1:-1].replace("''", "'")

    def unary(self) -> _Node:
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            raise SelectorError(f"nested more than {MAX_DEPTH} deep")
        try:
            if self.accept("+"):
                return self.unary()
            if self.accept("-"):
                return self.count(_negate(self.unary()))
            if self.accept("NOT"):
                return self.count(_not(self.unary()))
            return self.primary()
        finally:
            self.nesting -= 1

    def primary(self) -> _Node:
        kind, word, _ = self.peek()
        if kind in ("int", "float", "string", "id") or word in ("TRUE", "FALSE", "NULL"):
            self.i += 1
            if kind == "string":
                return _const(word[1:-1].replace("''", "'"))
            if kind == "id":
                self.names.add(word)
                return _prop(word)
            if kind == "kw":
                return _const({"TRUE": True, "FALSE": False, "NULL": None}[word], "bool_const")
            return _number(kind, word)
        if self.accept("("):
            node = self.or_expr()
            self.expect(")")
            return node
        self.fail("expected a value, a property name or (")


class Selector:
    """A parsed expression. ``evaluate(props)``: True, False or None; raises SelectorEvalError. ``names``:
    the properties it reads (no other property can change its value); ``operators``: how many it has, the
    most one evaluation computes."""
    __slots__ = ("expression", "evaluate", "names", "operators")

    def __init__(self, expression: str, fn, names: frozenset = frozenset(), operators: int = 0):
        self.expression = expression
        self.evaluate = fn      # the expression's function itself: no method call around it per record
        self.names = names
        self.operators = operators

    def __repr__(self) -> str:
        return f"Selector({self.expression!r})"


def parse(expression: str) -> Selector:
    """The Selector of ``expression``; SelectorError says why it does not parse."""
    if not isinstance(expression, str) or not expression.strip():
        raise SelectorError("an SQL92 expression cannot be empty (nor other than text)")
    if len(expression) > MAX_LENGTH:
        raise SelectorError(f"the expression is {len(expression)} characters long, more than {MAX_LENGTH}")
    parser = _Parser(expression)
    node = parser.parse()
    return Selector(expression, node.fn, frozenset(parser.names), parser.operators)


@functools.lru_cache(maxsize=128)
def _cached(expression: str):
    try:
        return parse(expression)
    except SelectorError as exc:
        # Its text, not the exception: one instance raised again and again kept each raise's traceback, and
        # through the frames' f_back each caller's (the pull or heartbeat and its command), without end.
        return str(exc)


def compile_cached(expression: str) -> Selector:
    """``parse`` through a cache of the last 128 expressions, errors included (RocketMQ's PARSE_CACHE): every
    heartbeat, and every pull that carries its subscription, names its expression again."""
    if not isinstance(expression, str) or len(expression) > MAX_LENGTH:
        return parse(expression)        # not kept: the cache holds only what could be an expression
    got = _cached(expression)
    if isinstance(got, str):
        raise SelectorError(got)
    return got
