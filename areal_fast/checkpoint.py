"""The run's checkpoint format, in one place: the directory layout and its names, the atomic
write, validation on read, listing, moving aside a checkpoint that cannot be read, and choosing
the newest readable one. The controller (``areal_fast.controller``) decides *when* to write and
what its state is; the trainer writes its own part (``areal_fast.trainer.checkpoint``: DCP shards
and :data:`TRAINER_STATE_FILE`) into :func:`trainer_dir`; everything else is here.

::

    <output_dir>/checkpoints/
        step_00000004/              a complete checkpoint of version 4 (8 digits: names sort by version)
            trainer/                the trainer's state (DCP shards, .metadata, trainer_state.pt)
            buffer.bin              the buffered groups, as records (``areal_fast.buffer``)
            controller.json         the controller state (:func:`check_state` says what it holds)
            COMPLETE                written last: a directory without it is not a checkpoint
        step_00000006.tmp/          being written; renamed to step_00000006 when complete
        step_00000002.corrupt/      could not be read; moved aside with a warning, never deleted

Writing (:func:`write`) is atomic: everything goes to ``step_N.tmp``, is fsynced, then COMPLETE,
then the rename; only the newest ``keep_last`` are kept. Reading (:func:`load`) checks everything
before the controller takes any of it: controller.json entry by entry, the data order
(``resume_key``: :class:`ResumeMismatch`), every buffered group, the position against what it
accounts for, the trainer's version against controller.json's; a failure is a
:class:`CorruptCheckpoint` naming the file. :func:`restore_newest` moves such a checkpoint aside
and tries the previous one; with none readable it refuses to start again at step 0 silently.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

from areal_fast import columns
from areal_fast.configutil import finite_number
from areal_fast.diskutil import write_failed

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"  # under the run's output directory
STATE_FILE = "controller.json"
BUFFER_FILE = "buffer.bin"  # the buffered groups of a checkpoint, as records (``areal_fast.buffer``)
TRAINER_DIR = "trainer"
TRAINER_STATE_FILE = "trainer_state.pt"  # in TRAINER_DIR, beside DCP's files (``areal_fast.trainer.checkpoint``)
COMPLETE_MARKER = "COMPLETE"
TMP_SUFFIX = ".tmp"
CORRUPT_SUFFIX = ".corrupt"
HANG_AFTER_CHECKPOINT_ENV = "AREAL_FAST_TEST_HANG_AFTER_CHECKPOINT"
_CKPT_NAME = re.compile(r"step_\d{8}")


class ResumeMismatch(RuntimeError):
    """The checkpoint was written by a run whose data order differs from this one."""


class CorruptCheckpoint(RuntimeError):
    """A checkpoint marked complete cannot be read; the message names its path."""


@dataclass
class Counters:
    """What the controller counts over a run; controller.json holds them (``counters``)."""

    admitted: int = 0
    finished: int = 0
    trained_groups: int = 0
    trained_tokens: int = 0
    trained_samples: int = 0  # trajectories (a workflow may return any number per episode)
    dropped_stale: int = 0
    regenerated: int = 0
    reward_status: dict = field(default_factory=dict)
    episodes_failed: int = 0
    groups_failed: int = 0  # every episode of the group failed: nothing to train on, slot freed
    tool_status: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- layout


def checkpoints_dir(output_dir: str | os.PathLike) -> Path:
    """Where the run at ``output_dir`` keeps its checkpoints."""
    return Path(output_dir) / CHECKPOINTS_DIR


def step_path(ckpt_dir: Path, version: int) -> Path:
    """The checkpoint of ``version`` in ``ckpt_dir``."""
    return Path(ckpt_dir) / f"step_{version:08d}"


def trainer_dir(path: Path) -> Path:
    """The trainer's part of the checkpoint at ``path``."""
    return Path(path) / TRAINER_DIR


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (``step_N.tmp``, ``step_N.corrupt`` and a directory
    without COMPLETE are ignored)."""
    if not ckpt_dir.is_dir():
        return []
    out = [p for p in ckpt_dir.iterdir()
           if p.is_dir() and _CKPT_NAME.fullmatch(p.name) and (p / COMPLETE_MARKER).is_file()]
    return sorted(out, key=lambda p: p.name)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    cks = list_checkpoints(ckpt_dir)
    return cks[-1] if cks else None


def corrupt_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoints moved aside as unreadable (:func:`move_aside`), by name."""
    return sorted(ckpt_dir.glob(f"step_*{CORRUPT_SUFFIX}")) if ckpt_dir.is_dir() else []


def move_aside(path: Path) -> Path:
    """Rename the unreadable checkpoint ``path`` to ``<name>.corrupt`` (replacing an older one of that
    name); returns the new path. Nothing is deleted: the user may rename it back."""
    aside = path.with_name(path.name + CORRUPT_SUFFIX)
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(path, aside)
    return aside


# ----------------------------------------------------------------------------- writing


def write(ckpt_dir: Path, state: dict, buffer, trainer, keep_last: int) -> Path:
    """Write the checkpoint of ``state`` (the controller's state dict; ``buffer`` its slots, a
    snapshot of ``buffer``, an ``areal_fast.buffer.GroupBuffer``) atomically: step_N.tmp
    (trainer + buffer.bin + controller.json + COMPLETE),
    then rename; then delete all but the newest ``keep_last``. The trainer is told the version it
    saves (``trainer.save(path, version)``). The buffered groups are streamed to buffer.bin group by
    group (a spilled one copied from the spill file as it is), so the write holds no second copy of
    the buffer; controller.json records their count and bytes. A failed write removes step_N.tmp
    and raises ``WriteFailed`` naming it."""
    version = state["version"]
    final = step_path(ckpt_dir, version)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    slots = state["buffer"]
    state = {k: v for k, v in state.items() if k != "buffer"}
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        trainer.save(trainer_dir(tmp), version)
        with open(tmp / BUFFER_FILE, "wb") as f:
            nbytes = buffer.write(slots, f)
        state["buffer_file"] = {"name": BUFFER_FILE, "groups": len(slots), "bytes": nbytes}
        write_json(tmp / STATE_FILE, state)
        fsync_tree(tmp)  # everything COMPLETE promises is on disk before the marker is
        write_json(tmp / COMPLETE_MARKER, "ok")
        fsync_dir(tmp)
    except (OSError, RuntimeError) as e:  # a full disk shows up as torch's "unexpected pos"
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(tmp, e) from e
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(ckpt_dir)
    for old in list_checkpoints(ckpt_dir)[: -keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    _failpoint_after_checkpoint(version)
    return final


def write_json(path: Path, obj) -> None:
    # one shot: the C encoder (json.dump streams through the Python one); arrays as compact columns
    text = json.dumps(obj, default=columns.json_default)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _failpoint_after_checkpoint(version: int) -> None:
    """Test hook: with ``AREAL_FAST_TEST_HANG_AFTER_CHECKPOINT=N`` the run stops making progress
    right after checkpoint N is complete, so a crash test can kill it at a point it controls (a run
    that may finish, or whose retention may delete checkpoint N, before the kill makes tests flaky)."""
    if os.environ.get(HANG_AFTER_CHECKPOINT_ENV) == str(version):
        log.warning("%s=%d: holding the run after this checkpoint (test hook)", HANG_AFTER_CHECKPOINT_ENV, version)
        threading.Event().wait()


# ----------------------------------------------------------------------------- reading


def load(path: Path, *, resume_key: dict, batch_size: int, new_buffer: Callable,
         read_groups: Callable[[Path, dict], Iterable], trainer) -> dict:
    """Read and check the checkpoint at ``path``, then load the trainer from it; returns the
    controller state, its ``buffer`` the buffered groups in a buffer from ``new_buffer`` (spilling
    past its bound as they are read, group by group), read by ``read_groups(path, state)``
    (``areal_fast.buffer.checkpoint_groups``: the record format is the buffer's).

    Raises :class:`ResumeMismatch` when the checkpoint was written with another ``resume_key``,
    :class:`CorruptCheckpoint` when it cannot be read or does not agree with itself (the trainer's
    version against controller.json's, the data position against what it accounts for), or when
    the trainer's load fails on a damaged file. Nothing of the controller is changed here."""
    st = read_state(path)
    check_resume_key(st, resume_key, path)
    # the buffered groups first: a damaged one makes the checkpoint corrupt, found before any load
    buf = new_buffer()
    try:
        buf.extend(read_groups(path, st))
        check_consistent(st, len(buf), batch_size, path)
        check = getattr(trainer, "check", None)  # optional: a trainer without it is trusted
        try:
            trainer_version = check(trainer_dir(path)) if check is not None else None
        except Exception as e:  # noqa: BLE001 - whatever the trainer's reader raised, named with the path
            raise CorruptCheckpoint(f"checkpoint {path}: trainer state unreadable: {e!r}") from e
        if trainer_version is not None and trainer_version != st["version"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {STATE_FILE} says version {st['version']}, the "
                                    f"trainer state in it version {trainer_version!r}")
        trainer.load(trainer_dir(path))  # a damaged shard raises CorruptCheckpoint (TrainerPort)
    except BaseException:
        buf.close()
        raise
    return {**st, "buffer": buf}


def restore_newest(ckpt_dir: Path, restore: Callable[[Path], None]) -> Path | None:
    """Call ``restore`` on the newest checkpoint in ``ckpt_dir`` it can restore (None when there is
    none). One that raises :class:`CorruptCheckpoint` is moved aside to ``<name>.corrupt`` with a
    warning naming it, and the previous is tried. When checkpoints exist (or were moved aside before)
    and none is readable, this raises :class:`CorruptCheckpoint`: starting again at step 0 is the
    user's decision (``experiment.resume=false``), never a silent one."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            restore(path)
            return path
        except CorruptCheckpoint as e:
            aside = move_aside(path)
            log.warning("%s; moved it to %s and falling back to the previous checkpoint", e, aside)
    corrupt = corrupt_checkpoints(ckpt_dir)
    if corrupt:
        raise CorruptCheckpoint(
            f"no readable checkpoint in {ckpt_dir}: {', '.join(p.name for p in corrupt)} could not be "
            f"read (moved aside; the reasons are in the log). Refusing to start again at step 0 silently: "
            f"restore a checkpoint by renaming it back to step_N, or start over with "
            f"experiment.resume=false (the previous run is moved aside, nothing is deleted)")
    return None


def newest_readable_state(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint whose controller.json reads and its state, without moving anything (the
    launcher's check before servers start; rank 0 moves unreadable ones aside when it restores).
    None when there is no checkpoint; :class:`CorruptCheckpoint` when there are some and none reads."""
    unreadable = []
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, read_state(path)
        except CorruptCheckpoint as e:
            unreadable.append(str(e))  # rank 0 moves it aside and falls back, with a warning
    if unreadable or corrupt_checkpoints(ckpt_dir):
        why = "; ".join(unreadable) or "only checkpoints moved aside as corrupt"
        raise CorruptCheckpoint(f"no readable checkpoint in {ckpt_dir} ({why}). Refusing to start again at step 0 "
                                f"silently: restore a checkpoint, or start over with experiment.resume=false (the "
                                f"previous run is moved aside, nothing is deleted)")
    return None


def check_resume_key(st: dict, key: dict, path: Path) -> None:
    """Refuse the checkpoint state ``st`` (at ``path``) when its data order (resume key) differs from
    ``key``; the message names every changed key with both values."""
    saved = st.get("resume_key")
    if saved is None:
        log.warning("checkpoint %s records no resume key (written by an older version); resuming "
                    "without checking that the data order is unchanged", path)
        return
    changed = sorted(k for k in set(saved) | set(key) if saved.get(k) != key.get(k))
    if changed:
        diff = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {key.get(k)!r} now" for k in changed)
        raise ResumeMismatch(
            f"cannot resume from {path}: the data order depends on {', '.join(changed)}, which changed "
            f"({diff}). Resuming would train some prompts twice and skip others. Put the old values "
            f"back, or start over with experiment.resume=false (the previous run is moved aside).")


def check_consistent(st: dict, n_buffered: int, batch_size: int, path: Path) -> None:
    """Every trained, buffered and pending group has its own position below ``position``: a
    controller.json whose position is smaller than what it accounts for (an edited or mixed-up
    file) would hand out positions again, training prompts twice."""
    accounted = st["version"] * batch_size + n_buffered + len(st["pending"])
    if st["position"] < accounted:
        raise CorruptCheckpoint(
            f"checkpoint {path}: {STATE_FILE} says position {st['position']}, but its version {st['version']} "
            f"x batch size {batch_size} + {n_buffered} buffered + {len(st['pending'])} pending groups "
            f"need {accounted} positions")


def read_state(path: Path) -> dict:
    """The controller state of the checkpoint at ``path``, every entry checked (types, ranges, no
    unknown entry: :func:`check_state`); CorruptCheckpoint names the file and the entry otherwise."""
    f = path / STATE_FILE
    try:
        st = json.loads(f.read_text())
        check_state(st)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: {f.name} unreadable: {e!r}") from e
    return st


def _is_int(v, low: int = 0) -> bool:
    return type(v) is int and v >= low


def _check_count_map(name: str, d) -> None:
    if not isinstance(d, dict) or not all(isinstance(k, str) and _is_int(v) for k, v in d.items()):
        raise ValueError(f"{name}: expected a mapping of names to counts >= 0, got {d!r:.200}")


_COUNTER_FIELDS = {f.name: f.type for f in fields(Counters)}
_STATE_ENTRIES = ("version", "position", "pending", "counters", "elapsed", "timers", "eval_history", "resume_key",
                  "buffer_file", "buffer")


def check_state(st) -> None:
    """Raise ValueError naming the entry when ``st`` (a parsed controller.json) is not a controller
    state as ``Controller.state_dict`` and :func:`write` write it: required entries present, counts
    integers >= 0 (never booleans), pending positions distinct and below ``position``, the buffer file
    named ``buffer.bin`` in the checkpoint, no unknown entry. Older checkpoints (groups in
    controller.json, fewer counters) pass."""
    if not isinstance(st, dict):
        raise ValueError(f"expected a JSON object, got {type(st).__name__}")
    unknown = sorted(set(st) - set(_STATE_ENTRIES))
    if unknown:
        raise ValueError(f"unknown entries {unknown}")
    for key in ("version", "position"):
        if not _is_int(st[key]):
            raise ValueError(f"{key}: expected an integer >= 0, got {st[key]!r:.100}")
    pending = st["pending"]
    if not isinstance(pending, list) or not all(_is_int(p) for p in pending):
        raise ValueError(f"pending: expected a list of positions >= 0, got {pending!r:.200}")
    if len(set(pending)) != len(pending) or any(p >= st["position"] for p in pending):
        raise ValueError(f"pending: positions must be distinct and below position {st['position']}, got "
                         f"{pending!r:.200}")
    counters = st["counters"]
    if not isinstance(counters, dict) or set(counters) - set(_COUNTER_FIELDS):
        raise ValueError(f"counters: expected a mapping of {sorted(_COUNTER_FIELDS)}, got {counters!r:.200}")
    for k, v in counters.items():
        if _COUNTER_FIELDS[k] == "dict":
            _check_count_map(f"counters.{k}", v)
        elif not _is_int(v):
            raise ValueError(f"counters.{k}: expected an integer >= 0, got {v!r:.100}")
    if "elapsed" in st and not (finite_number(st["elapsed"]) and st["elapsed"] >= 0):
        raise ValueError(f"elapsed: expected a number of seconds >= 0, got {st['elapsed']!r:.100}")
    timers = st.get("timers", {})
    if not isinstance(timers, dict) or not all(isinstance(k, str) and finite_number(v) for k, v in timers.items()):
        raise ValueError(f"timers: expected a mapping of names to seconds, got {timers!r:.200}")
    evals = st.get("eval_history", [])
    if not isinstance(evals, list) or not all(isinstance(e, dict) for e in evals):
        raise ValueError(f"eval_history: expected a list of objects, got {evals!r:.200}")
    if st.get("resume_key") is not None and not isinstance(st["resume_key"], dict):
        raise ValueError(f"resume_key: expected an object, got {st['resume_key']!r:.200}")
    ref = st.get("buffer_file")
    if not (isinstance(ref, dict) and set(ref) == {"name", "groups", "bytes"} and ref["name"] == BUFFER_FILE
            and _is_int(ref["groups"]) and _is_int(ref["bytes"])):
        raise ValueError(f"buffer_file: expected {{'name': {BUFFER_FILE!r}, 'groups': N, 'bytes': N}}, "
                         f"got {ref!r:.200}")
    elif "buffer" in st:
        raise ValueError("buffer: not expected beside buffer_file")
