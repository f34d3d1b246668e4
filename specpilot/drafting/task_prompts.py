"""Synthetic task prompts for drafter training: the kinds of question the benchmarks ask, written from templates
and MBPP's train split, never from a test prompt.

The free chat generations (sources.build_prompts) are the target's invented user turns: advice and conversation,
almost no arithmetic, LaTeX or docstring-style functions (decoded in session 41), while math500, gsm8k and humaneval
make the target write exactly those. Three kinds, mixed evenly:
- word problems (gsm8k's style): a person, a quantity, two or three operations, "How many ...?";
- competition-style problems in LaTeX (math500's style): equations, fractions, divisors, polynomials, geometry;
- function stubs (humaneval's style): an MBPP train task as a signature and a docstring with one doctest, taken
  from its first test's assert.
The target answers each greedily, as it answers the benchmarks; the drafter learns from that answer.
"""
from __future__ import annotations

import ast
import random
from collections.abc import Callable, Sequence
from enum import Enum

NAMES = ("Ava", "Ben", "Carla", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe")
ITEMS = ("apples", "stickers", "marbles", "books", "cupcakes", "pencils", "tickets", "stamps", "seashells", "cookies",
         "baseball cards", "plants", "eggs", "candles", "bracelets")


# Openings of user turns in the benchmarks' styles (none taken from a benchmark prompt): a steered free generation
# (TrainConfig.steered_prompts) has the target write the rest of the turn after one of them, then answer it, so
# the questions are as varied as the target's own text and still of the kinds the benchmarks ask.
TURN_STARTS = (
    "Solve for $x$:", "Compute $", "Find all real numbers", "What is the value of $", "Simplify", "Let $",
    "If $f(x)", "How many positive integers", "What is the probability that", "In triangle $ABC$,",
    "Find the remainder when", "Evaluate", "A store sells", "There are", "A train travels", "A baker makes",
    "A farmer has", "Write a python function to", "Write a function to", "Write a Python function that takes a list",
    "Implement a function", "from typing import List\n\n\ndef", "def ", "Write a persuasive essay",
    "Compose an email", "Explain the difference between", "Describe", "Imagine you are", "Draft a",
    "Given the following",
)


class TaskKind(str, Enum):
    WORD_PROBLEM = "word_problem"
    LATEX_PROBLEM = "latex_problem"
    FUNCTION_STUB = "function_stub"


def _word_problem(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    n, k, m, p = r.randint(12, 90), r.randint(2, 9), r.randint(2, 6), r.randint(2, 15)
    price, hours = r.choice((0.5, 1.25, 2, 3, 4.5, 5, 8)), r.randint(2, 9)
    return r.choice((
        f"{a} has {n} {item}. {a} gives {k} of them to {b} and then buys {m} packs with {p} {item} in each pack. "
        f"How many {item} does {a} have now?",
        f"{a} sells {item} at the market for ${price} each. On Monday {a} sells {n}, and on Tuesday {m} times as many "
        f"as on Monday. How much money does {a} make in the two days?",
        f"{a} can make {k} {item} in an hour. {b} makes {m} more per hour than {a}. If they both work for {hours} "
        f"hours, how many {item} do they make together?",
        f"A box holds {p} {item}. {a} needs {n * m} {item} for a school event. How many boxes must {a} buy, and how "
        f"many {item} will be left over?",
        f"{a} read {k} pages of a book on the first day. Each day after that, {a} read {m} more pages than the day "
        f"before. How many pages did {a} read in the first {hours} days?",
        f"{a} earns ${n} a week and saves {r.choice((10, 20, 25, 40, 50))}% of it. {b} saves ${p} a week. After "
        f"{hours} weeks, who has saved more, and by how much?",
        f"A recipe needs {k} cups of flour for every {m} cups of sugar. {a} uses {k * p} cups of flour. How many cups "
        f"of sugar does {a} need?",
        f"{a} drove {n} miles in {m} hours, then {p * 3} miles in {k} hours. What was {a}'s average speed for the "
        f"whole trip, in miles per hour?",
        f"A jacket costs ${n + 20}. The store takes {r.choice((10, 15, 20, 25, 30))}% off, and {a} pays a {k}% sales "
        f"tax on the discounted price. How much does {a} pay?",
        f"{a} is {k} times as old as {b}. In {m} years, the sum of their ages will be {2 * m + (k + 1) * p}. How old "
        f"is {b} now?",
        f"A train leaves at {r.randint(1, 11)}:{r.choice(('00', '15', '30', '45'))} and travels {n * 2} miles at "
        f"{r.choice((40, 45, 50, 60, 75))} miles per hour. How many minutes does the trip take?",
        f"{a} bought {k} notebooks at ${price} each and {m} pens at ${r.choice((1, 1.5, 2))} each, and paid with a "
        f"${r.choice((20, 50, 100))} bill. How much change did {a} get?",
        f"A garden is {k * m} feet long and {m * 2} feet wide. {a} puts a fence around it, with a post every {m} feet. "
        f"How many posts does {a} need?",
        f"{a} has ${n * 10} in savings. {a} spends a quarter of it on a bike and half of what is left on books. How "
        f"much money does {a} have left?",
        f"There are {n} students in a class. {r.choice((25, 40, 60, 75))}% of them play a sport, and a third of those "
        f"play soccer. How many students play soccer?",
    ))


def _latex_problem(r: random.Random) -> str:
    a, b, c, d = (r.randint(2, 12) for _ in range(4))
    x1, x2 = r.sample(range(-9, 10), 2)
    n = r.choice((36, 48, 60, 72, 84, 90, 96, 100, 120, 144, 180, 210))
    red, blue = r.randint(2, 8), r.randint(2, 8)
    sides, deg = r.choice((5, 6, 8, 9, 10, 12)), r.choice((30, 45, 60, 120, 135, 150))
    base = r.choice((2, 3, 5, 7, 8))
    quadratic = f"x^2 - {x1 + x2}x + {x1 * x2}".replace("- -", "+ ").replace("+ -", "- ")
    return r.choice((
        # algebra, prealgebra
        f"Solve for $x$: ${a}x + {b} = {c * a + b}$.",
        f"What is the value of $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$? Express your answer as a common fraction.",
        f"Find the sum of all values of $x$ such that ${quadratic} = 0$.",
        f"If $f(x) = {a}x^2 - {b}x + {c}$, what is $f({d})$?",
        f"The points $({x1}, {a})$ and $({x2}, {b})$ lie on a line. What is the slope of the line?",
        f"What is ${a}\\%$ of ${n * 5}$?",
        f"Find the value of $x$ if $\\sqrt{{{a}x + {b}}} = {c + 2}$.",
        # number theory
        f"How many positive divisors does ${n}$ have?",
        f"What is the remainder when ${a}^{{{b + 5}}}$ is divided by ${c + 1}$?",
        f"What is the least common multiple of ${a * b}$ and ${c * d}$?",
        f"What is the greatest common divisor of ${a * n}$ and ${b * n + n}$?",
        f"Express ${n + a}_{{10}}$ in base ${base}$.",
        # counting and probability
        f"Compute $\\dbinom{{{a + 4}}}{{{min(a + 4, c) // 2 + 1}}}$.",
        f"A bag has {red} red marbles and {blue} blue marbles. Two marbles are drawn at random without replacement. "
        f"What is the probability that both are red? Express your answer as a common fraction.",
        f"In how many ways can {a + 2} people be seated in a row of {a + 2} chairs if two of them refuse to sit next "
        f"to each other?",
        # intermediate algebra, precalculus
        f"Simplify $\\sqrt{{{a * a * b}}}$.",
        f"Evaluate $\\sum_{{k=1}}^{{{a + 5}}} k^2$.",
        f"Find the minimum value of ${a}x^2 - {a * b * 2}x + {c}$ over all real numbers $x$.",
        f"Let $r$ and $s$ be the roots of ${quadratic} = 0$. Compute $r^2 + s^2$.",
        f"Compute $\\begin{{pmatrix}} {a} & {b} \\\\ {c} & {d} \\end{{pmatrix}} \\begin{{pmatrix}} {x1} \\\\ {x2} "
        f"\\end{{pmatrix}}$.",
        f"Compute $\\cos {deg}^\\circ$.",
        f"Convert the point $({a}, {b})$ in rectangular coordinates to polar coordinates. Enter your answer in the form "
        f"$(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
        # geometry
        f"A right triangle has legs of length ${a}$ and ${b}$. What is the length of its hypotenuse? Express your "
        f"answer in simplest radical form.",
        f"What is the measure, in degrees, of each interior angle of a regular polygon with ${sides}$ sides?",
        f"A circle has circumference ${2 * a}\\pi$. What is its area? Express your answer in terms of $\\pi$.",
        f"A rectangle has perimeter ${2 * (a + b)}$ and one side of length ${a}$. What is its area?",
    ))


_HINTS = {str: "str", int: "int", float: "float", bool: "bool"}


def _hint(node: ast.expr) -> str | None:
    """A humaneval-style type hint for a literal (None: none is obvious)."""
    if isinstance(node, ast.Constant) and type(node.value) in _HINTS:
        return _HINTS[type(node.value)]
    if isinstance(node, ast.List):
        inner = {_hint(e) for e in node.elts}
        return f"List[{inner.pop()}]" if len(inner) == 1 and None not in inner else "list"
    return {ast.Tuple: "tuple", ast.Dict: "dict", ast.Set: "set"}.get(type(node))


def _parameters(call: ast.Call) -> str:
    """Parameter names (and hints) for a call's arguments, from the kind of each literal."""
    params, seen = [], set()
    for arg in call.args:
        hint = _hint(arg)
        name = {"str": "text", "int": "n", "float": "x", "bool": "flag", "tuple": "values", "dict": "mapping",
                "set": "elements", None: "arg"}.get(hint, "items")
        while name in seen:
            name = f"{name}{len(seen)}"
        seen.add(name)
        params.append(f"{name}: {hint}" if hint else name)
    return ", ".join(params)


def function_stub(text: str, test: str) -> str | None:
    """An MBPP task (its text and first `assert f(...) == expected` test) as a humaneval-style stub (hints from the
    test's literals, `typing.List` imported where used), or None when the test is not of that form."""
    try:
        node = ast.parse(test.strip()).body[0]
    except (SyntaxError, IndexError):
        return None
    if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq) and isinstance(node.test.left, ast.Call)
            and isinstance(node.test.left.func, ast.Name) and not node.test.left.keywords):
        return None
    call, expected = node.test.left, node.test.comparators[0]
    params, ret = _parameters(call), _hint(expected)
    signature = f"def {call.func.id}({params})" + (f" -> {ret}:" if ret else ":")
    head = "from typing import List\n\n\n" if "List[" in signature else ""
    doc = text.strip().rstrip(".") + "."
    return (f"{head}{signature}\n    \"\"\" {doc}\n    >>> {ast.unparse(call)}\n"
            f"    {ast.unparse(expected)}\n    \"\"\"\n")


def task_prompts(n: int, seed: int, mbpp_tasks: Sequence[tuple[str, str]] = ()) -> list[tuple[TaskKind, str]]:
    """`n` prompts, the three kinds in turn (function stubs from `mbpp_tasks`, (text, first test) pairs of MBPP's
    train split, each used once; the other two kinds fill in when they run out), seeded."""
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    r = random.Random(seed)
    stubs = [s for s in (function_stub(t, a) for t, a in mbpp_tasks) if s is not None]
    r.shuffle(stubs)
    writers: dict[TaskKind, Callable[[random.Random], str]] = {TaskKind.WORD_PROBLEM: _word_problem,
                                                              TaskKind.LATEX_PROBLEM: _latex_problem}
    out: list[tuple[TaskKind, str]] = []
    while len(out) < n:
        kind = (TaskKind.WORD_PROBLEM, TaskKind.LATEX_PROBLEM, TaskKind.FUNCTION_STUB)[len(out) % 3]
        if kind is TaskKind.FUNCTION_STUB:
            if stubs:
                out.append((kind, stubs.pop()))
                continue
            kind = r.choice(tuple(writers))
        out.append((kind, writers[kind](r)))
    return out
