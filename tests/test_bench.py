"""``shmkv bench``: every suite is registered and reachable with ``--only NAME``, and the
shared core's helpers (ratios, spread, percentiles, records, tables) do what they say.

No benchmark runs here (the machine is shared): ``--dry-run`` resolves each suite and
its arguments without measuring anything.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from shmkv import bench
from shmkv.bench import _scripts, core
from shmkv.bench.sections import SECTIONS
from shmkv.tools.cli import main

EXPECTED = {"data", "attach", "control", "handoff", "scaling", "memory", "batch", "prefix",
            "attention", "native", "transformers", "tiers", "remote", "metrics", "vllm"}
OTHERS = sorted(EXPECTED - set(SECTIONS))


def test_every_suite_is_registered():
    assert set(bench.SUITES) == EXPECTED
    assert set(SECTIONS) <= EXPECTED


def test_list_names_every_suite(capsys):
    assert main(["bench", "--list"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert listed == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_only_name_quick_resolves(name, capsys):
    """``shmkv bench --only NAME --quick`` reaches the suite's module (its ``main`` and
    ``cli_args``); nothing is measured (``--dry-run``)."""
    assert main(["bench", "--only", name, "--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    if name in SECTIONS:
        assert out[0] == f"shmkv bench: sections {name}"
        return
    module = bench.suite_module(name)
    assert callable(module.main)
    assert out[0].startswith(f"shmkv bench: {name}: python -m {module.__name__}")
    argv = module.cli_args(True, "benchmarks")
    if "--out" in argv:   # a quick run never replaces the committed result
        assert argv[argv.index("--out") + 1].endswith("-quick")


def test_sections_run_together_in_their_order(capsys):
    assert main(["bench", "--only", "control", "data", "tiers", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "shmkv bench: sections data control",
        "shmkv bench: tiers: python -m shmkv.bench.tiers"]
    assert main(["bench", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"shmkv bench: sections {' '.join(SECTIONS)}"]


def test_suite_options_after_double_dash(capsys):
    assert main(["bench", "--only", "tiers", "--dry-run", "--", "--only", "ping",
                 "--spin-us", "150"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "shmkv bench: tiers: python -m shmkv.bench.tiers --only ping --spin-us 150"]


@pytest.mark.parametrize("only", [["tiers", "data"], ["tiers", "remote"], ["data"]])
def test_suite_options_need_one_suite_of_its_own(only, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--only", *only, "--dry-run", "--", "--quick"])
    assert exc.value.code == 2
    assert "options after -- go to one suite run on its own" in capsys.readouterr().err


def test_unknown_suite_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--only", "nosuch", "--dry-run"])
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_name_and_out_reach_the_suite(capsys, tmp_path):
    out = str(tmp_path / "b")
    assert main(["bench", "--only", "native", "--name", "mine", "--out", out,
                 "--dry-run"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(f"--out {os.path.join(out, 'results', 'mine')}")


def test_scripts_still_in_scripts_exist():
    for name in ("vllm",):
        assert os.path.exists(_scripts.script_path(bench.suite_module(name).SCRIPT)), name


def test_run_script_passes_argv_and_exit_status(tmp_path, monkeypatch):
    script = tmp_path / "bench_probe_argv.py"
    script.write_text(
        "import json, sys\n"
        "def main():\n"
        "    open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))\n"
        "    if '--fail' in sys.argv:\n"
        "        sys.exit(3)\n")
    monkeypatch.setattr(_scripts, "SCRIPTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    record = tmp_path / "argv.json"
    before = list(sys.argv)
    try:
        assert _scripts.run_script("bench_probe_argv", [str(record), "--x", "1"]) == 0
        assert json.loads(record.read_text()) == ["--x", "1"]
        assert _scripts.run_script("bench_probe_argv", [str(record), "--fail"]) == 3
        assert sys.argv == before
        with pytest.raises(_scripts.ScriptMissing, match="not there"):
            _scripts.run_script("bench_probe_missing", [])
    finally:
        sys.modules.pop("bench_probe_argv", None)


# -- the shared core -------------------------------------------------------------------------

def test_paired_ratio_is_the_median_of_the_rounds_ratios():
    # Per-round ratios 1/3, 2, 1.5: their median is 1.5; the ratio of medians would be 1.
    assert core.paired_ratio([1.0, 2.0, 3.0], [3.0, 1.0, 2.0]) == 1.5
    assert core.paired_ratio([4.0], [2.0]) == 2.0
    with pytest.raises(ValueError, match="equally long"):
        core.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        core.paired_ratio([], [])


def test_spread():
    assert core.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0,
                                                  "n": 4}
    with pytest.raises(ValueError):
        core.spread([])


def test_percentiles():
    values = list(range(100, 0, -1))          # 100 .. 1, unsorted on purpose
    assert core.p99(values) == 100            # index int(0.99 * 100) = 99 of the sorted
    assert core.p99(list(range(10))) == 9     # under 100 values: the largest
    assert core.percentile(values, 50) == 50  # nearest rank
    assert core.percentile(values, 99) == 99
    assert core.median([5, 1, 3]) == 3


def test_interleaved_times_every_function_in_every_round():
    calls = {"a": 0, "b": 0}

    def count(name):
        calls[name] += 1

    times = core.interleaved({"a": lambda: count("a"), "b": lambda: count("b")}, repeats=4,
                             warmup=2)
    assert calls == {"a": 6, "b": 6}
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4}
    assert all(t >= 0 for v in times.values() for t in v)


def test_write_results(tmp_path):
    base = str(tmp_path / "results" / "suite")
    paths = core.write_results(base, {"x": 1, "b": [1.5]}, "| a |\n\n\n")
    assert paths == [base + ".json", base + ".md"]
    assert json.loads(open(base + ".json").read()) == {"x": 1, "b": [1.5]}
    assert open(base + ".md").read() == "| a |\n"
    only_json = str(tmp_path / "other")
    assert core.write_results(only_json, {"z": 2}, None, indent=2, sort_keys=True) == [
        only_json + ".json"]
    assert not os.path.exists(only_json + ".md")
    assert open(only_json + ".json").read() == '{\n  "z": 2\n}'


def test_markdown_table_escapes_pipes():
    assert core.markdown_table([["a", "b"], ["x|y", 2]]) == "| a | b |\n|---|---|\n| x\\|y | 2 |"


def test_format_table_and_targets():
    figures = [core.Figure("data", "write_all", 9.5, "GB/s", 10.0, "copy", 0.95, ">= 0.7", True),
               core.Figure("control", "rate", 600000.0, "blocks/s", target=">= 500000",
                           met=True, target_of="value"),
               core.Figure("control", "p50", 43.0, "us", 23.0, "echo", 1.87, "<= 1.5", False)]
    rows = core.table_rows(figures)
    assert rows[0] == ["section", "figure", "value", "baseline", "ratio", "target", "met?"]
    assert rows[1] == ["data", "write_all", "9.50 GB/s", "10.00 GB/s (copy)", "0.95", ">= 0.7",
                       "yes"]
    assert rows[2][5] == ">= 500,000 blocks/s"
    assert rows[3][6] == "NO"
    text = core.format_table(figures).splitlines()
    assert len(text) == 5 and set(text[1]) <= {"-", " "}
    assert core._check(0.95, ">= 0.7") and not core._check(1.87, "<= 1.5")


def test_result_paths_follow_out_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(core, "OUT_DIR", str(tmp_path))
    assert core.result_base("tiers") == os.path.join(str(tmp_path), "results", "tiers")
    assert core.plot_path("x-context") == os.path.join(str(tmp_path), "plots", "x-context.png")
    assert core.result_base("tiers", "elsewhere") == os.path.join("elsewhere", "results",
                                                                  "tiers")
    assert os.path.exists(core.trace_path())   # the committed chat trace of the checkout
