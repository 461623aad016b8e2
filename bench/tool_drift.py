"""Retokenization drift of tool calls: how often SmolLM2's chat template, as the dev server renders it, writes a
tool call back into other tokens than the model generated.

SmolLM2-135M-Instruct's template ignores tools, so the dev server renders them hermes-style
(``serving/tool_format.py``). Each form a model may write a call in (canonical; no newlines;
whitespace around; indented, compact or key-swapped JSON; ``parameters`` for ``arguments``; text
before or after; two calls) is measured from two sources:

- ``tokenizer``: the form's text in the tokenizer's own encoding (plus the end-of-turn token), parsed
  by the server's parser, turned into the openai SDK's message and serialized as the SDK sends it,
  then rendered as the server renders the next prompt;
- ``smollm2``: SmolLM2 asked greedily on the dev server, through the official openai SDK, to repeat the
  form, so the tokens are the model's own; the SDK's message goes back with a ``tool`` result the
  standard way and the server's next ``prompt_token_ids`` are compared. A copy that is not verbatim
  counts under ``smollm2_variant``; answers sampled at temperature 1 to a plain task count under
  ``smollm2_sampled``.

A prefix match means the next prompt starts with the previous prompt + response ids (trajectory-level
samples merge); a break means it does not, and ``retokenized`` counts the breaks where the text came
back the same but in other tokens than the model chose. Prints the machine's calibration, then one
JSON line per form and source, and the overall rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessage

from agentstream.models import LoadedModel, load_model
from agentstream.serving.app import create_app
from agentstream.serving.tool_format import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    canonical_tool_call,
    parse_tool_calls,
    render_prompt,
    renders_tools,
)
from agentstream.stack.machine import calibrate
from bench.common import emit
from tests.support.http_thread import ServerThread

BENCH = "tool_drift"
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
EXPRESSIONS = ("47*83+5", "12 * (31 - 4)", "96/8-3")
COPY_TOKENS = 96
TOOL_RESULT = "42"


def _block(payload: dict[str, Any], **dumps: Any) -> str:
    return f"{TOOL_CALL_START}\n{json.dumps(payload, ensure_ascii=False, **dumps)}\n{TOOL_CALL_END}"


def _call(expression: str) -> dict[str, Any]:
    return {"name": "calculator", "arguments": {"expression": expression}}


FORMS: dict[str, Callable[[str], str]] = {
    "canonical": lambda e: canonical_tool_call("calculator", {"expression": e}),
    "no_newlines": lambda e: f"{TOOL_CALL_START}{json.dumps(_call(e))}{TOOL_CALL_END}",
    "newline_before": lambda e: "\n" + canonical_tool_call("calculator", {"expression": e}),
    "newline_after": lambda e: canonical_tool_call("calculator", {"expression": e}) + "\n",
    "indented_json": lambda e: _block(_call(e), indent=2),
    "compact_json": lambda e: _block(_call(e), separators=(",", ":")),
    "keys_swapped": lambda e: _block({"arguments": {"expression": e}, "name": "calculator"}),
    "parameters_key": lambda e: _block({"name": "calculator", "parameters": {"expression": e}}),
    "text_before": lambda e: "I will use the calculator.\n" + canonical_tool_call("calculator", {"expression": e}),
    "text_after": lambda e: canonical_tool_call("calculator", {"expression": e}) + "\nThe tool will answer.",
    "two_calls": lambda e: (canonical_tool_call("calculator", {"expression": e}) + "\n"
                            + canonical_tool_call("calculator", {"expression": "1+1"})),
}


@dataclass
class Outcome:
    """One completion sent back: tool calls made, the asked text copied, the prefix kept, the text kept (ids aside)."""

    called: bool
    copied: bool = True
    extends: bool = False
    same_text: bool = False


def compare(tokenizer: Any, prompt: list[int], generated: list[int], next_prompt: list[int]) -> Outcome:
    """Whether the next prompt extends prompt + generated, and whether it at least spells the same text."""
    sequence = prompt + generated
    rendered = tokenizer.decode(next_prompt[len(prompt):])
    return Outcome(called=True, extends=next_prompt[:len(sequence)] == sequence,
                   same_text=rendered.startswith(tokenizer.decode(generated)))


def tokenized(loaded: LoadedModel, text: str) -> Outcome:
    """A form in the tokenizer's own encoding, through the server's parser, the SDK's message and the renderer."""
    tokenizer, native = loaded.tokenizer, renders_tools(loaded.tokenizer)
    ask = [{"role": "user", "content": f"Repeat after me:\n{text}"}]
    prompt = render_prompt(tokenizer, ask, [CALCULATOR], native)
    generated = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    parsed = parse_tool_calls(text)
    message = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls})
    sent = message.model_dump(exclude_unset=True, mode="json")  # what the SDK sends for a message object
    results = [{"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT} for call in parsed.tool_calls]
    return compare(tokenizer, prompt, generated, render_prompt(tokenizer, [*ask, sent, *results], [CALCULATOR], native))


async def send_back(client: openai.AsyncOpenAI, loaded: LoadedModel, messages: list[Any], asked: str | None,
                    **sampling: Any) -> Outcome:
    """Generate on the server, then send the SDK's message back with a tool result and compare the next prompt."""
    first = await client.chat.completions.create(model=loaded.name, messages=messages, tools=[CALCULATOR],
                                                 extra_body={"return_token_ids": True}, **sampling)
    choice = first.choices[0]
    generated = choice.model_extra["token_ids"]
    copied = asked is not None and loaded.tokenizer.decode(generated, skip_special_tokens=True) == asked
    calls = choice.message.tool_calls or []
    if not calls:
        return Outcome(called=False, copied=copied)
    results = [{"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT} for call in calls]
    following = await client.chat.completions.create(
        model=loaded.name, messages=[*messages, choice.message, *results], tools=[CALCULATOR], max_tokens=1,
        temperature=0, extra_body={"return_token_ids": True})
    outcome = compare(loaded.tokenizer, first.model_extra["prompt_token_ids"], generated,
                      following.model_extra["prompt_token_ids"])
    outcome.copied = copied
    return outcome


def report(form: str, source: str, outcomes: list[Outcome], **extra: Any) -> tuple[int, int, int]:
    """One JSON line for the calls of a form from a source; returns (calls, prefix matches, retokenized breaks)."""
    called = [outcome for outcome in outcomes if outcome.called]
    kept = sum(outcome.extends for outcome in called)
    retokenized = sum(outcome.same_text and not outcome.extends for outcome in called)
    emit(BENCH, "prefix_breaks", len(called) - kept, "calls", form=form, source=source, calls=len(called),
         prefix_matches=kept, retokenized=retokenized,
         break_rate=round((len(called) - kept) / len(called), 3) if called else None, **extra)
    return len(called), kept, retokenized


def overall(source: str, totals: list[tuple[int, int, int]], model: str) -> None:
    """The break rate over every call of a source."""
    calls, kept, retokenized = (sum(column) for column in zip(*totals, strict=True))
    emit(BENCH, "break_rate", (calls - kept) / calls if calls else None, "fraction", source=source, calls=calls,
         prefix_matches=kept, prefix_breaks=calls - kept, retokenized=retokenized, model=model,
         template="hermes in the system prompt (the template ignores tools)")


async def measure(url: str, loaded: LoadedModel, samples: int, sample_tokens: int) -> None:
    """Every form with every expression from both sources, then temperature-1 samples, printed as JSON lines."""
    cases = [(form, write(expression)) for form, write in FORMS.items() for expression in EXPRESSIONS]
    totals = [report(form, "tokenizer", [tokenized(loaded, text) for name, text in cases if name == form])
              for form in FORMS]
    overall("tokenizer", totals, loaded.name)

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    copies = await asyncio.gather(*(
        send_back(client, loaded, [{"role": "user", "content": f"Repeat after me:\n{text}"}], text,
                  max_tokens=COPY_TOKENS, temperature=0)
        for _, text in cases))
    model_totals = []
    for form in FORMS:
        mine = [outcome for (name, _), outcome in zip(cases, copies, strict=True) if name == form]
        model_totals.append(report(form, "smollm2", [outcome for outcome in mine if outcome.copied],
                                   asked=len(mine), copied_verbatim=sum(outcome.copied for outcome in mine)))
    variants = [outcome for outcome in copies if not outcome.copied]
    model_totals.append(report("not_verbatim", "smollm2_variant", variants))
    task = [{"role": "user", "content": f"Compute {EXPRESSIONS[0]}."}]
    sampled = await asyncio.gather(*(send_back(client, loaded, task, None, max_tokens=sample_tokens,
                                               temperature=1.0, seed=seed) for seed in range(samples)))
    model_totals.append(report("sampled", "smollm2_sampled", sampled, samples=samples, temperature=1.0,
                               max_tokens=sample_tokens))
    overall("smollm2", model_totals, loaded.name)
    await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16, help="Temperature-1 answers sampled to a plain task.")
    parser.add_argument("--sample-tokens", type=int, default=64, help="Token limit of each sampled answer.")
    args = parser.parse_args()
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    loaded = load_model("smollm2")
    server = ServerThread(create_app(loaded))
    try:
        asyncio.run(measure(server.url, loaded, args.samples, args.sample_tokens))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
