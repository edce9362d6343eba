"""The calculator tool: a recursive-descent parser of arithmetic (never `eval`), Python's semantics.

Grammar, with Python's precedence and associativity (so `-2**2 == -4`, `2**-1 == 0.5`, `2**3**2 == 512`):

    expr  := term (("+" | "-") term)*
    term  := unary (("*" | "/" | "%") unary)*
    unary := ("+" | "-") unary | power
    power := atom ("**" unary)?
    atom  := NUMBER | "(" expr ")"

Numbers are Python's int and float literals without underscores (`12`, `1.5`, `.5`, `2.`, `1e-3`); `/` is
true division, `%` takes the divisor's sign. Anything else (a name, a call, an attribute, `^`) is refused
with an error naming where it stopped. Division by zero, a result over `MAX_INT_BITS` bits, a non-finite
or complex result become an error too: `evaluate` raises `ArithmeticRefused`, the tool answers its text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from recipe_gkd.envs.protocol import ToolResult

Number = int | float

# Bounds that keep one call cheap: an int result of more bits than this (2**4096 has 1233 digits) is refused
# before it is computed, and so is an expression longer, or nested deeper, than these.
MAX_INT_BITS = 4096
MAX_EXPRESSION_CHARS = 1000
MAX_NESTING = 64

_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?)|(?P<op>\*\*|[-+*/%()]))",
)


class ArithmeticRefused(ValueError):
    """The expression is not arithmetic this calculator takes, or its result is refused."""


@dataclass(frozen=True)
class _Token:
    kind: str  # "number", "op" or "end"
    text: str
    at: int  # character offset in the expression


def tokenize(expression: str) -> list[_Token]:
    """The expression's tokens; an `ArithmeticRefused` naming the first character that is not arithmetic."""
    tokens: list[_Token] = []
    pos = 0
    while pos < len(expression):
        if expression[pos:].strip() == "":
            break
        match = _TOKEN.match(expression, pos)
        if match is None:
            at = pos + len(expression[pos:]) - len(expression[pos:].lstrip())
            raise ArithmeticRefused(
                f"unexpected {expression[at : at + 12]!r} at character {at}: only numbers, + - * / ** % and parentheses"
            )
        kind = "number" if match.group("number") is not None else "op"
        tokens.append(_Token(kind, match.group(kind), match.start(kind)))
        pos = match.end()
    tokens.append(_Token("end", "", len(expression)))
    return tokens


def _check(value: Any) -> Number:
    """A result as the calculator keeps it: a finite float or an int of at most MAX_INT_BITS bits."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArithmeticRefused(f"the result is not a real number ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ArithmeticRefused("the result is not finite (overflow)")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ArithmeticRefused(f"the result has more than {MAX_INT_BITS} bits")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # Refuse before computing: |base|**exponent has about exponent * log2|base| bits.
        if exponent * math.log2(abs(base)) > MAX_INT_BITS + 1:
            raise ArithmeticRefused(f"exponent too large: {base}**{exponent} has more than {MAX_INT_BITS} bits")
    if base == 0 and exponent < 0:
        raise ArithmeticRefused("division by zero (0 to a negative power)")
    try:
        return base**exponent
    except OverflowError as err:
        raise ArithmeticRefused(f"the result overflows: {err}") from None


def _apply(op: str, left: Number, right: Number) -> Number:
    try:
        if op == "+":
            return _check(left + right)
        if op == "-":
            return _check(left - right)
        if op == "*":  # cheap: each operand has at most MAX_INT_BITS bits
            return _check(left * right)
        if op == "/":
            return _check(left / right)
        if op == "%":
            return _check(left % right)
        return _check(_power(left, right))
    except ZeroDivisionError:
        raise ArithmeticRefused("division by zero") from None
    except OverflowError as err:
        raise ArithmeticRefused(f"the result overflows: {err}") from None


class _Parser:
    def __init__(self, expression: str) -> None:
        self.tokens = tokenize(expression)
        self.index = 0
        self.depth = 0

    def peek(self) -> _Token:
        return self.tokens[self.index]

    def take(self) -> _Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def expected(self, what: str) -> ArithmeticRefused:
        token = self.peek()
        found = "the end" if token.kind == "end" else repr(token.text)
        return ArithmeticRefused(f"expected {what} at character {token.at}, found {found}")

    def expr(self) -> Number:
        value = self.term()
        while self.peek().text in ("+", "-") and self.peek().kind == "op":
            op = self.take().text
            value = _apply(op, value, self.term())
        return value

    def term(self) -> Number:
        value = self.unary()
        while self.peek().kind == "op" and self.peek().text in ("*", "/", "%"):
            op = self.take().text
            value = _apply(op, value, self.unary())
        return value

    def unary(self) -> Number:
        token = self.peek()
        if token.kind == "op" and token.text in ("+", "-"):
            self.take()
            self.enter()
            operand = self.unary()
            self.depth -= 1
            return _check(-operand if token.text == "-" else +operand)
        return self.power()

    def power(self) -> Number:
        base = self.atom()
        if self.peek().kind == "op" and self.peek().text == "**":
            self.take()
            self.enter()
            exponent = self.unary()  # right-associative, and binds a unary minus: 2**-1
            self.depth -= 1
            return _apply("**", base, exponent)
        return base

    def atom(self) -> Number:
        token = self.take()
        if token.kind == "number":
            text = token.text
            return _check(float(text) if any(c in text for c in ".eE") else int(text))
        if token.kind == "op" and token.text == "(":
            self.enter()
            value = self.expr()
            self.depth -= 1
            if self.peek().text != ")":
                raise self.expected("')'")
            self.take()
            return value
        self.index -= 1
        raise self.expected("a number or '('")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise ArithmeticRefused(f"nested deeper than {MAX_NESTING} levels")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression, as Python computes it; `ArithmeticRefused` for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ArithmeticRefused(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(expression)
    if parser.peek().kind == "end":
        raise ArithmeticRefused("the expression is empty")
    value = parser.expr()
    if parser.peek().kind != "end":
        raise parser.expected("an operator or the end")
    return value


def format_number(value: Number) -> str:
    """The result as the model reads it: an int exactly, a float as Python's shortest repr."""
    return str(value) if isinstance(value, int) else repr(value)


class CalculatorTool:
    """`calculator(expression)`: the value of an arithmetic expression, or an error the model reads."""

    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = "Evaluate an arithmetic expression: numbers, + - * / ** % and parentheses."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (3 + 4) * 2"}},
        "required": ["expression"],
    }

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        expression = arguments["expression"]
        if not isinstance(expression, str):
            return ToolResult(f"error: 'expression' must be a string, got {type(expression).__name__}", failed=True)
        try:
            return ToolResult(format_number(evaluate(expression)))
        except ArithmeticRefused as err:
            return ToolResult(f"error: {err}", failed=True)
