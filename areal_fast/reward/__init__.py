"""Verifiable rewards for RL: math answers, code run against tests in a sandbox, custom functions.

    from areal_fast.reward import RewardService

    async with RewardService(num_workers=2, timeout_s=20) as service:
        r = await service.score({"reward": "math", "answer": "3/4"}, "... \\boxed{\\frac{3}{4}}")
        # RewardResult(value=1.0, status='ok', detail='correct', elapsed=0.002)
        r = await service.score({"reward": "code", "tests": [{"input": "2 3\\n", "output": "5\\n"}]},
                                "```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```")
        print(service.stats())

Task formats: `math.math_reward` ("answer"), `code.code_reward` ("tests", "fn_name", ...), and
"package.module:function" for a custom ``fn(task, completion) -> float | RewardResult``.
Every task may carry "timeout_s" (per-call limit). Rewards never run in the caller's process,
and generated code never runs in the workers' either (see `sandbox`).
"""

from .registry import get_reward_fn
from .result import RewardResult
from .service import RewardService

__all__ = ["RewardResult", "RewardService", "get_reward_fn"]
