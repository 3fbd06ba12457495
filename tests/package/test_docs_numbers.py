"""Every measured figure the README and docs quote is the one its committed result file holds.

``FIGURES`` maps a quoted text in a document, with ``{}`` where each figure stands, to the result file
under ``bench/results/`` and the function that computes the figures from it, formatted as the text
writes them. The test finds every occurrence of the text (whitespace folded, as Markdown renders it)
and compares the figures: a document that quotes a number no result file holds, or an older one than
the newest measurement of its kind, fails with the text it should say. A new measurement (a newer row)
makes the docs fail until they say the new figure. ``docs/benchmarks.md``'s table is checked against
``bench/`` the same way: every benchmark listed, nothing listed that does not exist.

What counts as a figure: a number the project measured (a speedup, a rate, a time, an exact-match
score, a k3, a byte count or share that a run produced, a count of what a run did). Not figures:
settings and defaults, fixed deadlines and limits in the code, a benchmark's parameters, confidence
levels, protocol constants, version numbers, model sizes a config chooses, arithmetic from shapes or
bandwidths, someone else's numbers (datasheets, papers, other projects' defaults). A figure with no
result file behind it is reworded away or deleted, never backed by a hand-written file.

So that no figure slips in unchecked, every line of the docs (outside code blocks) with a number
followed by a unit (``FIGURE``: x, s, ms, %, tokens/s, GB/s, MB, k, M, ...), and every line with a
unitless decimal in a table row or next to a measured quantity (exact match, EM, reward, k3, staleness:
``unitless_figure``), is spanned by a FIGURES entry or listed, under its reason, in
``docs_numbers_exempt.txt``. The reasons are the four of
``EXEMPT_REASONS`` (a setting, someone else's number, arithmetic, not a figure); there is no
"later" among them. A new or edited line lands in none of them and fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, localcontext
from math import ceil, exp
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def rows(name: str) -> list[dict]:
    """The rows of ``bench/results/<name>``, in the order they were measured (file order)."""
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def newest(name: str, **match) -> dict:
    """The last row of ``name`` whose fields equal ``match``."""
    found = [r for r in rows(name) if all(r.get(k) == v for k, v in match.items())]
    assert found, f"bench/results/{name} has no row with {match}"
    return found[-1]


def note(name: str, prefix: str) -> dict:
    """The last row of ``name`` whose ``note`` starts with ``prefix`` (a measurement the docs name)."""
    found = [r for r in rows(name) if (r.get("note") or "").startswith(prefix)]
    assert found, f"bench/results/{name} has no row noted {prefix!r}..."
    return found[-1]


def half_up(x: float) -> int:
    """x rounded to an integer, halves away from zero (4,548.5 -> 4,549), as the docs round."""
    return int(Decimal(repr(x)).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def thousands(x: float) -> str:
    return f"{half_up(x):,}"


def autoscale_row(scenario: str) -> Callable[[], tuple[str, ...]]:
    """docs/autoscale.md's table: the policy's and the best fixed split's samples/s, that split's generation
    GPUs, the policy's difference from it (%) and the seeds, of the newest sweep of ``scenario``."""
    def figures() -> tuple[str, ...]:
        r = newest("autoscale.jsonl", scenario=scenario)
        return (f"{r['policy_samples_per_s']:.1f}", f"{r['best_fixed_samples_per_s']:.1f}",
                str(r["best_fixed_gen_gpus"]), f"{100 * r['policy_vs_best_fixed']:+.1f}", str(len(r["seeds"])))
    return figures


LOADED_SWEEP = ("20261203_1649", (1, 2))  # docs/autoscale.md's first real-run sweep: its seeds run on a loaded machine


def autoscale_real_rows(arm: str | None = None, sweep: tuple | None = None) -> list[dict]:
    """The rows of one real-run comparison of ``bench_autoscale_real`` (its ``run`` stamp), of ``arm``:
    ``sweep`` None: the newest; else (stamp, seeds)."""
    rs = rows("autoscale_real.jsonl")
    run, seeds = sweep or (rs[-1]["run"], None)
    return [r for r in rs if r["run"] == run and arm in (None, r["arm"]) and (seeds is None or r["seed"] in seeds)]


def _seed_mean(rs: list[dict], key: str) -> float:
    return sum(r[key] for r in rs) / len(rs)


def autoscale_real_arm(arm: str, sweep: tuple | None = None) -> Callable[[], tuple[str, ...]]:
    """docs/autoscale.md's real-run tables, one arm: servers in the pool (mean over steps), RL wall time (s),
    held-out exact match at the end and over the evaluations after the start, the largest staleness of any
    step, the seeds, and the load average's range around the runs; means over the sweep's seeds."""
    def figures() -> tuple[str, ...]:
        rs = autoscale_real_rows(arm, sweep)
        loads = [x for r in rs for x in (r["load_1m_start"], r["load_1m_end"])]
        return (f"{_seed_mean(rs, 'server_mean'):.2f}", f"{_seed_mean(rs, 'rl_s'):.0f}",
                f"{_seed_mean(rs, 'eval_final'):.3f}", f"{_seed_mean(rs, 'eval_mean'):.3f}",
                str(max(r["staleness_max"] for r in rs)), str(len(rs)), f"{min(loads):.1f}", f"{max(loads):.1f}")
    return figures


def autoscale_real_policy(seed: int, sweep: tuple | None = None) -> Callable[[], tuple[str, ...]]:
    """docs/autoscale.md: one seed's policy run, as a phrase: the servers it held and when it changed them."""
    def figures() -> tuple[str, ...]:
        (r,) = [x for x in autoscale_real_rows("policy", sweep) if x["seed"] == seed]
        held = ", then ".join(f"{n} for {k} steps" for n, k in r["server_steps"])
        moves = ", ".join(f"{c['target'] - c['change']} -> {c['target']} at step {c['step']}" for c in r["changes"])
        return (f"seed {seed}: {held} ({moves or 'no change'})",)
    return figures


def autoscale_real_gap(sweep: tuple | None = None) -> Callable[[], tuple[str, ...]]:
    """The policy's mean final and mean-over-run exact match less the best fixed split's (the fixed arm highest
    on each), with that arm's server count."""
    def figures() -> tuple[str, ...]:
        rs = autoscale_real_rows(None, sweep)
        fixed = sorted({r["arm"] for r in rs if r["arm"] != "policy"})
        out = []
        for key in ("eval_final", "eval_mean"):
            best = max(fixed, key=lambda a: _seed_mean(autoscale_real_rows(a, sweep), key))
            gap = _seed_mean(autoscale_real_rows("policy", sweep), key) - _seed_mean(autoscale_real_rows(best, sweep),
                                                                                      key)
            out += [f"{gap:+.3f}", best[len("fixed"):]]
        return tuple(out)
    return figures


def e2e_speedup() -> tuple[str, ...]:
    return (f"{newest('e2e.jsonl')['speedup_tokens_per_s']:.2f}",)


def e2e_tokens() -> tuple[str, ...]:
    r = newest("e2e.jsonl")
    a, s = r["async_trained_tokens_per_s"], r["sync_trained_tokens_per_s"]
    return tuple(f"{round(v)}" for v in (a["mean"], a["min"], a["max"], s["mean"], s["min"], s["max"]))


def sim_speedup(setup: str) -> Callable[[], tuple[str, ...]]:
    return lambda: (f"{newest('async_speedup_summary.jsonl', setup=setup)['speedup']:.2f}",)


def sim_paper_scale_range() -> tuple[str, ...]:
    """The newest simulated async/sync speedup of each setup at the paper's scale (N nodes x 8 GPUs)."""
    setups = {r["setup"] for r in rows("async_speedup_summary.jsonl") if "nodes" in r["setup"]}
    s = [newest("async_speedup_summary.jsonl", setup=x)["speedup"] for x in sorted(setups)]
    return f"{min(s):.1f}", f"{max(s):.1f}"


CLIENT_RATE = "client rate at full lengths, no decode-rate limit"  # the note of the client-bound runs


def client_rate(prefix: str = CLIENT_RATE) -> Callable[[], tuple[str, ...]]:
    """Received tokens/s (millions) and the share of a core of the newest 256-server client-bound run."""
    def figures():
        r = note("controller_scale.jsonl", prefix)
        return f"{r['received_tok_s'] / 1e6:.1f}", f"{100 * r['cpu_util']:.0f}"
    return figures


def scale_row(prefix: str, rate: str = "M") -> Callable[[], tuple[str, ...]]:
    """A row of docs/scale.md's latest-state table: received tokens/s, CPU us a token, share of a core,
    loop lag p50 / p99 / max (ms), pause -> continue max (s), peak RSS (the table's GB: MB / 1000)."""
    def figures():
        r = note("controller_scale.jsonl", prefix)
        tok = f"{r['received_tok_s'] / 1e6:.1f}" if rate == "M" else f"{r['received_tok_s'] / 1e3:.0f}"
        return (tok, f"{r['cpu_us_per_tok']:.2f}", f"{100 * r['cpu_util']:.0f}",
                *(thousands(r[k]) for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms")),
                f"{r['pause_to_continue_max_s']:.2f}", f"{r['peak_rss_mb'] / 1000:.2f}")
    return figures


PARKED = "finished episodes of running groups parked under the bound; default bound 128 MB; "


def answer_parse(tokens: int) -> Callable[[], tuple[str, ...]]:
    def figures():
        r = newest("answer_parse.jsonl", tokens=tokens)
        return f"{r['reference_ns_per_token']:.0f}", f"{r['native_ns_per_token']:.0f}", f"{r['speedup']:.1f}"
    return figures


def suite_sentence() -> str:
    """What the README says of the newest full-suite row of ``bench/results/suite_time.jsonl``."""
    r = newest("suite_time.jsonl", selection="all")
    # the README quotes it as a passing clean-clone run
    assert r["exitstatus"] == 0 and not r["provenance"]["commit"].endswith("-dirty"), (r["exitstatus"], r["provenance"])
    counts = ", ".join(f"{thousands(r[k])} {k}" for k in ("passed", "skipped", "xfailed", "failed") if r.get(k))
    total = f" and {thousands(r['total_s'])} s in all with the install" if r.get("total_s") else ""
    workers = r.get("workers") or 1
    where = f" in {workers} worker processes" if workers > 1 else ""
    of_it = "of the workers' time" if workers > 1 else "of it"
    quick = f"; the tests not marked slow took {thousands(r['not_slow_s'])} s {of_it}" if r.get("not_slow_s") else ""
    when = f"{r['provenance']['commit']}, {r['provenance']['date'][:10]}"
    return f"{thousands(r['tests_s'])} s of tests{where}{total} ({counts}; {when}){quick}"


def sci(x: float) -> str:
    """1.7e-4 as the docs write it (one decimal, no padded exponent)."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def ci(mean: float, half: float, digits: int = 3) -> tuple[str, ...]:
    """A mean and its interval [mean - half, mean + half]."""
    return tuple(f"{v:.{digits}f}" for v in (mean, mean - half, mean + half))


def vllm_staleness(server_args: list[str]) -> Callable[[], tuple[str, ...]]:
    """docs/staleness.md's measurement on real vLLM started with ``server_args`` (the newest invocation's
    runs), per scheduling policy (first come first served, then priority): steps over eta of steps, their
    largest staleness_max, trained groups over eta of groups; then the runs of each, and the shortest and
    longest run's wall time (s)."""
    def figures():
        found = [r for r in rows("vllm_staleness.jsonl") if r.get("server_args", []) == server_args]
        assert found, f"bench/results/vllm_staleness.jsonl has no run with server_args {server_args}"
        runs = [r for r in found if r["measurement"] == found[-1]["measurement"]]
        out = []
        for policy in ("fcfs", "priority"):
            mine = [r for r in runs if r["policy"] == policy]
            out += [str(sum(r["steps_over_eta"] for r in mine)), thousands(sum(r["steps"] for r in mine)),
                    str(max(r["staleness_max"] for r in mine)), str(sum(r["groups_over_eta"] for r in mine)),
                    thousands(sum(r["groups"] for r in mine))]
        walls = [r["wall_s"] for r in runs]
        return (*out, str(len(runs) // 2), thousands(min(walls)), thousands(max(walls)))
    return figures


def vllm_staleness_spread() -> tuple[str, ...]:
    """The fewest and most steps over eta of one run, either policy, in docs/staleness.md's first measurement."""
    found = [r for r in rows("vllm_staleness.jsonl") if r.get("server_args", []) == []]
    runs = [r["steps_over_eta"] for r in found if r["measurement"] == found[-1]["measurement"]]
    return str(min(runs)), str(max(runs))


def vllm_pause(mode: str) -> Callable[[], tuple[str, ...]]:
    """docs/vllm.md's pause table: tokens/s, median update time, recomputed tokens, preemptions."""
    def figures():
        r = newest("vllm_pause.jsonl", mode=mode)
        out = [thousands(r["tokens_per_s"]), f"{r['update_s_median']:.3f}"]
        if mode == "abort":
            out.append(thousands(r["recomputed_tokens_per_update"]))
        if mode == "keep":
            out.append(f"{r['preemptions_per_update']:.1f}")
        return tuple(out)
    return figures


def lora_update(part: str, model: str, rank: int) -> Callable[[], tuple[str, ...]]:
    """docs/lora.md's one-update table: whole and adapter bytes and times, and their ratios."""
    def figures():
        r = newest("lora_sync.jsonl", part=part, model=model, rank=rank)
        base = newest("lora_sync.jsonl", part="tiny", model=model, rank=rank)  # the bytes (same files)
        t = (lambda s: f"{s:.2f}") if r["full_update_s"] >= 1 else (lambda s: f"{half_up(1000 * s)}")
        ratio = (lambda x: f"{x:.1f}" if x < 10 else f"{round(x)}")
        b, a = base["full_bytes"], base["adapter_bytes"]
        size = (lambda n: f"{n / 1e3:.0f}" if n < 1e6 else f"{n / 1e6:.3g}")
        return (size(b), t(r["full_update_s"]), size(a), f"{half_up(1000 * r['adapter_update_s'])}",
                ratio(base["bytes_ratio"]), ratio(r["time_ratio"]))
    return figures


def lora_7b(rank: int) -> Callable[[], tuple[str, ...]]:
    def figures():
        r = newest("lora_sync.jsonl", part="7b", rank=rank)
        mb = r["adapter_bytes"] / 1e6
        size = f"{mb:.1f}" if mb < 100 else f"{mb:.4g}" if mb < 200 else f"{mb:.0f}"
        return (f"{r['adapter_params'] / 1e6:.3g}", size,
                f"{r['adapter_write_s']:.2f}", f"{r['full_bytes'] / 1e9:.1f}", f"{r['full_write_s_est']:.1f}",
                f"{round(r['bytes_ratio'])}")
    return figures


def lora_memory(model: str, rank: int | None) -> Callable[[], tuple[str, ...]]:
    """docs/lora.md's trainer-memory table: trainable params, params, grads, AdamW, total."""
    def figures():
        r = [x for x in rows("lora_sync.jsonl") if x.get("part") == "memory" and x.get("lora_rank") == rank
             and x["model"].startswith(model)][-1]
        n = r["trainable_params"]
        count = f"{n / 1e9:.2f}" if n >= 1e9 else f"{n / 1e6:.3g}" if n >= 1e6 else f"{n / 1e6:.2f}"
        if model.startswith("Qwen"):
            gb = [r[k] / 1e9 for k in ("param_bytes", "grad_bytes", "adam_bytes", "total_bytes")]
            return (count, *(f"{g:.1f}" if g >= 10 or i in (0, 3) else f"{g:.2f}" for i, g in enumerate(gb)))
        mb = [r[k] / 1e6 for k in ("param_bytes", "grad_bytes", "adam_bytes", "total_bytes")]
        return (count, *(f"{m:.0f}" if m >= 100 else f"{m:.1f}" for m in mb))
    return figures


def mismatch_row(engine: str, dtype: str, temperature: float, shape: str) -> Callable[[], tuple[str, ...]]:
    """docs/mismatch.md's first table: tokens, k1, k3, w p99, w max, shares outside, per-sequence |sum log w|."""
    def figures():
        r = newest("mismatch.jsonl", engine=engine, dtype=dtype, temperature=temperature, shape=shape)
        share = (lambda x: "0" if x == 0 else f"{100 * x:.2g}")
        return (str(r["tokens"]), sci(r["mismatch_k1"]), sci(r["mismatch_k3"]), f"{r['mismatch_ratio_p99']:.2f}",
                f"{r['mismatch_ratio_max']:.2f}", share(r["outside_0.5_2.0"]), share(r["outside_0.8_1.25"]),
                f"{r['seq_abs_log_w_mean']:.3f}", f"{r['seq_abs_log_w_p90']:.3f}")
    return figures


def _fp8_row(arch: str, dtype: str, t: float) -> dict:
    return newest("mismatch_fp8.jsonl", arch=arch, engine="embedded", dtype=dtype, temperature=t, shape="long")


def _share(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.2g}"


def mismatch_fp8_row(arch: str, dtype: str, t: float) -> Callable[[], tuple[str, ...]]:
    """docs/mismatch.md's FP8 table: tokens, k1, k3, (FP8: k3 against bf16 serving), w p99 / max, share outside
    [0.5, 2], per-sequence |sum log w| mean / p90, the shares TIS, IcePop, sequence MIS and M2PO act on."""
    def figures():
        r = _fp8_row(arch, dtype, t)
        vs = (sci(r["bf16_k3"]),) if dtype == "fp8" else ()
        acts = (_share(r[f"acts_{c}"]) for c in ("tis", "icepop", "seq_mis", "m2po"))
        return (str(r["tokens"]), sci(r["mismatch_k1"]), sci(r["mismatch_k3"]), *vs, f"{r['mismatch_ratio_p99']:.2f}",
                f"{r['mismatch_ratio_max']:.2f}", _share(r["outside_0.5_2.0"]), f"{r['seq_abs_log_w_mean']:.3f}",
                f"{r['seq_abs_log_w_p90']:.3f}", *acts)
    return figures


def mismatch_fp8_prose() -> tuple[str, ...]:
    """docs/mismatch.md's reading of the FP8 table: the range of FP8 k3 over bf16 k3, the per-sequence p90 ranges
    (FP8, then bf16), and the largest share any correction acts on under FP8 (%)."""
    cases = [(a, t) for a in ("qwen2", "qwen3_moe") for t in (1.0, 0.6)]
    ratio = [_fp8_row(a, "fp8", t)["mismatch_k3"] / _fp8_row(a, "bfloat16", t)["mismatch_k3"] for a, t in cases]
    p90 = {d: [_fp8_row(a, d, t)["seq_abs_log_w_p90"] for a, t in cases] for d in ("fp8", "bfloat16")}
    acts = max(_fp8_row(a, "fp8", t)[f"acts_{c}"] for a, t in cases for c in ("tis", "icepop", "seq_mis", "m2po"))
    spans = (f"{f(p90[d]):.3f}" for d in ("fp8", "bfloat16") for f in (min, max))
    return f"{min(ratio):.1f}", f"{max(ratio):.1f}", *spans, _share(acts)


def mismatch_arm(arm: str) -> Callable[[], tuple[str, ...]]:
    """docs/mismatch.md's ablation table: final EM and mean EM over the run with their 95 % intervals, k3."""
    def figures():
        r = newest("mismatch_ablation.jsonl", arm=arm)
        return (*ci(r["eval_final_mean"], r["eval_final_ci95"]), *ci(r["eval_mean_mean"], r["eval_mean_ci95"]),
                sci(r["mismatch_k3_mean"]))
    return figures


MISMATCH_SWEEP = "mismatch_ablation_20261128_1002.json"  # docs/mismatch.md's sweep (14 arms x 8 seeds)
FP8_SWEEP = "mismatch_ablation_20261203_1731.json"  # docs/mismatch.md's FP8 sweep (5 arms x 2 etas x 6 seeds)


def mismatch_fp8_arm(arm: str) -> Callable[[], tuple[str, ...]]:
    """docs/mismatch.md's FP8 ablation table: final and mean EM with their intervals, k3, and the share (%) the
    arm's correction masked or truncated (none for no correction)."""
    def figures():
        r = newest("mismatch_ablation.jsonl", arm=arm)
        option = arm.split("_", 1)[1].removesuffix("_fp8")
        share = () if option == "none" else (_share(r[MISMATCH_FRACTION[option]]),)
        return (*mismatch_arm(arm)(), *share)
    return figures


def mismatch_sweep() -> tuple[str, ...]:
    """The sweep's seconds per run (shortest, longest) and its minutes of wall time in all."""
    d = json.loads((RESULTS / MISMATCH_SWEEP).read_text())
    wall = [r["wall_s"] for r in d["runs"]]
    return thousands(min(wall)), thousands(max(wall)), f"{d['sweep_wall_s'] / 60:.1f}"


MISMATCH_FRACTION = {"tis": "tis_truncated_fraction_mean", "icepop": "token_mis_masked_fraction_mean",
                     "seq_mis": "seq_mis_masked_fraction_mean", "m2po": "m2po_masked_fraction_mean"}


def mismatch_share(arm: str) -> float:
    """The share of tokens (%) the arm's correction masked or truncated."""
    option = arm.split("_", 1)[1].removesuffix("_fp32")
    return 100 * newest("mismatch_ablation.jsonl", arm=arm)[MISMATCH_FRACTION[option]]


def mismatch_eta4_tokens() -> tuple[str, ...]:
    """At eta 4: the range of shares TIS, IcePop and M2PO acted on (%), of their mean-EM differences from no
    correction (nearest 0 first), and IcePop's share (%)."""
    shares = [mismatch_share(f"eta4_{a}") for a in ("tis", "icepop", "m2po")]
    c = json.loads((RESULTS / MISMATCH_SWEEP).read_text())["contrasts"]
    diffs = sorted((x["eval_mean_diff_mean"] for a in ("tis", "icepop", "m2po") for x in c[f"{a}_minus_none"]
                    if x["eta"] == 4), key=abs)
    return (f"{min(shares):.1g}", f"{max(shares):.1g}", f"{diffs[0]:+.3f}", f"{diffs[-1]:+.3f}",
            f"{mismatch_share('eta4_icepop'):.1g}")


STALENESS_SWEEP = "2026-11-23T18:13"  # the 108-run sweep docs/staleness_ablation.md reports (its first table)


def staleness_arm(eta: int, objective: str, advantage: str) -> Callable[[], tuple[str, ...]]:
    """A row of docs/staleness_ablation.md's sweep table: final EM, final - sync, best EM (mean ± spread over
    the seeds), trained samples/s, staleness mean / max, the share of groups at the bound."""
    def figures():
        r = [x for x in rows("staleness.jsonl") if x["arm"] == f"eta{eta}_{objective}_{advantage}"
             and x["provenance"]["date"].startswith(STALENESS_SWEEP)][-1]
        return (f"{r['eval_final_mean']:.3f}", f"{r['eval_final_spread']:.3f}", f"{r['eval_final_vs_sync_mean']:+.3f}",
                f"{r['eval_final_vs_sync_spread']:.3f}", f"{r['eval_best_mean']:.3f}", f"{r['eval_best_spread']:.3f}",
                thousands(r["trained_samples_per_s_mean"]), f"{r['staleness_mean']:.2f}", str(r["staleness_max"]),
                f"{half_up(100 * r['staleness_at_bound_fraction_mean'])}")
    return figures


def pause_runs(setup: str) -> dict[str, dict]:
    """The newest run of each pause arm (and of sync) of ``setup`` in async_speedup_pause_mode.jsonl, without a note."""
    out = {}
    for r in rows("async_speedup_pause_mode.jsonl"):
        if r["setup"] == setup and not r.get("note"):
            out["sync" if r["arm"] == "sync" else r["pause_arm"]] = r
    return out


def pause_lag(setup: str) -> Callable[[], tuple[str, str]]:
    """The range of the controller's loop lag p99 (ms) over the setup's runs."""
    def figures():
        lag = [r["loop_lag_p99_ms"] for r in pause_runs(setup).values()]
        return thousands(min(lag)), thousands(max(lag))
    return figures


def pause_step_gain(setup: str) -> float:
    """How much longer retract's step is than in_place_ideal's (%)."""
    runs = pause_runs(setup)
    return 100 * (runs["retract"]["step_s"] / runs["in_place_ideal"]["step_s"] - 1)


def pause_7b_trainer() -> tuple[str, ...]:
    """At 7B: the trainer's wait per step (s, range) under retract and in_place_ideal, and the step's gain (%)."""
    runs = pause_runs("7B, 24 nodes x 8 GPUs")
    wait = [runs[a]["wait_for_batch_s"] for a in ("retract", "in_place_ideal")]
    return thousands(min(wait)), thousands(max(wait)), f"{half_up(pause_step_gain('7B, 24 nodes x 8 GPUs'))}"


def pause_arm(setup: str, arm: str) -> Callable[[], tuple[str, ...]]:
    """A row of docs/pause_modes.md's tables (the newest measurement of the setup and pause mode): requests
    running at an update, recomputed prefill (M tokens, GPU s), GPU s without overlap, share of generation
    capacity lost, step (s), samples/s, speedup over sync; "sync" gives the synchronous arm's step and rate."""
    def figures():
        r = [x for x in rows("async_speedup_pause_mode_summary.jsonl") if x["setup"] == setup
             and (arm == "sync" or x["pause_arm"] == arm) and not x.get("note")][-1]
        if arm == "sync":
            return f"{r['sync_step_s']:.1f}", f"{r['sync_samples_per_s']:.1f}"
        run = [thousands(r["running_per_update"])]
        rate = [f"{r['async_step_s']:.1f}", f"{r['async_samples_per_s']:.1f}", f"{r['speedup']:.2f}"]
        lost = f"{100 * r['lost_fraction_of_generation']:.1f}"
        if arm in ("abort", "retract"):
            return (*run, f"{r['recomputed_prefill_tokens_per_update'] / 1e6:.1f}",
                    thousands(r["recomputed_prefill_gpu_s_per_update"]), lost, *rate)
        if arm == "in_place":
            return (*run, thousands(r["no_overlap_gpu_s_per_update"]), lost, *rate)
        return (*run, *rate)
    return figures


def pause_cpu(mode: str) -> Callable[[], tuple[str, ...]]:
    """docs/pause_modes.md's CPU quality table: final EM mean ± std, EM over the run, staleness, KL, samples/s."""
    def figures():
        r = newest("pause_mode_cpu.jsonl", pause_mode=mode)
        return (f"{r['em_final_mean']:.3f}", f"{r['em_final_std']:.3f}",
                *(f"{x:.3f}" for x in r["em_final_per_seed"]), f"{r['em_over_run_mean']:.3f}",
                f"{r['staleness_mean']:.2f}", f"{r['behav_kl_mean']:.5f}", f"{r['trained_samples_per_s']:.1f}")
    return figures


def delta_gloo(delta: str) -> Callable[[], tuple[str, ...]]:
    """docs/weight_sync.md's loopback table: bytes per update (MB; and the share of whole) and seconds."""
    def figures():
        r = newest("delta.jsonl", part="gloo", delta=delta)
        share = () if delta == "off" else (f"{100 * r['sent_over_whole']:.1f}",)
        return (f"{r['bytes_sent'] / 1e6:.1f}", *share, f"{r['update_s_median']:.2f}")
    return figures


def sync_senders_row(ranks: int, senders: str) -> Callable[[], tuple[str, ...]]:
    """docs/weight_sync.md's many-sender table: whole and delta s per update, MB per rank to the servers
    (whole, delta), MB rank 0 took in from the other ranks (gather or exchange), delta shadow MB per rank."""
    def figures():
        w = newest("sync_senders.jsonl", part="senders", ranks=ranks, senders=senders, update="whole")
        d = newest("sync_senders.jsonl", part="senders", ranks=ranks, senders=senders, update="delta")

        def mb(xs):
            return tuple(f"{x / 1e6:.1f}" for x in xs)
        took = w["gather_received_rank0"] + w["exchange_received_per_rank"][0]
        return (f"{w['update_s_median']:.2f}", f"{d['update_s_median']:.2f}", *mb(w["bytes_to_servers_per_rank"]),
                *mb(d["bytes_to_servers_per_rank"]), f"{took / 1e6:.1f}", *mb(d["shadow_bytes_per_rank"]))
    return figures


def sync_breakeven(density: float) -> Callable[[], tuple[str, ...]]:
    """docs/weight_sync.md's break-even table: encode, apply, delta in all and whole-over-the-wire s per GB,
    and the delta's time over the whole tensor's (below 1: the delta paid), at one density (native kernels)."""
    def figures():
        r = newest("sync_senders.jsonl", part="breakeven", backend="native", density=density)
        return (f"{r['encode_s_per_gb']:.2f}", f"{r['apply_s_per_gb']:.2f}", f"{r['delta_s_per_gb']:.2f}",
                f"{r['whole_wire_s_per_gb']:.2f}", f"{r['delta_s_per_gb'] / r['whole_wire_s_per_gb']:.2f}")
    return figures


SYNC_DENSITIES = {0.001: "0.1", 0.01: "1", 0.0236: "2.36", 0.05: "5", 0.1: "10", 0.2: "20", 0.333: "33.3"}


def delta_sim(model: str, changed: float) -> Callable[[], tuple[str, ...]]:
    """docs/weight_sync.md's simulated table: bytes whole / delta (GB), sync s whole / delta / mean, speedup."""
    def figures():
        r = newest("delta.jsonl", part="sim", model=model, changed_frac=changed)
        gb = (lambda b: f"{b / 1e9:.1f}" if b >= 1e10 else f"{b / 1e9:.2f}")
        return (f"{100 * changed:.3g}", gb(r["bytes_whole"]), gb(r["bytes_delta"]),
                f"{r['sync_s_whole']:.2f}", f"{r['sync_s_delta']:.2f}", f"{r['sync_s_delta_mean']:.2f}",
                f"{r['speedup']:.2f}")
    return figures


def sync_model_fit() -> tuple[str, ...]:
    """docs/weight_sync.md's fitted constants of the re-anchored sync model (tools/sync_model.py)."""
    r = newest("sync_model.jsonl", part="fit")
    return (f"{r['fixed_s_one_sender']:.2f}", f"{r['sender_bytes_per_s'] / 1e9:.1f}", f"{r['fixed_s_many']:.2f}",
            f"{r['aggregate_bytes_per_s_many'] / 1e9:.0f}", f"{r['senders_implied_many']:.0f}")


def sync_model_check(source: str, model: str, what: str) -> Callable[[], tuple[str, ...]]:
    """docs/weight_sync.md's calibration log: the model's seconds for a published number, and their ratio."""
    def figures():
        r = newest("sync_model.jsonl", source=source, model=model, what=what)
        return (f"{r['predicted_s']:.2f}", f"{r['ratio']:.2f}")
    return figures


def sync_model_predict(model: str, path: str) -> Callable[[], tuple[str, ...]]:
    """docs/weight_sync.md's predictions: whole, delta and mean seconds of one path."""
    def figures():
        r = newest("sync_model.jsonl", part="predict", model=model, path=path)
        return tuple(f"{r[k]:.2f}" for k in ("sync_s_whole", "sync_s_delta", "sync_s_delta_mean"))
    return figures


SYNC_MODEL_LOG = (("verl", "Qwen2.5-7B", "full, taken as one sender", " (fit)", "5.5-6"),
                  ("verl", "Qwen2.5-7B", "delta, taken as one sender", " (fit)", "3.9-4.9"),
                  ("Miles", "Qwen3-30B-A3B", "shard-to-shard P2P", " (fit)", "2.16"),
                  ("Miles", "Qwen3-235B-A22B", "shard-to-shard P2P", " (fit)", "3.16"),
                  ("Miles", "Kimi-K2", "shard-to-shard P2P", "", "7.2"),
                  ("Miles", "Kimi-K2", "before P2P, taken as one sender", "", "53.3"),
                  ("verl", "Qwen3-235B-A22B", "full, taken as one sender", "", "246-266"),
                  ("verl", "Qwen3-235B-A22B", "delta_sharded, taken as one sender", "", "11.4-14.9"))
SYNC_MODEL_PATHS = (("Qwen2.5-7B", "one sender (today)", 1), ("Qwen2.5-7B", "many senders", 8),
                    ("Qwen2.5-7B", "vLLM sparse_nccl (one sender)", 1), ("Qwen2.5-32B", "one sender (today)", 1),
                    ("Qwen2.5-32B", "many senders", 16), ("Qwen2.5-32B", "vLLM sparse_nccl (one sender)", 1),
                    ("Qwen3-30B-A3B", "one sender (today)", 1), ("Qwen3-30B-A3B", "many senders", 16),
                    ("Qwen3-235B-A22B", "one sender (today)", 1), ("Qwen3-235B-A22B", "many senders", 64))


def vllm_pause_costs() -> tuple[str, ...]:
    """docs/vllm.md's reading of its pause table: abort's and keep's throughput cost against keep in place (%),
    and abort's segments a sample."""
    tok = {m: newest("vllm_pause.jsonl", mode=m)["tokens_per_s"] for m in ("abort", "keep", "keep_in_place")}
    cost = (lambda m: f"{half_up(100 * (1 - tok[m] / tok['keep_in_place']))}")
    return cost("abort"), f"{newest('vllm_pause.jsonl', mode='abort')['segments_per_sample']:.2f}", cost("keep")


def chaos_row(stamp: str, phase: str, fault: str, label: str = "", results: bool = False) -> Callable[[], tuple[str]]:
    """A row of docs/chaos.md's fault tables, from ``chaos_<stamp>.json``, up to the dip: pool before / min
    after, recovery s, pool back s, steps delayed, baseline and window samples/s, dip ("-": never)."""
    def figures():
        data = json.loads((RESULTS / f"chaos_{stamp}.json").read_text())
        [ph] = [x for x in data["phases"] if x["phase"] == phase]
        [f] = [x for x in ph["faults"] if x["fault"] == fault]
        opt = (lambda v: "-" if v is None else f"{v:.1f}")
        cells = [label or fault, f"`chaos_{stamp}`" if results else str(f["step_seen"]),
                 f"{f['pool_before']} / {f['pool_min_after']}", opt(f["recovery_s"]), opt(f["pool_back_s"]),
                 str(f["steps_delayed"]), f"{f['baseline_samples_per_s']:.1f}", f"{f['window_samples_per_s']:.1f}",
                 f"{half_up(100 * f['dip'])}%"]
        return ("| " + " | ".join(cells) + " |",)
    return figures


def replay_engine(stamp: str, seed: int) -> Callable[[], tuple[str, ...]]:
    """A seed of ``routing_replay_engine_<stamp>.md`` (the bench's log lines), as docs/moe.md's table writes it:
    routings that differ (%), k3, k1, max |log w| and IcePop's masked share (%), each without -> with replay."""
    def figures():
        text = (RESULTS / f"routing_replay_engine_{stamp}.md").read_text()
        m = re.search(rf"^seed {seed}: \d+ tokens \| routings differing ([\d.]+) % \| k3 (\S+) -> (\S+) \| "
                      r"k1 (\S+) -> (\S+) \| max \|log w\| (\S+) -> (\S+) \| IcePop masks (\S+) % -> (\S+) %$",
                      text, flags=re.M)
        assert m, f"bench/results/routing_replay_engine_{stamp}.md has no line for seed {seed}"
        g = m.groups()

        def fmt(x: str, spec: str) -> str:  # the log's figures are rounded already: round them on halves up
            with localcontext() as ctx:
                ctx.rounding = ROUND_HALF_UP
                return format(Decimal(x), spec)

        pct = (lambda x: "0" if float(x) == 0 else fmt(x, ".2f"))
        return (pct(g[0]), fmt(g[1], ".2e"), fmt(g[2], ".2e"), fmt(g[3], "+.1e"), fmt(g[4], "+.1e"), fmt(g[5], ".3f"),
                fmt(g[6], ".3f"), pct(g[7]), pct(g[8]))
    return figures


def replay_k3_ratios() -> tuple[str, ...]:
    """docs/moe.md's k3 without / with replay per seed at temperature 1 and at 0.6 (the logs' last line)."""
    out = []
    for stamp in ("20261128_1000", "20261128_1103_t0.6"):
        text = (RESULTS / f"routing_replay_engine_{stamp}.md").read_text()
        m = re.search(r"^k3 without / with replay \(same samples\): (.+)$", text, flags=re.M)
        assert m, f"bench/results/routing_replay_engine_{stamp}.md has no k3 ratio line"
        out += [f"{x:.1f}" if x < 10 else f"{half_up(x)}" for x in map(float, m.group(1).split(", "))]
    return tuple(out)


def replay_loop() -> tuple[str, ...]:
    """docs/moe.md's loop runs: k3 (step mean) per seed without and with replay on the recipe's strings and on
    the longer ones; the range of routings that differ (%); the trainer's step and recompute times (s)."""
    r = rows("routing_replay_loop.jsonl")
    k3 = [sci(newest("routing_replay_loop.jsonl", task=t, replay=rp, seed=s)["mismatch_k3"])
          for t in ("recipe", "long") for rp in (False, True) for s in (1, 2, 3)]
    differ = [100 * x["routing_differ_fraction"] for x in r]
    step, rec = [x["step_time_s"] for x in r], [x["recompute_time_s"] for x in r]
    return (*k3, f"{min(differ):.2f}", f"{max(differ):.2f}", f"{min(step):.2f}", f"{max(step):.2f}",
            f"{min(rec):.2f}", f"{max(rec):.2f}")


def replay_engine_t06() -> tuple[str, ...]:
    """docs/moe.md's sentence on the temperature-0.6 engine samples: the range of routings that differ (%), k3 and
    max |log w| without -> with replay per seed, and the share of tokens IcePop would have masked (%)."""
    text = (RESULTS / "routing_replay_engine_20261128_1103_t0.6.md").read_text()
    seeds = re.findall(r"^seed \d: \d+ tokens \| routings differing ([\d.]+) % \| k3 (\S+) -> (\S+) \| k1 \S+ -> \S+ "
                       r"\| max \|log w\| (\S+) -> (\S+) \| IcePop masks (\S+) % -> \S+ %$", text, flags=re.M)
    assert len(seeds) == 3, "bench/results/routing_replay_engine_20261128_1103_t0.6.md has not 3 seed lines"

    def half(x: str, spec: str) -> str:
        with localcontext() as ctx:
            ctx.rounding = ROUND_HALF_UP
            return format(Decimal(x), spec)

    differ = sorted(Decimal(g[0]) for g in seeds)
    masked = [g[5] for g in seeds if float(g[5]) > 0]
    return (half(str(differ[0]), ".2f"), half(str(differ[-1]), ".2f"),
            *(sci(float(g[i])) for g in seeds for i in (1, 2)),
            *(half(g[i], ".2f") for g in seeds for i in (3, 4)), *(half(m, ".2f") for m in masked))


def replay_loop_masked() -> tuple[str]:
    """The largest share of tokens any correction masked or truncated in the loop runs (%)."""
    r = rows("routing_replay_loop.jsonl")
    keys = ("token_mis_masked_fraction", "tis_truncated_fraction", "seq_mis_masked_fraction")
    return (f"{100 * max(x[k] for x in r for k in keys):.2f}",)


def reward_cost() -> tuple[str, ...]:
    """docs/reward.md's sandbox cost: load, child CPU ms of a sandboxed run (cgroup, RLIMIT fallback), of the
    bare interpreter, a cgroup's create + remove (ms), the median wall time of a sandboxed run (ms)."""
    run = newest("reward.jsonl", sandbox="sandboxed run (ns+uid, cgroup)")
    return (f"{half_up(run['loadavg_1m'])}", f"{half_up(run['child_cpu_ms'])}",
            f"{half_up(newest('reward.jsonl', sandbox='sandboxed run (ns+uid, RLIMIT fallback)')['child_cpu_ms'])}",
            f"{half_up(newest('reward.jsonl', sandbox='interpreter start, bare, no site')['child_cpu_ms'])}",
            f"{newest('reward.jsonl', sandbox='run cgroup create + remove (v1)')['median_ms']:.2f}",
            f"{half_up(run['median_ms'])}")


def e2e_stat(key: str, digits: int, target: str | None = None) -> Callable[[], tuple[str, ...]]:
    """examples/README.md's e2e table: mean [min..max] of async, then of sync, for ``key`` (eval_final,
    eval_best, time_to_target_s at ``target``)."""
    def figures():
        r = newest("e2e.jsonl")
        out = []
        for mode in ("async", "sync"):
            v = r[f"{mode}_{key}"] if target is None else r[f"{mode}_{key}"][target]
            out += [f"{v[k]:.{digits}f}" for k in ("mean", "min", "max")]
        return tuple(out)
    return figures


def e2e_modes() -> dict:
    """The per-mode summary of the newest e2e measurement (its ``curves`` file beside ``e2e.jsonl``)."""
    return json.loads((RESULTS / newest("e2e.jsonl")["curves"]).read_text())["modes"]


def e2e_spread(key: str, digits: int) -> Callable[[], tuple[str, ...]]:
    """mean [min..max] of async, then of sync, for ``key`` of the newest e2e measurement's modes."""
    def figures():
        fmt = (lambda v: f"{v:.{digits}f}") if digits else thousands
        return tuple(fmt(e2e_modes()[m][key][k]) for m in ("async", "sync") for k in ("mean", "min", "max"))
    return figures


def e2e_breakdown() -> tuple[str, ...]:
    """Waiting for a batch / training / weight sync / eval (mean s), async then sync."""
    keys = ("waiting_for_batch (generation-bound)", "training", "weight_sync", "evaluation")
    return tuple(f"{e2e_modes()[m]['time_breakdown_s_mean'][k]:.1f}" for m in ("async", "sync") for k in keys)


def e2e_overlap() -> tuple[str, str]:
    """Sync's wait for batches (s), and how much longer async's training took than sync's (s): what the
    overlap hid and what it paid back."""
    t = {m: e2e_modes()[m]["time_breakdown_s_mean"] for m in ("async", "sync")}
    wait = t["sync"]["waiting_for_batch (generation-bound)"]
    return f"{wait:.0f}", f"{t['async']['training'] - t['sync']['training']:.0f}"


def e2e_staleness() -> tuple[str, ...]:
    """The async groups' staleness: the share at 4 (%), how many above 4 and of how many."""
    hist = {int(k): v for k, v in e2e_modes()["async"]["staleness_hist"].items()}
    total, above = sum(hist.values()), sum(v for k, v in hist.items() if k > 4)
    return f"{half_up(100 * hist[4] / total)}", str(above), str(total)


def delta_fraction(tag: str) -> Callable[[], tuple[str, ...]]:
    """docs/weight_sync.md's fraction table: % of bf16 elements changed at steps 1-4, then the delta's bytes
    (indices + values) and a bitmask + values' at step 4, as a % of whole (the former only where it is smaller)."""
    def figures():
        r = [x for x in rows("delta.jsonl") if x.get("part") == "fraction" and x.get("lr_tag") == tag]
        by_step = {x["step"]: x for x in r}
        pct = (lambda x: f"{100 * x:.3g}")
        last = by_step[4]
        idx = last["bytes_indices_values"] / last["bytes_whole"]
        bitmask = f"{100 * last['bytes_bitmask_values'] / last['bytes_whole']:.2g}"
        return (*(pct(by_step[k]["changed_frac"]) for k in (1, 2, 3, 4)),
                *((f"{100 * idx:.2g}",) if idx < 1 else ()), bitmask)
    return figures


HARD = "staleness_20261126_0300_hard.json"  # docs/staleness_ablation.md's harder sweep (200 steps, 5 seeds)


def hard() -> dict:
    return json.loads((RESULTS / HARD).read_text())


def diff_ci(mean: float, half: float) -> str:
    """A paired difference and its 95 % interval, bold where the interval excludes 0."""
    lo, hi = mean - half, mean + half
    text = f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    return f"**{text}**" if lo > 0 or hi < 0 else text


def hard_eta_row(eta: int) -> Callable[[], tuple[str]]:
    """A row of the harder sweep's table: naive and decoupled mean EM - sync with their intervals, clip fractions."""
    def figures():
        arm = {(a["objective"], a["eta"]): a for a in hard()["arms"] if a["advantage"] == "grpo"}
        n, d = arm[("naive", eta)], arm[("recompute", eta)]
        clip = f"{n['clip_fraction_mean_mean']:#.2g} / {d['clip_fraction_mean_mean']:#.2g}"
        if eta == 0:
            cells = [f"0 ({n['eval_mean_mean']:.3f} ± {n['eval_mean_spread']:.3f})", "-",
                     f"0 ({d['eval_mean_mean']:.3f} ± {d['eval_mean_spread']:.3f})", "-"]
        else:
            cells = []
            for a in (n, d):
                m, h = a["eval_mean_vs_sync_mean"], a["eval_mean_vs_sync_ci95"]
                bold = m - h > 0 or m + h < 0
                cells += [f"**{m:+.3f}**" if bold else f"{m:+.3f}", f"[{m - h:+.3f}, {m + h:+.3f}]"]
        return ("| " + " | ".join([str(eta), *cells, clip]) + " |",)
    return figures


def hard_option_row(option: str, label: str) -> Callable[[], tuple[str]]:
    """A row of the harder sweep's options table: option - decoupled, mean EM over the run, per eta and pooled."""
    def figures():
        cells = [diff_ci(c["eval_mean_diff_mean"], c["eval_mean_diff_ci95"])
                 for c in hard()["contrast_option_minus_recompute"][option]]
        return ("| " + " | ".join([label, *cells]) + " |",)
    return figures


def hard_pooled_final() -> tuple[str, ...]:
    """Each option's final-EM difference pooled over eta 1-16."""
    opts = hard()["contrast_option_minus_recompute"]
    pooled = {o: [c for c in opts[o] if c["eta"] == "pooled"][0] for o in ("tis", "icepop", "seq_mis", "m2po")}
    return tuple(f"{c['eval_final_diff_mean']:+.3f}" for c in pooled.values())


def hard_final(objective: str) -> tuple[str, ...]:
    """Final EM at step 200 minus sync, with interval, at eta 4, 8, 16."""
    arm = {a["eta"]: a for a in hard()["arms"] if a["advantage"] == "grpo" and a["objective"] == objective}
    out = []
    for eta in (4, 8, 16):
        m, h = arm[eta]["eval_final_vs_sync_mean"], arm[eta]["eval_final_vs_sync_ci95"]
        out += [f"{m:+.3f}", f"{m - h:+.3f}", f"{m + h:+.3f}"]
    return tuple(out)


def hard_decoupled_minus_naive() -> tuple[str, ...]:
    """Decoupled minus naive, mean EM over the run, paired by seed: eta 0 with interval, eta 1 and 2, eta 4, 8,
    16 with intervals, pooled with its interval."""
    c = {x["eta"]: x for x in hard()["contrast_recompute_minus_naive"] if x["advantage"] == "grpo"}
    def ci3(e):
        m, h = c[e]["eval_mean_diff_mean"], c[e]["eval_mean_diff_ci95"]
        return f"{m:+.3f}", f"{m - h:+.3f}", f"{m + h:+.3f}"

    return (*ci3(0), f"{c[1]['eval_mean_diff_mean']:+.3f}", f"{c[2]['eval_mean_diff_mean']:+.3f}", *ci3(4), *ci3(8),
            *ci3(16), *ci3("pooled"))


def hard_acted_row(eta: int) -> Callable[[], tuple[str]]:
    """A row of the harder sweep's "what each option acted on" table: the share of loss tokens TIS truncated,
    IcePop, sequence MIS and M2PO masked (%), and the decoupled arm's k3 and mean(p - b)."""
    def figures():
        arm = {(a["objective"], a["eta"]): a for a in hard()["arms"] if a["advantage"] == "grpo"}
        pct = (lambda x: "0" if x == 0 else f"{100 * x:#.2g} %")
        acted = [pct(arm[(o, eta)][f"{k}_mean_mean"]) for o, k in (
            ("tis", "tis_truncated_fraction"), ("icepop", "token_mis_masked_fraction"),
            ("seq_mis", "seq_mis_masked_fraction"), ("m2po", "m2po_masked_fraction"))]
        d = arm[("recompute", eta)]
        k3, kl = d["mismatch_k3_mean_mean"], d["behav_kl_mean_mean"]
        tail = [sci(k3), f"{kl:.1e}"] if eta == 0 else [f"{k3:#.2g}", f"{kl:#.2g}"]
        return ("| " + " | ".join([str(eta), *acted, *tail]) + " |",)
    return figures


def scale_run(commit: str, servers: int) -> dict:
    """The controller_scale row measured at ``commit`` (its provenance, ``-dirty`` included) with ``servers``."""
    found = [r for r in rows("controller_scale.jsonl")
             if r["provenance"]["commit"] == commit and r["servers"] == servers]
    assert len(found) == 1, f"bench/results/controller_scale.jsonl: {len(found)} rows at {commit}, {servers} servers"
    return found[0]


def scale_memory(commit: str, servers: int, full: bool = True) -> Callable[[], tuple[str, ...]]:
    """docs/scale.md's table of the options: received tok/s, share of a core, CPU us / token (and tok/s per core,
    M), the simulator's CPU us / token, held tokens at peak (M; groups), RSS above base (MB), bytes / held token."""
    def figures():
        r = scale_run(commit, servers)
        us = f"{r['cpu_us_per_tok']:.3f}" if r["cpu_us_per_tok"] < 0.3 else f"{r['cpu_us_per_tok']:.2f}"
        held = r["at_peak_held_tokens"] / 1e6
        held = f"{held:.2f}" if held < 1 else f"{held:.1f}"
        return (thousands(r["received_tok_s"]), f"{half_up(100 * r['cpu_util'])}", us,
                *((f"{r['client_tok_s_per_core'] / 1e6:.1f}",) if full else ()),
                f"{r['sim_cpu_us_per_tok']:.3f}" if r["sim_cpu_us_per_tok"] < 0.1 else f"{r['sim_cpu_us_per_tok']:.2f}",
                held, thousands(r["at_peak_rss_above_base_mb"]),
                f"{r['rss_bytes_per_held_token']:.1f}" if r["rss_bytes_per_held_token"] < 100
                else thousands(r["rss_bytes_per_held_token"]))
    return figures


def scale_max_speed() -> tuple[str, ...]:
    """The --max-speed row: scale_memory's figures, with the checks' share of a core after the controller's,
    and the buffer's groups and the running groups' tokens (M) after the held tokens."""
    r = scale_run("f8a54d8", 64)
    m = scale_memory("f8a54d8", 64)()
    return (*m[:2], f"{half_up(100 * r['check_cpu_s'] / r['wall_s'])}", *m[2:6], str(r["at_peak_buffer_groups"]),
            f"{r['at_peak_in_flight_finished_tokens'] / 1e6:.1f}", *m[6:])


def scale_baseline(commit: str, servers: int, gc: bool = True) -> Callable[[], tuple[str, ...]]:
    """docs/scale.md's baseline table: received tok/s, CPU us / token, share of a core, GC share, loop lag
    p50 / p99 / max (ms), pause -> acked max, pause -> continue mean / max (s), RSS before -> peak (MB), samples
    checked, load average."""
    def figures():
        r = scale_run(commit, servers)
        return (thousands(r["received_tok_s"]), f"{r['cpu_us_per_tok']:.2f}", f"{half_up(100 * r['cpu_util'])}",
                *((f"{half_up(100 * r['gc_share_of_cpu'])}",) if gc else ()),
                f"{r['lag_p50_ms']:.1f}", thousands(r["lag_p99_ms"]), thousands(r["lag_max_ms"]),
                f"{r['pause_ack_max_s']:.2f}",
                f"{r['pause_to_continue_mean_s']:.2f}", f"{r['pause_to_continue_max_s']:.2f}",
                f"{half_up(r['rss_before_mb'])}", f"{half_up(r['peak_rss_mb'])}", thousands(r["samples_checked"]),
                f"{r['load_avg_1m']:.1f}")
    return figures


SIM_SETUPS = {"1.5B, 16 nodes x 8 GPUs": "1.5B, 128 GPUs", "7B, 24 nodes x 8 GPUs": "7B, 192 GPUs",
              "1.5B, 4 GPUs": "1.5B, 4 GPUs", "7B, 8 GPUs": "7B, 8 GPUs"}


def sim_run(setup: str, gen: int, nth: int = 0) -> Callable[[], tuple[str]]:
    """A row of docs/scale.md's simulated-time table: the ``nth`` run of ``setup`` with ``gen`` generation GPUs
    (sync: every GPU); the best split of the setup (most samples/s) in bold, a repeated sync run "(again)"."""
    def figures():
        runs = [r for r in rows("async_speedup.jsonl") if r["setup"] == setup]
        r = [x for x in runs if x["gen_gpus"] == gen][nth]
        best = max((x for x in runs if x["arm"] == "async"), key=lambda x: x["samples_per_s"])
        bold = (lambda t: f"**{t}**" if r is best else str(t))
        rate = f"{r['samples_per_s']:.1f}" if r["samples_per_s"] >= 10 else f"{r['samples_per_s']:.2f}"
        arm = "async eta 4" if r["arm"] == "async" else "sync eta 0" + (" (again)" if nth else "")
        stale = "0 / 0" if r["arm"] == "sync" else f"{r['staleness_mean']:.2f} / {r['staleness_max']}"
        cells = [SIM_SETUPS[setup], arm, bold(r["gen_gpus"]), bold(r["train_gpus"]), thousands(r["step_s"]), bold(rate),
                 thousands(r["train_step_model_s"]), thousands(r["wait_for_batch_s"]), stale]
        return ("| " + " | ".join(cells) + " |",)
    return figures


def sim_split() -> tuple[str, ...]:
    """The best splits' share of generation GPUs (1.5B, 7B at 192), and how close the 1.5B runner-up came (%)."""
    summary = {s: newest("async_speedup_summary.jsonl", setup=s) for s in ("1.5B, 16 nodes x 8 GPUs",
                                                                          "7B, 24 nodes x 8 GPUs")}
    runs = sorted((r for r in rows("async_speedup.jsonl") if r["setup"] == "1.5B, 16 nodes x 8 GPUs"
                   and r["arm"] == "async"), key=lambda r: -r["samples_per_s"])
    share = [100 * x["best_gen_gpus"] / (x["best_gen_gpus"] + x["best_train_gpus"]) for x in summary.values()]
    return (f"{share[0]:.3g}", f"{ceil(100 * (1 - runs[1]['samples_per_s'] / runs[0]['samples_per_s']))}",
            f"{share[1]:.3g}")


def sim_7b_pairs() -> tuple[str, ...]:
    """7B at 192 GPUs: the speedup of every (best async, sync) pair across its two sessions, min and max; the two
    sync runs' load averages and how far apart their rates are (%)."""
    r = [x for x in rows("async_speedup.jsonl") if x["setup"] == "7B, 24 nodes x 8 GPUs"]
    syncs = [x for x in r if x["arm"] == "sync"]
    sessions = dict.fromkeys(x["provenance"]["commit"] for x in syncs)
    best = [max((x for x in r if x["arm"] == "async" and x["provenance"]["commit"] == c),
                key=lambda x: x["samples_per_s"]) for c in sessions]
    ratios = [a["samples_per_s"] / s["samples_per_s"] for a in best for s in syncs]
    rates = sorted(s["samples_per_s"] for s in syncs)
    return (f"{min(ratios):.2f}", f"{max(ratios):.2f}", *(f"{s['load_avg_1m']:.1f}" for s in syncs),
            f"{100 * (rates[1] / rates[0] - 1):.1f}")


def sim_all_speedups() -> tuple[str, ...]:
    setups = {r["setup"] for r in rows("async_speedup_summary.jsonl")}
    s = [newest("async_speedup_summary.jsonl", setup=x)["speedup"] for x in setups]
    return f"{min(s):.1f}", f"{max(s):.1f}"


def scale_before_after(scale: str, code: str, commit: str, servers: int) -> Callable[[], tuple[str]]:
    """A row of docs/scale.md's before/after table (whole: two rows share their first cells): load, received
    tok/s (k), CPU us / token, GC collections and CPU s, loop lag p99 / max (ms), pause ack max, pause ->
    continue max (s), answers back at pauses, peak RSS (MB)."""
    def figures():
        r = scale_run(commit, servers)
        cont = r["pause_to_continue_max_s"]
        cells = (scale, code, f"{r['load_avg_1m']:.1f}", f"{r['received_tok_s'] / 1e3:.3g}k",
                 f"{r['cpu_us_per_tok']:.2f}",
                 f"{thousands(r['gc_collections'])}, {r['gc_s']:.1f}",
                 f"{thousands(r['lag_p99_ms'])} / {thousands(r['lag_max_ms'])}", f"{r['pause_ack_max_s']:.2f}",
                 f"{cont:.3g}" if cont >= 10 else f"{cont:.2f}", thousands(r["aborted_answers"]),
                 thousands(r["peak_rss_mb"]), "yes" if r["correct"] else "no")
        return ("| " + " | ".join(cells) + " |",)
    return figures


def sharded_row(label: str, procs: int, note_prefix: str) -> Callable[[], tuple[str]]:
    """A row of docs/scale.md's sharded-client table (the run whose note starts with ``note_prefix``): load
    before-after, received tok/s (k), controller and total CPU us / token, share of a core (controller / all),
    loop lag p50 / p99 / max (ms), pause -> acked and -> continue max (s), the simulator's loop lag max (s),
    peak RSS (controller + workers, MB), samples checked."""
    def figures():
        found = [r for r in rows("controller_scale.jsonl") if r["servers"] == (64 if label.startswith("64") else 256)
                 and (r.get("note") or "").startswith(note_prefix)]
        assert len(found) == 1, f"bench/results/controller_scale.jsonl: {len(found)} rows noted {note_prefix!r}"
        r = found[0]
        sec = (lambda x: f"{x:.2f}" if x < 1 else f"{x:.1f}")
        rss = thousands(r["peak_rss_mb"]) + (f" + {thousands(r['workers_peak_rss_mb'])}" if procs > 1 else "")
        cells = [label, str(procs), f"{r['load_avg_1m_before']:.1f}-{r['load_avg_1m']:.1f}",
                 f"{half_up(r['received_tok_s'] / 1e3)}k", f"{r['cpu_us_per_tok']:.2f}",
                 f"{r['total_cpu_us_per_tok']:.2f}",
                 f"{half_up(100 * r['cpu_util'])}% / {half_up(100 * r['total_cpu_util'])}%",
                 " / ".join(thousands(r[k]) for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms")),
                 sec(r["pause_ack_max_s"]), sec(r["pause_to_continue_max_s"]), f"{r['sim_loop_lag_max_s']:.1f}", rss,
                 f"yes, {thousands(r['samples_checked'])}"]
        return ("| " + " | ".join(cells) + " |",)
    return figures


def noted(prefix: str) -> dict:
    """The one controller_scale row whose note starts with ``prefix``."""
    found = [r for r in rows("controller_scale.jsonl") if (r.get("note") or "").startswith(prefix)]
    assert len(found) == 1, f"bench/results/controller_scale.jsonl has {len(found)} rows noted {prefix!r}"
    return found[0]


def rate(x: float) -> str:
    """Received tokens/s as the docs write them: 245k, 2.8M."""
    return f"{x / 1e6:.1f}" if x >= 1e6 else f"{half_up(x / 1e3)}"


def state_row(prefix: str) -> Callable[[], tuple[str, ...]]:
    """A row of docs/scale.md's state tables: received tokens/s (k or M), controller CPU us / token, share of a
    core, loop lag p50 / p99 / max (ms), pause -> continue max (s), peak RSS (GB)."""
    def figures():
        r = noted(prefix)
        return (rate(r["received_tok_s"]), f"{r['cpu_us_per_tok']:.2f}", f"{half_up(100 * r['cpu_util'])}",
                *(thousands(r[k]) for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms")),
                f"{r['pause_to_continue_max_s']:.2f}", f"{r['peak_rss_mb'] / 1000:.2f}")
    return figures


def state_range(*prefixes: str) -> tuple[str, ...]:
    """The full-buffer decode-16x runs at bound 1024 MB as ranges, and the earlier run's peak (GB)."""
    rs = [noted(p) for p in prefixes]

    def span(key, fmt):
        lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
        return fmt(lo), fmt(hi)
    return (*span("received_tok_s", lambda x: f"{x / 1e6:.1f}"), *span("cpu_us_per_tok", lambda x: f"{x:.2f}"),
            *span("cpu_util", lambda x: f"{half_up(100 * x)}"), *span("lag_p50_ms", thousands),
            *span("lag_p99_ms", thousands), *span("lag_max_ms", thousands),
            *span("pause_to_continue_max_s", lambda x: f"{x:.2f}"), f"{rs[1]['peak_rss_mb'] / 1000:.2f}",
            f"{rs[0]['peak_rss_mb'] / 1000:.2f}")


def quiet_row(prefix: str) -> Callable[[], tuple[str, ...]]:
    """A row of docs/scale.md's quiet-machine table: CPU us / token (controller; all processes when sharded), GC
    share (%), loop lag p50 / p99 / max (ms), pause -> continue max (s), peak RSS (GB; + the workers'), tok/s (k)."""
    def figures():
        r = noted(prefix)
        workers = r["client_procs"] > 1
        us = (f"{r['cpu_us_per_tok']:.3g}", f"{r['total_cpu_us_per_tok']:.2f}") if workers else (
            f"{r['cpu_us_per_tok']:.2f}",)
        rss = (f"{r['peak_rss_mb'] / 1000:.2f}", f"{r['workers_peak_rss_mb'] / 1000:.2f}") if workers else (
            f"{(r['process_peak_rss_mb'] if '/4' in prefix else r['peak_rss_mb']) / 1000:.2f}",)
        return (*us, f"{100 * r['gc_share_of_cpu']:.1f}", *(thousands(r[k]) for k in ("lag_p50_ms", "lag_p99_ms",
                "lag_max_ms")), f"{r['pause_to_continue_max_s']:.2f}", *rss, f"{half_up(r['received_tok_s'] / 1e3)}")
    return figures


def parked_workers_row() -> tuple[str, ...]:
    """docs/scale.md's latest-state row with 2 client workers: tokens/s, controller and workers' CPU us / token
    and shares of a core, loop lag, pause -> continue max, controller and workers' peak RSS (GB)."""
    r = noted("sharded client, 2 worker processes; finished episodes parked")
    return (rate(r["received_tok_s"]), f"{r['cpu_us_per_tok']:.2f}", f"{r['worker_cpu_us_per_tok']:.2f}",
            f"{half_up(100 * r['cpu_util'])}", f"{half_up(100 * (r['total_cpu_util'] - r['cpu_util']))}",
            *(thousands(r[k]) for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms")),
            f"{r['pause_to_continue_max_s']:.2f}", f"{r['peak_rss_mb'] / 1000:.2f}",
            f"{r['workers_peak_rss_mb'] / 1000:.2f}")


STATIC_ROWS = ("loss fwd, V = 151,936 bf16", "loss bwd, V = 151,936 bf16", "segment copy int64 [T]", "unpack int64 [T]",
               "segment copy bf16 [T, 3584]", "unpack bf16 [T, 3584]", "segment copy int64 [T, 3, 5]",
               "unpack int64 [T, 3, 5]", "pack int64 [B, L] (+ position ids)", "gather 5 per-token columns, T=4096",
               "scatter 5 per-token columns, T=4097", "gather mixed widths, 6 columns, T=4096",
               "scatter mixed widths, 6 columns, T=4096", "delta count, 151,936 x 3,584 bf16", "delta encode, same",
               "delta apply, 13,068,927 changes (2.4 %)")
STATIC_NAMES = {", V = 151,936 bf16": " V=151936 bfloat16",
                "delta count, 151,936 x 3,584 bf16": "delta count 151936 x 3584 bf16",
                "delta encode, same": "delta encode 151936 x 3584 bf16",
                "delta apply, 13,068,927 changes (2.4 %)": "delta apply 151936 x 3584 bf16, 13068927 changes"}


def static_row(triton: str, label: str) -> Callable[[], tuple[str]]:
    """A row of docs/static_sm90.md's table from ``static_sm90-triton<triton>.json``: registers, spill bytes,
    shared memory, the hot loop's own instructions ("(body)" for a loop-free kernel), SASS per element."""
    def figures():
        data = json.loads((RESULTS / f"static_sm90-triton{triton}.json").read_text())
        name = label
        for a, b in STATIC_NAMES.items():
            name = name.replace(a, b)
        if label.startswith("interval_copy_kernel"):
            name = "interval_copy.cu"
        [k] = [x for x in data["kernels"] if x["name"].split(":")[0] == name]
        unit = {"16-bit word": "word", "16 bytes loaded": "16 B"}.get(k["element"], k["element"])
        instr = f"{k['hot_loop']['own_instructions']}" + (" (body)" if k.get("loop_free") else "")
        sass = "-" if k["sass_per_element"] is None else f"{k['sass_per_element']} / {unit}"
        version = "nvcc" if name == "interval_copy.cu" else triton.rsplit(".", 1)[0]
        cells = (version, label, str(k["registers"]), f"{k['spill_store_bytes']}/{k['spill_load_bytes']}",
                 str(k["shared_bytes"]), instr, sass)
        return ("| " + " | ".join(cells) + " |",)
    return figures


def pause_cpu_spread() -> tuple[str, ...]:
    """docs/pause_modes.md's reading of the CPU table: the largest per-seed difference between modes, the range
    of the per-mode std over seeds, and of the behaviour KL."""
    r = [newest("pause_mode_cpu.jsonl", pause_mode=m) for m in ("abort", "retract", "in_place")]
    per_seed = list(zip(*(x["em_final_per_seed"] for x in r)))
    diff = max(max(s) - min(s) for s in per_seed)
    std = sorted(x["em_final_std"] for x in r)
    kl = sorted(x["behav_kl_mean"] for x in r)
    return f"{diff:.3f}", f"{std[0]:.2f}", f"{std[-1]:.2f}", f"{kl[-1]:.3f}", f"{kl[0]:.3f}"


def chaos_fault(stamp: str, phase: str, fault: str) -> dict:
    data = json.loads((RESULTS / f"chaos_{stamp}.json").read_text())
    [f] = [x for p in data["phases"] if p["phase"] == phase for x in p["faults"] if x["fault"] == fault]
    return f


def chaos_accounting() -> tuple[str, ...]:
    """docs/chaos.md's sample accounting of the default-schedule run: lost, duplicated, then per phase issued,
    trained, buffered, pending."""
    data = json.loads((RESULTS / "chaos_20261125_1949.json").read_text())
    acc = {p["phase"]: p["accounting"] for p in data["phases"]}
    lost = sum(a["lost_n"] for a in acc.values())
    dup = sum(a["duplicated_n"] for a in acc.values())
    return (str(lost), str(dup), *(str(acc["main"][k]) for k in ("issued", "trained", "buffered", "pending")),
            *(str(acc["proxy"][k]) for k in ("issued", "trained", "buffered", "pending")))


def part(figures: Callable[[], tuple[str, ...]], start: int, n: int) -> Callable[[], tuple[str, ...]]:
    """Figures ``start`` .. ``start + n`` of ``figures`` (one reading split over several quoted texts)."""
    return lambda: figures()[start:start + n]


def chaos_prose() -> tuple[str, ...]:
    """docs/chaos.md's reading of the default-schedule run, fault by fault."""
    f = (lambda fault, phase="main": chaos_fault("20261125_1949", phase, fault))
    return (thousands(f("40:server_kill")["pool_back_s"]), thousands(f("220:server_stop:20")["pool_back_s"]),
            f"{f('380:reward_kill')['recovery_s']:.1f}", str(f("380:reward_kill")["steps_delayed"]),
            f"{half_up(100 * f('440:reward_hang:15')['dip'])}", thousands(f("440:reward_hang:15")["recovery_s"]),
            thousands(f("580:controller_kill")["recovery_s"]), str(f("580:controller_kill")["steps_delayed"]),
            f"{half_up(100 * f('40:proxy_slow:30:1.0', 'proxy')['dip'])}")


def pause_summary(setup: str, arm: str, noted_run: bool = False) -> dict:
    """The newest async_speedup_pause_mode_summary row of ``setup`` and ``arm``; ``noted_run``: the earlier
    K = 25 run (rows with a note) instead of the table's."""
    return [x for x in rows("async_speedup_pause_mode_summary.jsonl") if x["setup"] == setup
            and x["pause_arm"] == arm and bool(x.get("note")) == noted_run][-1]


def pause_prose() -> tuple[str, ...]:
    """docs/pause_modes.md's reading of its tables: the K = 25 runs' prefill (M tokens, GPU s), the share of
    generation lost and the speedups compared."""
    small, big = "1.5B, 16 nodes x 8 GPUs", "7B, 24 nodes x 8 GPUs"
    k25 = pause_summary(big, "abort", noted_run=True)
    k25_small = [pause_summary(small, a, noted_run=True) for a in ("abort", "retract")]
    k8_small = [pause_summary(small, a) for a in ("abort", "retract")]
    lost = [pause_summary(s_, a)["lost_fraction_of_generation"] for s_, a in ((small, "abort"), (small, "retract"),
                                                                              (big, "retract"))]
    tok = (lambda rs: sorted(f"{r['recomputed_prefill_tokens_per_update'] / 1e6:.0f}" for r in rs))
    gpu = (lambda rs: sorted(thousands(r["recomputed_prefill_gpu_s_per_update"]) for r in rs))
    sp = (lambda setup, arm: f"{pause_summary(setup, arm)['speedup']:.2f}")
    return (f"{k25['recomputed_prefill_tokens_per_update'] / 1e6:.1f}",
            thousands(k25["recomputed_prefill_gpu_s_per_update"]),
            *tok(k25_small), *gpu(k25_small), *tok(k8_small), *gpu(k8_small),
            f"{100 * min(lost):.1f}", f"{100 * max(lost):.1f}",
            f"{half_up(100 * pause_summary(small, 'in_place')['lost_fraction_of_generation'])}",
            sp(small, "in_place"), sp(small, "retract"), sp(small, "in_place_ideal"), sp(small, "retract"),
            sp(big, "in_place_ideal"), sp(big, "retract"))


def mismatch_prose() -> tuple[str, ...]:
    """docs/mismatch.md's reading of its bf16 rows at full length: the k3 range, the w p99 range, IcePop's worst
    masked share (%), the per-sequence |sum log w| mean and p90 ranges, and exp(p90) as a factor."""
    r = [x for x in rows("mismatch.jsonl") if x["dtype"] == "bfloat16" and x["shape"] == "long"]
    span = (lambda key, fmt: (fmt(min(x[key] for x in r)), fmt(max(x[key] for x in r))))
    k3 = span("mismatch_k3", lambda v: f"{v * 1e4:.1f}")
    return (*k3, *span("mismatch_ratio_p99", lambda v: f"{v:.2f}"),
            f"{100 * max(x['outside_0.5_2.0'] for x in r):.2g}", *span("seq_abs_log_w_mean", lambda v: f"{v:.2f}"),
            *span("seq_abs_log_w_p90", lambda v: f"{v:.2f}"), *span("seq_abs_log_w_p90", lambda v: f"{exp(v):.1f}"))


SHARDED_NOTES = {(64, n): f"sharded client, final: --client-procs {n}" for n in (1, 2, 3)} | {
    (256, n): f"sharded client, final: --client-procs {n}" for n in (1, 2, 3)} | {
    (257, n): f"sharded client, cheaper simulator (orjson, GC thresholds): --client-procs {n}" for n in (1, 2, 3)}


def sharded_runs(servers: int, procs: tuple[int, ...]) -> list[dict]:
    """The sharded-client table's runs at ``servers`` (256 with both simulators) with ``procs`` processes."""
    keys = [(k, n) for k in ((256, 257) if servers == 256 else (64,)) for n in procs]
    return [[r for r in rows("controller_scale.jsonl") if r["servers"] == (64 if k == 64 else 256)
             and (r.get("note") or "").startswith(SHARDED_NOTES[(k, n)])][0] for k, n in keys]


def span(rs: list[dict], key: str, fmt: Callable[[float], str]) -> tuple[str, str]:
    return fmt(min(r[key] for r in rs)), fmt(max(r[key] for r in rs))


def sharded_prose() -> tuple[str, ...]:
    """docs/scale.md's reading of the sharded-client table: controller CPU us / token in process and with
    workers, total CPU, loop lag, memory."""
    one, many, small = sharded_runs(256, (1,)), sharded_runs(256, (2, 3)), sharded_runs(64, (2, 3))
    us = (lambda v: f"{v:.2f}")
    gb = (lambda v: f"{v / 1000:.1f}")
    total = [r["peak_rss_mb"] + r["workers_peak_rss_mb"] for r in many]
    return (*span(sharded_runs(256, (1,)) + sharded_runs(64, (1,)), "cpu_us_per_tok", us),
            *span(many, "cpu_us_per_tok", us), *span(small, "cpu_us_per_tok", us),
            *span(one, "total_cpu_us_per_tok", us), *span(many, "total_cpu_us_per_tok", us),
            *span(many, "lag_p99_ms", thousands), *span(many, "lag_max_ms", gb),
            *span(one, "lag_p99_ms", thousands), *span(one, "lag_max_ms", gb),
            *span(many, "workers_peak_rss_mb", thousands), *span(many, "peak_rss_mb", thousands),
            gb(min(total)), gb(max(total)), *span(one, "peak_rss_mb", thousands))


def staleness_sweep() -> tuple[str, ...]:
    """docs/staleness_ablation.md's account of the 108-run sweep: runs done / planned, minutes of wall time,
    seconds per run, and the range of the share of groups at the bound over the arms (%)."""
    d = json.loads((RESULTS / "staleness_20261123_1842.json").read_text())
    arms = [x for x in rows("staleness.jsonl") if x["provenance"]["date"].startswith(STALENESS_SWEEP)]
    at = [100 * a["staleness_at_bound_fraction_mean"] for a in arms]
    return (str(d["runs_done"]), str(d["runs_planned"]), f"{d['sweep_wall_s'] / 60:.1f}",
            thousands(d["sum_run_wall_s"] / d["runs_done"]), f"{half_up(min(at))}", f"{half_up(max(at))}")


def hard_arms(**match) -> list[dict]:
    return [a for a in hard()["arms"] if a["advantage"] == "grpo" and all(a[k] == v for k, v in match.items())]


def pct_span(values: list[float], fmt: Callable[[float], str]) -> tuple[str, str]:
    """The smallest and largest of shares (0-1) as percentages, as the docs write a range."""
    return fmt(100 * min(values)), fmt(100 * max(values))


def hard_at_eta() -> tuple[str, ...]:
    """The harder sweep's share of trained groups exactly eta versions old (%): eta 1-4, 8, 16, over every arm."""
    out = []
    for etas in ((1, 2, 4), (8,), (16,)):
        out += pct_span([a["staleness_at_eta_fraction"] for a in hard()["arms"] if a["eta"] in etas],
                        lambda x: f"{half_up(x)}")
    return tuple(out)


def hard_clip() -> tuple[str, ...]:
    """Naive PPO's clip fraction (%) at eta 4, 8, 16 and 0, then the decoupled objective's range over every eta."""
    naive = [f"{100 * hard_arms(objective='naive', eta=e)[0]['clip_fraction_mean_mean']:.1f}" for e in (4, 8, 16, 0)]
    return (*naive, *pct_span([a["clip_fraction_mean_mean"] for a in hard_arms(objective="recompute")],
                              lambda x: f"{x:.1f}"))


HARD_OPTION_FRACTION = {"tis": "tis_truncated_fraction_mean_mean", "icepop": "token_mis_masked_fraction_mean_mean",
                        "seq_mis": "seq_mis_masked_fraction_mean_mean", "m2po": "m2po_masked_fraction_mean_mean"}


def hard_option_share(etas: tuple[int, ...]) -> tuple[str, str]:
    """The range over the four options, at ``etas``, of the share of tokens each masked or truncated (%)."""
    return pct_span([a[HARD_OPTION_FRACTION[a["objective"]]] for a in hard()["arms"]
                     if a["objective"] in HARD_OPTION_FRACTION and a["eta"] in etas],
                    lambda x: f"{x:.1f}".replace("0.0", "0") if x < 0.05 else f"{x:.1f}")


def lora_share() -> tuple[str]:
    """The tiny recipe's r-8 adapter as a share of the whole model's bytes (%)."""
    r = newest("lora_sync.jsonl", part="tiny", model="tiny recipe", rank=8)
    return (f"{half_up(100 * r['adapter_bytes'] / r['full_bytes'])}",)


def mismatch_fp32_row() -> tuple[str, ...]:
    """docs/mismatch.md's fp32 control row (real vLLM, T 1.0, long): tokens, k1, k3, w p99 / max, the
    per-sequence |sum log w| mean / p90, at one significant digit where they are noise."""
    r = newest("mismatch.jsonl", engine="vllm", dtype="float32", temperature=1.0, shape="long")
    one = (lambda x: "{}e{}".format(*f"{x:.0e}".split("e")[:1], int(f"{x:.0e}".split("e")[1])))
    return (str(r["tokens"]), one(r["mismatch_k1"]), one(r["mismatch_k3"]), f"{r['mismatch_ratio_p99']:.2f}",
            f"{r['mismatch_ratio_max']:.2f}", one(r["seq_abs_log_w_mean"]), one(r["seq_abs_log_w_p90"]))


def mismatch_contrast(label: str, key: str, sweep: str = MISMATCH_SWEEP) -> Callable[[], tuple[str]]:
    """A row of docs/mismatch.md's paired-contrast table: mean EM over the run, arm minus its pair, with its
    95 % interval, at eta 0 and at eta 4 (bold where the interval excludes 0)."""
    def figures():
        c = json.loads((RESULTS / sweep).read_text())["contrasts"][key]
        cells = [diff_ci(x["eval_mean_diff_mean"], x["eval_mean_diff_ci95"]) for eta in (0, 4) for x in c
                 if x["eta"] == eta]
        return ("| " + " | ".join([label, *cells]) + " |",)
    return figures


def fp8_contrast_at(key: str, eta: int) -> tuple[str, ...]:
    """One FP8 contrast at ``eta``: the mean-over-the-run difference, then the final one with its interval."""
    x = next(x for x in json.loads((RESULTS / FP8_SWEEP).read_text())["contrasts"][key] if x["eta"] == eta)
    m, f, h = x["eval_mean_diff_mean"], x["eval_final_diff_mean"], x["eval_final_diff_ci95"]
    return tuple(f"{v:+.3f}" for v in (m, f, f - h, f + h))


MINIBATCHES4 = "staleness_20261123_1848_minibatches4.json"  # docs/staleness_ablation.md's four-minibatch sweep


def minibatches4_row(eta: int, objective: str) -> Callable[[], tuple[str, ...]]:
    """A row of the four-minibatch table: final EM, final - sync, best EM (mean ± spread over the seeds),
    mean(p - b) (the behaviour KL estimate) and the clip fraction."""
    def figures():
        d = json.loads((RESULTS / MINIBATCHES4).read_text())
        [r] = [a for a in d["arms"] if a["arm"] == f"eta{eta}_{objective}_grpo"]
        return (f"{r['eval_final_mean']:.3f}", f"{r['eval_final_spread']:.3f}", f"{r['eval_final_vs_sync_mean']:+.3f}",
                f"{r['eval_final_vs_sync_spread']:.3f}", f"{r['eval_best_mean']:.3f}", f"{r['eval_best_spread']:.3f}",
                f"{round(r['behav_kl_mean_mean'], 3) + 0.0:+.3f}", f"{r['clip_fraction_mean_mean']:.3f}")  # no -0.000
    return figures


def hard_pilot_curve() -> tuple[str, ...]:
    """The held-out EM curve of the harder sweep's first run (pilot B, adopted by the sweep)."""
    [r] = [x for x in hard()["runs"] if x["run"] == "eta0_recompute_grpo_s1"]
    return tuple(str(Decimal(repr(em)).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP)) for _, em in r["eval_curve"])


def top_p_bias(top_p: float, top_k: int) -> Callable[[], tuple[str, ...]]:
    """docs/config.md's truncated-sampling table: mean and largest |log q - log p|, mean and smallest Z."""
    def figures():
        r = newest("top_p_bias.jsonl", top_p=top_p, top_k=top_k)
        return tuple(f"{r[k]:.3f}" for k in ("mean_abs_gap", "max_abs_gap", "mean_weight", "min_weight"))
    return figures


def parallel_counted(arm):
    """docs/parallelism.md's counted table: rank 0's parameter bytes and bytes sent by kind, one step."""
    def figures():
        p = newest("parallel_cost.jsonl", kind="counted", arm=arm)["per_rank"][0]
        sent = p["sent"]

        def by(op):
            return sum(v for k, v in sent.items() if k.split(":")[0] == op)

        return tuple(thousands(x) for x in (p["param_bytes"]["dense"], p["param_bytes"]["experts"],
                                            by("all_gather_single"), by("reduce_scatter_single"),
                                            by("all_to_all_single"), by("all_reduce"), sum(sent.values())))
    return figures


def parallel_computed(arm, micro_batches):
    """docs/parallelism.md's computed table for Qwen3-30B-A3B on 8 H200: GB held and sent, ms at NVLink and IB."""
    def figures():
        nv, ib = (newest("parallel_cost.jsonl", kind="computed", arm=arm, micro_batches=micro_batches, link=link)
                  for link in ("nvlink", "ib"))
        gb = tuple(f"{nv[k] / 1e9:.1f}" for k in ("param_bytes_held", "all_gather", "reduce_scatter",
                                                  "expert_grad_all_reduce", "all_to_all", "sent_total"))
        return gb + (thousands(nv["comm_seconds"] * 1e3), thousands(ib["comm_seconds"] * 1e3))
    return figures


def parallel_computed_cp(arm, scenario):
    """docs/parallelism.md's context-parallel table for Qwen3-30B-A3B on 8 H200: tokens a rank, longest
    sequence, key/value heads sent, all-to-all GB, ms at NVLink and IB, attention PFLOP."""
    def figures():
        nv, ib = (newest("parallel_cost.jsonl", kind="computed_cp", arm=arm, scenario=scenario, link=link)
                  for link in ("nvlink", "ib"))
        return (thousands(nv["tokens_per_rank"]), thousands(nv["longest_sequence"]), str(nv["kv_heads_exchanged"]),
                f"{nv['all_to_all'] / 1e9:.1f}", thousands(nv["all_to_all_seconds"] * 1e3),
                thousands(ib["all_to_all_seconds"] * 1e3), f"{nv['attention_flops'] / 1e15:.2f}")
    return figures


def parallel_learning(tag, arm):
    """docs/parallelism.md's learning table: seeds, held-out EM at step 0 and at the end (mean over seeds,
    their standard deviation) and the mean wall time of a run, of the newest sweep tagged ``tag``."""
    def figures():
        found = [r for r in rows("parallel_learning.jsonl")
                 if r["arm"] == arm and r["curves"].endswith(f"_{tag}.json")]
        assert found, f"bench/results/parallel_learning.jsonl has no {arm} row of a {tag} sweep"
        r = found[-1]
        return (str(len(r["seeds"])), f"{r['eval_first_mean']:.3f}", f"{r['eval_final_mean']:.3f}",
                f"{r['eval_final_spread']:.3f}", thousands(r["wall_s_mean"]))
    return figures


@dataclass(frozen=True)
class Figure:
    doc: str
    text: str  # the quoted text, "{}" where each figure stands
    source: str  # the result file under bench/results/
    figures: Callable[[], tuple[str, ...]]
    whole: bool = False  # the one "{}" is a whole phrase, there word for word (not numbers in a pattern)
    after: str = ""  # where the same text stands twice: only its first occurrence after this text is checked


def trainer_step_ab(note: str = "tiny recipe step, A/B", digits: int = 2) -> Callable[[], tuple[str, ...]]:
    """The A/B pairs of tools/profile_step.py noted ``note``: the reference paths' and the new paths'
    median step, lowest-highest."""
    def figures():
        ab = [r for r in rows("trainer_step.jsonl") if r["note"] == note]
        ref = [r["step_s_median"] for r in ab if r["variant"] == "reference"]
        fast = [r["step_s_median"] for r in ab if r["variant"] == "fast"]
        return tuple(f"{x:.{digits}f}" for x in (min(ref), max(ref), min(fast), max(fast)))
    return figures


def vs_trl_run() -> list[dict]:
    """The rows of the newest run of bench/bench_vs_trl.py."""
    every = rows("vs_trl.jsonl")
    return [r for r in every if r["run"] == every[-1]["run"]]


def vs_trl_arm(arm: str) -> Callable[[], tuple[str, ...]]:
    """One arm's row of the table: seeds, mean RL wall time, mean time to the target over the seeds
    that reached it, how many reached it, mean final exact match."""
    def figures():
        got = [r for r in vs_trl_run() if r["arm"] == arm]
        hit = [r["time_to_target_s"] for r in got if r["time_to_target_s"] is not None]
        return (str(len(got)), f"{sum(r['rl_s'] for r in got) / len(got):.1f}",
                f"{sum(hit) / len(hit):.1f}" if hit else "-", str(len(hit)),
                f"{sum(r['eval_last'] for r in got) / len(got):.3f}")
    return figures


def vs_trl_seed(seed: int) -> Callable[[], tuple[str, ...]]:
    """One seed's RL wall time and time to the target: asynchronous, synchronous, TRL."""
    def figures():
        got = {r["arm"]: r for r in vs_trl_run() if r["seed"] == seed}
        return tuple(f"{got[a][k]:.1f}" for k in ("rl_s", "time_to_target_s") for a in ("async", "sync", "trl"))
    return figures


def vs_trl_load() -> tuple[str, ...]:
    loads = [x for r in vs_trl_run() for x in (r["load_start"][0], r["load_end"][0])]
    return f"{min(loads):.1f}", f"{max(loads):.1f}"


def vs_trl_split() -> tuple[str, ...]:
    """The asynchronous arm's seconds a step: training, weight sync, waiting for samples."""
    got = [r for r in vs_trl_run() if r["arm"] == "async"]
    n = sum(r["steps"] for r in got)
    return tuple(f"{sum(r['timers'][k] for r in got) / n:.2f}" for k in ("train_s", "sync_s", "wait_s"))


FIGURES = [
    Figure("docs/benchmarks.md", "| areal_fast, asynchronous | {} | {} s | {} s | {} | {} |", "vs_trl.jsonl",
           vs_trl_arm("async")),
    Figure("docs/benchmarks.md", "| areal_fast, synchronous | {} | {} s | {} s | {} | {} |", "vs_trl.jsonl",
           vs_trl_arm("sync")),
    Figure("docs/benchmarks.md", "| TRL GRPOTrainer | {} | {} s | {} s | {} | {} |", "vs_trl.jsonl",
           vs_trl_arm("trl")),
    Figure("docs/benchmarks.md", "one-minute load average between {} and {} on", "vs_trl.jsonl", vs_trl_load),
    Figure("docs/benchmarks.md", "seed 1, the quietest: RL wall time {} s asynchronous, {} s synchronous, {} s TRL; "
           "exact match 0.8 after {} s, {} s and {} s", "vs_trl.jsonl", vs_trl_seed(1)),
    Figure("docs/benchmarks.md", "a step spent {} s training, {} s in the weight update and {} s waiting",
           "vs_trl.jsonl", vs_trl_split),
    Figure("docs/benchmarks.md", "the median trainer step went from {}-{} s to {}-{} s", "trainer_step.jsonl",
           trainer_step_ab()),
    Figure("docs/benchmarks.md", "on the quieter machine (load average about 1) from {}-{} s to {}-{} s",
           "trainer_step.jsonl", trainer_step_ab("tiny recipe step, A/B, quieter", 3)),
    Figure("README.md", "120 steps take {} s of RL wall time asynchronously against TRL's {} s, and held-out exact "
           "match 0.8 comes after {} s against {} s", "vs_trl.jsonl",
           lambda: tuple(vs_trl_arm(a)()[k] for k in (1, 2) for a in ("async", "trl"))),
    Figure("README.md", "async vs sync on the tiny task {}x", "e2e.jsonl", e2e_speedup),
    Figure("README.md", "at the paper's scale async/sync is {}-{}x", "async_speedup_summary.jsonl",
           sim_paper_scale_range),
    Figure("README.md", "one rollout client process takes in {}M generated tokens/s from 256 simulated servers at "
           "{}% of a core", "controller_scale.jsonl", client_rate()),
    Figure("README.md", "The newest clean-clone `.ci/run` on 2 cores: {}.", "suite_time.jsonl",
           lambda: (suite_sentence(),), whole=True),
    Figure("README.md", "the quick loop alone took {} s of tests ({} passed)", "suite_time.jsonl",
           lambda: (lambda r: (thousands(r["tests_s"]), thousands(r["passed"])))(
               newest("suite_time.jsonl", selection="not slow"))),
    Figure("examples/README.md", "of the means **{}x**", "e2e.jsonl", e2e_speedup),
    Figure("examples/README.md", "to at least {} at step 120 in every seed, in both modes", "e2e.jsonl",
           lambda: (f"{min(newest('e2e.jsonl')[f'{m}_eval_final']['min'] for m in ('async', 'sync')):.3f}",)),
    Figure("examples/README.md", "| trained tokens/s | {} [{}..{}] | {} [{}..{}] (", "e2e.jsonl", e2e_tokens),
    Figure("examples/README.md", "| held-out exact match, final (step 120) | {} [{}..{}] | {} [{}..{}] |", "e2e.jsonl",
           e2e_stat("eval_final", 3)),
    Figure("examples/README.md", "| held-out exact match, best | {} [{}..{}] | {} [{}..{}] |", "e2e.jsonl",
           e2e_stat("eval_best", 3)),
    Figure("examples/README.md", "| time to held-out >= 0.7 (first eval that hit it) | {} s [{}..{}] | {} s [{}..{}] |",
           "e2e.jsonl", e2e_stat("time_to_target_s", 1, "0.7")),
    Figure("examples/README.md", "| time to held-out >= 0.8 | {} s [{}..{}] | {} s [{}..{}] |", "e2e.jsonl",
           e2e_stat("time_to_target_s", 1, "0.8")),
    Figure("examples/README.md", "| held-out exact match, warm start | {} [{}..{}] | {} [{}..{}] |", "e2e.jsonl",
           e2e_spread("eval_first", 3)),
    Figure("examples/README.md", "| trained samples/s | {} [{}..{}] | {} [{}..{}] |", "e2e.jsonl",
           e2e_spread("trained_samples_per_s", 0)),
    Figure("examples/README.md", "| wall time for 120 steps | {} s [{}..{}] | {} s [{}..{}] |", "e2e.jsonl",
           e2e_spread("elapsed_s", 1)),
    Figure("examples/README.md", "| time: waiting for a batch / training / weight sync / eval (mean s) | "
           "{} / {} / {} / {} | {} / {} / {} / {} |", "e2e.jsonl", e2e_breakdown),
    Figure("examples/README.md", "| staleness of trained groups | 4 for {} %, 0-3 mostly at the start, {} of {} "
           "groups at 5-6 | 0 |", "e2e.jsonl", e2e_staleness),
    Figure("examples/README.md", "the trainer waits {} s of ~100 s", "e2e.jsonl", lambda: (e2e_breakdown()[4],)),
    Figure("examples/README.md", "({} vs {} s for the same 120 steps)", "e2e.jsonl",
           lambda: (e2e_breakdown()[1], e2e_breakdown()[5])),
    Figure("examples/README.md", "here it hides most of the {} s of waiting but pays ~{} s of it back in slower "
           "training", "e2e.jsonl", e2e_overlap),
    Figure("examples/README.md", "async/sync {}x (`bench/results/e2e_20261122_0552.json`)", "e2e_20261122_0552.json",
           lambda: (f"{json.loads((RESULTS / 'e2e_20261122_0552.json').read_text())['speedup_tokens_per_s']:.2f}",)),
    *(Figure("docs/scale.md", "{}", "async_speedup.jsonl", sim_run(setup, gen, nth), whole=True)
      for setup, gens in (("1.5B, 16 nodes x 8 GPUs", (128, 64, 80, 96, 112)),
                          ("7B, 24 nodes x 8 GPUs", (192, 96, 112, 128, 144, 160)), ("1.5B, 4 GPUs", (4, 2, 3)),
                          ("7B, 8 GPUs", (8, 4, 5, 6, 7)))
      for gen in gens for nth in ((0, 1) if gen == 192 else (0,))),
    Figure("docs/scale.md", "| 1.5B, 16 nodes x 8 GPUs | 80 / 48 ({}%; 96 / 32 within {}%) | **{}x** |",
           "async_speedup_summary.jsonl", lambda: (*sim_split()[:2], *sim_speedup("1.5B, 16 nodes x 8 GPUs")())),
    Figure("docs/scale.md", "| 7B, 24 nodes x 8 GPUs | 112 / 80 ({}%) | **{}x** (same-session pair; {}-{}x across the "
           "two sync runs) |", "async_speedup_summary.jsonl",
           lambda: (sim_split()[2], *sim_speedup("7B, 24 nodes x 8 GPUs")(), *sim_7b_pairs()[:2])),
    Figure("docs/scale.md", "| 1.5B, 8 GPUs | 5 / 3 (the 128-GPU slice itself) | {}x |", "async_speedup_summary.jsonl",
           sim_speedup("1.5B, 16 nodes x 8 GPUs")),
    Figure("docs/scale.md", "The model lands a little below the paper's 2.57-2.77x ({}-{}x).",
           "async_speedup_summary.jsonl", sim_all_speedups),
    Figure("docs/scale.md", "The two sync runs of the 7B setup, at load averages {} and {}, differ by {}%",
           "async_speedup.jsonl", lambda: sim_7b_pairs()[2:]),
    Figure("docs/scale.md", "(the controller had changed; its CPU stays below {}% of a core in every run)",
           "async_speedup.jsonl",
           lambda: (f"{ceil(100 * max(r['controller_cpu_util'] for r in rows('async_speedup.jsonl')))}",)),
    Figure("docs/scale.md", "| 1.5B, 4 GPUs | 3 / 1 | {}x |", "async_speedup_summary.jsonl",
           sim_speedup("1.5B, 4 GPUs")),
    Figure("docs/scale.md", "| 7B, 8 GPUs | 5 / 3 | {}x |", "async_speedup_summary.jsonl", sim_speedup("7B, 8 GPUs")),
    Figure("docs/scale.md", "(the client is the bottleneck), 10 steps | **{}M** | {} | {}% | {} / {} / {} | {} | "
           "{} GB |", "controller_scale.jsonl", scale_row(CLIENT_RATE)),
    Figure("docs/scale.md", "| decode 4x real time (the production rate) | {}k | {} | {}% | {} / **{}** / {} | {} | "
           "**{} GB** |", "controller_scale.jsonl", scale_row(PARKED + "decode 4x", rate="k")),
    Figure("docs/scale.md", "| decode 16x | {}M | {} | {}% | {} / {} / {} | {} | {} GB |", "controller_scale.jsonl",
           scale_row(PARKED + "decode 16x")),
    Figure("docs/scale.md", "yes, as a rate: {}M tokens/s at {}% of one core, one process", "controller_scale.jsonl",
           client_rate()),
    Figure("docs/scale.md", "({}M at {}% before heap trimming and parking)", "controller_scale.jsonl",
           client_rate("client rate at 256 servers: simulator without a decode-rate")),
    Figure("docs/scale.md", "| 8 / 512, `--compress 1 --steps 2 --fill-buffer --buffer-memory-mb none` | {} | {}% | {} "
           "({}M) | {} | {}M (64 + a batch of 16) | {} MB | {} |", "controller_scale.jsonl",
           scale_memory("97c00c5-dirty", 8)),
    Figure("docs/scale.md", "| same, `--reference-renderer` | {} | {}% | {} | {} | {}M | {} MB | {} |",
           "controller_scale.jsonl", scale_memory("41c08b5-dirty", 8, full=False)),
    Figure("docs/scale.md", "| 64 / 4,096, `--compress 1 --steps 10 --train-s 0.01 --max-speed` | {} | "
           "{}% (+{}% checks) "
           "| {} ({}M) | {} | {}M ({}, + {}M in running groups) | {} MB | {} |", "controller_scale.jsonl",
           scale_max_speed),
    Figure("docs/scale.md", "| 64 / 4,096, default (/16, real time) | {} | {}% | {} | {} | {}M | {} MB | {} |",
           "controller_scale.jsonl", scale_memory("97c00c5-dirty", 64, full=False)),
    Figure("docs/scale.md", "| 8 / 512 | {} | {} | {}% | {}% | {} / {} / {} | {} | {} / {} | {} -> {} | "
           "yes, {} samples | {} |",
           "controller_scale.jsonl", scale_baseline("49827d3", 8)),
    Figure("docs/scale.md", "| 64 / 4,096 | {} | {} | {}% | {}% | {} / {} / {} | {} | {} / {} | {} -> {} | "
           "yes, {} samples | "
           "{} |", "controller_scale.jsonl", scale_baseline("49827d3", 64)),
    Figure("docs/scale.md", "| 8 / 512 (earlier run) | {} | {} | {}% | - | {} / {} / {} | {} | {} / {} | "
           "{} -> {} | yes, {} "
           "samples | {} |", "controller_scale.jsonl", scale_baseline("12e2ca5", 8, gc=False)),
    Figure("docs/scale.md", "| 64 / 4,096 (earlier run) | {} | {} | {}% | - | {} / {} / {} | {} | {} / {} | "
           "{} -> {} | yes, "
           "{} samples | {} |", "controller_scale.jsonl", scale_baseline("12e2ca5", 64, gc=False)),
    *(Figure("docs/scale.md", "{}", "controller_scale.jsonl", scale_before_after(scale, code, commit, servers),
             whole=True)
      for scale, code, commit, servers in (
          ("64 / 4,096", "before", "12e2ca5", 64), ("64 / 4,096", "before", "49827d3", 64),
          ("64 / 4,096", "after", "9e93af9", 64), ("256 / 16,384", "after", "9e93af9", 256),
          ("256 / 16,384", "after (4478c76: control calls on new connections)", "4478c76", 256))),
    Figure("docs/scale.md", "(the controller used {}% of a core); at 256 it is bounded by the machine (the simulated "
           "servers took {} s of CPU in an {} s run, and the controller {} s, on 2 shared cores)",
           "controller_scale.jsonl", lambda: (
               f"{half_up(100 * scale_run('9e93af9', 64)['cpu_util'])}",
               *(thousands(scale_run("9e93af9", 256)[k]) for k in ("sim_cpu_s", "wall_s", "cpu_s")))),
    *(Figure("docs/scale.md", "{}", "controller_scale.jsonl", sharded_row(label, procs, note), whole=True)
      for label, procs, note in (
          ("64 / 4,096", 1, "sharded client, final: --client-procs 1"),
          ("64 / 4,096", 2, "sharded client, final: --client-procs 2"),
          ("64 / 4,096", 3, "sharded client, final: --client-procs 3"),
          ("256 / 16,384", 1, "sharded client, final: --client-procs 1"),
          ("256 / 16,384", 2, "sharded client, final: --client-procs 2"),
          ("256 / 16,384", 3, "sharded client, final: --client-procs 3"),
          *(("256 / 16,384, cheaper simulator", n, f"sharded client, cheaper simulator (orjson, GC thresholds): "
             f"--client-procs {n}") for n in (1, 2, 3)))),
    Figure("docs/scale.md", "| decode 16x, **2 client worker processes** | {}M | {} (+{} in the workers) | "
           "{}% (+{}% in "
           "the workers) | {} / **{}** / {} | {} | {} GB (+{} GB in the workers) |", "controller_scale.jsonl",
           parked_workers_row),
    Figure("docs/scale.md", "| answers /4, decode 4x real time; orjson parser, float32 columns | {}k | {} | "
           "{}% | {} / {} "
           "/ {} | {} | {} GB |", "controller_scale.jsonl", state_row("f32 columns, orjson parser (before the native "
                                                                      "scanner), quiet machine")),
    Figure("docs/scale.md", "| the same, native scanner | {}k | **{}** | {}% | {} / {} / {} | {} | {} GB |",
           "controller_scale.jsonl", state_row("native answer scanner, float32 columns")),
    Figure("docs/scale.md", "| full lengths, no decode-rate limit (the client is the bottleneck) | **{}M** | "
           "{} | {}% | {} / {} / {} | {} | {} GB |", "controller_scale.jsonl", state_row("client rate at 256 servers")),
    Figure("docs/scale.md", "| full lengths, full buffer (`--fill-buffer`), decode 4x real time, bound 1024 MB | "
           "{}k | {} | {}% | {} / {} / {} | {} | {} GB |", "controller_scale.jsonl",
           state_row("worst-case memory at full lengths, production buffer bound 1024 MB, decode 4x")),
    Figure("docs/scale.md", "| full lengths, full buffer, decode 16x, bound 1024 MB | {}-{}M | {}-{} | "
           "{}-{}% | {}-{} / {}-{} "
           "/ {}-{} | {}-{} | {} GB ({} before the connection fix) |", "controller_scale.jsonl",
           lambda: state_range("worst-case memory at full lengths: first step waits",
                               "worst-case memory at full lengths, production buffer bound 1024 MB; connections")),
    Figure("docs/scale.md", "| full lengths, full buffer, decode 16x, bound 256 MB | {}M | {} | {}% | "
           "{} / {} / {} | {} "
           "| {} GB |", "controller_scale.jsonl", state_row("worst-case memory at full lengths, buffer bound 256 MB")),
    Figure("docs/scale.md", "| in process | /16 (median 250) | {} | {}% | {} / {} / {} | {} | {} GB | {}k |",
           "controller_scale.jsonl", quiet_row("final, quiet machine, in-process client (HEAD")),
    Figure("docs/scale.md", "| 2 workers | /16 | controller {}; all processes {} | {}% | {} / {} / {} | {} | "
           "{} + {} GB | "
           "{}k |", "controller_scale.jsonl", quiet_row("final, quiet machine, sharded client 2 processes (HEAD")),
    Figure("docs/scale.md", "| in process | /4 (median 1,000) | {} | {}% | {} / {} / {} | {} | "
           "{} GB (process peak) | {}k |",
           "controller_scale.jsonl", quiet_row("final, quiet machine, in-process client, answers /4")),
    Figure("docs/scale.md", "| 2 workers | /4 | **controller {}**; all processes {} | {}% | {} / {} / {} | "
           "{} | {} + {} GB | {}k |", "controller_scale.jsonl",
           quiet_row("final, quiet machine, sharded client 2 processes, answers /4")),
    *(Figure("docs/scale.md", text, "controller_scale.jsonl", part(sharded_prose, i, text.count("{}")))
      for i, text in ((0, "Controller CPU: {}-{} us per received token with the client in the process, {}-{} with "
                          "2-3 workers at 256 / 16,384 ({}-{} at 64 servers"),
                      (6, "({}-{} -> {}-{} at 256)"),
                      (10, "p99 {}-{} ms, max {}-{} s, against {}-{} ms and {}-{} s in-process."),
                      (18, "{}-{} MB for the workers together at 256 / 16,384, controller {}-{} MB; {}-{} GB in all, "
                           "under the 2 GB goal ({}-{} MB in-process)."))),
    *(Figure("docs/scale.md", f"| {n:,} | {{}} | {{}} | {{}}x |", "answer_parse.jsonl", answer_parse(n))
      for n in (100, 1000, 4000, 32000)),
    Figure("docs/vllm.md", "| abort (client pause, settle, resume) | {} | {} s | {} (resubmitted prefixes) | 0 |",
           "vllm_pause.jsonl", vllm_pause("abort")),
    Figure("docs/vllm.md", "| keep, `clear_cache` default (true) | {} | {} s | not in vLLM's counters | {} |",
           "vllm_pause.jsonl", vllm_pause("keep")),
    Figure("docs/vllm.md", "| keep, `clear_cache=false` (`in_place`) | {} | {} s | 0 | 0 |", "vllm_pause.jsonl",
           vllm_pause("keep_in_place")),
    Figure("docs/vllm.md", "Abort costs {} % of throughput here against keeping in place: the aborted requests' "
           "prefixes (prompt + output so far) are prefilled again after every update, and {} segments a sample are "
           "sent. Keep with vLLM's default clear_cache preempts nearly every running request: {} % here",
           "vllm_pause.jsonl", vllm_pause_costs),
    Figure("docs/pause_modes.md", "time compression: controller loop lag p99 {}-{} ms",
           "async_speedup_pause_mode.jsonl", pause_lag("1.5B, 16 nodes x 8 GPUs")),
    Figure("docs/pause_modes.md", "**7B, 192 GPUs (112 generate, 80 train), K = 8** (loop lag p99 {}-{} ms)",
           "async_speedup_pause_mode.jsonl", pause_lag("7B, 24 nodes x 8 GPUs")),
    Figure("docs/pause_modes.md", "(it waits {}-{} s per step for its batch under retract and in_place_ideal): the "
           "generation time saved shows in the step only as {} %", "async_speedup_pause_mode.jsonl", pause_7b_trainer),
    Figure("docs/pause_modes.md", "(1.5B: retract's step is {} % longer than in_place_ideal's)",
           "async_speedup_pause_mode.jsonl", lambda: (f"{half_up(pause_step_gain('1.5B, 16 nodes x 8 GPUs'))}",)),
    Figure("docs/mismatch.md", "seeds), {}-{} s each; {} min of wall time in all", MISMATCH_SWEEP, mismatch_sweep),
    Figure("docs/mismatch.md", "and M2PO act on {}-{} % of the tokens and move the mean EM by {} to {}; IcePop's "
           "interval just excludes 0 (a small cost of masking {} % of the tokens)", "mismatch_ablation.jsonl",
           mismatch_eta4_tokens),
    Figure("docs/mismatch.md", "It masks only {}-{} % of the tokens", "mismatch_ablation.jsonl",
           lambda: tuple(f"{mismatch_share(a):.1f}" for a in ("eta4_seq_mis_fp32", "eta4_seq_mis"))),
    Figure("docs/mismatch.md", "saw no such cost at eta 4 ({} [{}, {}])", HARD, lambda: tuple(
        f"{v:+.3f}" for x in hard()["contrast_option_minus_recompute"]["seq_mis"] if x["eta"] == 4
        for v in (x["eval_mean_diff_mean"], x["eval_mean_diff_mean"] - x["eval_mean_diff_ci95"],
                  x["eval_mean_diff_mean"] + x["eval_mean_diff_ci95"]))),
    Figure("docs/mismatch.md", "k3 {}-{}e-4 per token against", "mismatch.jsonl", part(mismatch_prose, 0, 2)),
    Figure("docs/mismatch.md", "99 % of tokens have w within {}-{}, and IcePop's default band [0.5, 2] masks almost "
           "nothing ({} % of tokens at worst). But summed over a 96-token sequence the log-ratio is {}-{} on average "
           "and {}-{} at the 90th percentile: a sequence-level weight exp(sum log w) is off by {}-{}x for one sequence "
           "in ten", "mismatch.jsonl", part(mismatch_prose, 2, 9)),
    *(Figure("docs/lora.md", f"| {label} | {server} | {rank} | {{}} MB | {{}} {whole_time} | {{}} {adapter} | {{}} ms "
             "| {}x | {}x |", "lora_sync.jsonl", lora_update(part, model, rank))
      for label, model, adapter in (("tiny recipe", "tiny recipe", "KB"), ("small (55 M)", "small", "MB"))
      for part, server in (("tiny", "embedded engine"), ("vllm", "real vLLM 0.32 CPU"))
      for rank in (8, 32)
      for whole_time in ["s" if (model, part) == ("small", "vllm") else "ms"]),
    Figure("docs/lora.md", "estimated from the same run's measured safetensors write bandwidth ({} GB/s, page cache)",
           "lora_sync.jsonl", lambda: (f"{newest('lora_sync.jsonl', part='7b')['write_gb_per_s']:.2f}",)),
    Figure("docs/lora.md", "an r-8 adapter on every projection is {} % of it", "lora_sync.jsonl", lora_share),
    *(Figure("docs/lora.md", f"| {rank} | {{}} M | {{}} MB | {{}} s | {{}} GB | {{}} s | {{}}x |", "lora_sync.jsonl",
             lora_7b(rank)) for rank in (8, 32, 128)),
    *(Figure("docs/lora.md", f"| small (55 M), measured | {rank or 'none'} | {{}} M | {{}} MB | {{}} MB | {{}} MB | "
             "{} MB |", "lora_sync.jsonl", lora_memory("5", rank)) for rank in (None, 8, 32)),
    *(Figure("docs/lora.md", f"| Qwen2.5-7B shapes, computed | {rank or 'none'} | {{}} {'B' if rank is None else 'M'}"
             " | {} GB | {} GB | {} GB | {} GB |", "lora_sync.jsonl", lora_memory("Qwen", rank))
      for rank in (None, 8, 32, 128)),
    *(Figure("docs/mismatch.md", f"| {label} | bf16 | {t} | {shape} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}}"
             f"{' %' if pct1 else ''} | {{}}{' %' if pct2 else ''} | {{}} / {{}} |", "mismatch.jsonl",
             mismatch_row(engine, "bfloat16", t, shape))
      for label, engine, t, shape, pct1, pct2 in (
          ("embedded", "embedded", 1.0, "long", False, True), ("embedded", "embedded", 0.6, "long", False, True),
          ("vLLM 0.32", "vllm", 1.0, "long", False, True), ("vLLM 0.32", "vllm", 0.6, "long", True, True),
          ("vLLM 0.32", "vllm", 1.0, "task", False, False))),
    *(Figure("docs/mismatch.md", f"| {label} | {serving} | {t} | {{}} | {{}} | {{}} | "
             f"{'{}' if dtype == 'fp8' else '-'} | {{}} | {{}} | {{}} | {{}} / {{}} | {{}} | {{}} | {{}} | {{}} |",
             "mismatch_fp8.jsonl", mismatch_fp8_row(arch, dtype, t))
      for arch, label in (("qwen2", "dense"), ("qwen3_moe", "MoE")) for dtype, serving in (("bfloat16", "bf16"),
                                                                                           ("fp8", "FP8"))
      for t in (1.0, 0.6)),
    Figure("docs/mismatch.md", "grows by {}-{}x over bf16 serving", "mismatch_fp8.jsonl",
           part(mismatch_fp8_prose, 0, 2)),
    Figure("docs/mismatch.md", "its 90th percentile is {}-{} with FP8 against {}-{} with bf16", "mismatch_fp8.jsonl",
           part(mismatch_fp8_prose, 2, 4)),
    Figure("docs/mismatch.md", "at most {} % of the tokens leave IcePop's band", "mismatch_fp8.jsonl",
           part(mismatch_fp8_prose, 6, 1)),
    *(Figure("docs/mismatch.md", f"| {eta} | {label} | {serving} | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] | {{}}",
             "mismatch_ablation.jsonl", mismatch_arm(f"eta{eta}_{arm}{'_fp32' if serving == 'fp32' else ''}"))
      for eta in (0, 4)
      for label, arm, serving in (("none", "none", "bf16"), ("TIS C = 2", "tis", "bf16"),
                                  ("IcePop [0.5, 2]", "icepop", "bf16"), ("sequence MIS [0.5, 2]", "seq_mis", "bf16"),
                                  ("M2PO tau = 0.04", "m2po", "bf16"), ("none", "none", "fp32"),
                                  ("sequence MIS [0.5, 2]", "seq_mis", "fp32"))),
    *(Figure("docs/staleness_ablation.md", f"| {eta} | {objective} | {adv} | {{}} ± {{}} | {{}} ± {{}} | {{}} ± {{}} | "
             "{} | {} / {} | {}% |", "staleness.jsonl", staleness_arm(eta, objective, adv))
      for adv in ("grpo", "rloo") for objective in ("recompute", "loglinear", "naive") for eta in (0, 1, 2, 4, 8, 16)),
    Figure("docs/staleness.md", "First come first served (vLLM's default): {} of {} steps trained a group older than "
           "eta (staleness_max up to {}; {} of {} trained groups); by priority: {} of {} steps (staleness_max up to "
           "{}; {} of {} groups). {} runs of each, alternating; a run of 120 steps took {}-{} s",
           "vllm_staleness.jsonl", vllm_staleness([])),
    Figure("docs/staleness.md", "beyond the spread between runs ({} to {} steps a run under either)",
           "vllm_staleness.jsonl", vllm_staleness_spread),
    Figure("docs/staleness.md", "With `--max-num-seqs 32` (a quarter of them at once), first come first served: "
           "{} of {} steps over eta (staleness_max up to {}; {} of {} groups); by priority: {} of {} steps "
           "(staleness_max up to {}; {} of {} groups). {} runs of each, alternating; a run took {}-{} s",
           "vllm_staleness.jsonl",
           vllm_staleness(["--max-num-seqs", "32"])),
    Figure("docs/staleness_ablation.md", "{}/{} runs, none failed, **{} min wall**", "staleness_20261123_1842.json",
           part(staleness_sweep, 0, 3)),
    Figure("docs/staleness_ablation.md", "and ~{} s per run, its start-up included", "staleness_20261123_1842.json",
           part(staleness_sweep, 3, 1)),
    Figure("docs/staleness_ablation.md", "At bound: {}-{} % of the trained groups in every arm", "staleness.jsonl",
           part(staleness_sweep, 4, 2)),
    *(Figure("docs/staleness_ablation.md", "{}", HARD, hard_eta_row(eta), whole=True) for eta in (0, 1, 2, 4, 8, 16)),
    *(Figure("docs/staleness_ablation.md", "{}", HARD, hard_option_row(option, label), whole=True)
      for option, label in (("tis", "TIS (token, truncate at C = 2)"), ("icepop", "IcePop (token band [0.5, 5])"),
                            ("seq_mis", "sequence MIS [0.5, 2]"), ("m2po", "M2PO (tau = 0.04)"))),
    *(Figure("docs/staleness_ablation.md", "{}", HARD, hard_acted_row(eta), whole=True) for eta in (0, 1, 2, 4, 8, 16)),
    Figure("docs/staleness_ablation.md", "(pooled over eta 1-16: TIS {}, IcePop {}, sequence MIS {}, M2PO {})", HARD,
           hard_pooled_final),
    Figure("docs/staleness_ablation.md", "Final EM at step 200, same pairing: naive {} [{}, {}] at eta 4, {} [{}, {}] "
           "at 8 and {} [{}, {}] at 16; decoupled {} [{}, {}], {} [{}, {}] and {} [{}, {}].", HARD,
           lambda: (*hard_final("naive"), *hard_final("recompute"))),
    Figure("docs/staleness_ablation.md", "Decoupled minus naive, paired by seed (mean EM over run): eta 0 {} [{}, {}]; "
           "eta 1 {}; eta 2 {}; eta 4 **{} [{}, {}]**; eta 8 **{} [{}, {}]**; eta 16 **{} [{}, {}]**; averaged over "
           "eta 1-16 per seed first (the report's pooled row) **{} [{}, {}]**.", HARD, hard_decoupled_minus_naive),
    *(Figure("docs/pause_modes.md", text, "async_speedup_pause_mode_summary.jsonl", pause_arm(setup, arm), after=head)
      for setup, head, arms in (("1.5B, 16 nodes x 8 GPUs", "**1.5B, 128 GPUs", ("abort", "retract")),
                                ("7B, 24 nodes x 8 GPUs", "**7B, 192 GPUs", ("retract",)))
      for arm, text in (("sync", "| sync (eta 0) | 0 | 0 | 0 | 0 | 0 | {} | {} | 1 |"),
                        *((a, f"| `{a}` | {{}} | {{}}M tokens | {{}} | 0 | {{}} % | {{}} | {{}} | {{}}x |")
                          for a in arms),
                        ("in_place", "| `in_place` (+10 % decode) | {} | 0 | 0 | {} | {} % | {} | {} | {}x |"),
                        ("in_place_ideal", "| `in_place_ideal` | {} | 0 | 0 | 0 | 0 | {} | {} | **{}x** |"))),
    *(Figure("docs/pause_modes.md", f"| `{mode}` | {{}} ± {{}} | {{}}, {{}}, {{}} | {{}} | {{}} | {{}} | 0.0000 "
             "| {} |",
             "pause_mode_cpu.jsonl", pause_cpu(mode)) for mode in ("abort", "retract", "in_place")),
    *(Figure("docs/pause_modes.md", text, "async_speedup_pause_mode_summary.jsonl",
             part(pause_prose, i, text.count("{}")))
      for i, text in ((0, "`abort`: {}M tokens and {} GPU s per update, the same order as retract."),
                      (2, "(1.5B at K = 25 on the loaded machine: {}-{}M prefill tokens and {}-{} GPU s per update for "
                          "abort and retract, against {}-{}M and {}-{} at K = 8"),
                      (10, "{}-{} % of the generation GPUs' time"),
                      (12, "At the assumed 10 % that costs more ({} % of generation capacity) than it saves: "
                           "{}x against retract's {}x."),
                      (15, "is the fastest mode: {}x against {}x at 1.5B, {}x against {}x at 7B"))),
    Figure("docs/pause_modes.md", "the per-seed differences (at most {}) are below the spread between seeds "
           "(std {}-{}). The behaviour weight's KL, `mean(p - b)`, is the same in all three ({} to {})",
           "pause_mode_cpu.jsonl", pause_cpu_spread),
    *(Figure("docs/chaos.md", "{}", f"chaos_{stamp}.json", chaos_row(stamp, phase, fault, label, results=bool(label)),
             whole=True)
      for stamp, phase, fault, label in (
          ("20261125_1949", "main", "40:server_kill", ""), ("20261125_1949", "main", "220:server_stop:20", ""),
          ("20261125_1949", "main", "380:reward_kill", ""), ("20261125_1949", "main", "440:reward_hang:15", ""),
          ("20261125_1949", "main", "580:controller_kill", ""), ("20261125_1949", "main", "990:server_stop:never", ""),
          ("20261125_1949", "proxy", "40:proxy_slow:30:1.0", ""),
          ("20261125_1949", "proxy", "250:proxy_slow:20:30", ""),
          ("20261125_2020", "main", "40:server_stop:never", "40:server_stop:never (main, 3 launched)"),
          ("20261125_2020", "proxy", "40:proxy_slow:20:30", "40:proxy_slow:20:30 (proxy, 2 external)"),
          ("20261125_2024", "proxy", "40:proxy_slow:20:30", "40:proxy_slow:20:30 (proxy, 2 external)"))),
    *(Figure("docs/moe.md", f"| {seed} | {{}} % | {{}} -> {{}} | {{}} -> {{}} | {{}} -> {{}} | "
             f"{{}}{' %' * bool(mask)} -> {{}} |",
             "routing_replay_engine_20261128_1000.md", replay_engine("20261128_1000", seed),
             after="**Paired, on engine-generated samples**")
      for seed, mask in ((1, False), (2, True), (3, True))),
    Figure("docs/moe.md", "k3 is {}x, {}x and {}x lower with replay at temperature 1, {}x, {}x and {}x at 0.6",
           "routing_replay_engine_20261128_1000.md", replay_k3_ratios),
    Figure("docs/moe.md", "{} / {} / {} without and {} / {} / {} with replay on the recipe's strings, {} / {} / {} "
           "against {} / {} / {} on the longer ones; {}-{} % of the recorded routings differ",
           "routing_replay_loop.jsonl", lambda: replay_loop()[:14]),
    Figure("docs/moe.md", "{}-{} % of the routings differ, k3 {} -> {}, {} -> {} and {} -> {}, max |log w| {} -> {}, "
           "{} -> {} and {} -> {} (the two tokens IcePop would mask, {} %, gone)",
           "routing_replay_engine_20261128_1103_t0.6.md", replay_engine_t06),
    Figure("docs/moe.md", "the corrections masked at most {} % of the tokens", "routing_replay_loop.jsonl",
           replay_loop_masked),
    Figure("docs/moe.md", "the trainer's step {}-{} s and its recompute {}-{} s with or without replay",
           "routing_replay_loop.jsonl", lambda: replay_loop()[-4:]),
    Figure("docs/reward.md", "(`bench/results/reward.jsonl`, at a load average of {}), a trivial program cost {} ms of "
           "CPU per sandboxed run, all processes of the run counted ({} ms with the RLIMIT fallback instead of a "
           "cgroup): {} ms are the interpreter itself", "reward.jsonl", lambda: reward_cost()[:4]),
    Figure("docs/reward.md", "creating and removing a run's cgroup took {} ms. Wall time per run follows the machine's "
           "load: {} ms (median) at that load", "reward.jsonl", lambda: reward_cost()[4:]),
    Figure("docs/weight_sync.md", "| 1e-6 (GPU example) | {} % | {} % | {} % | {} % | {} % of whole | {} % |",
           "delta.jsonl", delta_fraction("gpu_example_1e-6")),
    Figure("docs/weight_sync.md", "| 2e-4 (tiny example) | {} % | {} % | {} % | {} % | whole (above the threshold) "
           "| {} % |",
           "delta.jsonl", delta_fraction("tiny_example_2e-4")),
    *(Figure("docs/static_sm90.md", "{}", f"static_sm90-triton{triton}.json", static_row(triton, label), whole=True)
      for triton in ("3.6.0", "3.9.0") for label in STATIC_ROWS),
    Figure("docs/static_sm90.md", "{}", "static_sm90-triton3.9.0.json",
           static_row("3.9.0", "interval_copy_kernel (csrc/reshard)"), whole=True),
    Figure("docs/chaos.md", "**Samples: {} lost, {} duplicated in both runs.** Main: {} positions handed out, {} "
           "trained once (1000 steps x 4 groups, across the kill -9 and the resume), {} buffered and {} pending in "
           "the last checkpoint; every group had its 4 samples; steps 1..1000 once each. Proxy: {} handed out, {} "
           "trained, {} buffered, {} pending.", "chaos_20261125_1949.json", chaos_accounting),
    *(Figure("docs/chaos.md", text, "chaos_20261125_1949.json", part(chaos_prose, i, text.count("{}")))
      for i, text in ((0, "back in the pool {} s after the kill"), (1, "back in the pool only {} s after the stop"),
                      (2, "no visible effect ({} s, {} step)"), (4, "throughput fell by {} % during the window"),
                      (5, "back to pace {} s after it began"),
                      (6, "{} s from the kill to being past the last step trained before it"),
                      (7, "steps delayed ({}) is the meaningful figure"),
                      (8, "but the run's pace fell by {} % for the"))),
    Figure("docs/chaos.md", "joined over generation 2 of the weight group 0.1 s later: back in the pool {} s after the "
           "stop", "chaos_20261125_2020.json",
           lambda: (f"{chaos_fault('20261125_2020', 'main', '40:server_stop:never')['pool_back_s']:.1f}",)),
    Figure("docs/chaos.md", "got the update in full and was back in the pool {} s after the stall began",
           "chaos_20261125_2024.json",
           lambda: (f"{chaos_fault('20261125_2024', 'proxy', '40:proxy_slow:20:30')['pool_back_s']:.1f}",)),
    Figure("docs/staleness_ablation.md", "The staleness histograms show the bound was reached: at eta 1-4, {}-{} % of "
           "the trained groups were exactly eta versions old, at eta 8 {}-{} % and at eta 16 {}-{} %", HARD,
           hard_at_eta),
    Figure("docs/staleness_ablation.md", "the sum of the run times is {} minutes", HARD,
           lambda: (thousands(hard()["sum_run_wall_s"] / 60),)),
    Figure("docs/staleness_ablation.md", "the ratio to the behaviour policy leaves [0.8, 1.2] for {} % of the tokens "
           "at eta 4, {} % at eta 8 and {} % at eta 16 ({} % at eta 0), and those tokens give no gradient. The "
           "decoupled clip stays at {}-{} % at every eta", HARD, hard_clip),
    Figure("docs/staleness_ablation.md", "At eta 1-2 they mask or truncate {}-{} % of the tokens and at eta 4 {}-{} %",
           HARD, lambda: (*hard_option_share((1, 2)), *hard_option_share((4,)))),
    Figure("docs/staleness_ablation.md", "The options then only drop or truncate the gradient of {}-{} % of the tokens "
           "at eta 16", HARD, lambda: hard_option_share((16,))),
    Figure("docs/mismatch.md", "| vLLM 0.32 | fp32 | 1.0 | long | {} | {} | {} | {} | {} | 0 | 0 | {} / {} |",
           "mismatch.jsonl", mismatch_fp32_row),
    Figure("docs/mismatch.md", "past 0: {} [{}, {}] with bf16 serving, {} [{}, {}] with fp32.", MISMATCH_SWEEP,
           lambda: tuple(
        f"{v:+.3f}" for key in ("seq_mis_minus_none", "seq_mis_fp32_minus_none_fp32")
        for x in json.loads((RESULTS / MISMATCH_SWEEP).read_text())["contrasts"][key] if x["eta"] == 4
        for v in (x["eval_final_diff_mean"], x["eval_final_diff_mean"] - x["eval_final_diff_ci95"],
                  x["eval_final_diff_mean"] + x["eval_final_diff_ci95"]))),
    *(Figure("docs/mismatch.md", f"| {eta} | {label} | FP8 | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] | {{}} | "
             f"{'-' if arm == 'none' else '{}'} |", "mismatch_ablation.jsonl", mismatch_fp8_arm(f"eta{eta}_{arm}_fp8"))
      for eta in (0, 4)
      for label, arm in (("none", "none"), ("TIS C = 2", "tis"), ("IcePop [0.5, 2]", "icepop"),
                         ("sequence MIS [0.5, 2]", "seq_mis"), ("M2PO tau = 0.04", "m2po"))),
    Figure("docs/mismatch.md", "by a hair ({} of mean exact match over the run, final exact match {} [{}, {}])",
           FP8_SWEEP, lambda: fp8_contrast_at("m2po_fp8_minus_none_fp8", 0)),
    Figure("docs/mismatch.md", "a cost (final exact match {} [{}, {}]), as it was", FP8_SWEEP,
           lambda: fp8_contrast_at("seq_mis_fp8_minus_none_fp8", 4)[1:]),
    *(Figure("docs/mismatch.md", "{}", FP8_SWEEP, mismatch_contrast(f"{label}, FP8 serving", key, FP8_SWEEP),
             whole=True)
      for label, key in (("TIS - none", "tis_fp8_minus_none_fp8"), ("IcePop - none", "icepop_fp8_minus_none_fp8"),
                         ("sequence MIS - none", "seq_mis_fp8_minus_none_fp8"),
                         ("M2PO - none", "m2po_fp8_minus_none_fp8"))),
    *(Figure("docs/mismatch.md", "{}", MISMATCH_SWEEP, mismatch_contrast(label, key), whole=True)
      for label, key in (("TIS - none", "tis_minus_none"), ("IcePop - none", "icepop_minus_none"),
                         ("sequence MIS - none", "seq_mis_minus_none"), ("M2PO - none", "m2po_minus_none"),
                         ("fp32 serving - bf16 serving (no correction)", "none_fp32_minus_none"),
                         ("sequence MIS - none, both fp32 serving", "seq_mis_fp32_minus_none_fp32"))),
    *(Figure("docs/staleness_ablation.md",
             f"| {eta} | {objective} | {{}} ± {{}} | {{}} ± {{}} | {{}} ± {{}} | {{}} | {{}} |",
             MINIBATCHES4, minibatches4_row(eta, objective))
      for objective in ("recompute", "naive") for eta in (0, 8, 16)),
    Figure("docs/staleness_ablation.md", "| held-out EM |" + " {} |" * 9, HARD, hard_pilot_curve),
    Figure("docs/pause_modes.md", "warm start {} / {} / {} for seeds 1 / 2 / 3", "pause_mode_cpu.jsonl",
           lambda: tuple(f"{x:.3f}" for x in newest("pause_mode_cpu.jsonl")["em_start_per_seed"])),
    Figure("docs/weight_sync.md", "| whole (`delta: off`) | {} MB | {} | yes |", "delta.jsonl", delta_gloo("off")),
    Figure("docs/weight_sync.md", "left CPU trainers on whole updates) | {} MB ({} %) | {} | yes |", "delta.jsonl",
           delta_gloo("auto")),
    *(Figure("docs/weight_sync.md", f"| {model} | {{}} % | {{}} GB | " + ("{} GB (all whole)" if c == 0.8 else "{} GB")
             + " | {} | {} | {} | {}x |", "delta.jsonl", delta_sim(model, c))
      for model in ("Qwen2.5-7B", "Qwen2.5-32B") for c in (0.0236, 0.8)),
    *(Figure("docs/weight_sync.md", f"| {n} | {label} | {{}} | {{}} | {', '.join(['{}'] * n)} | "
             f"{', '.join(['{}'] * n)} | {{}} | {', '.join(['{}'] * n)} |", "sync_senders.jsonl",
             sync_senders_row(n, senders))
      for n, senders, label in ((1, "one", "`one`"), (2, "one", "`one` (today)"), (2, "rank", "`rank`"),
                                (4, "one", "`one` (today)"), (4, "rank", "`rank`"))),
    *(Figure("docs/weight_sync.md", f"| {label} % | {{}} | {{}} | {{}} | {{}} | {{}} |", "sync_senders.jsonl",
             sync_breakeven(d)) for d, label in SYNC_DENSITIES.items()),
    Figure("docs/weight_sync.md", "In this run a delta paid up to {} % changed and cost more than sending the tensor "
           "whole from {} % on.", "sync_senders.jsonl",
           lambda: (lambda r: (f"{r['highest_paying_density'] * 100:g}", f"{r['lowest_losing_density'] * 100:g}"))(
               newest("sync_senders.jsonl", part="breakeven_summary"))),
    Figure("docs/weight_sync.md", "(65,536 elements, 2.36 % changed) encodes at {} s per GB", "sync_senders.jsonl",
           lambda: (thousands(newest("sync_senders.jsonl", part="breakeven",
                                     backend="interpret")["encode_s_per_gb"]),)),
    Figure("docs/weight_sync.md", "Fitted: one sender `F` {} s and `b` {} GB/s; many senders `F` {} s at {} GB/s in "
           "all ({} senders", "sync_model.jsonl", sync_model_fit),
    Figure("docs/weight_sync.md", "the many-sender fit's `F` ({} s, the lower one)", "sync_model.jsonl",
           lambda: (sync_model_fit()[2],)),
    Figure("docs/weight_sync.md", "and `b` = {} GB/s per sender", "sync_model.jsonl", lambda: (sync_model_fit()[1],)),
    *(Figure("docs/weight_sync.md", f"| {src} | {m} | {w}{fit} | {pub} | {{}} | {{}} |", "sync_model.jsonl",
             sync_model_check(src, m, w)) for src, m, w, fit, pub in SYNC_MODEL_LOG),
    *(Figure("docs/weight_sync.md", f"| {m} | {path} | {n} | {{}} | {{}} | {{}} |", "sync_model.jsonl",
             sync_model_predict(m, path)) for m, path, n in SYNC_MODEL_PATHS),
    *(Figure("docs/config.md", f"| {p} | {k} | {{}} | {{}} | {{}} | {{}} |", "top_p_bias.jsonl", top_p_bias(p, k))
      for p, k in ((0.9, -1), (1.0, 8), (0.9, 8), (1.0, -1))),
    Figure("docs/autoscale.md", "| constant (cap 32k) | {} | {} ({} GPUs) | {}% | {} |", "autoscale.jsonl",
           autoscale_row("constant")),
    Figure("docs/autoscale.md", "| growing (cap 8k to 32k) | {} | {} ({} GPUs) | {}% | {} |", "autoscale.jsonl",
           autoscale_row("growing")),
    *(Figure("docs/autoscale.md", f"| {label} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} to {{}} |",
             "autoscale_real.jsonl", autoscale_real_arm(arm, sweep), after=after)
      for sweep, after in ((None, "newest sweep"), (LOADED_SWEEP, "first sweep"))
      for arm, label in (("policy", "policy, 1 to 2 servers"), ("fixed1", "1 server"), ("fixed2", "2 servers"))),
    *(Figure("docs/autoscale.md", "- {}", "autoscale_real.jsonl", autoscale_real_policy(seed, sweep), whole=True)
      for sweep, seeds in ((None, (1, 2, 3)), (LOADED_SWEEP, LOADED_SWEEP[1])) for seed in seeds),
    *(Figure("docs/autoscale.md", "the policy's held-out exact match at the end is {} from the best fixed split's (the "
             "{}-server one), its mean over the evaluations {} from the best fixed split's (the {}-server one)",
             "autoscale_real.jsonl", autoscale_real_gap(sweep), after=after)
      for sweep, after in ((None, "newest sweep"), (LOADED_SWEEP, "first sweep"))),
    *(Figure("docs/parallelism.md", f"| {label} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} |",
             "parallel_cost.jsonl", parallel_counted(arm))
      for arm, label in (("dp", "`dp`: FSDP2 only"), ("ep2", "`ep2`: expert-parallel 2"),
                         ("cp2", "`cp2`: context-parallel 2"))),
    *(Figure("docs/parallelism.md", f"| {label} | {{}} | {{}} | {{}} | {{}} GB | {{}} ms | {{}} ms | {{}} |",
             "parallel_cost.jsonl", parallel_computed_cp(arm, scenario))
      for arm, scenario, label in [("dp8", "32k_a_rank", "`dp8`")]
      + [(f"cp{c}", sc, f"`cp{c}`, {text}") for sc, text in (("32k_a_rank", "32k a rank"),
                                                               ("one_32k_sequence", "one 32k sequence"))
         for c in (2, 4, 8)]),
    *(Figure("docs/parallelism.md", f"| `{arm}` | {mbs} | {{}} GB | {{}} GB | {{}} GB | {{}} GB | {{}} GB | {{}} GB | "
             f"{{}} ms | {{}} ms |", "parallel_cost.jsonl", parallel_computed(arm, mbs))
      for arm in ("dp8", "ep2", "ep4", "ep8") for mbs in (1, 4)),
    *(Figure("docs/parallelism.md", f"| {recipe} | {label} | {{}} | {{}} | {{}} ± {{}} | {{}} s |",
             "parallel_learning.jsonl", parallel_learning(tag, arm))
      for tag, recipe, arm, label in (("moe", "MoE", "one", "one rank"), ("moe", "MoE", "ep2", "`ep: 2`"),
                                      ("long", "long strings", "one", "one rank"),
                                      ("long", "long strings", "cp2", "`cp: 2`"))),
]


NUMBER = r"[-+]?[0-9][0-9.,]*(?:e[-+]?[0-9]+)?"  # 1,570 / 0.057 / -0.004 / +0.019 / 1.7e-4


def _fold(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _pattern(template: str) -> re.Pattern:
    parts = [re.escape(_fold(p)) for p in template.split("{}")]
    return re.compile(f"({NUMBER})".join(parts))


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f"{f.doc}:{f.text[:40]}")
def test_each_quoted_figure_is_its_result_files(fig):
    assert (RESULTS / fig.source).is_file(), f"{fig.doc} quotes bench/results/{fig.source}, which is not committed"
    doc = _fold((REPO / fig.doc).read_text())
    want = tuple(_fold(w) for w in fig.figures())
    assert len(want) == fig.text.count("{}"), f"the table's entry gives {len(want)} figures for {fig.text!r}"
    expected = fig.text.format(*want)
    if fig.whole:
        assert _fold(expected) in doc, f"{fig.doc} must say, from bench/results/{fig.source}: {expected!r}"
        return
    if fig.after:
        assert _fold(fig.after) in doc, f"{fig.doc} no longer says {fig.after!r}"
        doc = doc[doc.index(_fold(fig.after)):]
    found = [m.groups() for m in _pattern(fig.text).finditer(doc)][:1 if fig.after else None]
    assert found, f"{fig.doc} no longer says {fig.text!r}: say {expected!r} (from bench/results/{fig.source})"
    for got in found:
        assert got == want, f"{fig.doc} says {fig.text.format(*got)!r}; bench/results/{fig.source} says {expected!r}"


def test_the_helpers_read_figures_as_the_docs_write_them():
    """The formatting the table relies on: rounding, thousands, the pattern of a quoted figure."""
    assert thousands(1569.6) == "1,570" and thousands(39) == "39" and thousands(4548.5) == "4,549"
    assert half_up(72.5) == 73 and half_up(-0.5) == -1 and sci(3.3486e-4) == "3.3e-4" and sci(-7.2e-5) == "-7.2e-5"
    assert _pattern("a {}x").findall("a 1.07x and a 2,125x") == ["1.07", "2,125"]
    assert _pattern("k {} / {} [{}]").findall("k 1.7e-4 / -0.004 [+0.019]") == [("1.7e-4", "-0.004", "+0.019")]
    assert [bool(FIGURE.search(t)) for t in ("took 1.5 s", "4.4M tokens", "62%", "v0.5.23", "rank 0")] == [
        True, True, True, False, False]
    assert [unitless_figure(t, row) for t, row in (
        ("| 1 | 0.297 | **0.922** |", True), ("exact match rises to 0.906", False), ("k3 1.7e-4 per token", False),
        ("| `delta_max_changed` | `0.25` |", True), ("SGLang 0.5.23 and vLLM 0.27 / 0.33's", True),
        ("a learning rate of 0.001", False), ("near 0: -0.080 [-0.161, +0.001] with", False))] == [
        True, True, True, False, False, False, True]
    with pytest.raises(AssertionError, match="no row with"):
        newest("e2e.jsonl", bench="not e2e")


# ----------------------------------------------------------------------------- nothing slips in unchecked

DOCS = ["README.md", "examples/README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
EXEMPT_FILE = Path(__file__).with_name("docs_numbers_exempt.txt")
# A figure: a number followed by a unit of speed, time, size or ratio ("1.07x", "4.4M", "0.057 s", "62%").
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:x\b|×|s\b|ms\b|µs|us\b|%|tokens/s|tok/s|GB/s|MB/s"
                    r"|GB\b|MB\b|KB\b|GiB\b|MiB\b|min\b|k\b|M\b)")


# A unitless figure: a decimal ("0.906", "-0.004", "1.7e-4") outside inline code, where a version
# ("vLLM 0.32", "SGLang 0.5.23", "Triton 3.6") is not one. It counts in a table row (not the header) and
# in a prose line that names a measured quantity (``MEASURED``): scores, rewards, divergences, lags.
DECIMAL = re.compile(r"(?<![\w.\-/])[-+]?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])")
VERSION = re.compile(r"\b(?:(?:vLLM|SGLang|Triton|Python|CUDA|PyTorch|torch|transformers|Qwen\d?)[ -]?(?:>=|<=|<|>)?\s*"
                     r"|versions? (?:before|after|from|since) )"
                     r"v?\d+(?:\.\d+)+(?:'s)?(?:\s*(?:/|-|to|and)\s*\d+(?:\.\d+)+)*")
MEASURED = re.compile(r"\b(?:exact[- ]match|EM|rewards?|k1|k3|KL|staleness|accuracy|loss|entropy|score|nats|"
                      r"right characters|calls?|mismatch|w p99|w max|log w)\b", re.I)


# Wherever it stands, an estimate with its interval ("-0.080 [-0.161, +0.001]") or spread ("0.815 ± 0.055") is
# measured, and so is a signed decimal ("+0.043", "-0.035 at eta 4"): a difference a run showed.
ESTIMATE = re.compile(r"[-+]?\d+\.\d+\s*(?:\[[-+]?\d+\.\d+, [-+]?\d+\.\d+\]|± ?\d)"
                      r"|(?<![\w.\-+/=^*])[-+]\d+\.\d+(?![\w.])")


def unitless_figure(line: str, table_row: bool) -> bool:
    text = VERSION.sub("v", re.sub(r"`[^`]*`", "``", line))
    return bool(ESTIMATE.search(text)) or bool(DECIMAL.search(text)) and (table_row or bool(MEASURED.search(text)))


def figure_lines(doc: str) -> dict[int, str]:
    """Line number -> text of each line of ``doc`` (outside fenced code) that holds a figure: a number
    with a unit (``FIGURE``), or a unitless decimal in a table row or beside a measured quantity."""
    out, fenced = {}, False
    lines = (REPO / doc).read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        header = i < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i])  # the next line is |---|
        unitless = not header and unitless_figure(line, line.lstrip().startswith("|"))
        if not fenced and (FIGURE.search(line) or unitless):
            out[i] = line.strip()
    return out


def checked_lines(doc: str) -> set[int]:
    """The lines of ``doc`` that a FIGURES entry spans (as it reads now, right or wrong)."""
    text, lines = (REPO / doc).read_text(), set()

    def loose(t: str) -> str:  # whitespace as Markdown folds it
        return r"\s+".join(re.escape(w) for w in t.split(" "))

    for fig in (f for f in FIGURES if f.doc == doc):
        if fig.whole:
            pat = loose(_fold(fig.text.format(*fig.figures())))
        else:
            pat = NUMBER.join(loose(_fold(p)) for p in fig.text.split("{}"))
        start = re.search(loose(_fold(fig.after)), text).start() if fig.after else 0
        for m in list(re.finditer(pat, text[start:]))[:1 if fig.after else None]:
            m_start, m_end = start + m.start(), start + m.end()
            lines.update(range(text.count("\n", 0, m_start) + 1, text.count("\n", 0, m_end) + 2))
    return lines


# What may exempt a line: each "## " heading of docs_numbers_exempt.txt starts with one of these.
EXEMPT_REASONS = ("a setting, not a measurement", "someone else's number", "arithmetic, not a measurement",
                  "not a figure")


def exemptions() -> dict[tuple[str, str], str]:
    """(doc, line text) -> reason, from ``docs_numbers_exempt.txt``: ``## reason`` then ``doc: line`` rows."""
    out, reason = {}, None
    for raw in EXEMPT_FILE.read_text().splitlines():
        if raw.startswith("## "):
            reason = raw[3:].strip()
            assert reason.startswith(EXEMPT_REASONS), (
                f"{EXEMPT_FILE.name}: {reason!r} is not a reason a figure may go unchecked: a measured figure "
                f"is checked against its result file (FIGURES) or reworded away; the reasons are {EXEMPT_REASONS}")
        elif raw.strip() and not raw.startswith("#"):
            assert reason, f"{EXEMPT_FILE.name}: {raw!r} has no reason above it"
            doc, line = raw.split(": ", 1)
            out[(doc, line.strip())] = reason
    return out


def test_every_figure_in_the_docs_is_checked_or_exempt_with_a_reason():
    """A line of README.md, examples/README.md or docs/*.md with a figure is spanned by a FIGURES entry,
    or listed in docs_numbers_exempt.txt under its reason (a setting, a protocol constant, someone
    else's number, ...). A new or edited line with a figure fails here until it is one or the other;
    an exemption whose line is gone fails too, so the list stays the docs' own."""
    exempt = exemptions()
    unchecked, seen = [], set()
    for doc in DOCS:
        covered = checked_lines(doc)
        for i, line in figure_lines(doc).items():
            if i in covered:
                continue
            if (doc, line) in exempt:
                seen.add((doc, line))
            else:
                unchecked.append(f"{doc}: {line}")
    assert unchecked == [], ("figures no FIGURES entry checks and docs_numbers_exempt.txt does not exempt:\n"
                             + "\n".join(unchecked))
    stale = sorted(f"{d}: {t}" for d, t in set(exempt) - seen)
    assert stale == [], "exemptions for lines no doc has (any more), or that FIGURES now checks:\n" + "\n".join(stale)


# ----------------------------------------------------------------------------- docs/benchmarks.md


def _benchmarks_table() -> list[str]:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    section = text.split("## The benchmarks", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(bench_\w+\.py)` \|", section, flags=re.M)


def test_benchmarks_table_lists_every_benchmark_and_nothing_else():
    listed = _benchmarks_table()
    on_disk = sorted(p.name for p in (REPO / "bench").glob("bench_*.py"))
    assert len(listed) == len(set(listed)), f"docs/benchmarks.md lists a benchmark twice: {listed}"
    assert sorted(set(on_disk) - set(listed)) == [], "benchmarks missing from docs/benchmarks.md's table"
    assert sorted(set(listed) - set(on_disk)) == [], "docs/benchmarks.md lists benchmarks that do not exist"


def test_no_result_file_is_in_a_format_no_command_writes():
    """Rows files are the harness's (``bench/common.py: append_rows``): every row of ``<name>.jsonl`` says
    ``"bench": "<name>"`` and carries its provenance. Any other file is named as a benchmark writes it
    (``<name>_<stamp>...``, or a name its source spells out). Nothing is left from an earlier format."""
    sources = "\n".join(p.read_text() for d in ("bench", "tools") for p in (REPO / d).glob("*.py"))
    stale = []
    for f in sorted(RESULTS.iterdir()):
        if f.suffix == ".jsonl":
            if any(r.get("bench") != f.stem or not isinstance(r.get("provenance"), dict) for r in rows(f.name)):
                stale.append(f.name)
            continue
        stem = re.sub(r"(_\d{8}_\d{4}.*|\.(json|md|png|log))$", "", f.name)
        stem = re.sub(r"-triton[0-9.]+$", "", stem)  # static_sm90-triton<version>.json
        if not re.search(rf"[\"'/]{re.escape(stem)}[_\"'.-]", sources):
            stale.append(f.name)
    assert stale == [], f"result files in a format no command writes any more (regenerate or delete them): {stale}"


# ----------------------------------------------------------------------------- the suite's own time


def test_the_suite_records_its_own_time(tmp_path):
    """tests/_suite_time.py, as .ci/run uses it (with worker processes): one row, written by the process
    that started the workers, with the counts, the seconds, the tiers and the number of workers."""
    import os
    import subprocess
    import sys
    import time

    (tmp_path / "test_x.py").write_text("import pytest\n\ndef test_a():\n    pass\n\n@pytest.mark.skip\ndef test_b():\n"
                                        "    pass\n\n@pytest.mark.slow\ndef test_c():\n    pass\n")
    out = tmp_path / "suite_time.jsonl"
    env = {**os.environ, "AREAL_FAST_SUITE_TIME": str(out), "AREAL_FAST_SUITE_START": str(time.time() - 5),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "_suite_time", "-p", "no:cacheprovider",
                        "-n", "2", "test_x.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = out.read_text().splitlines()
    assert len(rows) == 1, rows  # the workers write none
    row = json.loads(rows[0])
    assert row["workers"] == 2
    counts = (row["bench"], row["selection"], row["passed"], row["skipped"], row["failed"])
    assert counts == ("suite_time", "all", 2, 1, 0)
    assert row["not_slow_passed"] == 1 and row["tests_s"] > 0 and row["total_s"] >= 5
    assert row["provenance"]["commit"] and row["exitstatus"] == 0
