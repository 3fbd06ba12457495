"""The command line: info, config, config errors (exit status 2 naming the key), datasets."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import pytest

from areal_fast import cli
from areal_fast.cli import main, parse_args
from areal_fast.config import load_config
from areal_fast.data import CharTokenizer, PromptStream, load_split, read_rows, tiny_task

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse.yaml")


def test_info_prints_backends(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "areal_fast" in info and "torch" in info


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", EXAMPLE, "train.batch_size=3"]) == 0
    assert "batch_size: 3" in capsys.readouterr().out


def test_config_does_not_print_the_derived_trainer_keys(capsys):
    assert main(["config", EXAMPLE, "rollout.temperature=0.5"]) == 0
    out = capsys.readouterr().out
    assert "temperature: 0.5" in out and out.count("temperature") == 1  # set once, shown once
    assert "sampling_temperature" not in out and "model_path" not in out


@pytest.mark.parametrize("argv", [
    ["train", EXAMPLE, "--no-progress", "train.batch_size=3", "rollout.top_k=5"],
    ["train", "--no-progress", EXAMPLE, "train.batch_size=3", "rollout.top_k=5"],
    ["train", EXAMPLE, "train.batch_size=3", "--no-progress", "rollout.top_k=5"],
    ["train", EXAMPLE, "train.batch_size=3", "rollout.top_k=5", "--no-progress"],
])
def test_flags_may_come_anywhere_among_the_overrides(argv):
    args = parse_args(argv)
    assert args.cmd == "train" and args.no_progress and args.config == EXAMPLE
    assert args.overrides == ["train.batch_size=3", "rollout.top_k=5"]


def test_eval_and_config_flags_anywhere():
    a = parse_args(["eval", EXAMPLE, "--checkpoint", "ckpt", "eval.size=3"])
    assert a.checkpoint == "ckpt" and a.overrides == ["eval.size=3"]
    a = parse_args(["config", "--check", EXAMPLE, "eval.size=3"])
    assert a.check and a.overrides == ["eval.size=3"]


def test_unknown_command_and_flag_exit_2(capsys):
    for argv in (["trian", EXAMPLE], ["train", EXAMPLE, "--no-progres"]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
    assert "--no-progres" in capsys.readouterr().err


def test_train_with_a_bad_key_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", EXAMPLE, "train.optim.lrr=1"])
    assert e.value.code == 2
    assert "train.optim.lrr" in capsys.readouterr().err


def test_tiny_task_is_long_tailed_and_verifiable():
    cfg = load_config(EXAMPLE).data.synthetic
    rows = tiny_task.generate(cfg, "train", seed=1)
    lens = sorted(len(r["answer"]) for r in rows)
    median, p99 = lens[len(lens) // 2], lens[int(0.99 * len(lens))]
    # the long tail that makes synchronous batches wait: the longest 1 % are at least 2.5x the median
    # (the example's 3 -> 8 characters) and strings reach the cap
    assert p99 >= 2.5 * median and lens[-1] == cfg.max_len, (median, p99, lens[-1])
    r = rows[0]
    assert r["prompt"][:-1][::-1] == r["answer"]
    assert tiny_task.reward(r, r["answer"]) == 1.0 and tiny_task.reward(r, r["answer"] + "a") == 0.0
    assert tiny_task.generate(cfg, "eval", 1) != tiny_task.generate(cfg, "train", 1)[: cfg.n_eval]


def test_char_tokenizer_round_trip_and_errors(tmp_path):
    tok = CharTokenizer("abc=")
    ids = tok.encode("cab=")
    assert ids[0] == tok.bos_token_id and tok.decode(ids + [tok.eos_token_id]) == "cab="
    assert tok.decode([40]) == "\ufffd"  # an id past the vocabulary is visible, never silently right
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("z")
    tok.save_pretrained(tmp_path)
    assert CharTokenizer.from_pretrained(tmp_path).chars == "abc="


def test_jsonl_dataset_fields_and_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "1+1", "answer": "2"}\n\n{"question": "2+2", "answer": "4"}\n')
    cfg = load_config(None, [f"data.train={f}", "data.prompt_key=question", "data.prompt_template=Q: {prompt}",
                             "model.path=x", "model.warm_start.enabled=false"]).data
    rows = load_split(cfg, "train", seed=0)
    assert [r.text for r in rows] == ["Q: 1+1", "Q: 2+2"] and rows[1].task == {"answer": "4"}
    assert load_split(cfg, "eval", seed=0) == []  # no held-out source configured
    stream = PromptStream(rows, seed=0)
    assert sorted(stream.at(i).index for i in range(2)) == [0, 1]  # one epoch = a permutation
    bad = load_config(None, [f"data.train={f}", "model.path=x", "model.warm_start.enabled=false"]).data
    with pytest.raises(KeyError, match="'prompt'"):
        load_split(bad, "train", seed=0)
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        read_rows(str(tmp_path / "nothing.jsonl"), cfg, "train", 0)


def test_eval_with_a_missing_checkpoint_exits_2_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", EXAMPLE, f"experiment.output_dir={tmp_path}", "--checkpoint", str(tmp_path / "step_9")])
    assert e.value.code == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_a_stop_signal_in_a_finalizer_is_sent_again_not_dropped(monkeypatch):
    """Python prints an exception raised in __del__ and drops it: CI's run went on training after
    its SIGTERM. Inside a finalizer the handler re-sends the signal instead of raising."""
    sent = threading.Event()
    got = []
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: (got.append((pid, sig)), sent.set()))
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    class Finalized:
        def __del__(self):
            cli._terminate_as_interrupt(signal.SIGTERM, sys._getframe())

    Finalized()  # collected at once: __del__ runs here
    assert sent.wait(5)
    assert got == [(cli.os.getpid(), signal.SIGTERM)] and unraisable == []
    with pytest.raises(KeyboardInterrupt, match="signal 15"):  # anywhere else it raises
        cli._terminate_as_interrupt(signal.SIGTERM, sys._getframe())


def test_servers_set_or_add_above_the_cap_is_refused_naming_the_value_and_the_cap(tmp_path, capsys):
    from areal_fast.elastic.members import Member, read_target, write_members

    MAX_SERVERS = 1024  # the documented cap (areal_fast.elastic.members.MAX_SERVERS)
    write_members(tmp_path, [Member("server0", "http://127.0.0.1:40000", 0)], target=1)
    for argv in (["servers", "set", "100000"], ["servers", "add", str(MAX_SERVERS)]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--run-dir", str(tmp_path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        wanted = "100000" if argv[1] == "set" else str(MAX_SERVERS + 1)
        assert wanted in err and f"at most {MAX_SERVERS}" in err, err
        assert read_target(tmp_path) is None  # nothing written
    assert main(["servers", "set", str(MAX_SERVERS), "--run-dir", str(tmp_path)]) == 0
    assert read_target(tmp_path).n_servers == MAX_SERVERS
    from areal_fast.elastic.members import MAX_SERVERS as documented

    assert documented == MAX_SERVERS
