"""Every measured figure the README and docs quote is the one its committed result file holds.

``FIGURES`` maps a quoted text in a document, with ``{}`` where each figure stands, to the result file
under ``bench/results/`` and the function that computes the figures from it, formatted as the text
writes them. The test finds every occurrence of the text (whitespace folded, as Markdown renders it)
and compares the figures: a document that quotes a number no result file holds, or an older one than
the newest measurement of its kind, fails with the text it should say. A new measurement (a newer row)
makes the docs fail until they say the new figure. ``docs/benchmarks.md``'s table is checked against
``bench/`` the same way: every benchmark listed, nothing listed that does not exist.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
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


def thousands(x: float) -> str:
    return f"{round(x):,}"


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
    counts = ", ".join(f"{thousands(r[k])} {k}" for k in ("passed", "skipped", "xfailed", "failed") if r.get(k))
    total = f" and {thousands(r['total_s'])} s in all with the install" if r.get("total_s") else ""
    quick = f"; the tests not marked slow took {thousands(r['not_slow_s'])} s of it" if r.get("not_slow_s") else ""
    when = f"{r['provenance']['commit']}, {r['provenance']['date'][:10]}"
    return f"{thousands(r['tests_s'])} s of tests{total} ({counts}; {when}){quick}"


@dataclass(frozen=True)
class Figure:
    doc: str
    text: str  # the quoted text, "{}" where each figure stands
    source: str  # the result file under bench/results/
    figures: Callable[[], tuple[str, ...]]
    whole: bool = False  # the one "{}" is a whole phrase, there word for word (not numbers in a pattern)


FIGURES = [
    Figure("README.md", "async vs sync on the tiny task {}x", "e2e.jsonl", e2e_speedup),
    Figure("README.md", "at the paper's scale async/sync is {}-{}x", "async_speedup_summary.jsonl",
           sim_paper_scale_range),
    Figure("README.md", "one rollout client process takes in {}M generated tokens/s from 256 simulated servers at "
           "{}% of a core", "controller_scale.jsonl", client_rate()),
    Figure("README.md", "The newest clean-clone `.ci/run` on 2 cores: {}.", "suite_time.jsonl",
           lambda: (suite_sentence(),), whole=True),
    Figure("examples/README.md", "of the means **{}x**", "e2e.jsonl", e2e_speedup),
    Figure("examples/README.md", "| trained tokens/s | {} [{}..{}] | {} [{}..{}] (", "e2e.jsonl", e2e_tokens),
    Figure("docs/scale.md", "| 1.5B, 16 nodes x 8 GPUs | 80 / 48 (62%; 96 / 32 within 4%) | **{}x** |",
           "async_speedup_summary.jsonl", sim_speedup("1.5B, 16 nodes x 8 GPUs")),
    Figure("docs/scale.md", "| 7B, 24 nodes x 8 GPUs | 112 / 80 (58%) | **{}x** (same-session pair",
           "async_speedup_summary.jsonl", sim_speedup("7B, 24 nodes x 8 GPUs")),
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
    *(Figure("docs/scale.md", f"| {n:,} | {{}} | {{}} | {{}}x |", "answer_parse.jsonl", answer_parse(n))
      for n in (100, 1000, 4000, 32000)),
]


def _fold(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _pattern(template: str) -> re.Pattern:
    parts = [re.escape(_fold(p)) for p in template.split("{}")]
    return re.compile(r"([0-9][0-9.,]*)".join(parts))


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f"{f.doc}:{f.text[:40]}")
def test_each_quoted_figure_is_its_result_files(fig):
    assert (RESULTS / fig.source).is_file(), f"{fig.doc} quotes bench/results/{fig.source}, which is not committed"
    doc = _fold((REPO / fig.doc).read_text())
    want = tuple(_fold(w) for w in fig.figures())
    expected = fig.text.format(*want)
    if fig.whole:
        assert _fold(expected) in doc, f"{fig.doc} must say, from bench/results/{fig.source}: {expected!r}"
        return
    found = [m.groups() for m in _pattern(fig.text).finditer(doc)]
    assert found, f"{fig.doc} no longer says {fig.text!r}: say {expected!r} (from bench/results/{fig.source})"
    for got in found:
        assert got == want, f"{fig.doc} says {fig.text.format(*got)!r}; bench/results/{fig.source} says {expected!r}"


def test_the_helpers_read_figures_as_the_docs_write_them():
    """The formatting the table relies on: rounding, thousands, the pattern of a quoted figure."""
    assert thousands(1569.6) == "1,570" and thousands(39) == "39"
    assert _pattern("a {}x").findall("a 1.07x and a 2,125x") == ["1.07", "2,125"]
    with pytest.raises(AssertionError, match="no row with"):
        newest("e2e.jsonl", bench="not e2e")


# ----------------------------------------------------------------------------- nothing slips in unchecked

DOCS = ["README.md", "examples/README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
EXEMPT_FILE = Path(__file__).with_name("docs_numbers_exempt.txt")
# A figure: a number followed by a unit of speed, time, size or ratio ("1.07x", "4.4M", "0.057 s", "62%").
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:x\b|×|s\b|ms\b|µs|us\b|%|tokens/s|tok/s|GB/s|MB/s"
                    r"|GB\b|MB\b|KB\b|GiB\b|MiB\b|min\b|k\b|M\b)")


def figure_lines(doc: str) -> dict[int, str]:
    """Line number -> text of each line of ``doc`` (outside fenced code) that holds a figure."""
    out, fenced = {}, False
    for i, line in enumerate((REPO / doc).read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and FIGURE.search(line):
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
            pat = r"[0-9][0-9.,]*".join(loose(_fold(p)) for p in fig.text.split("{}"))
        for m in re.finditer(pat, text):
            lines.update(range(text.count("\n", 0, m.start()) + 1, text.count("\n", 0, m.end()) + 2))
    return lines


def exemptions() -> dict[tuple[str, str], str]:
    """(doc, line text) -> reason, from ``docs_numbers_exempt.txt``: ``## reason`` then ``doc: line`` rows."""
    out, reason = {}, None
    for raw in EXEMPT_FILE.read_text().splitlines():
        if raw.startswith("## "):
            reason = raw[3:].strip()
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
    sources = "\n".join(p.read_text() for p in (REPO / "bench").glob("*.py"))
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
    """tests/_suite_time.py, as .ci/run uses it: one row with the counts, the seconds and the tiers."""
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
                        "test_x.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(out.read_text())
    counts = (row["bench"], row["selection"], row["passed"], row["skipped"], row["failed"])
    assert counts == ("suite_time", "all", 2, 1, 0)
    assert row["not_slow_passed"] == 1 and row["tests_s"] > 0 and row["total_s"] >= 5
    assert row["provenance"]["commit"] and row["exitstatus"] == 0
