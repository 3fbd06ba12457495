"""The workflow API with fakes: multi-turn trajectories (loss masks, log-probs and versions exact),
pauses between and within turns (nothing lost or duplicated), failing and hanging tools
(contained and counted), the controller scheduling episodes, and the loading of workflows."""

from __future__ import annotations

import asyncio
import os
import time
from array import array
from collections import Counter

import pytest
from fakes import LengthReward, LetterTok, Prompts, RecordingTrainer, Row, Score, VersionSync

from areal_fast.columns import LOGPROB_ARRAY, MASK_ARRAY, TOKEN_ARRAY
from areal_fast.controller import Controller, ControllerSettings
from areal_fast.rollout.staleness import StalenessManager
from areal_fast.sample import Sample
from areal_fast.workflow import EpisodeEngine, EpisodeFailed, Trajectory, load_workflow
from areal_fast.workflow.tools import CALCULATOR, calculate

ME = __name__
EOS = LetterTok.eos_token_id
COLUMNS = {"prompt_ids": TOKEN_ARRAY, "output_ids": TOKEN_ARRAY, "loss_mask": MASK_ARRAY,
           "output_logprobs": LOGPROB_ARRAY, "output_versions": TOKEN_ARRAY}
FINISH_S = 60.0  # limit of tool calls that must finish: a cold reward worker imports this module first


# ---------------------------------------------------------------- fakes
def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context (a lost or repeated token
    changes every later one)."""
    return 3 + (sum(context) * 31 + len(context)) % 23


def logprob_of(context: list[int]) -> float:
    return -0.01 * (1 + len(context) % 13)


class StepRollout:
    """Generates one token per step from :func:`next_token`, each tagged with the version the
    server holds at that moment; a pause holds generation between tokens (as the real client's
    abort-and-continue keeps every token). ``hold[(rid, k)]`` stops before token k of request rid
    and sets ``reached[(rid, k)]`` so a test can act at exactly that point."""

    def __init__(self, n_tokens: int = 4):
        self.version = 0
        self.n_tokens = n_tokens
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.hold: dict[tuple[str, int], asyncio.Event] = {}
        self.reached: dict[tuple[str, int], asyncio.Event] = {}
        self.requests: list[str] = []

    def hold_at(self, rid: str, k: int) -> None:
        self.hold[(rid, k)] = asyncio.Event()
        self.reached[(rid, k)] = asyncio.Event()

    async def generate(self, input_ids, sampling, rid):
        self.requests.append(rid)
        ctx, out, lps, vers = list(input_ids), [], [], []
        n = int(sampling.get("max_new_tokens", self.n_tokens))
        while len(out) < n:
            if (rid, len(out)) in self.hold:
                self.reached[(rid, len(out))].set()
                await self.hold[(rid, len(out))].wait()
            await self.resumed.wait()
            await asyncio.sleep(0)
            t = next_token(ctx)
            lps.append(logprob_of(ctx))
            ctx.append(t)
            out.append(t)
            vers.append(self.version)
        return Sample(prompt_ids=input_ids, output_ids=out, output_logprobs=lps, output_versions=vers,
                      finish_reason="length")

    async def pause(self):
        self.resumed.clear()

    async def resume(self):
        self.resumed.set()


async def two_turns(row, engine, feedback: str = "ok?") -> list[Trajectory]:
    """A test workflow: turn, feedback text, turn; reward from the last turn."""
    traj = Trajectory(prompt_ids=engine.encode_prompt(row.text))
    for turn in range(2):
        if turn:
            traj.add_context(engine.encode(feedback))
        gen = await engine.generate(traj.context_ids)
        traj.add_model(gen)
    traj.reward = (await engine.reward(row.task, engine.decode(gen.output_ids))).value
    traj.info = {"turns": 2}
    return [traj]


def expected_tokens(prompt_ids: list[int], pieces: list[tuple[str, object]], n: int) -> tuple[list, list, list]:
    """Replay: (output_ids, loss_mask, output_logprobs) for model turns of n tokens and context pieces."""
    ctx, out, mask, lps = list(prompt_ids), [], [], []
    for kind, value in pieces:
        if kind == "model":
            for _ in range(n):
                lps.append(logprob_of(ctx))
                t = next_token(ctx)
                ctx.append(t)
                out.append(t)
                mask.append(1)
        else:
            ctx += value
            out += value
            mask += [0] * len(value)
            lps += [0.0] * len(value)
    return out, mask, array(LOGPROB_ARRAY, lps).tolist()  # the columns hold float32 log-probs


# ---------------------------------------------------------------- trajectories
def test_multi_turn_trajectory_masks_logprobs_versions_exact():
    async def main():
        roll = StepRollout(n_tokens=3)
        engine = EpisodeEngine(roll, LengthReward(), LetterTok(), {"max_new_tokens": 3, "temperature": 1.0}, "ep")
        row = Row(0, "abc", {})
        (traj,) = await two_turns(row, engine)
        return traj, roll

    traj, roll = asyncio.run(main())
    tok = LetterTok()
    prompt = tok.encode("abc")
    fb = tok.encode("ok?", add_bos=False)
    out, mask, lps = expected_tokens(prompt, [("model", None), ("ctx", fb), ("model", None)], 3)
    assert [(f, type(getattr(traj, f)), getattr(traj, f).typecode) for f in COLUMNS] == [
        (f, array, code) for f, code in COLUMNS.items()]
    assert traj.prompt_ids.tolist() == prompt
    assert traj.output_ids.tolist() == out
    assert traj.loss_mask.tolist() == mask == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert traj.output_logprobs.tolist() == lps
    assert traj.output_versions.tolist() == [0, 0, 0, -1, -1, -1, 0, 0, 0]
    assert traj.n_turns == 2 and traj.n_model_tokens == 6 and traj.min_model_version() == 0
    assert roll.requests == ["ep-0", "ep-1"]  # one request id per turn, unique within the episode


def test_pause_within_and_between_turns_loses_and_duplicates_nothing():
    """Pause after 2 tokens of turn 0 (weights 0 -> 1), then again before turn 1 starts (1 -> 2):
    the trajectory equals the uninterrupted replay token for token, and each token carries the
    version that was live when it was made."""

    async def main():
        roll = StepRollout(n_tokens=4)
        roll.hold_at("ep-0", 2)
        roll.hold_at("ep-1", 0)
        engine = EpisodeEngine(roll, LengthReward(), LetterTok(), {"max_new_tokens": 4}, "ep")
        task = asyncio.create_task(two_turns(Row(0, "xyz", {}), engine))
        for key, new_version in ((("ep-0", 2), 1), (("ep-1", 0), 2)):
            await roll.reached[key].wait()
            await roll.pause()
            roll.version = new_version
            roll.hold[key].set()  # the request goes on only after the resume below
            await asyncio.sleep(0)
            await roll.resume()
        return await task

    (traj,) = asyncio.run(main())
    tok = LetterTok()
    fb = tok.encode("ok?", add_bos=False)
    out, mask, lps = expected_tokens(tok.encode("xyz"), [("model", None), ("ctx", fb), ("model", None)], 4)
    assert traj.output_ids.tolist() == out
    assert traj.loss_mask.tolist() == mask
    assert traj.output_logprobs.tolist() == lps
    assert traj.output_versions.tolist() == [0, 0, 1, 1, -1, -1, -1, 2, 2, 2, 2]
    assert traj.model_versions() == [0, 0, 1, 1, 2, 2, 2, 2]
    assert traj.min_model_version() == 0


def test_trajectory_check_names_the_workflow():
    t = Trajectory(prompt_ids=[1], output_ids=[3, 4], loss_mask=[1], output_logprobs=[0.0, 0.0],
                   output_versions=[0, 0])
    with pytest.raises(ValueError, match=r"my_wf.*2 output_ids.*loss_mask"):
        t.check("my_wf")
    with pytest.raises(ValueError, match="empty prompt_ids"):
        Trajectory(prompt_ids=[]).check("w")
    for bad in (float("inf"), float("nan"), None):
        with pytest.raises(ValueError, match="reward must be a finite number"):
            Trajectory(prompt_ids=[1], reward=bad).check("w")


def test_generate_refuses_another_temperature_while_training():
    engine = EpisodeEngine(StepRollout(), LengthReward(), LetterTok(), {"temperature": 1.0}, "ep")
    with pytest.raises(ValueError, match="temperature is fixed"):
        asyncio.run(engine.generate([1], temperature=0.5))


@pytest.mark.parametrize("key, value", [("top_p", 0.9), ("top_k", 20), ("min_p", 0.1)])
def test_generate_refuses_a_truncated_draw_while_training(key, value):
    """The trainer's log-probs are over the whole softmax: a turn may not ask for top-p / top-k /
    min-p while training; during evaluation (nothing trained) it may."""
    engine = EpisodeEngine(StepRollout(), LengthReward(), LetterTok(), {"temperature": 1.0}, "ep")
    with pytest.raises(ValueError, match=f"{key}={value!r} while training.*whole softmax"):
        asyncio.run(engine.generate([1], **{key: value}))
    asyncio.run(engine.generate([1], top_p=1.0, top_k=-1, min_p=0.0))  # the untruncated values pass
    evaluating = EpisodeEngine(StepRollout(), LengthReward(), LetterTok(), {"temperature": 0.0}, "ev",
                               training=False)
    assert asyncio.run(evaluating.generate([1], **{key: value})) is not None


# ---------------------------------------------------------------- loading
async def wf_ok(row, engine):
    return []


def wf_sync(row, engine):
    return []


def test_load_workflow_by_name_and_clear_errors():
    assert load_workflow(f"{ME}:wf_ok") is wf_ok
    assert load_workflow("areal_fast.workflow.single_turn:single_turn").__name__ == "single_turn"
    for name, msg in ((f"{ME}:wf_sync", "must be an async function"), (f"{ME}:nope", "has no attribute 'nope'"),
                      ("no_such_module_xyz:f", "cannot import module"), ("bad", "package.module:function")):
        with pytest.raises(ValueError, match=msg):
            load_workflow(name)


def test_config_resolves_rollout_workflow_at_load(tmp_path):
    from areal_fast.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout\.workflow: .*async function"):
        load_config(None, [f"rollout.workflow={ME}:wf_sync", "reward.name=math"])
    with pytest.raises(ConfigError, match=r"rollout\.workflow"):
        load_config(None, ["rollout.workflow=not a name"])
    assert load_config(None, [f"rollout.workflow={ME}:wf_ok"]).rollout.workflow == f"{ME}:wf_ok"


# ---------------------------------------------------------------- tools (real reward service)
def hang_tool(fields, call):
    time.sleep(3600)


def crash_tool(fields, call):
    os._exit(3)


def raise_tool(fields, call):
    raise RuntimeError("tool boom")


def test_calculator_parses_and_never_executes():
    assert calculate("12*34") == 408 and calculate("-(3+4)//2") == -4
    for bad in ("__import__('os')", "9**9**9", "1/2", "a+1", "2" * 300):
        with pytest.raises(ValueError):
            calculate(bad)


def test_hanging_and_crashing_tools_are_contained_and_counted():
    from areal_fast.launch.runtime import ServiceReward
    from areal_fast.reward import RewardService

    async def main():
        async with RewardService(num_workers=1, timeout_s=FINISH_S, default_reward="math") as svc:
            counts = Counter()
            engine = EpisodeEngine(StepRollout(), ServiceReward(svc), LetterTok(), {}, "ep", tool_counts=counts,
                                   tool_timeout_s=FINISH_S)
            ok = await engine.tool(CALCULATOR, "12*34")
            bad = await engine.tool(CALCULATOR, "12*")
            hung = await engine.tool(f"{ME}:hang_tool", "", timeout_s=0.5)  # must time out: short limit
            crashed = await engine.tool(f"{ME}:crash_tool", "")
            raised = await engine.tool(f"{ME}:raise_tool", "")
            after = await engine.tool(CALCULATOR, "2**10")  # the pool still answers
            return ok, bad, hung, crashed, raised, after, counts

    ok, bad, hung, crashed, raised, after, counts = asyncio.run(main())
    assert (ok.status, ok.output) == ("ok", "408")
    assert bad.status == "error" and "calculator" in bad.output
    assert hung.status == "timeout" and "exceeded" in hung.output
    assert crashed.status == "error" and raised.status == "error" and "tool boom" in raised.output
    assert (after.status, after.output) == ("ok", "1024")
    assert counts == Counter(ok=2, error=3, timeout=1)


# ---------------------------------------------------------------- the controller schedules episodes
async def flaky(row, engine):
    """Episode 1 of every odd position gives up (EpisodeFailed); position 2's episodes all do."""
    if row.index == 2 or (row.index % 2 and engine.episode_id.endswith("-1")):
        raise EpisodeFailed("the environment broke")
    return await two_turns(row, engine)


def _controller(tmp_path, workflow, roll, trainer, steps=4, batch=2, group=2):
    s = ControllerSettings(batch_size=batch, group_size=group, total_steps=steps,
                           sampling={"max_new_tokens": 3}, eval_sampling={"max_new_tokens": 3}, eval_every=0,
                           eval_at_start=False, output_dir=tmp_path, workflow=workflow)
    gate = StalenessManager(batch, max_staleness=1, max_concurrent=4)
    return Controller(s, Prompts(), LetterTok(), roll, LengthReward(), trainer,
                      VersionSync(roll, paused=lambda: not roll.resumed.is_set()), gate)


def test_controller_trains_multi_turn_episodes_with_exact_tokens_across_pauses(tmp_path):
    """Weight updates pause generation while episodes are mid-turn; every trained sample equals the
    uninterrupted replay, context tokens are masked with version -1, model-token versions never go
    down, and each position is trained once with its group's episodes."""
    roll, trainer = StepRollout(), RecordingTrainer()
    ctl = _controller(tmp_path, f"{ME}:two_turns", roll, trainer)
    summary = asyncio.run(ctl.run())
    assert summary["steps"] == 4
    tok = LetterTok()
    fb = tok.encode("ok?", add_bos=False)
    groups = Counter(s.group_id for s in trainer.samples)
    assert set(groups.values()) == {2} and len(groups) == 4 * 2  # 4 steps x 2 groups x 2 episodes
    for s in trainer.samples:
        out, mask, lps = expected_tokens(s.prompt_ids, [("model", None), ("ctx", fb), ("model", None)], 3)
        assert (s.output_ids.tolist(), s.loss_mask.tolist(), s.output_logprobs.tolist()) == (out, mask, lps)
        model_v = [v for v, m in zip(s.output_versions, mask) if m]
        assert model_v == sorted(model_v) and all(v >= 0 for v in model_v)
        assert all(v == -1 for v, m in zip(s.output_versions, mask) if not m)


def test_failed_episodes_are_counted_and_groups_train_on_the_rest(tmp_path):
    roll, trainer = StepRollout(), RecordingTrainer()
    ctl = _controller(tmp_path, flaky, roll, trainer, steps=3)
    summary = asyncio.run(ctl.run())
    c = summary["counters"]
    trained = Counter(s.group_id for s in trainer.samples)
    assert 2 not in trained  # every episode failed: nothing trained, its slot went back
    assert c["groups_failed"] >= 1
    assert all(n == (1 if g % 2 else 2) for g, n in trained.items())
    assert c["episodes_failed"] == 2 * c["groups_failed"] + sum(1 for g in trained if g % 2) + _odd_in_flight(ctl)


def _odd_in_flight(ctl) -> int:
    """Odd positions whose group finished but was not trained (still in the buffer at the end)."""
    return sum(1 for g in ctl.buffer if g.position % 2)


async def not_a_list(row, engine):
    return "oops"


def test_a_workflow_returning_garbage_stops_the_run_naming_it(tmp_path):
    ctl = _controller(tmp_path, f"{ME}:not_a_list", StepRollout(), RecordingTrainer())
    with pytest.raises(TypeError, match=rf"workflow {ME}:not_a_list .*list of Trajectory"):
        asyncio.run(ctl.run())


# ---------------------------------------------------------------- the python-tool math workflow
class CharTok:
    eos_token_id = 0

    def encode(self, text, add_bos=True):
        return ([1] if add_bos else []) + [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 1)


class ScriptedRollout:
    """Answers turn k with ``turns[k]`` (text), as tokens with version k."""

    def __init__(self, turns):
        self.turns, self.calls = list(turns), []

    async def generate(self, input_ids, sampling, rid):
        self.calls.append((list(input_ids), dict(sampling)))
        k = len(self.calls) - 1
        ids = [ord(c) for c in self.turns[k]]
        return Sample(prompt_ids=input_ids, output_ids=ids, output_logprobs=[-0.1] * len(ids),
                      output_versions=[k] * len(ids), finish_reason="stop")


class ToolAndMathReward:
    def __init__(self):
        self.programs = []

    async def score(self, task, completion):
        if task.get("reward", "").endswith(":python"):
            self.programs.append(completion)
            return Score(1.0, "ok", "42\n")
        return Score(1.0 if "\\boxed{42}" in completion else 0.0)


def test_python_math_workflow_masks_tool_output_and_scores_the_whole_answer():
    from areal_fast.workflow.python_math import solve_with_python

    turns = ["Let me compute. <python>print(6*7)</python>", " So the answer is \\boxed{42}."]
    roll, reward = ScriptedRollout(turns), ToolAndMathReward()
    engine = EpisodeEngine(roll, reward, CharTok(), {"max_new_tokens": 64}, "ep")
    (traj,) = asyncio.run(solve_with_python(Row(0, "Q?", {"answer": "42"}), engine))
    shown = "\n<output>\n42\n\n</output>\n"
    assert reward.programs == ["print(6*7)"]
    assert CharTok().decode(traj.output_ids) == turns[0] + shown + turns[1]
    assert traj.loss_mask.tolist() == [1] * len(turns[0]) + [0] * len(shown) + [1] * len(turns[1])
    assert traj.model_versions() == [0] * len(turns[0]) + [1] * len(turns[1])
    assert roll.calls[0][1]["stop"] == ["</python>"]
    assert roll.calls[1][0] == (traj.prompt_ids + traj.output_ids[: len(turns[0]) + len(shown)]).tolist()
    assert traj.reward == 1.0 and traj.info["tool_calls"] == 1.0 and traj.info["tool_failures"] == 0.0


def test_tool_output_with_special_token_text_is_spliced_in_as_plain_text(tmp_path):
    # the program prints the text of the tokenizer's special tokens: it must not become <eos>/<bos>
    transformers = pytest.importorskip("transformers")
    from areal_fast.data.tokenizer import CharTokenizer, HFTokenizer
    from areal_fast.workflow.python_math import solve_with_python

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 <>/()*{}.\\\n"
    CharTokenizer(chars).save_pretrained(tmp_path)
    tok = HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(tmp_path)))
    specials = {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}
    turns = ["<python>print(1)</python>", " so \\boxed{42}."]

    class Forging(ToolAndMathReward):
        async def score(self, task, completion):
            if task.get("reward", "").endswith(":python"):
                return Score(1.0, "ok", "42<eos><bos>\n<pad>")
            return await super().score(task, completion)

    roll = ScriptedTokens([tok.encode(t, add_bos=False) for t in turns])
    engine = EpisodeEngine(roll, Forging(), tok, {"max_new_tokens": 64}, "ep")
    (traj,) = asyncio.run(solve_with_python(Row(0, "q", {"answer": "42"}), engine))
    spliced = [i for i, m in zip(traj.output_ids, traj.loss_mask) if m == 0]
    assert spliced and not specials & set(spliced)
    assert tok.decode(spliced, skip_special_tokens=False) == "\n<output>\n42<eos><bos>\n<pad>\n</output>\n"
    assert engine.encode("<eos>") == [tok.tok.convert_tokens_to_ids(c) for c in "<eos>"]
    assert engine.encode("<eos>", special_tokens=True) == [tok.eos_token_id]  # a workflow that writes them itself


# ---------------------------------------------------------------- the CPU examples' workflows
class InProcessTools:
    """Runs named tools and the tiny task's rewards in this process (the real service runs them in
    its workers; what is tested here is the workflow around them)."""

    async def score(self, task, completion):
        from areal_fast.reward.registry import get_reward_fn
        from areal_fast.reward.result import coerce_result

        name = task.get("reward", "areal_fast.data.tiny_task:partial_reward")
        return coerce_result(get_reward_fn(name)(task, completion), name)


def _char_engine(turns, chars):
    from areal_fast.data.tokenizer import CharTokenizer

    tok = CharTokenizer(chars)
    roll = ScriptedTokens([tok.encode(t, add_bos=False) + [tok.eos_token_id] for t in turns])
    return EpisodeEngine(roll, InProcessTools(), tok, {"max_new_tokens": 16}, "ep"), roll, tok


class ScriptedTokens:
    def __init__(self, turns):
        self.turns, self.inputs = list(turns), []

    async def generate(self, input_ids, sampling, rid):
        self.inputs.append(list(input_ids))
        ids = self.turns[len(self.inputs) - 1]
        return Sample(prompt_ids=input_ids, output_ids=ids, output_logprobs=[-0.2] * len(ids),
                      output_versions=[len(self.inputs)] * len(ids), finish_reason="stop")


def test_tool_example_calls_the_calculator_right_to_left():
    from areal_fast.recipes import tool_task

    prompt, answer = tool_task.problem("seed-row")
    a, b = prompt[:-1].split("*")
    engine, roll, tok = _char_engine([f"{a}*{b}"[::-1]], tool_task.ALPHABET + "=")
    # the reversed expression is the model's call; the calculator reads it back as a*b
    (traj,) = asyncio.run(tool_task.multiply_with_calculator(Row(0, "seed-row", {"answer": "x"}), engine))
    assert traj.info == {"called": 1.0, "call_right": 1.0, "exact": 1.0} and traj.reward == 1.0
    n_call = len(a) + len(b) + 2  # call + eos
    assert tok.decode(traj.output_ids[n_call:]) == answer
    assert traj.loss_mask.tolist() == [1] * n_call + [0] * len(answer)
    engine, _, _ = _char_engine(["12"], tool_task.ALPHABET + "=")  # a direct answer: no call, partial credit
    (traj,) = asyncio.run(tool_task.multiply_with_calculator(Row(0, "seed-row", {"answer": "x"}), engine))
    assert traj.info["called"] == 0.0 and traj.loss_mask.tolist() == [1, 1, 1]


def test_multiturn_example_feedback_and_turns():
    from areal_fast.recipes import multiturn_task

    assert multiturn_task.feedback_text("djbac", "djbxcq", "positions") == "djb=c"
    assert multiturn_task.feedback_text("djbac", "dj", "positions") == "dj==="
    assert multiturn_task.feedback_text("djbac", "x", "retry") == ""
    engine, roll, tok = _char_engine(["djbhc", "djbac"], "abcdefghij=")
    row = Row(0, "cabjd=", {"answer": "djbac"})
    (traj,) = asyncio.run(multiturn_task.reverse_with_feedback(row, engine, max_turns=3))
    feedback = tok.encode("djb=c", add_bos=False) + tok.encode("cabjd=")
    assert traj.output_ids.tolist() == roll.turns[0] + feedback + roll.turns[1]
    assert traj.loss_mask.tolist() == [1] * 6 + [0] * len(feedback) + [1] * 6
    assert roll.inputs[1] == traj.prompt_ids.tolist() + roll.turns[0] + feedback
    assert traj.turn_rewards == [0.0, 1.0] and traj.reward == 0.5  # right after one feedback: discounted once
    assert traj.info["after_feedback"] == 1.0 and traj.info["turn1"] == 0.0


def test_python_tool_runs_model_code_in_the_sandbox_and_stops_a_loop():
    from areal_fast.launch.runtime import ServiceReward
    from areal_fast.reward import RewardService
    from areal_fast.workflow.tools import PYTHON

    async def main():
        async with RewardService(num_workers=1, timeout_s=FINISH_S, default_reward="math") as svc:
            engine = EpisodeEngine(StepRollout(), ServiceReward(svc), LetterTok(), {}, "ep", tool_timeout_s=FINISH_S)
            ok = await engine.tool(PYTHON, "print(6 * 7)")
            # must time out: the program's own limit is 0.8 x the call's, so the sandbox stops it first
            loop = await engine.tool(PYTHON, "while True:\n    pass\n", timeout_s=2.0)
            bad = await engine.tool(PYTHON, "raise SystemExit('no')")
            return ok, loop, bad, engine.tool_counts

    ok, loop, bad, counts = asyncio.run(main())
    assert (ok.status, ok.output) == ("ok", "42\n")
    assert loop.status == "timeout" and "python: timeout" in loop.output
    assert bad.status == "error" and "no" in bad.output
    assert counts == Counter(ok=1, timeout=1, error=1)
