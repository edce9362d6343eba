"""The calculator's parser against Python's own arithmetic on random expressions, and what it refuses."""

from __future__ import annotations

import cmath
import math
import random
import time
from pathlib import Path

import pytest

from recipe_gkd.envs.arithmetic import MAX_INT_BITS, ArithmeticRefused, CalculatorTool, evaluate

N_EXPRESSIONS = 2000


def _leaf(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        return str(rng.randint(0, 30))
    if kind < 0.8:
        return f"{rng.randint(0, 99)}.{rng.randint(0, 99)}"
    return rng.choice([".5", "3.", "1e2", "2.5e-1", "0", "0.0", "7"])


def random_expression(rng: random.Random, depth: int) -> str:
    """A random expression in Python's syntax; exponents stay small so Python itself answers at once."""
    if depth == 0:
        return _leaf(rng)
    kind = rng.random()
    if kind < 0.15:
        return "-" + random_expression(rng, depth - 1)
    if kind < 0.25:
        return "(" + random_expression(rng, depth - 1) + ")"
    if kind < 0.35:
        exponent = rng.choice(["0", "1", "2", "3", "-1", "-2", "0.5", "(-1)"])
        return "(" + random_expression(rng, depth - 1) + ")**" + exponent
    op = rng.choice(["+", "-", "*", "/", "%", "+", "-", "*"])
    space = rng.choice(["", " "])
    return random_expression(rng, depth - 1) + space + op + space + random_expression(rng, depth - 1)


def python_reference(expression: str) -> int | float | None:
    """What Python computes (eval is the independent reference here), or None where the calculator must refuse."""
    try:
        value = eval(expression, {"__builtins__": {}})  # the test's reference, on generated arithmetic only
    except (ZeroDivisionError, OverflowError):
        return None
    except TypeError:  # a complex intermediate (a negative base to a fractional power) met `%`
        return None
    if isinstance(value, complex):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        return None
    return value


def test_random_expressions_match_python() -> None:
    rng = random.Random(1234)
    compared = refused = 0
    for _ in range(N_EXPRESSIONS):
        expression = random_expression(rng, rng.randint(1, 5))
        expected = python_reference(expression)
        if expected is None:
            with pytest.raises(ArithmeticRefused):
                evaluate(expression)
            refused += 1
            continue
        got = evaluate(expression)
        assert type(got) is type(expected), expression
        assert got == expected, f"{expression}: {got!r} != {expected!r}"
        compared += 1
    # Both sides of the comparison were exercised: values and refusals (division by zero, complex results).
    assert compared > N_EXPRESSIONS // 2 and refused > 20


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("-2**2", -4),
        ("2**-1", 0.5),
        ("2**3**2", 512),
        ("1--1", 2),
        ("7%-3", -2),
        ("-7%3", 2),
        ("7/2", 3.5),
        ("(1+2)*3", 9),
    ],
)
def test_python_precedence_and_semantics(expression: str, value: float) -> None:
    assert evaluate(expression) == value == eval(expression)


@pytest.mark.parametrize(
    "expression",
    [
        "x",
        "abs(1)",
        "(1).real",
        "1 .real",
        "__import__('os')",
        "[1]",
        "1 if 1 else 2",
        "1; 2",
        "lambda: 1",
        "True",
        "2^3",
        "1 2",
        "((1)",
        "",
        "1e",
        "1_000",
        "0x10",
        "\u0663 + 1",  # an Arabic-Indic digit: int() takes it, Python source does not
        "'1'",
    ],
)
def test_refuses_what_is_not_arithmetic(expression: str) -> None:
    with pytest.raises(ArithmeticRefused):
        evaluate(expression)


def test_refused_code_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = CalculatorTool()({"expression": f"__import__('pathlib').Path({str(marker)!r}).touch()"})
    assert result.failed and result.content.startswith("error: unexpected")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0**-1", "division by zero"),
        ("2.5/(3-3)", "division by zero"),
        ("(-8)**(1/3)", "not a real number"),
        ("1e308*10", "not finite"),
        ("2.0**5000", "overflows"),
        ("2**5000", "more than 4096 bits"),
    ],
)
def test_errors_become_observations(expression: str, reason: str) -> None:
    result = CalculatorTool()({"expression": expression})
    assert result.failed and reason in result.content, result.content


@pytest.mark.timeout(30)  # without the check, 9**9**9 would run for minutes: fail instead of hanging the suite
def test_huge_exponents_are_refused_before_they_are_computed() -> None:
    start = time.monotonic()
    for expression in ("9**9**9", "10**100000000", "(2**4000)*(2**4000)", "(-3)**99999999"):
        with pytest.raises(ArithmeticRefused, match="bits"):
            evaluate(expression)
    # Computing any of them would take minutes (9**9**9 has 370 million digits).
    assert time.monotonic() - start < 1.0


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    with pytest.raises(ArithmeticRefused, match="nested"):
        evaluate("(" * 400 + "1" + ")" * 400)
    with pytest.raises(ArithmeticRefused, match="nested"):
        evaluate("-" * 400 + "1")
    assert evaluate("(" * 30 + "1" + ")" * 30) == 1


def test_results_read_back_exactly() -> None:
    tool = CalculatorTool()
    assert tool({"expression": "2**100"}).content == str(2**100)
    assert tool({"expression": "0.1 + 0.2"}).content == repr(0.1 + 0.2)
    assert float(tool({"expression": "1/3"}).content) == 1 / 3
    assert cmath.isclose(float(tool({"expression": "2**0.5"}).content), 2**0.5)
    bad = tool({"expression": 12})
    assert bad.failed and "must be a string" in bad.content
