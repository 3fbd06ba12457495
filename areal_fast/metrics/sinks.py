"""Metric sinks of a run: JSONL (always), TensorBoard (when installed), a tqdm bar, PNG plots.
W&B and MLflow are in ``metrics.services``, the Prometheus endpoint in ``metrics.prometheus``.

``metrics.jsonl`` holds one JSON object per event: ``{"kind": "train"|"eval"|"checkpoint"|"autoscale", "step":
...}`` (``autoscale``: the server-count policy's decision after a step, ``docs/autoscale.md``).
After a resume from step s the file is cut back to the events of steps <= s, and TensorBoard purges
the steps after s, so every step appears once in the lineage that produced the final model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from areal_fast.diskutil import open_private, open_private_temp, write_failed

log = logging.getLogger(__name__)


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only the lines whose 'step' <= max_step (atomic rewrite through ``<name>.tmp``). The file
    and the temporary are opened without following a symlink (``diskutil.open_private``)."""
    path = Path(path)
    if not path.is_file():
        return
    with os.fdopen(open_private(path, os.O_RDONLY), "r") as f:
        lines = f.read().splitlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= max_step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut by kill -9
            continue
    tmp = path.with_suffix(path.suffix + ".tmp")
    with os.fdopen(open_private_temp(tmp), "w") as f:
        f.write("".join(x + "\n" for x in keep))
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class JsonlSink:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = os.fdopen(open_private(self.path), "a")  # a planted symlink is refused, not followed

    def __call__(self, m: dict) -> None:
        try:
            self.f.write(json.dumps(m) + "\n")
            self.f.flush()
        except OSError as e:
            raise write_failed(self.path, e) from e

    def close(self) -> None:
        self.f.close()


def scalars(m: dict) -> dict[str, float]:
    """The scalars of one record under the names every sink uses (TensorBoard, W&B, MLflow): a key
    without '/' gets the record's kind in front (``train/reward``, ``eval/eval_reward``), one with a
    '/' is kept (``train/clip_fraction``, ``sync/servers``). Lists, strings and booleans are left out."""
    prefix = m.get("kind", "train")
    return {(f"{prefix}/{k}" if "/" not in k else k): v for k, v in m.items()
            if k not in ("step", "kind") and isinstance(v, int | float) and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars to TensorBoard; a no-op (with one log line) when no writer library is installed.
    ``purge_step``: a resumed run's first step; TensorBoard hides what earlier event files hold from
    that step on (the steps a killed run made after its checkpoint)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        self.w = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.w = SummaryWriter(str(log_dir), purge_step=purge_step)
        except Exception as e:  # noqa: BLE001 - tensorboard is optional
            log.info("TensorBoard disabled (%s); metrics are in metrics.jsonl", e)

    def __call__(self, m: dict) -> None:
        if self.w is None or "step" not in m:
            return
        prefix = m.get("kind", "train")
        for k, v in scalars(m).items():
            self.w.add_scalar(k, v, m["step"])
        if m.get("staleness"):  # the consumed groups' staleness, as a histogram per step
            import numpy as np

            self.w.add_histogram(f"{prefix}/staleness_hist", np.asarray(m["staleness"]), m["step"])

    def close(self) -> None:
        if self.w is not None:
            self.w.close()


class ProgressBar:
    """tqdm bar over trainer steps: step, reward, tokens/s, staleness (and the last eval reward; with the
    server-count policy, the servers in the pool and its target: ``srv 3->4``)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.bar = None
        self.eval_reward = None
        self.servers: str | None = None
        self._post: dict = {}
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def __call__(self, m: dict) -> None:
        if self.bar is None:
            return
        if m.get("kind") == "eval":
            self.eval_reward = m["eval_reward"]
        if m.get("kind") == "autoscale":
            self.servers = server_count(m)
            self._post["srv"] = self.servers
            self.bar.set_postfix(self._post, refresh=True)
            return
        if m.get("kind") != "train":
            return
        post = {"reward": f"{m['reward']:.3f}", "tok/s": f"{m['trained_tokens_per_s']:.0f}",
                "stale": f"{m['staleness_mean']:.2f}"}
        if self.eval_reward is not None:
            post["eval"] = f"{self.eval_reward:.3f}"
        if self.servers is not None:
            post["srv"] = self.servers
        self._post = post
        self.bar.set_postfix(post, refresh=False)
        self.bar.n = m["step"]
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def server_count(m: dict) -> str:
    """An autoscale record as the progress line shows it: the pool, and the target when it differs
    (``3->4``: a server being added), with the change's sign (``4 (+1)``) when one was decided."""
    servers, target, change = m["autoscale/servers"], m["autoscale/target"], m["autoscale/change"]
    text = f"{servers}" if servers == target else f"{servers}->{target}"
    return f"{text} ({change:+d})" if change else text


def plot_run(metrics_path: Path, out_dir: Path) -> list[Path]:
    """reward.png, throughput.png, staleness.png, mismatch.png from metrics.jsonl (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no plots")
        return []
    rows = read_jsonl(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="train reward (batch)", alpha=0.6)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o-", label="held-out (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "reward.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["trained_tokens_per_s"] for r in train], label="trained tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s (cumulative average)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    stal = [s for r in train for s in r.get("staleness", [])]
    if stal:
        ax.hist(stal, bins=range(0, max(stal) + 2), align="left", rwidth=0.8)
    ax.set_xlabel("staleness (trainer version - oldest token version)")
    ax.set_ylabel("groups")
    fig.tight_layout()
    paths.append(out_dir / "staleness.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    paths.append(_plot_mismatch(plt, train, out_dir / "mismatch.png"))
    return paths


MISMATCH_PANELS = (
    ("KL(inference || train)", ("train/mismatch_k1", "train/mismatch_k3")),
    ("ratio quantiles", ("train/mismatch_ratio_p50", "train/mismatch_ratio_p99", "train/mismatch_ratio_max",
                         "train/ratio_p99", "train/ratio_max")),
    ("fraction of loss tokens", ("train/tis_truncated_fraction", "train/token_mis_masked_fraction",
                                 "train/seq_mis_masked_fraction", "train/m2po_masked_fraction",
                                 "train/clip_fraction")),
    ("staleness of consumed groups", ("staleness_p50", "staleness_p90", "staleness_max")),
)


def _plot_mismatch(plt, train: list[dict], path: Path) -> Path:
    """mismatch.png: the dashboard of docs/objective.md per step (a key absent from a run is skipped)."""
    fig, axes = plt.subplots(len(MISMATCH_PANELS), 1, figsize=(7, 2.6 * len(MISMATCH_PANELS)), sharex=True)
    for ax, (title, keys) in zip(axes, MISMATCH_PANELS):
        for k in keys:
            pts = [(r["step"], r[k]) for r in train if k in r]
            if pts:
                ax.plot(*zip(*pts), label=k.split("/")[-1])
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
