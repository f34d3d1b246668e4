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
    ))


def _latex_problem(r: random.Random) -> str:
    a, b, c, d = (r.randint(2, 12) for _ in range(4))
    x1, x2 = r.sample(range(-9, 10), 2)
    n = r.choice((36, 48, 60, 72, 84, 90, 96, 100, 120, 144, 180, 210))
    return r.choice((
        f"Solve for $x$: ${a}x + {b} = {c * a + b}$.",
        f"What is the value of $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$? Express your answer as a common fraction.",
        f"How many positive divisors does ${n}$ have?",
        f"Find the sum of all values of $x$ such that $x^2 - {x1 + x2}x + {x1 * x2} = 0$.".replace("- -", "+ ")
        .replace("+ -", "- "),
        f"If $f(x) = {a}x^2 - {b}x + {c}$, what is $f({d})$?",
        f"Simplify $\\sqrt{{{a * a * b}}}$.",
        f"A right triangle has legs of length ${a}$ and ${b}$. What is the length of its hypotenuse? Express your "
        f"answer in simplest radical form.",
        f"What is the remainder when ${a}^{{{b + 5}}}$ is divided by ${c + 1}$?",
        f"The points $({x1}, {a})$ and $({x2}, {b})$ lie on a line. What is the slope of the line?",
        f"Compute $\\dbinom{{{a + 4}}}{{{min(a + 4, c) // 2 + 1}}}$.",
        f"What is the least common multiple of ${a * b}$ and ${c * d}$?",
        f"Evaluate $\\sum_{{k=1}}^{{{a + 5}}} k^2$.",
    ))


def _signature(call: ast.Call) -> str | None:
    """Parameter names for a call's arguments, from the literal kind of each (None: not a plain call)."""
    names, seen = [], set()
    for arg in call.args:
        kind = type(arg.value).__name__ if isinstance(arg, ast.Constant) else type(arg).__name__
        name = {"str": "text", "int": "n", "float": "x", "List": "items", "Tuple": "values", "Dict": "mapping",
                "Set": "elements", "bool": "flag"}.get(kind, "arg")
        while name in seen:
            name = f"{name}{len(seen)}"
        seen.add(name)
        names.append(name)
    return ", ".join(names) if not call.keywords else None


def function_stub(text: str, test: str) -> str | None:
    """An MBPP task (its text and first `assert f(...) == expected` test) as a humaneval-style stub, or None when
    the test is not of that form."""
    try:
        node = ast.parse(test.strip()).body[0]
    except (SyntaxError, IndexError):
        return None
    if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq) and isinstance(node.test.left, ast.Call)
            and isinstance(node.test.left.func, ast.Name)):
        return None
    call = node.test.left
    params = _signature(call)
    if params is None:
        return None
    doc = text.strip().rstrip(".") + "."
    return (f"def {call.func.id}({params}):\n    \"\"\" {doc}\n    >>> {ast.unparse(call)}\n"
            f"    {ast.unparse(node.test.comparators[0])}\n    \"\"\"\n")


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
