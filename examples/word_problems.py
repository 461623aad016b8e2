"""A tool-using agent on word problems whose demonstrations cover only some of the kinds of problem.

Each task is a short story with three two-digit numbers ("A baker makes 23 trays of 14 rolls and
sells 31 rolls. How many rolls are left?"); the agent has the calculator agent's tool and loop
(:func:`agentstream.examples.calculator_agent.solve`) and must write the expression itself: which
operations the words ask for, and in which order. There are eight kinds (:data:`KINDS`), each a
story and its expression over the numbers in the order the story gives them. Demonstrations
(:func:`demonstration_tasks`) are written only for the kinds in :data:`DEMONSTRATED`; train and
held-out tasks come from all eight. So a warm start teaches the tool protocol and half of the
stories, and the rest is what reinforcement learning has to teach. Each kind left out differs
from a demonstrated one in one operation (the library's "adds b shelves of c" is ``a + b * c``
where the stamps' "buys b more and gives away c" is ``a + b - c``), so an agent sampling its
expressions sometimes writes the right one, and the reward tells it from the wrong ones
(docs/multistep.md says how the split was chosen).

Nothing here imports agentstream's pipeline: tasks are ``{"id", "prompt", "answer"}`` objects and
the reward is the calculator agent's (1.0 when the final answer's last number is the task's answer).
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

from agentstream.examples import calculator_agent
from agentstream.examples.calculator_agent import CALCULATOR

HELDOUT_SIZE = 64
SYSTEM = ("Solve the word problem. Call the calculator tool with the arithmetic expression it needs. "
          "End your answer with the final number.")


class Kind(NamedTuple):
    """One kind of word problem: its story (``{a}``, ``{b}``, ``{c}`` in that order) and its expression."""

    name: str
    story: str
    expression: str

    def values(self, rng: random.Random) -> tuple[int, int, int]:
        """Three two-digit numbers for which every step of the expression stays positive."""
        while True:
            a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
            if self.answer(a, b, c) > 0 and (a > b or "{a} - {b}" not in self.expression):
                return a, b, c

    def answer(self, a: int, b: int, c: int) -> int:
        return int(calculator_agent.calculate(self.expression.format(a=a, b=b, c=c)))


KINDS = (
    Kind("boxes", "A shop has {a} boxes of {b} pens each and {c} loose pens. How many pens does it have?",
         "{a} * {b} + {c}"),
    Kind("trays", "A baker makes {a} trays of {b} rolls each and sells {c} rolls. How many rolls are left?",
         "{a} * {b} - {c}"),
    Kind("stamps", "Mia has {a} stamps, buys {b} more and gives away {c}. How many stamps does she have now?",
         "{a} + {b} - {c}"),
    Kind("tank", "A tank holds {a} litres. {b} litres leak out, then {c} litres are poured in. How many litres "
         "are in the tank?", "{a} - {b} + {c}"),
    Kind("shelves", "A library has {a} books. It adds {b} shelves of {c} books each. How many books does it have?",
         "{a} + {b} * {c}"),
    Kind("cans", "A class collects {a} cans on Monday, {b} on Tuesday and {c} on Wednesday. How many cans did it "
         "collect?", "{a} + {b} + {c}"),
    Kind("crates", "A truck carries {a} crates. Each crate holds {b} bags of {c} apples. How many apples does it "
         "carry?", "{a} * {b} * {c}"),
    Kind("pages", "A book has {a} pages. Ann reads {b} pages on Monday and {c} on Tuesday. How many pages are left "
         "to read?", "{a} - {b} - {c}"),
)
DEMONSTRATED = frozenset({"boxes", "trays", "stamps", "tank"})
"""The kinds the warm start's demonstrations show; the others are left to RL."""
_BY_NAME = {kind.name: kind for kind in KINDS}


def all_tasks() -> list[dict]:
    """A fixed, seeded 2,000 tasks, the kinds in turn, each ``{"id": "wp-<kind>-a-b-c", "prompt", "answer"}``."""
    rng, tasks, seen = random.Random(52), list[dict](), set[str]()
    while len(tasks) < 2000:
        kind = KINDS[len(tasks) % len(KINDS)]
        a, b, c = kind.values(rng)
        task_id = f"wp-{kind.name}-{a}-{b}-{c}"
        if task_id not in seen:
            seen.add(task_id)
            tasks.append({"id": task_id, "prompt": kind.story.format(a=a, b=b, c=c), "answer": kind.answer(a, b, c)})
    return tasks


def split(heldout: int = HELDOUT_SIZE) -> tuple[list[dict], list[dict]]:
    """(train, held-out): the first ``heldout`` tasks are held out (64: every kind in equal parts)."""
    return calculator_agent.held_out_first(all_tasks(), heldout)


def kind_of(task: dict) -> Kind:
    """The kind a task was made from, read from its id."""
    return _BY_NAME[task["id"].split("-")[1]]


def expression(task: dict) -> str:
    """The calculator expression that solves a task: its kind's, over the task's numbers."""
    a, b, c = (int(n) for n in task["id"].split("-")[2:])
    return kind_of(task).expression.format(a=a, b=b, c=c)


def demonstration_tasks(train: list[dict]) -> list[dict]:
    """The train tasks a warm start demonstrates: those of the :data:`DEMONSTRATED` kinds, in order."""
    return [task for task in train if kind_of(task).name in DEMONSTRATED]


def demonstration(task: dict) -> list[dict[str, Any]]:
    """The conversation of a correct agent on ``task``: one calculator call with its expression, then the answer."""
    return calculator_agent.one_call_conversation(task, expression(task), SYSTEM)


async def solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """One rollout: the calculator agent's loop on the word problem, scored by its final number."""
    return await calculator_agent.solve(task, rollout, temperature=temperature, system=SYSTEM)


__all__ = ["CALCULATOR", "DEMONSTRATED", "KINDS", "SYSTEM", "all_tasks", "demonstration", "demonstration_tasks",
           "expression", "kind_of", "solve", "split"]
