"""Every bad input a careless or hostile user can give is refused when the config is loaded (before
any process starts), with a message that names the culprit: the dotted key, the file (and line),
the device.

Each case builds its inputs in a fresh directory and runs what ``areal-fast train`` runs first:
``load_config`` then ``check_machine`` (with the machine's GPU count fixed by the case, so the
outcome does not depend on where the test runs).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from areal_fast.cli import main
from areal_fast.config import ConfigError, load_config
from areal_fast.preflight import check_machine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse.yaml"


def _data_file(tmp: Path, name: str, content: bytes) -> list[str]:
    f = tmp / name
    f.write_bytes(content)
    return [f"data.train={f}", "model.warm_start.enabled=false", f"model.path={_model_dir(tmp)}"]


def _model_dir(tmp: Path) -> Path:
    m = tmp / "model"
    m.mkdir(exist_ok=True)
    (m / "config.json").write_text("{}")
    return m


def _config_file(tmp: Path, content: bytes) -> Path:
    f = tmp / "run.yaml"
    f.write_bytes(content)
    return f


# (id, builder(tmp) -> (config path, overrides), GPUs of the pretend machine, texts the message must contain)
CASES = [
    ("config-not-utf8", lambda t: (_config_file(t, b"experiment:\n  name: caf\xe9\n"), []), 0,
     ["run.yaml", "not UTF-8", "offset"]),
    ("config-top-level-list", lambda t: (_config_file(t, b"- 1\n- 2\n"), []), 0, ["run.yaml", "mapping"]),
    ("data-not-utf8", lambda t: (EXAMPLE, _data_file(t, "d.jsonl", b'{"prompt": "a", "answer": "b"}\n'
                                                                b'{"prompt": "\xff", "answer": "b"}\n')), 0,
     ["data.train", "d.jsonl:2", "not UTF-8"]),
    ("data-scalar-rows", lambda t: (EXAMPLE, _data_file(t, "d.jsonl", b'{"prompt": "a", "answer": "b"}\n3\n')), 0,
     ["data.train", "d.jsonl:2", "JSON object"]),
    ("data-string-rows", lambda t: (EXAMPLE, _data_file(t, "d.jsonl", b'"just text"\n')), 0,
     ["data.train", "d.jsonl:1", "JSON object"]),
    ("data-gz-not-gzip", lambda t: (EXAMPLE, _data_file(t, "d.jsonl.gz", b'{"prompt": "a", "answer": "b"}\n')), 0,
     ["data.train", "d.jsonl.gz", "gzip"]),
    ("data-gz-no-prompt-field", lambda t: (EXAMPLE, _data_file(t, "d.jsonl.gz", gzip.compress(b'{"q": "a"}\n'))), 0,
     ["data.train", "d.jsonl.gz", "data.prompt_key"]),
    ("data-row-reward-misspelled",
     lambda t: (EXAMPLE, _data_file(t, "d.jsonl", b'{"prompt": "a", "answer": "b"}\n'
                                                  b'{"prompt": "a", "tests": [], "reward": "cod"}\n')), 0,
     ["data.train", "d.jsonl row 1", "'reward'", "cod"]),
    ("data-missing-file", lambda t: (EXAMPLE, [f"data.train={t / 'nope.jsonl'}", "model.warm_start.enabled=false",
                                               f"model.path={_model_dir(t)}"]), 0, ["data.train", "nope.jsonl"]),
    ("data-unknown-format", lambda t: (EXAMPLE, ["data.train=rows.csv", "model.warm_start.enabled=false",
                                                 "model.path=m"]), 0, ["data.train", "rows.csv"]),
    ("data-unknown-synthetic-task", lambda t: (EXAMPLE, ["data.train=synthetic:revers"]), 0,
     ["data.train", "synthetic:revers"]),
    ("prompt-template-other-field", lambda t: (EXAMPLE, ["data.prompt_template={prompt} {answer}"]), 0,
     ["data.prompt_template"]),
    ("model-path-missing", lambda t: (EXAMPLE, ["model.warm_start.enabled=false", "data.train=synthetic:reverse",
                                                f"model.path={t / 'Qwen2.5-1.5B'}"]), 0,
     ["model.path", "Qwen2.5-1.5B", "does not exist"]),
    ("model-path-not-a-model", lambda t: (EXAMPLE, ["model.warm_start.enabled=false", f"model.path={t}"]), 0,
     ["model.path", "config.json"]),
    ("train-cuda-without-gpu", lambda t: (EXAMPLE, ["train.device=cuda"]), 0, ["train.device", "no CUDA device"]),
    ("rollout-cuda-without-gpu", lambda t: (EXAMPLE, ["rollout.device=cuda:0"]), 0,
     ["rollout.device", "no CUDA device"]),
    ("train-gpus-beyond-machine", lambda t: (EXAMPLE, ["train.gpus=['0','7']"]), 2,
     ["train.gpus[1]", "GPU 7", "2 GPU"]),
    ("rollout-gpus-beyond-machine", lambda t: (EXAMPLE, ["rollout.gpus=['3']"]), 2, ["rollout.gpus[0]", "GPU 3"]),
    ("world-size-beyond-gpus", lambda t: (EXAMPLE, ["train.device=cuda", "train.world_size=4"]), 2,
     ["train.world_size", "2 GPU"]),
    ("output-dir-under-a-file", lambda t: (EXAMPLE, [f"experiment.output_dir={_config_file(t, b'x: 1')}/run"]), 0,
     ["experiment.output_dir", "run.yaml", "is a file"]),
    ("top-k-zero", lambda t: (EXAMPLE, ["rollout.top_k=0"]), 0, ["rollout.top_k", "-1"]),
    ("eval-max-new-tokens-negative", lambda t: (EXAMPLE, ["eval.max_new_tokens=-5"]), 0, ["eval.max_new_tokens"]),
    ("max-tokens-per-mb-zero", lambda t: (EXAMPLE, ["train.max_tokens_per_mb=0"]), 0, ["train.max_tokens_per_mb"]),
    ("request-timeout-negative", lambda t: (EXAMPLE, ["rollout.request_timeout=-1"]), 0, ["rollout.request_timeout"]),
    ("health-timeout-zero", lambda t: (EXAMPLE, ["rollout.health_timeout=0"]), 0, ["rollout.health_timeout"]),
    ("reward-timeout-negative", lambda t: (EXAMPLE, ["reward.timeout=-3"]), 0, ["reward.timeout"]),
    ("weights-timeout-negative", lambda t: (EXAMPLE, ["weights.timeout_s=-1"]), 0, ["weights.timeout_s"]),
    ("ray-placement-timeout-negative", lambda t: (EXAMPLE, ["ray.placement_timeout=-1"]), 0,
     ["ray.placement_timeout"]),
    ("temperature-inf", lambda t: (EXAMPLE, ["rollout.temperature=inf"]), 0, ["rollout.temperature", "finite"]),
    ("temperature-nan", lambda t: (EXAMPLE, ["rollout.temperature=.nan"]), 0, ["rollout.temperature", "finite"]),
    ("temperature-nan-in-file", lambda t: (_config_file(t, b"rollout:\n  temperature: NaN\n"), []), 0,
     ["rollout.temperature", "finite"]),
    ("lr-inf", lambda t: (EXAMPLE, ["train.optim.lr=.inf"]), 0, ["train.optim.lr", "finite"]),
    ("temperature-in-the-trainer", lambda t: (EXAMPLE, ["train.ppo.loss.temperature=0.7"]), 0,
     ["train.ppo.loss.temperature", "rollout.temperature"]),
    ("reward-misspelled", lambda t: (EXAMPLE, ["reward.name=maht"]), 0, ["reward.name", "maht"]),
    ("reward-module-missing", lambda t: (EXAMPLE, ["reward.name=no_such_pkg.rewards:score"]), 0,
     ["reward.name", "no_such_pkg.rewards"]),
    ("reward-function-missing", lambda t: (EXAMPLE, ["reward.name=areal_fast.data.tiny_task:rewrd"]), 0,
     ["reward.name", "rewrd"]),
    ("eval-reward-misspelled", lambda t: (EXAMPLE, ["eval.reward=areal_fast.data.tiny_task:exact"]), 0,
     ["eval.reward", "exact"]),
    ("launcher-unknown", lambda t: (EXAMPLE, ["launcher=pbs"]), 0, ["launcher", "pbs"]),
    ("server-vllm-without-its-api", lambda t: (EXAMPLE, ["rollout.server=vllm"]), 0, ["rollout.server", "vllm"]),
    ("server-url-without-scheme", lambda t: (EXAMPLE, ["rollout.servers=['127.0.0.1:30000']"]), 0,
     ["rollout.servers[0]"]),
    ("attn-impl-unknown", lambda t: (EXAMPLE, ["train.attn_impl=flash"]), 0, ["train.attn_impl"]),
    ("param-dtype-unknown", lambda t: (EXAMPLE, ["train.param_dtype=bf16"]), 0, ["train.param_dtype"]),
    ("group-size-zero", lambda t: (EXAMPLE, ["rollout.group_size=0"]), 0, ["rollout.group_size"]),
    ("keep-last-zero", lambda t: (EXAMPLE, ["checkpoint.keep_last=0"]), 0, ["checkpoint.keep_last"]),
]


@pytest.mark.parametrize("build, gpus, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_culprit(tmp_path, build, gpus, needles):
    path, overrides = build(tmp_path)
    with pytest.raises(ConfigError) as e:
        cfg = load_config(path, overrides)
        check_machine(cfg, gpus=gpus)
    msg = str(e.value)
    missing = [n for n in needles if n not in msg]
    assert not missing, f"{missing} not in: {msg}"


def test_the_same_inputs_pass_when_they_are_right(tmp_path):
    """The checks above are not refusing everything: the fixed versions of the inputs load."""
    rows = b'{"prompt": "1+1", "answer": "2", "fn_name": "f"}\n'
    cfg = load_config(EXAMPLE, _data_file(tmp_path, "d.jsonl.gz", gzip.compress(rows)) + [
        "rollout.top_k=-1", "eval.max_new_tokens=4", "train.max_tokens_per_mb=64", "rollout.temperature=0.5",
        "reward.name=math", "eval.reward=null", "train.gpus=['1']", "train.device=cuda"])
    check_machine(cfg, gpus=2)
    assert cfg.train.sampling_temperature == 0.5 and cfg.train.loss.temperature == 0.5


def test_the_cli_exits_2_naming_the_culprit_before_starting_anything(tmp_path, capsys):
    missing = tmp_path / "no-model"
    with pytest.raises(SystemExit) as e:
        main(["train", str(EXAMPLE), "--no-progress", "model.warm_start.enabled=false", f"model.path={missing}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "no-model" in err
    assert not (tmp_path / "runs").exists()
