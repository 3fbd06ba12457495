"""Configuration: YAML + dotted overrides, errors that name the key, the exact save/load round trip,
a torch-free import, and no import cycle anywhere in the package."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_graph import import_targets  # the one reader of an import statement

from areal_fast.config import (
    RENAMED,
    AppConfig,
    ConfigError,
    RayConfig,
    from_dict,
    load_config,
    parse_override,
    save_config,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"


def test_example_loads_and_overrides_apply():
    cfg = load_config(EXAMPLE, ["train.optim.lr=2e-4", "rollout.max_staleness=0", "experiment.name=x"])
    assert cfg.train.optim.lr == pytest.approx(2e-4)
    assert cfg.rollout.max_staleness == 0
    assert cfg.experiment.out == Path("runs/x")
    assert cfg.model.warm_start.enabled


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_is_valid(example):
    cfg = load_config(example)
    assert from_dict(AppConfig, to_dict(cfg)) == cfg


def test_round_trip_through_dict():
    cfg = load_config(EXAMPLE)
    again = from_dict(AppConfig, to_dict(cfg))
    assert again == cfg and to_dict(again) == to_dict(cfg)


def test_save_then_load_gives_back_an_equal_config(tmp_path, monkeypatch):
    # values that a careless YAML round trip would change: a float without a dot, a string that
    # reads as a number, a tuple, a template with braces, a path relative to the working directory
    # that also exists next to the saved file (it must not be re-resolved)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "d.jsonl").write_text('{"prompt": "q", "answer": "b"}\n')
    cfg = load_config(EXAMPLE, [
        "train.optim.lr=1e-5", "train.optim.betas=[0.9, 0.95]", "train.gpus=['0']", "experiment.seed=7",
        "data.train=d.jsonl", "model.warm_start.enabled=false", "model.path=m", "reward.name=math",
        "data.prompt_template=Q: {prompt} {{x}}", "rollout.server_args=[--dtype, '1.0']", "eval.reward=null",
        "rollout.temperature=0.7", "ray.cpus_per_rank=0.5",
    ])
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    again = load_config(path)
    assert again == cfg
    assert again.data.train == "d.jsonl" and again.train.optim.betas == (0.9, 0.95)
    assert again.train.gpus == ["0"] and again.rollout.server_args == ["--dtype", "1.0"]
    assert not list((tmp_path / "out").glob(".*tmp*"))  # written through a temporary file and renamed


def test_save_config_names_the_path_it_cannot_write(tmp_path):
    cfg = load_config(EXAMPLE)
    with pytest.raises(OSError, match="no_such_dir"):
        save_config(cfg, tmp_path / "no_such_dir" / "config.yaml")


@pytest.mark.parametrize("override, needle", [
    ("train.optim.lrr=1", "unknown key 'train.optim.lrr'"),
    ("nope.x=1", "unknown key 'nope'"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.batch_size=1.5", "train.batch_size: expected an integer"),
    ("train.optim.lr=fast", "train.optim.lr: expected a number"),
    ("train.optim.lr=-1", "train.optim.lr"),
    ("rollout.server=vllm", "rollout.server"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.max_staleness=-1", "rollout.max_staleness"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.servers=[localhost:3000]", "rollout.servers[0]"),
    ("train.ppo.adv_estimator=ppo", "train.ppo.adv_estimator"),
    ("weights.method=nccl", "weights.method"),
    ("log.progress=maybe", "log.progress: expected true/false"),
    ("train=3", "train: expected a mapping"),
    ("rollout.max_staleness.x=1", "'rollout.max_staleness' is not a section"),
    ("ray.server_strategy=EVERYWHERE", "ray.server_strategy"),
    ("data.synthetic.alphabet=ab=", "data.synthetic.alphabet"),
    ("model.warm_start.num_key_value_heads=3", "model.warm_start.num_key_value_heads"),
])
def test_bad_keys_and_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, [override])
    assert needle in str(e.value)


def test_temperature_is_set_once_in_the_rollout_section():
    cfg = load_config(EXAMPLE, ["rollout.temperature=0.7"])  # no second key that has to agree
    assert cfg.rollout.temperature == pytest.approx(0.7)
    with pytest.raises(ConfigError, match="unknown key 'train.ppo.temperature'"):
        load_config(EXAMPLE, ["train.ppo.temperature=0.7"])


@pytest.mark.parametrize("override, key", [("rollout.top_p=0.9", "rollout.top_p"),
                                           ("rollout.top_k=20", "rollout.top_k"), ("rollout.top_k=1", "rollout.top_k")])
def test_truncated_sampling_is_refused_in_a_training_run_with_its_reason(override, key):
    """The servers draw from the top-p / top-k truncated distribution, the trainer recomputes over the
    whole softmax: a training run refuses the options, naming them and why; a command that trains
    nothing (``areal-fast eval``, greedy) still loads a config that sets them."""
    import argparse

    from areal_fast.cli import _load
    from areal_fast.config import RolloutConfig

    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, [override])
    msg = str(e.value)
    assert msg.startswith(f"{key}: ") and "refused in a training run" in msg and "whole softmax" in msg
    assert "importance weight would be biased" in msg and "docs/config.md" in msg
    field, value = key.split(".")[1], override.split("=")[1]
    with pytest.raises(ValueError, match=f"^{key}: "):  # a config built in code too
        AppConfig(rollout=RolloutConfig(**{field: type(getattr(RolloutConfig(), field))(value)}))
    assert str(getattr(load_config(EXAMPLE, [override], training=False).rollout, field)) == value
    args = argparse.Namespace(cmd="eval", config=str(EXAMPLE), overrides=[override])
    assert str(getattr(_load(args, machine=False).rollout, field)) == value
    with pytest.raises(SystemExit):  # any other command loads a training run's config
        _load(argparse.Namespace(cmd="config", config=str(EXAMPLE), overrides=[override]), machine=False)
    ok = load_config(EXAMPLE, ["rollout.top_p=1.0", "rollout.top_k=-1"])
    assert (ok.rollout.top_p, ok.rollout.top_k) == (1.0, -1)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("train.lr")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=null") == (["a"], None)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_model_path_required_without_warm_start():
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, ["model.warm_start.enabled=false"])


def test_relative_paths_resolve_against_the_yaml_dir(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "m").mkdir()
    y = tmp_path / "c.yaml"
    y.write_text("model: {path: m}\ndata: {train: data.jsonl}\n")
    cfg = load_config(y)
    assert cfg.model.path == str(tmp_path / "m") and cfg.data.train == str(tmp_path / "data.jsonl")


def test_ray_section_lives_with_the_other_sections():
    cfg = load_config(EXAMPLE, ["launcher=ray", "ray.cpus_per_rank=0.5"])
    assert isinstance(cfg.ray, RayConfig) and cfg.ray.cpus_per_rank == 0.5


# ----------------------------------------------------------------------------- imports


@pytest.mark.parametrize("load", [
    "import areal_fast.config as c, areal_fast.preflight as p; p.check_machine(c.load_config(sys.argv[1]))",
    "from areal_fast.cli import main; main(['config', sys.argv[1], '--check'])",  # what `areal-fast config` runs
])
def test_loading_and_checking_a_config_does_not_import_torch(load):
    code = (f"import sys; {load}; "
            "bad = sorted(m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


PKG = ROOT / "areal_fast"
# Files that are programs, not importable modules: importing them runs them.
PROGRAMS = {"areal_fast.reward._nsinit": "the sandbox's PID 1, run as a script inside the namespaces"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(tree: ast.Module, name: str, is_pkg: bool, known: set[str], import_time: bool = True) -> set[str]:
    """Modules of the package that ``name`` imports. ``import_time``: only while it is itself being
    imported (top-level statements and the bodies of top-level if/try/with/class), else also inside
    functions. ``if TYPE_CHECKING:`` blocks never count (they do not run)."""
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(stmts):
        for node in stmts:
            if isinstance(node, ast.Import | ast.ImportFrom):
                out.update(import_targets(node, package, known))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With | ast.ClassDef):
                visit(node.body)
            elif not import_time and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body)
            elif not import_time and isinstance(node, ast.For | ast.While | ast.AsyncFor | ast.AsyncWith):
                visit(node.body)

    visit(tree.body)
    return {m for m in out if m in known and m != name}


def _import_graph(import_time: bool = True) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", known, import_time)
            for name, path in mods.items()}


# Import circles are checked once, on every import statement, in tests/package/test_import_graph.py.
# Here: the config loader sits below the launchers and the controller, and above the components.


def test_the_import_reader_tells_import_time_from_inside_functions():
    src = "from . import x, name\nfrom .y import z\nif TYPE_CHECKING:\n    import p.q\ndef f():\n    import p.r\n"
    known = {"p", "p.x", "p.y", "p.q", "p.r", "p.s"}
    assert _imports(ast.parse(src), "p.s", False, known) == {"p", "p.x", "p.y"}
    assert _imports(ast.parse(src), "p.s", False, known, import_time=False) == {"p", "p.x", "p.y", "p.r"}
    assert _imports(ast.parse("from . import x\n"), "p.s", False, known) == {"p.x"}


def test_the_config_loader_reaches_neither_the_launcher_nor_the_controller():
    reached = _reached(_import_graph(import_time=False), "areal_fast.config")
    assert "areal_fast.configutil" in reached
    upward = sorted(m for m in reached if _package(m) in ("areal_fast.launch", "areal_fast.controller"))
    assert upward == [], "the config loader reaches the launcher or the controller"


def _package(module: str) -> str:
    """'areal_fast.data.tiny_task' -> 'areal_fast.data'; a top-level module is its own package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PKG / parts[1]).is_dir() else module


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing ``start`` may import, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_package_below_the_config_imports_the_config_back():
    # Each component owns its section (data/config.py, rollout/config.py, ...) and the loader imports
    # them; a module of those packages importing the loader back, even inside a function, would make
    # the two packages import each other (data/warm_start.py once did, for to_dict).
    graph = _import_graph(import_time=False)
    below = {_package(m) for m in _reached(graph, "areal_fast.config")} - {"areal_fast"}
    assert {"areal_fast.data", "areal_fast.rollout", "areal_fast.reward"} <= below
    back = sorted(m for m, deps in graph.items() if _package(m) in below and "areal_fast.config" in deps)
    assert back == [], "modules of a package that the config imports import the config back"


def test_every_module_of_the_package_imports():
    failed = {}
    for name in _modules():
        if name in PROGRAMS or name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - collected and reported together
            failed[name] = f"{type(e).__name__}: {e}"
    assert not failed, failed


# ----------------------------------------------------------------------------- docs


def _config_keys(inst=None, prefix: str = "") -> set[str]:
    import dataclasses

    from areal_fast.config import DERIVED

    inst = AppConfig() if inst is None else inst
    keys = set()
    for f in dataclasses.fields(inst):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if key in DERIVED:
            continue
        value = getattr(inst, f.name)
        keys |= _config_keys(value, key) if dataclasses.is_dataclass(value) else {key}
    return keys


def _documented_keys(text: str) -> set[str]:
    import re

    keys, section = set(), None
    for line in text.splitlines():
        m = re.match(r"^### `([\w.]+)`", line)
        if m or line.startswith("### top level"):
            section = m.group(1) if m else ""
            continue
        m = re.match(r"^\| `(\w+)` \|", line)
        if m and section is not None:
            keys.add(f"{section}.{m.group(1)}" if section else m.group(1))
    return keys


def test_docs_name_the_home_of_every_section():
    # each section's paragraph ends with "(`module.Class`)": the module where the class is defined
    import dataclasses
    import re

    text = (ROOT / "docs" / "config.md").read_text()
    named = dict(re.findall(r"^### `([\w.]+)`\n\n.*\(`(areal_fast\.[\w.]+)`\)$", text, flags=re.M))

    def sections(inst, prefix=""):
        for f in dataclasses.fields(inst):
            value = getattr(inst, f.name)
            if dataclasses.is_dataclass(value):
                key = f"{prefix}.{f.name}" if prefix else f.name
                yield key, type(value)
                yield from sections(value, key)

    homes = {key: f"{cls.__module__}.{cls.__qualname__}" for key, cls in sections(AppConfig())}
    assert len(homes) >= 14 and named == homes


def test_docs_list_every_key_of_the_configuration():
    documented = _documented_keys((ROOT / "docs" / "config.md").read_text())
    keys = _config_keys()
    assert len(keys) > 100
    assert sorted(keys - documented) == [], "keys missing from docs/config.md"
    assert sorted(documented - keys) == [], "docs/config.md lists keys that do not exist"


# ------------------------------------------------------------------------ values that must not reach a command line


@pytest.mark.parametrize("override, needles", [
    ("experiment.seed=18446744073709551616", ["experiment.seed", "18446744073709551616"]),  # 2**64
    ("experiment.seed=4294967296", ["experiment.seed", "4294967296"]),  # 2**32: numpy refuses it as a seed
    ("experiment.seed=-1", ["experiment.seed", "-1"]),
    ("rollout.servers=[http://127.0.0.1:99999]", ["rollout.servers[0]", "99999"]),
    ("rollout.servers=[http://127.0.0.1:abc]", ["rollout.servers[0]", "abc"]),
    ("rollout.servers=['http://127.0.0.1:8000 /x']", ["rollout.servers[0]", "spaces"]),
    ("rollout.servers=[http://127.0.0.1:0]", ["rollout.servers[0]", "1..65535"]),
    ("rollout.servers=[http://user:pw@127.0.0.1:8000]", ["rollout.servers[0]", "user:password@"]),
    ("rollout.server_args=[--config, x.yaml]", ["rollout.server_args", "--config"]),
    ("rollout.server_args=[--api-key=abc]", ["rollout.server_args", "--api-key"]),
    ("rollout.temperature=1e-300", ["rollout.temperature", "1e-300", "0.01"]),
    ("train.ppo.reward_scale=0", ["train.ppo.reward_scale", "0"]),
    ("weights.master_addr='10.0.0.1 '", ["weights.master_addr", "10.0.0.1 "]),
    ("rollout.empty_pool_timeout=0", ["rollout.empty_pool_timeout", "0"]),
    ("rollout.empty_pool_timeout=-5", ["rollout.empty_pool_timeout", "-5"]),
])
def test_values_that_would_fail_later_are_refused_at_load_naming_field_and_value(override, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_the_edge_values_still_load():
    cfg = load_config(None, ["experiment.seed=4294967295", "rollout.temperature=0.01", "weights.master_addr=::1",
                             "rollout.servers=['http://[::1]:8000', 'https://h:65535/v1']",
                             "rollout.server_args=[--configure-thing, x]"])
    assert cfg.experiment.seed == 2**32 - 1 and cfg.weights.master_addr == "::1"
    with pytest.raises(ConfigError, match="experiment.seed"):  # launched server 1 would get 2**32
        load_config(None, ["experiment.seed=4294967295", "rollout.n_servers=2"])


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_renamed_key_is_refused_naming_the_new_key(old):
    value = "x" if old.endswith(("api_key", "_mode")) else 1
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{old}={value}"])
    assert str(e.value).startswith(f"{old}: renamed to ") and RENAMED[old] in str(e.value)


def test_docs_list_every_renamed_key():
    import re

    text = (ROOT / "docs" / "config.md").read_text()
    table = text.split("## Renamed keys", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`[^|]+`) \|", table, flags=re.M)
    documented = {k for row in rows for k in re.findall(r"`([\w.]+)`", row)}
    assert documented == set(RENAMED)


def test_declared_rules_are_checked_on_construction_and_at_load():
    from areal_fast.configutil import allowed, option
    from areal_fast.trainer.config import OptimConfig, TrainerConfig

    with pytest.raises(ValueError, match=r"^lr: must be >= 0, got -1"):
        OptimConfig(lr=-1)
    with pytest.raises(ConfigError, match=r"^train\.optim\.lr_schedule: must be one of \('constant', 'linear', "):
        load_config(None, ["train.optim.lr_schedule=step"])
    with pytest.raises(ValueError, match=r"^peak_flops: must be a number > 0 or null, got True"):
        TrainerConfig(peak_flops=True)
    with pytest.raises(ValueError, match="eps: must be a finite number"):
        OptimConfig(eps=float("inf"))
    assert allowed(option(0, ge=0, le=1).metadata["areal_fast.rules"]) == ">= 0 and <= 1"
    assert load_config(None, ["train.optim.lr=0"]).train.optim.lr == 0


def test_flush_cache_follows_the_user_and_refuses_a_flush_in_place():
    assert load_config(None, ["rollout.pause_mode=in_place"]).weights.flush_cache is False
    assert load_config(None, []).weights.flush_cache is True
    assert load_config(None, ["weights.flush_cache=false"]).weights.flush_cache is False
    with pytest.raises(ConfigError, match="weights.flush_cache: true .* 'in_place'"):
        load_config(None, ["rollout.pause_mode=in_place", "weights.flush_cache=true"])


def test_the_api_key_is_the_runs_and_reaches_the_weight_sync():
    cfg = load_config(None, ["api_key=k3y"])
    assert cfg.api_key == "k3y" and cfg.weights.resolved_api_key == "k3y" and "k3y" not in repr(cfg)


def test_both_gpus_keys_are_lists_from_yaml_and_the_command_line():
    cfg = load_config(None, ["train.gpus=[4, 5]", "rollout.gpus=['0,1']"])
    assert cfg.train.gpus == ["4", "5"] and cfg.rollout.gpus == ["0,1"]
    with pytest.raises(ConfigError, match=r"train\.gpus: expected a list"):
        load_config(None, ["train.gpus='4,5'"])
    with pytest.raises(ConfigError, match=r"train\.gpus\[0\]: one device per trainer rank"):
        load_config(None, ["train.gpus=['4,5']"])
