"""A Prometheus endpoint on the controller's process (``metrics.prometheus``): ``GET /metrics`` in
Prometheus's text format, built with prometheus_client's registry and exposition
(``generate_latest``), served on the one HTTP server stack of our listeners (aiohttp with the
connection guard and the key check of ``areal_fast.http``, as the embedded engine and the agent
endpoint): a connection that sends no request head within 10 s is closed, idle kept-alive ones
after 10 s, and connections that have not proved the key are capped (``http.conn_guard``).
prometheus_client's own server has neither a key check nor such limits.

Who may scrape: on a loopback address (the default, 127.0.0.1) anyone on this machine, without a
key; on any other address only a scrape with ``Authorization: Bearer <key>``, compared in constant
time, ``key`` being the run's scrape key (``launch.train.metrics_key``: ``$AREAL_FAST_METRICS_KEY``,
else the key the user gave a run that launches its servers; never the key of servers started by
hand). Without such a key the endpoint refuses to start (the config load refuses it first).

What it exposes (``docs/observability.md`` has the table; ``docs/grafana_dashboard.json`` plots
them): the step, servers live and dropped, generate requests in flight, the buffer, the staleness of
the last batch, tokens generated and trained (counters, and their rate over the last 30 s), the
weight-sync and train time of the last step, the last batch reward and the last eval reward.

Threads: the values change only on the controller's event loop (:meth:`ControllerExporter.observe`,
a controller callback, after every record; :meth:`ControllerExporter.sample`, every 0.5 s, for what
changes between steps). The endpoint serves on an event loop of its own, in its own thread, so a
busy controller loop never delays a scrape; it only reads the registry, which prometheus_client locks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

from aiohttp import web

from areal_fast.http.auth import authorized
from areal_fast.http.conn_guard import ConnLimits, authorize, start_site
from areal_fast.metrics_config import is_loopback

log = logging.getLogger(__name__)

PREFIX = "areal_fast_"
SAMPLE_S = 0.5  # the watchdog's cadence: a server dropped between two samples is still counted
RATE_WINDOW_S = 30.0  # tokens/s gauges: the rate over this window (rate() in PromQL over the counters is finer)
SCRAPE_PATHS = ("/metrics", "/")
_START_S = 30.0  # the endpoint's thread has this long to listen (it binds at once: a failure is raised)

# name (without PREFIX) -> help; every gauge the endpoint exposes (counters below)
GAUGES = {
    "step": "Trainer step = weight version the servers hold",
    "total_steps": "Steps the run makes (experiment.total_steps)",
    "servers_live": "Inference servers in the rollout pool",
    "requests_in_flight": "Generate requests the controller has outstanding (waiting through a pause included)",
    "groups_running": "Prompt groups generating",
    "buffer_groups": "Finished groups waiting to be trained",
    "buffer_spilled_groups": "Of buffer_groups, those spilled to disk (rollout.buffer_memory_mb)",
    "staleness_mean": "Mean staleness of the groups the last step trained (versions)",
    "staleness_max": "Largest staleness of the groups the last step trained (versions)",
    "max_staleness": "The staleness bound eta (rollout.max_staleness)",
    "generated_tokens_per_second": "Output tokens generated per second over the last 30 s",
    "trained_tokens_per_second": "Tokens trained per second over the last 30 s",
    "weight_sync_seconds": "Pause, weight sync and resume of the last step (s)",
    "train_seconds": "Trainer time of the last step (s)",
    "reward": "Mean reward of the last trained batch",
    "eval_reward": "Mean held-out reward of the last evaluation",
    "last_step_timestamp_seconds": "Unix time of the last step (alert when it stops moving)",
    "autoscale_target_servers": "The server-count policy's target (rollout.autoscale; docs/autoscale.md)",
    "autoscale_trainer_idle_fraction": "Trainer idle fraction over the policy's last window",
    "autoscale_buffer_batches": "Batches waiting when the trainer asked, over the policy's last window",
    "autoscale_last_change": "Servers added (+) or removed (-) by the policy's last decision (0: a hold)",
}
COUNTERS = {
    "servers_dropped": "Inference servers dropped from the pool (died or hung)",
    "generated_tokens": "Output tokens generated (finished generate requests)",
    "trained_tokens": "Tokens trained",
    "dropped_stale_groups": "Groups dropped as too stale (strict staleness) and regenerated",
    "autoscale_changes": "Changes of the server count the policy decided",
}


class MeteredRollout:
    """The controller's rollout port with its generate calls counted (in flight, output tokens);
    every other attribute is the port's own."""

    def __init__(self, port):
        self._port = port
        self.in_flight = 0
        self.generated_tokens = 0

    async def generate(self, input_ids, sampling, rid):
        self.in_flight += 1
        try:
            sample = await self._port.generate(input_ids, sampling, rid)
        finally:
            self.in_flight -= 1
        self.generated_tokens += len(sample.output_ids)
        return sample

    def __getattr__(self, name):
        return getattr(self._port, name)


class ControllerExporter:
    """The registry, its HTTP server and the code that fills it; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: str | None = None, *, total_steps: int = 0,
                 max_staleness: int | None = None, conn_limits: ConnLimits | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if not is_loopback(host) and not key:
            raise ValueError(f"metrics.prometheus.host {host!r} is not a loopback address: scrapes must carry a "
                             f"key, and the run has none (set api_key or $AREAL_FAST_API_KEY)")
        self.host, self.key = host, (key if not is_loopback(host) else None)
        self.registry = CollectorRegistry()
        self.g = {n: Gauge(PREFIX + n, h, registry=self.registry) for n, h in GAUGES.items()}
        self.c = {n: Counter(PREFIX + n, h, registry=self.registry) for n, h in COUNTERS.items()}
        self.g["total_steps"].set(total_steps)
        if max_staleness is not None:
            self.g["max_staleness"].set(max_staleness)
        self._live: set[str] = set()
        self._seen = {"generated_tokens": 0, "trained_tokens": 0, "dropped_stale_groups": 0}
        self._window: deque = deque()
        self.meter: MeteredRollout | None = None
        self._sources: tuple | None = None  # (controller, pool) once sample_forever runs
        self._server = _Endpoint(self, host, port, conn_limits or ConnLimits())
        self.port = self._server.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def where(self) -> str:
        return self.url + (" (bearer key required)" if self.key else "")

    def metered(self, port) -> MeteredRollout:
        """``port`` with its generate calls counted; give the controller this one."""
        self.meter = MeteredRollout(port)
        return self.meter

    # ------------------------------------------------------------- filled on the controller's loop
    def observe(self, m: dict) -> None:
        """A controller callback: the per-step values of a train record, the eval reward."""
        kind = m.get("kind")
        if kind == "train":
            g = self.g
            g["step"].set(m["step"])
            g["reward"].set(m["reward"])
            g["staleness_mean"].set(m["staleness_mean"])
            g["staleness_max"].set(m["staleness_max"])
            g["weight_sync_seconds"].set(m["sync_s"])
            g["train_seconds"].set(m["train_s"])
            g["last_step_timestamp_seconds"].set(time.time())
            if self._sources is not None:  # the counters at the step, not up to 0.5 s later
                self.sample(*self._sources)
        elif kind == "eval":
            self.g["eval_reward"].set(m["eval_reward"])
        elif kind == "autoscale":  # one decision of the server-count policy
            g = self.g
            g["autoscale_target_servers"].set(m["autoscale/target"])
            g["autoscale_last_change"].set(m["autoscale/change"])
            for key, name in (("autoscale/idle", "autoscale_trainer_idle_fraction"),
                              ("autoscale/buffer_batches", "autoscale_buffer_batches")):
                if key in m:
                    g[name].set(m[key])
            if m["autoscale/change"]:
                self.c["autoscale_changes"].inc()

    def sample(self, ctl, pool) -> None:
        """What changes between steps: read from the controller ``ctl`` and the rollout port ``pool``."""
        g = self.g
        g["step"].set(ctl.version)
        urls = set(pool.urls)
        gone = self._live - urls
        if gone:
            self.c["servers_dropped"].inc(len(gone))
        self._live = urls
        g["servers_live"].set(len(urls))
        g["groups_running"].set(len(ctl.running))
        g["buffer_groups"].set(len(ctl.buffer))
        g["buffer_spilled_groups"].set(ctl.buffer.spilled)
        generated = self.meter.generated_tokens if self.meter is not None else 0
        if self.meter is not None:
            g["requests_in_flight"].set(self.meter.in_flight)
        now_totals = {"generated_tokens": generated, "trained_tokens": ctl.counters.trained_tokens,
                      "dropped_stale_groups": ctl.counters.dropped_stale}
        for name, total in now_totals.items():
            if total > self._seen[name]:
                self.c[name].inc(total - self._seen[name])
            self._seen[name] = total
        now = time.monotonic()
        self._window.append((now, generated, ctl.counters.trained_tokens))
        while len(self._window) > 2 and now - self._window[1][0] >= RATE_WINDOW_S:
            self._window.popleft()
        t0, gen0, tr0 = self._window[0]
        if now > t0:
            g["generated_tokens_per_second"].set((generated - gen0) / (now - t0))
            g["trained_tokens_per_second"].set((ctl.counters.trained_tokens - tr0) / (now - t0))

    async def sample_forever(self, ctl, pool) -> None:
        self._sources = (ctl, pool)
        while True:
            try:
                self.sample(ctl, pool)
            except Exception as e:  # noqa: BLE001 - the endpoint must never stop the run
                log.warning("prometheus: sampling failed: %r", e)
            await asyncio.sleep(SAMPLE_S)

    # ------------------------------------------------------------- served on the endpoint's thread
    def allowed(self, authorization: str | None) -> bool:
        """A scrape with this ``Authorization`` header may read the metrics (``http.auth``'s one
        check; ``/metrics`` is what the key guards here, so no path is exempt)."""
        return authorized(self.key, "/metrics", authorization, exempt=())

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def close(self) -> None:
        self._server.close()


class _Endpoint:
    """``GET /metrics`` (and ``/``) of ``exporter`` on aiohttp with the connection guard
    (``http.conn_guard.start_site``), served by an event loop in a thread of its own."""

    def __init__(self, exporter: ControllerExporter, host: str, port: int, limits: ConnLimits):
        self.exporter = exporter
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="prometheus", daemon=True)
        self._thread.start()
        try:
            self._runner = asyncio.run_coroutine_threadsafe(self._start(host, port, limits), self.loop).result(_START_S)
        except OSError as e:
            self._stop_loop()
            raise OSError(e.errno, f"metrics.prometheus: cannot listen on {host}:{port}: {e.strerror or e} "
                                   f"(another run's endpoint? set metrics.prometheus.port, 0 = any free port)") from e
        except BaseException:
            self._stop_loop()
            raise
        self.port = self._runner.addresses[0][1]

    async def _start(self, host: str, port: int, limits: ConnLimits) -> web.AppRunner:
        app = web.Application()
        for path in SCRAPE_PATHS:
            app.router.add_get(path, self._scrape)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return await start_site(app, host, port, limits)

    async def _scrape(self, request: web.Request) -> web.Response:
        if not authorize(request, self.exporter.key, exempt=()):
            return web.Response(status=401, text="a bearer key is required\n",
                                headers={"WWW-Authenticate": 'Bearer realm="areal_fast"'})
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(status=200, body=self.exporter.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @staticmethod
    async def _not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text="not found: scrape /metrics\n")

    def close(self) -> None:
        if self._runner is not None and self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
            except Exception as e:  # noqa: BLE001 - closing at the end of a run: say it, go on
                log.warning("prometheus: closing the endpoint: %r", e)
            self._runner = None
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def start_exporter(cfg, key: str | None) -> ControllerExporter | None:
    """The endpoint of the run ``cfg`` (``metrics.prometheus``), listening; None when it is off."""
    p = cfg.metrics.prometheus
    if not p.enabled:
        return None
    return ControllerExporter(p.host, p.port, key, total_steps=cfg.experiment.total_steps,
                              max_staleness=cfg.rollout.max_staleness)
