"""SGLang version gates live in one place (``backends/sglang/compat.py``): a named predicate per
behaviour, used by the engine, the rollout client and the weight sync alike. vLLM's gates have
their own single home beside it (``backends/vllm/compat.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from packaging.version import Version

from areal_fast.backends.sglang import compat
from areal_fast.backends.sglang.compat import SGLangBehaviour

PKG = Path(__file__).resolve().parents[2] / "areal_fast"
COMPAT = PKG / "backends" / "sglang" / "compat.py"
GATE_HOMES = (COMPAT, PKG / "backends" / "vllm" / "compat.py")  # SGLang's, vLLM's
UNKNOWN = "0"  # Version("0"): a server that did not say its version (the most conservative answer)


def version_literals_outside_compat() -> list[str]:
    """Every ``Version("<literal>")`` in the package outside the gate homes, but the unknown-version one."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path in GATE_HOMES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Version"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value != UNKNOWN):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} Version({node.args[0].value!r})")
    return found


def test_no_version_gate_outside_compat():
    assert version_literals_outside_compat() == [], "move the gate into backends/sglang/compat.py as a predicate"


@pytest.mark.parametrize(("predicate", "since"), [
    (compat.supports_pause_mode, "0.5.6"),
    (compat.reports_weight_version_spans, "0.5.19"),
    (compat.server_info_reports_launch_version, "0.5.19"),
    (compat.needs_weight_update_sessions, "0.5.21"),
    (compat.refuses_unknown_sampling_keys_with_400, "0.5.22"),
])
def test_each_gate_opens_at_its_release(predicate, since):
    v = Version(since)
    before = Version(f"{v.major}.{v.minor}.{v.micro - 1}")
    assert predicate(v) and predicate(Version("0.6.0")) and predicate(Version(f"{since}.post1"))
    assert not predicate(before) and not predicate(Version(UNKNOWN))


def test_the_engine_behaves_as_the_predicates_say_for_every_supported_release():
    for micro in range(6, 24):
        v = Version(f"0.5.{micro}")
        b = SGLangBehaviour.of(v)
        assert b.weight_version_spans == compat.reports_weight_version_spans(v)
        assert b.server_info_weight_version_is_launch_value == compat.server_info_reports_launch_version(v)
        assert b.weight_update_sessions == compat.needs_weight_update_sessions(v)
        assert b.generate_schema_400 == compat.refuses_unknown_sampling_keys_with_400(v)


def test_the_client_and_the_weight_sync_ask_compat():
    from areal_fast.backends.sglang.client import SGLangRolloutClient, auto_pause_mode
    from areal_fast.rollout.client_pool import ServerState

    assert auto_pause_mode(Version("0.5.18")) == "abort" and auto_pause_mode(Version("0.5.19")) == "retract"
    client = SGLangRolloutClient(["http://127.0.0.1:1"])
    old, new = (ServerState("u", version=Version(v), info={"version": v}) for v in ("0.5.21", "0.5.22"))
    assert client._caller_500(old)  # before the schema: a 500 naming a TypeError blames the request
    assert not client._caller_500(new)  # from 0.5.22 such a request is a 400
    assert client._caller_500(ServerState("u"))  # facts unknown: taken as the caller's
    from areal_fast.backends.sglang.weight_sync import uses_sessions

    assert not uses_sessions("0.5.20") and uses_sessions("0.5.21") and uses_sessions("main-build")
