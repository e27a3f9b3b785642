"""``shmkv bench``: every suite is registered and reachable with ``--only NAME``, and the
shared core's helpers (ratios, spread, percentiles, records, tables) do what they say.

No benchmark runs here (the machine is shared): ``--dry-run`` resolves each suite and
its arguments without measuring anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from shmkv import bench
from shmkv.bench import core
from shmkv.bench.sections import SECTIONS
from shmkv.tools.cli import main

EXPECTED = {
    "data",
    "attach",
    "control",
    "handoff",
    "scaling",
    "memory",
    "batch",
    "prefix",
    "attention",
    "native",
    "transformers",
    "tiers",
    "remote",
    "metrics",
    "vllm",
    "warm",
    "load",
    "serving",
}
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
    if "--out" in argv:  # a quick run never replaces the committed result
        assert argv[argv.index("--out") + 1].endswith("-quick")


def test_sections_run_together_in_their_order(capsys):
    assert main(["bench", "--only", "control", "data", "tiers", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "shmkv bench: sections data control",
        "shmkv bench: tiers: python -m shmkv.bench.tiers",
    ]
    assert main(["bench", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"shmkv bench: sections {' '.join(SECTIONS)}"]


def test_suite_options_after_double_dash(capsys):
    assert (
        main(["bench", "--only", "tiers", "--dry-run", "--", "--only", "ping", "--spin-us", "150"])
        == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        "shmkv bench: tiers: python -m shmkv.bench.tiers --only ping --spin-us 150"
    ]


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
    assert main(["bench", "--only", "native", "--name", "mine", "--out", out, "--dry-run"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(f"--out {os.path.join(out, 'results', 'mine')}")


@pytest.mark.parametrize(
    "name,committed", [("metrics", "metrics-scrape"), ("vllm", "vllm"), ("serving", "serving")]
)
def test_moved_suites_write_their_committed_names(name, committed):
    module = bench.suite_module(name)
    full, quick = module.cli_args(False, "benchmarks"), module.cli_args(True, "benchmarks")
    if "--out" in full:
        assert full[full.index("--out") + 1] == os.path.join("benchmarks", "results", committed)
    assert quick[quick.index("--out") + 1] == os.path.join(
        "benchmarks", "results", f"{committed}-quick"
    )


def test_vllm_suite_imports_without_vllm():
    """The suite module and its options need no vLLM: it is imported by the engines'
    processes only (``shmkv bench --list`` and ``--dry-run`` import every suite)."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # import vllm would raise
        "from shmkv.bench import vllm\n"
        "try:\n    vllm.main(['--help'])\nexcept SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert vllm.engine_driver().__file__.endswith('vllm_engine.py')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--report-only" in proc.stdout


def _vllm_report(base, rows, throughput, **extra) -> str:
    """The vLLM suite's report (``--report-only``) of a record with ``rows`` of TTFT and
    ``throughput`` (tokens/s, plain and shmkv), written at ``base`` (a ``results`` folder:
    the plot goes to ``plots`` beside it)."""
    from shmkv.bench import vllm

    record = {
        "date": "d",
        "vllm": "0.32.0",
        "torch": "t",
        "cpus": 2,
        "reps": 2,
        "model": {"layers": 4, "kv_heads": 2, "head_dim": 64, "kv_bytes_per_token": 4096},
        "engine_startup_s": 30.0,
        "ttft": rows,
        "throughput_tokens_per_s": throughput,
        **extra,
    }
    base.parent.mkdir(exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(record))
    assert vllm.main(["--report-only", "--out", str(base)]) == 0
    return base.with_suffix(".md").read_text()


def test_vllm_report_from_a_record(tmp_path):
    rows = [
        {
            "tokens": n,
            "recompute": r,
            "vllm_hit": 0.01,
            "shmkv_hit": 0.012,
            "example_hit": 0.05,
            "shmkv_cached": n - 128,
            "example_cached": n - 128,
        }
        for n, r in ((1024, 0.1), (4096, 0.4))
    ]
    md = _vllm_report(tmp_path / "results" / "vllm-x", rows, {"plain": 1000.0, "shmkv": 980.0})
    assert "| 4096 | 400.0 ms | 10.0 ms | 12.0 ms (3968 cached) |" in md
    assert "* (c) >= 3x faster than (a) at 4k: met (33.3x)" in md
    assert "* no-hit overhead <= 5 %: met (2.0 %)" in md
    assert "[vllm-x.json](vllm-x.json)" in md
    assert "hits where (c) took less" not in md  # (no hook times in this record)


def test_vllm_report_reads_pairs_and_hook_times(tmp_path):
    """The per-rep pairs, the connectors' hook times and the no-hit cost are read from
    the raw figures: (d)/(c) of each rep, hits where (c) took less, and hooks plus the
    coordinator's CPU as a share of the wall time."""
    c, d = [0.010, 0.020, 0.030], [0.012, 0.018, 0.036]
    hooks = {
        "descriptor": {"own": [0.001, 0.001, 0.001], "copy": [0.001, 0.003, 0.001]},
        "export": {"own": [0.002, 0.002, 0.002], "copy": [0.001, 0.001, 0.001]},
        "example": {"own": [0.005, 0.001, 0.005], "copy": [0.0, 0.0, 0.0]},
    }
    row = {
        "tokens": 4096,
        "recompute": 1.0,
        "vllm_hit": 0.02,
        "shmkv_hit": 0.02,
        "example_hit": 0.018,
        "shmkv_cached": 3968,
        "example_cached": 3968,
        "raw": {"shmkv_hit": c, "example_hit": d},
        "hooks": {t: {k: sorted(v)[1] for k, v in h.items()} for t, h in hooks.items()},
        "hooks_raw": hooks,
    }
    md = _vllm_report(
        tmp_path / "results" / "vllm",
        [row],
        {"plain": 1000.0, "shmkv": 900.0, "timed": 910.0},
        throughput_raw={"plain": [1000.0, 900.0, 1100.0], "shmkv": [990.0, 700.0, 1089.0]},
        throughput_cost={
            "hooks_s": [0.01, 0.02],
            "coordinator_cpu_s": [0.01, 0.0],
            "wall_s": [1.0, 3.0],
        },
    )
    # pairs 1.2, 0.9, 1.2: the median of the medians says 0.90x, the pairs 1.20x
    assert "4096: 0.90x; per rep, (d)/(c) of the pair: 4096: median 1.20x, 0.90-1.20" in md
    # all hooks per hit: (c) 2, 4, 2 ms; (d) 5, 1, 5 ms
    assert "| 4096 | 2.00 ms | 5.00 ms | 2.50x | 2 of 3 |" in md
    # pairs 1 %, 22.2 %, 1 %: medians 10 %, missed; the pairs' median 1 %
    assert "* no-hit overhead <= 5 %: missed (10.0 %; per pair of runs: median 1.0 %" in md
    # over all the runs' wall time: hooks 0.03 / 4 s, coordinator 0.01 / 4 s; by run 2 %
    # and 0.67 %
    assert "hooks 0.75 %, coordinator 0.25 %, together 1.00 % (by run 0.67-2.00 %)" in md
    assert "(`TimedShmkvConnector`; 910 tokens/s, median)" in md
    assert "turned one place on each rep" in md


def test_an_older_vllm_record_keeps_its_method():
    """A record from before the hits were timed in a turning order is reported with the
    order it was timed in."""
    from shmkv.bench import vllm

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(
        core.result_base("vllm-before-descriptors", os.path.join(root, "benchmarks")) + ".json"
    ) as f:
        record = json.load(f)
    md = vllm.markdown(record)
    assert "(c) and (c'') take turns going first." in md
    assert "turned one place" not in md


def test_process_cpu_s_counts_this_process_busy():
    start, wall = core.process_cpu_s(os.getpid()), time.monotonic()
    while time.monotonic() - wall < 0.3:
        sum(range(1000))
    spent = core.process_cpu_s(os.getpid()) - start
    assert 0 < spent <= time.monotonic() - wall + 0.05


def test_metrics_summary_is_paired_medians():
    from shmkv.bench import metrics

    runs = [
        {"ratio_p99": r, "control_ratio_p99": c} for r, c in ((1.0, 0.9), (1.3, 1.1), (1.1, 1.0))
    ]
    s = metrics.summarise(runs)
    assert (s["median_ratio_p99"], s["min_ratio_p99"], s["max_ratio_p99"]) == (1.1, 1.0, 1.3)
    assert s["within_bound"] and s["runs_within_bound"] == 2 and s["runs"] == 3
    assert s["median_control_ratio_p99"] == 1.0


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
    assert core.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    with pytest.raises(ValueError):
        core.spread([])


def test_percentiles():
    values = list(range(100, 0, -1))  # 100 .. 1, unsorted on purpose
    assert core.p99(values) == 100  # index int(0.99 * 100) = 99 of the sorted
    assert core.p99(list(range(10))) == 9  # under 100 values: the largest
    assert core.percentile(values, 50) == 50  # nearest rank
    assert core.percentile(values, 99) == 99
    assert core.median([5, 1, 3]) == 3


def test_interleaved_times_every_function_in_every_round():
    calls = {"a": 0, "b": 0}

    def count(name):
        calls[name] += 1

    times = core.interleaved(
        {"a": lambda: count("a"), "b": lambda: count("b")}, repeats=4, warmup=2
    )
    assert calls == {"a": 6, "b": 6}
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4}
    assert all(t >= 0 for v in times.values() for t in v)


def test_write_results(tmp_path):
    base = tmp_path / "results" / "suite"
    paths = core.write_results(str(base), {"x": 1, "b": [1.5]}, "| a |\n\n\n")
    assert paths == [f"{base}.json", f"{base}.md"]
    assert json.loads(base.with_suffix(".json").read_text()) == {"x": 1, "b": [1.5]}
    assert base.with_suffix(".md").read_text() == "| a |\n"
    only_json = tmp_path / "other"
    assert core.write_results(str(only_json), {"z": 2}, None, indent=2, sort_keys=True) == [
        f"{only_json}.json"
    ]
    assert not only_json.with_suffix(".md").exists()
    assert only_json.with_suffix(".json").read_text() == '{\n  "z": 2\n}'


def test_markdown_table_escapes_pipes():
    assert core.markdown_table([["a", "b"], ["x|y", 2]]) == "| a | b |\n|---|---|\n| x\\|y | 2 |"


def test_format_table_and_targets():
    figures = [
        core.Figure("data", "write_all", 9.5, "GB/s", 10.0, "copy", 0.95, ">= 0.7", True),
        core.Figure(
            "control", "rate", 600000.0, "blocks/s", target=">= 500000", met=True, target_of="value"
        ),
        core.Figure("control", "p50", 43.0, "us", 23.0, "echo", 1.87, "<= 1.5", False),
    ]
    rows = core.table_rows(figures)
    assert rows[0] == ["section", "figure", "value", "baseline", "ratio", "target", "met?"]
    assert rows[1] == [
        "data",
        "write_all",
        "9.50 GB/s",
        "10.00 GB/s (copy)",
        "0.95",
        ">= 0.7",
        "yes",
    ]
    assert rows[2][5] == ">= 500,000 blocks/s"
    assert rows[3][6] == "NO"
    text = core.format_table(figures).splitlines()
    assert len(text) == 5 and set(text[1]) <= {"-", " "}
    assert core._check(0.95, ">= 0.7") and not core._check(1.87, "<= 1.5")


def test_result_paths_follow_out_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(core, "OUT_DIR", str(tmp_path))
    assert core.result_base("tiers") == os.path.join(str(tmp_path), "results", "tiers")
    assert core.plot_path("x-context") == os.path.join(str(tmp_path), "plots", "x-context.png")
    assert core.result_base("tiers", "elsewhere") == os.path.join("elsewhere", "results", "tiers")
    assert os.path.exists(core.trace_path())  # the committed chat trace of the checkout


def test_warm_suite_runs_its_four_states_on_a_small_pool(tmp_path):
    """The warm suite end to end, on a pool of a few MiB (its figures are not checked:
    no timing here): the record has every state of every run and the target's verdict."""
    import json

    from shmkv.bench import warm

    base = str(tmp_path / "warm")
    argv = ["--runs", "1", "--pool-gib", "0.03", "--seqs", "2", "--steps", "3", "--groups", "2"]
    argv += ["--out", base]
    assert warm.main(argv) == 0
    with open(base + ".json") as f:
        record = json.load(f)
    (run,) = record["runs"]
    assert set(warm.STATES) <= set(run) and all(run[s] > 0 for s in warm.STATES)
    assert record["ratio_to_warm"]["warm"] == 1.0
    assert isinstance(record["met"], bool) and run["hugepages"] is False
    with open(base + ".md") as f:
        assert "| prefaulted |" in f.read()


def test_load_suite_runs_on_a_small_pool(tmp_path):
    """The load suite end to end with one client, one rate and a short ping figure (its
    figures are not checked: timing belongs to the benchmark)."""
    import json

    from shmkv.bench import load

    base = str(tmp_path / "load")
    argv = ["--clients", "1", "--rates", "64", "--phase-s", "0.5", "--pool-blocks", "48"]
    argv += ["--ping-cycles", "1", "--out", base, "--plot", str(tmp_path / "load.png")]
    assert load.main(argv) == 0
    with open(base + ".json") as f:
        record = json.load(f)
    (point,) = record["points"]
    assert point["clients"] == 1 and point["achieved_ops_s"] > 0
    assert sum(op["n"] for op in point["ops"].values()) > 0
    assert record["ping"]["p99_ratio"] > 0


# -- the serving suite's pure parts (no server starts here) -----------------------------------


def test_serving_suite_imports_without_vllm():
    """``shmkv.bench.serving`` and its options need no vLLM (the client and the servers
    import it in their own processes)."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from shmkv.bench import serving\n"
        "try:\n    serving.main(['--help'])\nexcept SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for option in ("--report-only", "--rates", "--rounds", "--datasets", "--trace", "--quick"):
        assert option in proc.stdout


def test_serving_tokenizer_gives_back_the_ids_it_decoded(tmp_path):
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    from shmkv.bench import serving

    serving.save_tokenizer(str(tmp_path), 64)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ids = [5, 0, 63, 1, 2, 17, 17]
    text = tok.decode(ids)
    assert text == serving.words(ids) == "w5 <unk> w63 <s> </s> w17 w17"
    assert tok(text, add_special_tokens=True).input_ids == ids
    assert tok.vocab_size == 64 and tok.eos_token_id == 2


def test_serving_chat_dataset_grows_each_session_from_the_shared_system_prompt():
    from shmkv.bench import serving

    header = {"system": [100, 101, 102, 103]}
    turns = [
        {"session": 0, "user": [1, 2], "reply": [3]},
        {"session": 1, "user": [4], "reply": [5, 6]},
        {"session": 2, "user": [7], "reply": [8]},  # beyond the sessions kept
        {"session": 0, "user": [9], "reply": [10]},
    ]
    lines = serving.chat_dataset(header, turns, sessions=2, vocab=50, seed=1, out=8)
    assert [x["session"] for x in lines] == [0, 1, 0]
    prompts = [x["prompt"].split() for x in lines]
    assert [len(p) for p in prompts] == [6, 5, 6 + 1 + 1]
    assert prompts[0][:4] == prompts[1][:4] == prompts[2][:4]  # one system prompt
    assert prompts[2][:6] == prompts[0]  # the session's history, then its new turn
    assert all(x["output_tokens"] == 8 for x in lines)
    ids = {int(w[1:]) for p in prompts for w in p}
    assert ids <= set(range(serving.FIRST_WORD, 50))
    again = serving.chat_dataset(header, turns, sessions=2, vocab=50, seed=1, out=8)
    other = serving.chat_dataset(header, turns, sessions=2, vocab=50, seed=2, out=8)
    assert again == lines and other != lines


def test_serving_zipf_dataset_makes_one_prefix_most_requests():
    from shmkv.bench import serving

    lines = serving.zipf_dataset(400, 8, 20, 5, 2.0, vocab=512, seed=3, out=4)
    counts = [sum(x["prefix"] == k for x in lines) for k in range(8)]
    assert counts[0] > 0.55 * len(lines) and counts[0] == max(counts)
    prompts = [x["prompt"].split() for x in lines]
    assert all(len(p) == 25 for p in prompts)
    firsts = [p[:20] for p, x in zip(prompts, lines) if x["prefix"] == 0]
    assert all(f == firsts[0] for f in firsts)
    assert len({" ".join(p[20:]) for p in prompts}) == len(lines)  # fresh suffixes


def test_serving_dataset_args_write_a_custom_file_per_run(tmp_path):
    from shmkv.bench import serving

    shape = serving.sizes(True)
    argv = serving.dataset_args("zipf", shape["zipf"], 7, str(tmp_path), 512)
    path = argv[argv.index("--dataset-path") + 1]
    with open(path) as f:
        assert len(f.readlines()) == int(argv[argv.index("--num-prompts") + 1])
    assert argv[argv.index("--dataset-name") + 1] == "custom"
    assert "--disable-shuffle" in argv and argv[argv.index("--seed") + 1] == "7"
    header = {"system": [1, 2, 3]}
    turns = [{"session": 0, "user": [4], "reply": [5]}, {"session": 1, "user": [6], "reply": []}]
    argv = serving.dataset_args(
        "chat", {"sessions": 1, "out": 4}, 8, str(tmp_path), 64, (header, turns)
    )
    assert argv[argv.index("--num-prompts") + 1] == "1"
    argv = serving.dataset_args("prefix", shape["prefix"], 9, str(tmp_path), 512)
    assert argv[argv.index("--dataset-name") + 1] == "prefix_repetition"
    with pytest.raises(ValueError):
        serving.dataset_args("nosuch", {}, 1, str(tmp_path), 512)


def test_serving_metrics_deltas():
    from shmkv.bench import serving

    text = (
        "# HELP x\n"
        'vllm:request_success_total{engine="0",finished_reason="length"} 5.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop"} 1.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 300.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 128.0\n'
        'shmkv_client_prefix_hit_tokens_total{client="replica-1"} 256\n'
    )
    after = serving.parse_metrics(text)
    assert serving.metric(after, "vllm:request_success_total") == 6.0
    assert serving.metric(after, "shmkv_client_prefix_hit_tokens_total", client="replica-1") == 256
    assert serving.metric(after, "shmkv_client_prefix_hit_tokens_total", client="replica-2") == 0
    before = serving.parse_metrics('vllm:request_success_total{engine="0"} 2.0\n')
    delta = serving.replica_delta(before, after)
    assert {k: delta[k] for k in ("requests", *serving.SOURCES)} == {
        "requests": 4.0,
        "local_compute": 300.0,
        "local_cache_hit": 128.0,
        "external_kv_transfer": 0.0,
    }
    steps = serving.parse_metrics(
        'vllm:iteration_tokens_total_bucket{engine="0",le="16.0"} 6.0\n'
        'vllm:iteration_tokens_total_bucket{engine="0",le="32.0"} 8.0\n'
        'vllm:iteration_tokens_total_count{engine="0"} 10.0\n'
        'vllm:inter_token_latency_seconds_sum{engine="0"} 0.5\n'
        'vllm:inter_token_latency_seconds_count{engine="0"} 50.0\n'
    )
    summary = serving.step_summary({"replicas": [serving.replica_delta({}, steps)] * 2})
    assert summary["steps"] == 20 and summary["prefill_step_share"] == pytest.approx(0.2)
    assert summary["server_itl_ms"] == pytest.approx(10.0)
    hooks = serving.hook_delta(
        {"build_connector_meta": [1.0, 10]},
        {
            "build_connector_meta": [1.5, 20],
            "bind_connector_metadata": [0.2, 20],
            "_copy_layer": [0.1, 4],
            "get_finished": [0.0, 20],
        },
    )
    assert hooks["build_connector_meta"] == [0.5, 10]
    counts = serving.hook_delta(
        {"count:late_lookups": [0.0, 3]},
        {"count:late_lookups": [0.0, 3], "count:computing_waits": [0.0, 5]},
    )
    assert counts == {"count:late_lookups": [0.0, 0], "count:computing_waits": [0.0, 5]}
    step = serving.per_step(hooks)
    assert step["steps"] == 10 and step["scheduler_us_per_step"] == pytest.approx(50000)
    assert step["worker_us_per_step"] == pytest.approx(10000)  # 0.2 s over 20 binds
    assert step["copies_s"] == 0.1


def test_serving_reads_a_replicas_hook_files_and_its_schedulers_counters(tmp_path):
    """Each process of a replica writes its hook totals (``TimedShmkvConnector``); the
    scheduler's file also has its counters, read as ``count:NAME`` entries."""
    from shmkv.bench.serving.deploy import read_hooks

    (tmp_path / "1.json").write_text(
        json.dumps(
            {
                "pid": 1,
                "hooks": {"build_connector_meta": [0.5, 10]},
                "counters": {"computing_waits": 4, "late_lookups": 1},
            }
        )
    )
    (tmp_path / "2.json").write_text(
        json.dumps({"pid": 2, "hooks": {"build_connector_meta": [0.25, 5]}})
    )
    (tmp_path / "3.json").write_text("{half a fi")  # (being replaced): skipped
    assert read_hooks(str(tmp_path)) == {
        "build_connector_meta": [0.75, 15],
        "count:computing_waits": [0.0, 4],
        "count:late_lookups": [0.0, 1],
    }


def _serving_run(ds, dep, rate, fraction, tput, ttft, tpot, **extra):
    replicas = [
        {"requests": 4, "local_compute": 100, "local_cache_hit": 50, "external_kv_transfer": 50}
    ] * (1 if dep == "e" else 3)
    return {
        "name": f"{ds}-{dep}-{rate}",
        "raw": f"{ds}-{dep}-{rate}.json",
        "dataset": ds,
        "deployment": dep,
        "offered_rate": rate,
        "rate_fraction": fraction,
        "duration": 2.0,
        "request_throughput": tput,
        "output_throughput": tput * 16,
        "p50_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 2,
        "p50_tpot_ms": tpot,
        "p99_tpot_ms": tpot * 2,
        "p50_itl_ms": tpot,
        "replicas": replicas,
        **extra,
    }


def test_serving_report_states_each_target(tmp_path):
    """``--report-only`` from a record: each target with its ratio (the median of the
    rounds' paired ratios), met or not, every run linked to its raw file, the decode
    probe's ratios."""
    from shmkv.bench import serving

    runs = []
    # (c) 2x (a) at saturation and a quarter of its TTFT: met; chat misses both
    for ds, speed, ttft in (("prefix", 2.0, 0.25), ("chat", 1.2, 0.5)):
        for dep, f in (("a", 1.0), ("b", 1.1), ("c", speed), ("d", speed), ("e", 0.5)):
            hooks = {}
            if dep in "cd":
                hooks = {"coordinator_cpu_share": 0.02, "shmkv_loaded": [0, 128, 256]}
                hooks["hooks_per_step"] = [serving.per_step({"build_connector_meta": [0.01, 10]})]
                hooks["hooks"] = [
                    {"count:computing_waits": [0.0, waits], "count:late_lookups": [0.0, late]}
                    for waits, late in ((2, 0), (0, 1), (1, 0))
                ]
            runs.append(_serving_run(ds, dep, "inf", None, 4.0 * f, 900 / f, 10.0, **hooks))
            ms = 400 * (ttft if dep == "c" else 1)
            runs.append(_serving_run(ds, dep, 2.0, 0.5, 2.0, ms, 10.5 if dep == "c" else 10.0))
    for dep, f in (("a", 1.0), ("b", 1.0), ("c", 1.1), ("d", 1.0), ("e", 0.5)):
        runs.append(_serving_run("zipf", dep, "inf", None, 3.0 * f, 500, 10.0))
    for dep, f in (("a", 1.0), ("b", 1.0), ("c", 0.98), ("d", 1.0), ("e", 0.5)):
        runs.append(_serving_run("random", dep, "inf", None, 3.0 * f, 500, 10.0 * f))
    probe = [
        _serving_run("probe", dep, "inf", None, 1.0, 20, tpot, rep=0)
        for dep, tpot in (("a", 8.0), ("c", 8.4))
    ]
    record = {
        "date": "d", "quick": False, "vllm": "0.32.0", "vllm_router": "0.1.17", "torch": "t",
        "cpus": 2, "cpu_model": "", "model": {"layers": 4, "kv_heads": 2, "head_dim": 64,
        "hidden": 256, "vocab": 512}, "pool_blocks": 2048, "block_size": 128,
        "shapes": serving.sizes(False), "rate_fractions": [0.5], "startup_s": 100.0,
        "total_s": 600.0, "load_start": [1.0, 1.0, 1.0], "load_end": [2.0, 2.0, 2.0],
        "other_processes": ["python (30%)"], "dev_shm_left": [], "raw_dir": "serving-x",
        "runs": runs, "probe": probe,
    }  # fmt: skip
    # two more rounds of (a) and (c) on prefix at inf: paired ratios 2.0 (round 0), 1.0,
    # 1.25: their median 1.25; the figures shown are each deployment's median
    for rnd, (ta, tc) in ((1, (4.0, 4.0)), (2, (8.0, 10.0))):
        for dep, t in (("a", ta), ("c", tc)):
            runs.append(dict(_serving_run("prefix", dep, "inf", None, t, 900, 10.0), round=rnd))
            runs[-1]["raw"] = f"prefix-{dep}-inf-{rnd}.json"
    base = tmp_path / "results" / "serving-x"
    base.parent.mkdir()
    base.with_suffix(".json").write_text(json.dumps(record))
    assert serving.main(["--report-only", "--out", str(base)]) == 0
    md = base.with_suffix(".md").read_text()
    verdicts = {t["target"]: (round(t["ratio"], 2), t["met"]) for t in serving.targets(record)}
    assert verdicts["prefix: (c) >= 1.5x (a) throughput at saturation"] == (1.25, False)
    assert verdicts["prefix: TTFT p50 (c) <= 1/3 (a) at 0.5x (a)'s saturated rate"] == (
        0.25,
        True,
    )
    assert verdicts["chat: (c) >= 1.5x (a) throughput at saturation"] == (1.2, False)
    assert verdicts["zipf: (c) > (b) throughput at saturation"] == (1.1, True)
    assert verdicts["zipf: TTFT p99 (c) < (b) at saturation"] == (1.0, False)
    assert verdicts["random (no prefix): (c) within 3 % of (a) throughput at saturation"] == (
        0.98,
        True,
    )
    assert verdicts["prefix: TPOT p50 (c) <= 1.1x (a) at 0.5x"] == (1.05, True)
    assert (
        "| prefix: (c) >= 1.5x (a) throughput at saturation | 8.00 / 4.00 req/s; by round "
        "2.00, 1.00, 1.25 | 1.25 | NOT met |" in md
    )
    assert (
        "| chat: (c) >= 1.5x (a) throughput at saturation | 4.80 / 4.00 req/s | 1.20 | NOT met |"
        in md
    )
    assert "[1](serving-x/prefix-c-inf.json) [2](serving-x/prefix-c-inf-1.json)" in md
    assert "| TPOT p50 | 8.00 ms | 8.40 ms | 1.05 |" in md
    assert "25% / 25% / 50%" in md  # cached / loaded / computed prompt tokens
    assert "(c, round 1) 0 / 128 / 256" in md  # loaded by each replica, labelled by round
    assert "(c, round 1) waited 2 / 0 / 1, late 0 / 1 / 0" in md  # the schedulers' counters
    assert "**The whole deployment shares these 2 CPUs**" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "plots" / "serving-x.png").exists()


def test_serving_ttft_dip_splits_requests_by_when_they_started():
    from shmkv.bench import serving

    starts = [0.0, 1.0, 2.0, 10.0, 11.0, 19.0, 30.0]
    ttfts = [0.1, 0.2, 0.3, 2.0, None, 1.0, 0.1]  # (None: a failed request)
    dip = serving.ttft_dip(starts, ttfts, kill=9.0, up=12.0)
    assert dip["before"] == {"requests": 3, "p50_ms": 200.0, "max_ms": 300.0}
    assert dip["during"] == {"requests": 1, "p50_ms": 2000.0, "max_ms": 2000.0}  # < up + 5 s
    assert dip["after"] == {"requests": 2, "p50_ms": 550.0, "max_ms": 1000.0}
    empty = serving.ttft_dip([], [], kill=1.0, up=2.0)
    assert empty["during"] == {"requests": 0, "p50_ms": None, "max_ms": None}


def test_serving_damage_overwrites_the_middle_of_block_files_keeping_their_size(tmp_path):
    from shmkv.bench import serving

    blocks = tmp_path / "blocks"
    (blocks / "ab").mkdir(parents=True)
    files = {}
    for i in range(5):
        path = blocks / "ab" / f"{i}.blk"
        path.write_bytes(bytes(16384))
        files[f"ab/{i}.blk"] = path
    damaged = serving.damage_block_files(str(blocks), 3)
    assert len(damaged) == 3 and set(damaged) <= set(files)
    for rel, path in files.items():
        data = path.read_bytes()
        assert len(data) == 16384
        changed = [i for i, b in enumerate(data) if b]
        if rel in damaged:  # random bytes in [6144, 10240), nothing else
            assert changed and min(changed) >= 6144 and max(changed) < 10240
        else:
            assert not changed
