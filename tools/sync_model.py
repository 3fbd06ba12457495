"""The weight-sync time model of ``docs/weight_sync.md`` (a model, not a measurement: it lives in tools/ beside
the other simulators and writes its result beside the benchmarks'), re-anchored on other projects' published sync times,
then its predictions for our paths on H200 nodes. Computed, not measured: no GPU ran any of it.

    python tools/sync_model.py [--results DIR] [--no-results] [--dry-run]

The model (per update, bytes ``B`` on the wire in the sent dtype; every constant named in the result file):

    t = F + max(B / (S * b), B / (L * b)) + C

* ``F``: fixed seconds per update (pause, control calls, sessions, cache flush, resume);
* ``b``: what one sender moves per second (NCCL, the servers' loaders included);
* ``S`` senders (today 1: trainer rank 0); ``L`` lanes into one server node: every server worker loads
  the full tensors, a node takes each weight group's bytes in once (NCCL rings enter a node once, NVLink
  inside) and at most ``L`` groups at a time (its NICs); a single sender is its own bound;
* ``C``: the delta's codec (encode at the senders, the shadow's copy over PCIe on today's path, the
  server's scatter), at 70 % of H200 HBM; each sender encodes its own share on the many-sender path.

Delta bytes: 6 per changed bf16 element (int32 index + value), ``CHANGED`` of the elements per update (our
lr 1e-6 measurement, ``delta_fraction.md``); a whole update every ``FULL_EVERY``.

**Calibration** (``fit`` rows): ``F`` and ``b`` from verl's one-sender 7B pair (full 5.5-6.0 s, delta
3.9-4.9 s, mid-points); a many-sender ``F`` and aggregate rate ``S * b`` from Miles' shard-to-shard
Qwen3-30B-A3B (2.16 s) and Qwen3-235B (3.16 s), taken as one cluster. **Checks** (``check`` rows): every
other published number against the fitted model, the ratio logged. **Predictions** (``predict`` rows):
our one-sender path and the many-sender path (one sender per trainer rank) for Qwen2.5-7B, Qwen2.5-32B,
Qwen3-30B-A3B and Qwen3-235B-A22B; vLLM's sparse path (whole anchors as every index and value).

``--sender-bytes-per-s`` / ``--codec-bytes-per-s``: measured rates in place of the fitted and assumed ones, for the
predictions. ``--pieces FILE`` reads the GPU day's ``sync_model_inputs`` row (``bench/bench_sync_senders.py
--parts gpu``, the day's ``sync_pieces`` step: ``sync_senders.jsonl`` or the day's JSON summary): its codec rate
is in this model's units and replaces the HBM assumption; its sender rate is a one-GPU upper bound (no wire),
used only with ``--pieces-sender-bound`` (:func:`pieces_inputs`).

Results: ``bench/results/sync_model.json`` (rows, constants) and ``.md``; rows in ``sync_model.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RESULTS_DIR, add_harness_args, print_dry_run, provenance, save  # noqa: E402

# parameters (config.json / model cards); bf16 on the wire
PARAMS = {"Qwen2.5-7B": 7.62e9, "Qwen2.5-32B": 32.76e9, "Qwen3-30B-A3B": 30.5e9, "Qwen3-235B-A22B": 235e9,
          "Kimi-K2": 1.04e12}
CHANGED = 0.0236  # bf16 elements changed per update at lr 1e-6 (docs/weight_sync.md's delta rows)
FULL_EVERY = 10
HBM_BYTES_PER_S = 4.8e12 * 0.7  # H200 HBM3e at 70 %
PCIE_BYTES_PER_S = 50e9  # host -> GPU, pinned, PCIe Gen5 x16 (today's host shadow staged per tensor)
SECTOR_BYTES = 32  # a scattered 2-byte write costs a 32-byte sector
LANES_PER_NODE = 8  # an H200 node: 8 GPUs, one 400 Gb/s NIC each
TRAINER_GPUS = {"Qwen2.5-7B": 8, "Qwen2.5-32B": 16, "Qwen3-30B-A3B": 16, "Qwen3-235B-A22B": 64}  # senders

# other projects' published sync seconds (ranges as (low, high))
PUBLISHED = [
    {"source": "verl", "model": "Qwen2.5-7B", "what": "full, taken as one sender", "s": (5.5, 6.0), "use": "fit_one"},
    {"source": "verl", "model": "Qwen2.5-7B", "what": "delta, taken as one sender", "s": (3.9, 4.9), "use": "fit_one"},
    {"source": "Miles", "model": "Qwen3-30B-A3B", "what": "shard-to-shard P2P", "s": (2.16, 2.16), "use": "fit_many"},
    {"source": "Miles", "model": "Qwen3-235B-A22B", "what": "shard-to-shard P2P", "s": (3.16, 3.16),
     "use": "fit_many"},
    {"source": "Miles", "model": "Kimi-K2", "what": "shard-to-shard P2P", "s": (7.2, 7.2), "use": "check_many"},
    {"source": "Miles", "model": "Kimi-K2", "what": "before P2P, taken as one sender", "s": (53.3, 53.3),
     "use": "check_one"},
    {"source": "verl", "model": "Qwen3-235B-A22B", "what": "full, taken as one sender", "s": (246.0, 266.0),
     "use": "check_one"},
    {"source": "verl", "model": "Qwen3-235B-A22B", "what": "delta_sharded, taken as one sender",
     "s": (11.4, 14.9), "use": "check_one_delta"},
]


def mid(r: tuple[float, float]) -> float:
    return (r[0] + r[1]) / 2


def model_bytes(n: float) -> float:
    return 2 * n


def delta_bytes(n: float) -> float:
    return 6 * CHANGED * n


def codec_bytes(n: float, changed: float) -> float:
    """The bytes :func:`codec_s` charges one sender and one server for ``n`` bf16 elements with ``changed``
    changes: encode (read old and new, write index + value, scatter the shadow), apply (read, scatter). A
    measured rate over these bytes (``bench_sync_senders.py --parts gpu``) replaces ``HBM_BYTES_PER_S``."""
    return 4 * n + (6 + 2 * SECTOR_BYTES) * changed + (6 + SECTOR_BYTES) * changed


def pieces_inputs(rows: list[dict]) -> dict:
    """The GPU day's rates for this model, from ``bench_sync_senders.py --parts gpu``'s rows: the Triton codec
    at the changed share nearest :data:`CHANGED`, and the one-rank NCCL group's bound on a sender's rate.

    One GPU has no wire: its NCCL rows give one call's fixed cost (a 4 KiB broadcast) and the receiving side's
    local work per bucket (broadcast + unpack), an upper bound on ``b``, not ``b`` (NVLink, the NICs, rings
    across nodes need two GPUs or more; NCCL refuses two ranks on one GPU). Only the codec rate stands as
    measured; ``--pieces-sender-bound`` uses the bound to ask what a free wire would give."""
    out: dict = {"part": "sync_model_inputs"}
    tri = [r for r in rows if r.get("backend") == "triton" and r.get("bitwise_equal")]
    if tri:
        out["codec_bytes_per_s"] = min(tri, key=lambda r: abs(r["density"] - CHANGED))["codec_bytes_per_s"]
    bound = [r["sender_bytes_per_s_local_bound"] for r in rows if "sender_bytes_per_s_local_bound" in r]
    if bound:
        out["sender_bytes_per_s_local_bound"] = bound[-1]
    out["sync_model_command"] = "python tools/sync_model.py --pieces bench/results/sync_senders.jsonl"
    return out


def codec_s(n: float, senders: int, shadow_over_pcie: bool) -> float:
    """The delta's GPU passes (encode: read shadow and new, write the changes, scatter into the shadow;
    apply: a scatter on the server), each sender its share; today's shadow crosses PCIe too."""
    f = CHANGED * n
    encode = (4 * n + (6 + 2 * SECTOR_BYTES) * f) / HBM_BYTES_PER_S / senders
    apply = (6 * f + SECTOR_BYTES * f) / HBM_BYTES_PER_S
    pcie = 2 * n / PCIE_BYTES_PER_S / senders if shadow_over_pcie else 0.0
    return encode + apply + pcie


def fit() -> dict:
    """F and b from verl's one-sender 7B pair; F and S*b from Miles' two P2P points (one cluster)."""
    m7 = model_bytes(PARAMS["Qwen2.5-7B"])
    t_full, t_delta = (mid(p["s"]) for p in PUBLISHED[:2])
    b_one = (m7 - delta_bytes(PARAMS["Qwen2.5-7B"])) / (t_full - t_delta)
    f_one = t_full - m7 / b_one
    (m30, t30), (m235, t235) = ((model_bytes(PARAMS[p["model"]]), mid(p["s"])) for p in PUBLISHED[2:4])
    agg_many = (m235 - m30) / (t235 - t30)
    f_many = t30 - m30 / agg_many
    return {"fixed_s_one_sender": f_one, "sender_bytes_per_s": b_one, "fixed_s_many": f_many,
            "aggregate_bytes_per_s_many": agg_many, "senders_implied_many": agg_many / b_one}


def checks(c: dict) -> list[dict]:
    rows = []
    for p in PUBLISHED:
        m = model_bytes(PARAMS[p["model"]])
        if p["use"] in ("fit_one", "check_one", "check_one_delta"):
            b = delta_bytes(PARAMS[p["model"]]) if p["use"] == "check_one_delta" or "delta" in p["what"] else m
            pred = c["fixed_s_one_sender"] + b / c["sender_bytes_per_s"]
        else:
            pred = c["fixed_s_many"] + m / c["aggregate_bytes_per_s_many"]
        rows.append({"part": "fit" if p["use"].startswith("fit") else "check", "source": p["source"],
                     "model": p["model"], "what": p["what"], "published_s": list(p["s"]),
                     "published_mid_s": mid(p["s"]), "predicted_s": pred, "ratio": pred / mid(p["s"])})
    return rows


def predictions(c: dict) -> list[dict]:
    rows = []
    f, b = c["fixed_s_many"], c["sender_bytes_per_s"]  # the lower published fixed cost, for both paths
    for name, n in ((k, PARAMS[k]) for k in TRAINER_GPUS):
        whole, dlt = model_bytes(n), delta_bytes(n)
        for path, s in (("one sender (today)", 1), ("many senders", TRAINER_GPUS[name])):
            lanes = min(s, LANES_PER_NODE)

            def wire(nbytes, lanes=lanes):
                return nbytes / (lanes * b)

            t_whole = f + wire(whole)
            t_delta = f + wire(dlt) + codec_s(n, s, shadow_over_pcie=s == 1)
            mean = ((FULL_EVERY - 1) * t_delta + t_whole) / FULL_EVERY
            rows.append({"part": "predict", "model": name, "params": n, "path": path, "senders": s,
                         "lanes": lanes, "bytes_whole": whole, "bytes_delta": dlt, "sync_s_whole": t_whole,
                         "sync_s_delta": t_delta, "sync_s_delta_mean": mean})
        if name in ("Qwen2.5-7B", "Qwen2.5-32B"):  # vLLM sparse_nccl: anchors as (index, value) of every element
            t_anchor = f + 3 * whole / b
            t_delta = f + dlt / b + codec_s(n, 1, shadow_over_pcie=True)
            rows.append({"part": "predict", "model": name, "params": n, "path": "vLLM sparse_nccl (one sender)",
                         "senders": 1, "lanes": 1, "bytes_whole": 3 * whole, "bytes_delta": dlt,
                         "sync_s_whole": t_anchor, "sync_s_delta": t_delta,
                         "sync_s_delta_mean": ((FULL_EVERY - 1) * t_delta + t_anchor) / FULL_EVERY})
    today = {r["model"]: r for r in rows if r["path"] == "one sender (today)"}
    for r in rows:
        r["speedup_whole_vs_today"] = today[r["model"]]["sync_s_whole"] / r["sync_s_whole"]
        r["speedup_mean_vs_today_whole"] = today[r["model"]]["sync_s_whole"] / r["sync_s_delta_mean"]
    return rows


def constants() -> dict:
    return {"changed_frac": CHANGED, "full_every": FULL_EVERY, "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "pcie_bytes_per_s": PCIE_BYTES_PER_S, "lanes_per_node": LANES_PER_NODE, "trainer_gpus": TRAINER_GPUS,
            "params": PARAMS, "label": "computed, not measured"}


def markdown(c: dict, rows: list[dict]) -> str:
    out = ["# Weight-sync model, re-anchored (computed, not measured)", "",
           "Fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in c.items()), "",
           "| source | model | what | published s | model s | model / published |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] in ("fit", "check"):
            lo, hi = r["published_s"]
            pub = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
            out.append(f"| {r['source']} | {r['model']} | {r['what']}{' (fit)' if r['part'] == 'fit' else ''} | "
                       f"{pub} | {r['predicted_s']:.2f} | {r['ratio']:.2f} |")
    out += ["", "| model | path | senders | whole s | delta s | mean s, 1 in 10 whole |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "predict":
            out.append(f"| {r['model']} | {r['path']} | {r['senders']} | {r['sync_s_whole']:.2f} | "
                       f"{r['sync_s_delta']:.2f} | {r['sync_s_delta_mean']:.2f} |")
    return "\n".join(out) + "\n"


def read_pieces(path: str | Path) -> dict:
    """The last ``sync_model_inputs`` row (:func:`pieces_inputs`) in a JSONL of rows or a GPU day's JSON summary
    (``steps[].key.rows``); ValueError naming the file when there is none."""
    text = Path(path).read_text()
    rows: list[dict] = []
    try:
        day = json.loads(text)
    except ValueError:  # JSON lines
        day = None
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    if isinstance(day, dict):
        for step in day.get("steps", []):
            for found in ((step.get("key") or {}).get("rows") or {}).values():
                rows += found
    elif isinstance(day, list):
        rows = day
    found = [r for r in rows if isinstance(r, dict) and r.get("part") == "sync_model_inputs"]
    if not found:
        raise ValueError(f"{path}: no sync_model_inputs row (bench_sync_senders.py --parts gpu writes one on a GPU)")
    return found[-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sender-bytes-per-s", type=float, default=None,
                    help="a measured per-sender rate (one bucket's NCCL broadcast on the GPU day) in place of the fit")
    ap.add_argument("--codec-bytes-per-s", type=float, default=None,
                    help="a measured delta encode/apply rate (GPU day) in place of 70 %% of H200 HBM")
    ap.add_argument("--pieces", default=None, metavar="FILE",
                    help="the GPU day's sync_model_inputs row (sync_senders.jsonl or the day's JSON): its codec rate")
    ap.add_argument("--pieces-sender-bound", action="store_true",
                    help="with --pieces: its one-GPU sender bound as the per-sender rate (the wire taken as free)")
    add_harness_args(ap)
    a = ap.parse_args(argv)
    if a.pieces_sender_bound and not a.pieces:
        ap.error("--pieces-sender-bound needs --pieces FILE")
    if a.pieces:
        try:
            got = read_pieces(a.pieces)
        except (OSError, ValueError) as e:
            ap.error(f"--pieces: {e}")
        a.codec_bytes_per_s = a.codec_bytes_per_s or got.get("codec_bytes_per_s")
        if a.pieces_sender_bound:
            if "sender_bytes_per_s_local_bound" not in got:
                ap.error(f"--pieces-sender-bound: {a.pieces} has no sender_bytes_per_s_local_bound")
            a.sender_bytes_per_s = a.sender_bytes_per_s or got["sender_bytes_per_s_local_bound"]
    global HBM_BYTES_PER_S
    if a.codec_bytes_per_s:
        HBM_BYTES_PER_S = a.codec_bytes_per_s
    if a.dry_run:
        print_dry_run("sync_model", [{"published": len(PUBLISHED), "models": len(TRAINER_GPUS)}])
        return
    c = fit()
    rows = checks(c)
    if a.sender_bytes_per_s:  # the predictions from a measured rate; the log keeps the fitted one
        c = {**c, "sender_bytes_per_s_measured": a.sender_bytes_per_s}
    rows += predictions({**c, "sender_bytes_per_s": a.sender_bytes_per_s or c["sender_bytes_per_s"]})
    md = markdown(c, rows)
    print(md)
    if a.no_results:
        return
    prov = provenance(native=False)
    out = Path(a.results) if a.results else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_model.json").write_text(json.dumps({"provenance": prov, "fit": c, "constants": constants(),
                                                     "rows": rows}, indent=1) + "\n")
    (out / "sync_model.md").write_text(md)
    save("sync_model", [{**r, **{k: v for k, v in c.items()}} for r in rows], a, prov)


if __name__ == "__main__":
    sys.exit(main())
