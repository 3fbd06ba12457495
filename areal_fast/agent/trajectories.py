"""An episode's recorded chat calls as trajectories to train on (:func:`assemble`).

The calls form a forest: a call that continues an earlier one token for token (its ``parent``)
extends that conversation; a conversation's first call, and a call after the agent edited its
history (a *break*), start a tree. Each path from a root to a leaf is a *chain* of calls.

Two ways to give rewards (``reward``):

- ``"final"``: one trajectory per chain, the whole conversation as one sample: the first call's
  prompt, then each call's output (loss mask 1) and, between calls, the tokens the next prompt
  added (the template's end of turn, tool results, user messages: loss mask 0). Its reward is
  the chain's discounted return from its first call, ``sum_k discount**k * r_k``.
- ``"per_turn"``: one trajectory per call (its prompt, its output), with the return from that
  call, ``G_k = r_k + discount * G_{k+1}``: each turn gets its own advantage.

``r_k`` is the reward of call k: the one set with ``set_reward(completion_id, value)`` (0 when
none), plus the episode's final reward on the episode's last call. With only a final reward
and ``discount`` < 1, a conversation that took more turns is worth less.

A call shared by two chains (the agent branched from it) is trained once: in the second chain
its output is context (loss mask 0). Only model tokens carry loss mask 1, log-probs and versions;
every other token is context (version -1).
"""

from __future__ import annotations

from areal_fast.agent.session import ChatCall
from areal_fast.sample import Sample

REWARD_MODES = ("final", "per_turn")


def chains(calls: list[ChatCall]) -> list[list[ChatCall]]:
    """Root-to-leaf paths of the calls' forest, in the order of their leaves."""
    by_id = {c.completion_id: c for c in calls}
    has_child = {c.parent for c in calls if c.parent is not None}
    out = []
    for leaf in calls:
        if leaf.completion_id in has_child:
            continue
        path = [leaf]
        while path[-1].parent is not None:
            path.append(by_id[path[-1].parent])
        out.append(path[::-1])
    return out


def returns(chain: list[ChatCall], rewards: dict[str, float], discount: float) -> list[float]:
    """``G_k`` along ``chain`` (see the module docstring)."""
    out, g = [], 0.0
    for c in reversed(chain):
        g = rewards.get(c.completion_id, 0.0) + discount * g
        out.append(g)
    return out[::-1]


def _info(chain: list[ChatCall]) -> dict[str, float]:
    return {"calls": float(len(chain)), "tool_calls": float(sum(len(c.tool_calls) for c in chain))}


def assemble(calls: list[ChatCall], *, reward: str = "final", discount: float = 1.0,
             final_reward: float | None = None) -> list[Sample]:
    """The trajectories of one episode (see the module docstring)."""
    if reward not in REWARD_MODES:
        raise ValueError(f"reward: expected one of {REWARD_MODES}, got {reward!r}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount: expected a number in [0, 1], got {discount!r}")
    if not calls:
        return []
    rewards = {c.completion_id: c.reward for c in calls if c.reward is not None}
    if final_reward is not None:
        last = calls[-1].completion_id
        rewards[last] = rewards.get(last, 0.0) + float(final_reward)
    breaks = float(sum(c.diverged_at is not None for c in calls))
    out: list[Sample] = []
    trained: set[str] = set()
    for chain in chains(calls):
        g = returns(chain, rewards, discount)
        if reward == "per_turn":
            for c, gk in zip(chain, g):
                if c.completion_id in trained:
                    continue
                trained.add(c.completion_id)
                t = Sample(prompt_ids=c.sample.prompt_ids)
                t.add_model(c.sample)
                t.reward, t.rid, t.turn_rewards = gk, c.completion_id, [rewards.get(c.completion_id, 0.0)]
                t.info = {**_info([c]), "history_breaks": breaks}
                out.append(t)
            continue
        t = Sample(prompt_ids=chain[0].sample.prompt_ids)
        for k, c in enumerate(chain):
            if k:  # what the next prompt added after the previous output: context
                n = len(t.prompt_ids) + len(t.output_ids)
                if c.sample.prompt_ids[:n] != t.context_ids:
                    raise RuntimeError(f"call {c.completion_id} does not continue {chain[k - 1].completion_id} "
                                       "token for token (a recording bug)")
                t.add_context(c.sample.prompt_ids[n:])
            if c.completion_id in trained:
                t.add_context(c.sample.output_ids)
            else:
                t.add_model(c.sample)
                trained.add(c.completion_id)
        t.reward, t.rid = g[0], chain[-1].completion_id
        t.turn_rewards = [rewards.get(c.completion_id, 0.0) for c in chain]
        t.info = {**_info(chain), "history_breaks": breaks}
        out.append(t)
    return out
