"""A task whose answers grow longer over the run, for the server-count policy's real run
(``tests/launch/test_autoscale_e2e.py``, ``docs/autoscale.md``): the tiny task's prompts and reward, but
every answer is exactly ``short`` tokens long until weight version ``switch``, and ``long`` tokens from
then on (the end-of-sequence token is ignored), so generation is cheap and then costly, as when a
long-CoT run's answers lengthen.

It runs as the workflow ``tools.autoscale_task:growing_answers`` (``rollout.workflow``); its lengths are
``rollout.workflow_args``. The run's working directory is the repository root (``tools`` importable).

The answers here are forced, not the model's own (exact match means nothing under it): it is the step in
cost the real-run test needs at a known version, in a few steps. A task whose answers lengthen by
themselves, and where exact match is the model's, is the synthetic task's ``data.synthetic.growth``
(``areal_fast.data.tiny_task``), which the comparison with fixed splits runs (``tools/autoscale_compare.py``)."""

from __future__ import annotations


async def growing_answers(row, engine, short: int = 2, long: int = 96, switch: int = 6) -> list:
    n = short if engine.version < switch else long
    sample = await engine.generate(engine.encode_prompt(row.text), max_new_tokens=n, ignore_eos=True,
                                   stop_token_ids=[])
    res = await engine.reward(row.task, engine.decode(sample.output_ids))
    sample.reward = float(res.value)
    return [sample]
