"""The TRL arm of ``bench/bench_vs_trl.py``: TRL's synchronous ``GRPOTrainer`` on the tiny recipe
(``examples/tiny_reverse.yaml``): the same warm-started model, train and held-out rows, reward,
group size, batch, sampling and optimizer settings; greedy held-out exact match every
``eval.every_steps`` steps (its time left out of the RL wall time, as areal_fast leaves its own out).

    python -m tools.trl_arm WARM_START_DIR OUT.json --seed 1 --steps 120

Needs the ``trl`` extra (``pip install areal-fast[trl]``)."""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--recipe", default="examples/tiny_reverse.yaml")
    ap.add_argument("--eval-every", type=int, default=20)
    a = ap.parse_args(argv)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_fast.config import load_config
    from areal_fast.data import tiny_task
    from areal_fast.data.datasets import read_rows
    from areal_fast.data.tokenizer import load_tokenizer

    cfg = load_config(a.recipe, [f"experiment.seed={a.seed}", f"eval.every_steps={a.eval_every}"])
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(a.seed)
    char_tok = load_tokenizer(a.model)  # areal_fast's prompt ids: BOS + characters
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    bos = tok.bos_token
    train = read_rows(cfg.data.train, cfg.data, "train", a.seed)
    held = read_rows(cfg.data.train, cfg.data, "eval", a.seed)
    ds = Dataset.from_list([{"prompt": bos + r["prompt"], "answer": r["answer"]} for r in train])
    reward_fn = tiny_task.partial_reward

    def reward(prompts, completions, answer, **_):
        return [reward_fn({"answer": ans}, c) for c, ans in zip(completions, answer)]

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    r, t, o = cfg.rollout, cfg.train, cfg.train.optim
    args = GRPOConfig(
        output_dir=a.out + ".d", max_steps=a.steps, per_device_train_batch_size=t.batch_size * r.group_size,
        num_generations=r.group_size, max_completion_length=r.max_new_tokens, temperature=r.temperature,
        top_p=r.top_p, learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps, max_grad_norm=o.grad_clip,
        beta=0.0, epsilon=t.ppo.loss.eps_clip, num_iterations=1, loss_type="dapo", scale_rewards="group",
        use_cpu=True, bf16=False, seed=a.seed, logging_steps=1000, save_strategy="no", report_to=[],
        dataloader_num_workers=0, disable_tqdm=True)
    evals, eval_s = [], [0.0]
    held_ids = [char_tok.encode(x["prompt"]) for x in held]

    @torch.no_grad()
    def evaluate(m, step):
        t0 = time.perf_counter()
        m.eval()
        hits = 0
        for i in range(0, len(held), 64):
            rows = held_ids[i:i + 64]
            n = max(map(len, rows))
            x = torch.tensor([[tok.pad_token_id] * (n - len(p)) + p for p in rows])
            mask = (torch.arange(n)[None] >= torch.tensor([n - len(p) for p in rows])[:, None]).long()
            y = m.generate(input_ids=x, attention_mask=mask, do_sample=False, max_new_tokens=r.max_new_tokens,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for row, q in zip(y[:, n:].tolist(), held[i:i + 64]):
                hits += tiny_task.reward(q, tok.decode(row, skip_special_tokens=True))
        m.train()
        eval_s[0] += time.perf_counter() - t0
        evals.append({"step": step, "time": time.perf_counter() - start - eval_s[0], "eval_reward": hits / len(held)})

    class Every(TrainerCallback):
        def on_step_end(self, args_, state, control, model=None, **kw):
            if state.global_step % cfg.eval.every_steps == 0:
                evaluate(model, state.global_step)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Every()])
    start = time.perf_counter()
    evaluate(model, 0)
    trainer.train()
    rl_s = time.perf_counter() - start - eval_s[0]
    json.dump({"rl_s": rl_s, "evals": evals, "eval_s": eval_s[0]}, open(a.out, "w"))



def _areal_arm(recipe: str, out: str, seed: int, steps: int, extra: list[str]) -> dict:
    """One areal_fast run of the recipe; RL wall time and eval times without the evaluations."""
    import subprocess
    from pathlib import Path

    cmd = ["areal-fast", "train", recipe, f"experiment.seed={seed}", f"experiment.total_steps={steps}",
           f"experiment.output_dir={out}", "checkpoint.every_steps=0", "log.progress=false", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=open(out + ".log", "w"), env=None)
    summary = json.loads((Path(out) / "summary.json").read_text())
    evals, spent = [], 0.0
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "eval":
            spent += row["eval_s"]
            evals.append({"step": row["step"], "time": row["time"] - spent, "eval_reward": row["eval_reward"]})
    return {"rl_s": summary["elapsed_s"] - summary["timers"].get("eval_s", 0.0), "evals": evals,
            "timers": summary["timers"], "elapsed_s": summary["elapsed_s"]}


def compare(out_dir: str, seeds: list[int], steps: int, target: float, recipe: str, eval_every: int = 10):
    """The three arms per seed, interleaved (async, then sync and TRL in an order turning with the
    seed) so the machine's load falls on all alike; yields one row per (seed, arm) with the load around it."""
    import os
    import subprocess
    import sys

    os.makedirs(out_dir, exist_ok=True)
    for seed in seeds:
        base = f"{out_dir}/s{seed}"
        warm = f"{base}_async/warm_start"
        ev = f"eval.every_steps={eval_every}"
        arms = [("async", [ev]), ("sync", [ev, "rollout.max_staleness=0"]), ("trl", None)]
        order = [arms[0]] + (arms[1:] if seed % 2 else arms[:0:-1])
        for arm, extra in order:
            load0 = os.getloadavg()
            if extra is None:
                subprocess.run([sys.executable, "-m", "tools.trl_arm", warm, f"{base}_trl.json", "--seed", str(seed),
                                "--steps", str(steps), "--recipe", recipe, "--eval-every", str(eval_every)], check=True,
                               stdout=subprocess.DEVNULL, stderr=open(f"{base}_trl.log", "w"))
                res = json.load(open(f"{base}_trl.json"))
            else:
                more = [] if arm == "async" else [f"model.path={warm}", "model.warm_start.enabled=false"]
                res = _areal_arm(recipe, f"{base}_{arm}", seed, steps, extra + more)
            hit = next((e["time"] for e in res["evals"] if e["eval_reward"] >= target), None)
            row = {"seed": seed, "arm": arm, "steps": steps, "eval_every": eval_every, "rl_s": round(res["rl_s"], 2),
                   "time_to_target_s": None if hit is None else round(hit, 2), "target": target,
                   "eval_last": res["evals"][-1]["eval_reward"], "evals": res["evals"],
                   "load_start": load0, "load_end": os.getloadavg(), "timers": res.get("timers"),
                   "elapsed_s": res.get("elapsed_s")}
            print(json.dumps({k: v for k, v in row.items() if k != "evals"}), flush=True)
            yield row


if __name__ == "__main__":
    main()
