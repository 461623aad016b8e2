"""Warm start: how a tool-using agent's success grows with supervised steps on demonstrations.

The demonstrations are the demo's (``--agent calculator``: ``agentstream.examples.calculator_agent``;
``--agent word-problems``: ``agentstream.examples.word_problems``, demonstrated on half its kinds of
problem): one calculator call, then the answer, as trajectory-level samples without logprobs, 32 per step,
trained with the trainer's own step (``agentstream.trainer.step.train_step``, the demo's learning rate by
default). After each step from ``--from-step`` on, the agent's two-turn loop runs on the
held-out tasks in-process (the dev server's generation code, its tool rendering and parsing):
greedy, then ``--samples`` rollouts per task at each ``--temperatures``. Per step, JSON lines:
success, tool calls per rollout, and for the sampled runs the tasks whose rollouts disagree
(what a GRPO group learns from), and for the word problems greedy success per kind, after a machine
calibration line.

``--coast-from DIR`` asks what a saved warm start's AdamW moments do on their own: it loads the warm start a demo
saved (``demo-output/warm-start/<model>/v<N>``, its weights and optimizer state), judges it, then takes
``--steps`` optimizer steps whose gradients are all zero, so that only the carried first moment (decaying by
beta1 a step) moves the weights (the demo's weight decay is 0), and judges the agent after each step from
``--from-step`` on. A gain there is the warm start still going, which any steps after it, RL's or the supervised
control's, also get.
"""

from __future__ import annotations

import argparse
import copy
import time
import uuid
from dataclasses import replace
from pathlib import Path

import torch

from agentstream.demo.demonstrations import demonstration_calls
from agentstream.examples import arithmetic, calculator_agent, word_problems
from agentstream.infra.config import load_config
from agentstream.models import LoadedModel, assign_weights, eos_token_ids
from agentstream.serving.attention import use_grouped_attention
from agentstream.serving.generation import BatchRequest, SamplingParams, generate_batch
from agentstream.serving.tool_format import parse_tool_calls, render_prompt
from agentstream.stack.machine import calibrate
from agentstream.trainer.batching import Batch, Counts, Sample
from agentstream.trainer.policy import OPTIMIZER_STATE, build_policy, load_weights
from agentstream.trainer.step import train_step
from bench.common import emit

AGENTS = {"calculator": calculator_agent, "word-problems": word_problems}


def demonstration_sample(module, task: dict, tokenizer) -> Sample:
    """A demonstration as the stream processor merges it: first prompt, both turns, the tool result masked."""
    (prompt, first), (second_prompt, second) = demonstration_calls(
        module.demonstration(task), [module.CALCULATOR], tokenizer, tokenizer.eos_token_id)
    glue = second_prompt[len(prompt) + len(first):]
    return Sample.from_record({
        "transition_id": uuid.uuid4().hex, "rollout_id": uuid.uuid4().hex, "policy_version": 0,
        "prompt_token_ids": prompt, "response_token_ids": first + glue + second, "behaviour_logprobs": [],
        "loss_mask": [True] * len(first) + [False] * len(glue) + [True] * len(second), "merged_calls": 2,
        "split_at_break": False, "reward": 1.0, "advantage": 1.0})


class Agent:
    """The calculator agent's loop (a call, the tools, a second call) on a model in this process."""

    def __init__(self, module, model, tokenizer, eos) -> None:
        self.module, self.model, self.tokenizer, self.eos = module, model, tokenizer, eos

    def _generate(self, prompts: list[list[int]], temperature: float, n: int):
        self.model.eval()
        requests = [BatchRequest(p, SamplingParams(max_tokens=calculator_agent.MAX_TOKENS, temperature=temperature,
                                                   n=n))
                    for p in prompts]
        return generate_batch(self.model, self.tokenizer, requests, self.eos, self.tokenizer.pad_token_id or 0)

    def _prompt(self, messages: list[dict]) -> list[int]:
        return render_prompt(self.tokenizer, messages, [self.module.CALCULATOR], False)

    def run(self, tasks: list[dict], temperature: float, n: int) -> tuple[list[list[float]], float]:
        """(each task's n rewards, tool calls per rollout)."""
        opening = [[{"role": "system", "content": self.module.SYSTEM}, {"role": "user", "content": t["prompt"]}]
                   for t in tasks]
        answers: dict[tuple[int, int], str] = {}
        follow_ups, calls = [], 0
        for i, sequences in enumerate(self._generate([self._prompt(m) for m in opening], temperature, n)):
            for j, sequence in enumerate(sequences):
                parsed = parse_tool_calls(sequence.text)
                if not parsed.tool_calls:
                    answers[i, j] = sequence.text
                    continue
                calls += 1
                results = [{"role": "tool", "tool_call_id": c["id"],
                            "content": calculator_agent.run_tool(c["function"]["name"], c["function"]["arguments"])}
                           for c in parsed.tool_calls]
                follow_ups.append(((i, j), opening[i] + [{"role": "assistant", "content": parsed.content,
                                                          "tool_calls": parsed.tool_calls}] + results))
        if follow_ups:
            finals = self._generate([self._prompt(m) for _, m in follow_ups], temperature, 1)
            answers.update({key: sequences[0].text for (key, _), sequences in zip(follow_ups, finals, strict=True)})
        rewards = [[arithmetic.reward(answers[i, j], t["answer"]) for j in range(n)] for i, t in enumerate(tasks)]
        return rewards, calls / (n * len(tasks))


def by_kind(tasks: list[dict], rewards: list[list[float]]) -> dict[str, float]:
    """A word-problem agent's success per kind of problem (``word_problems.KINDS``)."""
    totals: dict[str, list[float]] = {}
    for task, task_rewards in zip(tasks, rewards, strict=True):
        totals.setdefault(word_problems.kind_of(task).name, []).extend(task_rewards)
    return {kind: round(sum(r) / len(r), 3) for kind, r in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", choices=sorted(AGENTS), default="calculator", help="The agent and its tasks.")
    parser.add_argument("--steps", type=int, default=5,
                        help="Supervised steps (32 demonstrations each); with --coast-from, zero-gradient steps.")
    parser.add_argument("--from-step", type=int, default=3, help="The first step after which the agent is judged.")
    parser.add_argument("--lr", type=float, default=None, help="Learning rate (default: the demo's).")
    parser.add_argument("--heldout", type=int, default=32, help="Held-out tasks the agent is judged on.")
    parser.add_argument("--temperatures", default="0.5,1.0", help="Sampling temperatures besides greedy.")
    parser.add_argument("--samples", type=int, default=4, help="Rollouts per task at each temperature.")
    parser.add_argument("--coast-from", type=Path, default=None,
                        help="A saved warm start's version folder: zero-gradient steps from it, not demonstrations.")
    args = parser.parse_args()
    if args.coast_from is not None and not (args.coast_from / OPTIMIZER_STATE).is_file():
        parser.error(f"{args.coast_from} holds no optimizer state ({OPTIMIZER_STATE}): no moments to coast on")
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    calibration = calibrate()
    emit("warm_start", "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    config = load_config()
    trainer = replace(config.trainer, model="smollm2", threads=2, lr=args.lr or config.demo.lr, temperature=1.0,
                      micro_batch_tokens=2048)
    policy = build_policy(trainer)
    tokenizer = policy.tokenizer
    sampler = copy.deepcopy(policy.model)  # generates as the dev server does
    sampler.set_attn_implementation("sdpa")
    use_grouped_attention(sampler)
    module = AGENTS[args.agent]
    agent = Agent(module, sampler, tokenizer,
                  eos_token_ids(LoadedModel(policy.model, tokenizer, policy.name, policy.dtype)))
    train, heldout = module.split()
    heldout = heldout[:args.heldout]

    def judge(step: int, **extra) -> None:
        for temperature, n in [(0.0, 1), *((t, args.samples) for t in temperatures)]:
            rewards, calls = agent.run(heldout, temperature, n)
            kinds = {"by_kind": by_kind(heldout, rewards)} if module is word_problems else {}
            emit("warm_start", "heldout_success", sum(map(sum, rewards)) / (n * len(heldout)), "share", step=step,
                 temperature=temperature, rollouts_per_task=n, tool_calls_per_rollout=round(calls, 3),
                 tasks_with_mixed_rollouts=sum(1 for r in rewards if 0 < sum(r) < n), **kinds, **extra)

    if args.coast_from is not None:
        load_weights(policy, args.coast_from)
        assign_weights(sampler, policy.model.state_dict())
        parameters = [p for group in policy.optimizer.param_groups for p in group["params"]]
        judge(0, zero_gradient_steps=True)
        for step in range(1, args.steps + 1):
            for parameter in parameters:
                parameter.grad = torch.zeros_like(parameter)
            policy.optimizer.step()
            assign_weights(sampler, policy.model.state_dict())
            if step >= args.from_step:
                judge(step, zero_gradient_steps=True)
        return
    demonstrated = module.demonstration_tasks(train)
    for step in range(1, args.steps + 1):
        batch = [demonstration_sample(module, task, tokenizer) for task in demonstrated[(step - 1) * 32:step * 32]]
        started = time.monotonic()
        result = train_step(policy, Batch(batch, 0, Counts()), trainer)
        assign_weights(sampler, policy.model.state_dict())
        emit("warm_start", "step_seconds", time.monotonic() - started, "s", step=step, loss=round(result.loss, 4))
        if step >= args.from_step:
            judge(step)


if __name__ == "__main__":
    main()
