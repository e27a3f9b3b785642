"""The command line: help for every flag, bad flags refused, --pool-size, serve with
metrics and logs, stats --watch, a demo whose output carries no third-party warnings, and
short stress runs over the tiers and a real Redis store that must report zeros."""

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

import shmkv
from shmkv.tools import cli


def _subcommands():
    return cli.build_parser().subcommands


def test_every_flag_of_every_subcommand_has_help_with_its_default():
    parsers = _subcommands()
    assert {"serve", "stats", "demo", "stress", "bench"} <= set(parsers)
    for name, parser in parsers.items():
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[-1]
            assert action.help, f"shmkv {name} {flag} has no help text"
            if action.default not in (None, False, argparse.SUPPRESS):
                shown = parser._get_formatter()._get_help_string(action)
                assert "default" in shown.lower(), f"shmkv {name} {flag}: no default in help"
        assert "(default:" in text or name == "bench", name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--pool-size", "8X"], "is not a size"),
        (["serve", "--pool-size", "8G", "--num-blocks", "4"], "not allowed with"),
        (["serve", "--metrics-port", "70000"], "port must lie in"),
        (["serve", "--metrics-port", "http"], "is not an integer"),
        (["serve", "--log-level", "loud"], "is not one of"),
        (["serve", "--dtype", "float4"], "unsupported dtype"),
        (["serve", "--num-blocks", "0"], "must be at least 1"),
        (["serve", "--pool-size", "1K"], "holds no block"),
        (["stats", "--watch", "0"], "must be greater than 0"),
        (["stats", "--count", "-1"], "must be 0 or more"),
        (["--log-level", "verbose", "stats"], "is not one of"),
        (["serve", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_pool_size_is_an_alternative_to_num_blocks():
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--pool-size", "8M", "--dtype", "fp8"])
    cfg = cli._config(args)
    block = 4 * 2 * 16 * 8 * 64 * 1  # layers, K/V, tokens, heads, dim, bytes
    assert cfg.dtype == "float8_e4m3fn" and cfg.num_blocks == (8 << 20) // block
    assert cli._config(parser.parse_args(["serve"])).num_blocks == 1024
    assert cli._config(parser.parse_args(["serve", "--num-blocks", "7"])).num_blocks == 7
    assert parser.parse_args(["serve", "--pool-size", "1.5GiB"]).pool_size == 3 << 29
    assert parser.parse_args(["--log-level", "DEBUG", "serve"]).log_level == "debug"
    assert parser.parse_args(["serve", "--log-level", "error"]).log_level == "error"


def _line_reader(stream) -> "queue.Queue":
    """Lines of ``stream`` as they come, from a daemon thread ("" at EOF)."""
    lines = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_serve_serves_metrics_and_logs_connections(tmp_path):
    address = str(tmp_path / "serve.sock")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmkv",
            "serve",
            "--address",
            address,
            "--num-blocks",
            "16",
            "--num-layers",
            "1",
            "--head-dim",
            "8",
            "--metrics-port",
            "0",
            "--dtype",
            "int8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines, errors, url = _line_reader(proc.stdout), _line_reader(proc.stderr), None
        while url is None:
            line = lines.get(timeout=60)
            assert line, "serve exited before it served"
            if "metrics:" in line:
                url = line.split("metrics:", 1)[1].strip()
        with shmkv.connect(address, timeout=10) as client:
            client.allocate(5).close()
            assert client.config.dtype == "int8"
        deadline = time.monotonic() + 10
        while True:  # until the loop has seen the client close (nothing answers a close)
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
            if "shmkv_connections_open 0.0" in text or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert 'shmkv_ops_total{op="allocate_many"} 1.0' in text
        assert "shmkv_pool_bytes 32768.0" in text
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        out = "".join(iter(lambda: lines.get(timeout=30), ""))
        err = "".join(iter(lambda: errors.get(timeout=30), ""))
        assert code == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert "stopped" in out
    assert "INFO shmkv.coordinator.server: connection 1 from pid" in err  # --log-level info
    assert "dropped: closed by the client" in err
    assert not os.path.exists(address)


def test_stats_watch_shows_a_live_view(coord, client, capsys):
    client.allocate(6)
    args = cli.build_parser().parse_args(
        ["stats", "--address", coord.address, "--watch", "0.05", "--count", "3"]
    )
    assert cli.cmd_stats(args) == 0
    out = capsys.readouterr().out
    assert out.count("shmkv coordinator") == 3
    assert "referenced of 64" in out and "requests" in out
    args = cli.build_parser().parse_args(
        ["stats", "--address", coord.address, "--watch", "--count", "2", "--json"]
    )
    assert args.watch == 1.0
    args.watch = 0.05
    assert cli.cmd_stats(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("{") for line in lines)


def test_demo_output_carries_no_third_party_warnings():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmkv",
            "demo",
            "--prompts",
            "3",
            "--workers",
            "1",
            "--decode-steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr  # no warnings, no progress bar (a pipe)
    assert "warn" not in out.stdout.lower() and "numpy" not in out.stdout.lower()
    assert "nothing left in /dev/shm" in out.stdout


def _stress(tmp_path, *flags) -> dict:
    """Run a short ``shmkv stress`` with ``flags``; its JSON report (it must pass)."""
    report = tmp_path / "stress.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmkv",
            "stress",
            "--workers",
            "2",
            "--num-blocks",
            "48",
            "--block-size",
            "4",
            "--quiet",
            "--json",
            str(report),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(report.read_text())
    assert result["passed"] and result["corrupted_reads"] == 0, out.stdout
    assert result["shm_entries_left"] == [] and not result["unexpected_errors"], out.stdout
    assert result["values_verified"] > 0
    return result


def test_stress_with_tiers_promotes_demotes_and_reports_zeros(tmp_path):
    result = _stress(tmp_path, "--ops", "300", "--tiers", "--tier-dir", str(tmp_path / "tier"))
    assert result["blocks_leaked"] == 0 and result["sequences_left"] == 0
    tiers = {t["tier"]: t for t in result["tiers"]}
    assert set(tiers) == {"host", "disk"}
    assert tiers["host"]["demotions"] > 0 and tiers["disk"]["demotions"] > 0
    # the read-back at the end evicts the pool first: what it hits is promoted, and every
    # byte is as the workers wrote it
    assert tiers["host"]["promotions"] + tiers["disk"]["promotions"] > 0
    check = result["prefix_checks"]["tiers, the pool evicted"]
    assert check["prefixes"] == 24 and check["hit_tokens"] > 0 and check["corrupted"] == 0
    assert os.listdir(tmp_path / "tier" / "blocks")  # --tier-dir is kept


def test_stress_with_a_killed_coordinator_restarts_on_its_tiers(tmp_path):
    # (by time: with --ops a worker may finish its share before the kill)
    result = _stress(tmp_path, "--duration", "4", "--tiers", "--kill-coordinator")
    kill = result["coordinator_kill"]
    assert kill["restart"] == "ok" and not kill["workers_missing"]
    check = result["prefix_checks"]["restarted coordinator's tiers"]
    assert check["hit_tokens"] > 0 and check["corrupted"] == 0  # from the disk


def test_stress_with_a_redis_store_reads_it_back_from_a_second_coordinator(tmp_path):
    test_remote = pytest.importorskip("test_remote")
    if test_remote.SERVER is None:
        pytest.skip("no redis-server on PATH: ./scripts/setup.sh test installs it")
    server = test_remote.RedisServer(test_remote._free_port(), str(tmp_path)).start()
    try:
        result = _stress(tmp_path, "--ops", "300", "--tiers", "--redis", server.url)
    finally:
        server.kill()
    assert result["blocks_leaked"] == 0
    tiers = {t["tier"]: t for t in result["tiers"]}
    assert set(tiers) == {"host", "disk", "redis"} and tiers["redis"]["writes"] > 0
    assert tiers["redis"]["errors"] == 0 and tiers["redis"]["corrupt"] == 0
    check = result["prefix_checks"]["store, read by a second coordinator"]
    assert check["hit_tokens"] > 0 and check["corrupted"] == 0
    assert check["store"]["hits"] > 0 and check["store"]["corrupt"] == 0


def test_serve_no_populate_and_hugepages_flags(tmp_path):
    """--no-populate leaves the pool unpopulated; --hugepages without free huge pages says
    so plainly and serves from /dev/shm; --loop-slice-us is the loop thread's slice."""
    from test_control_plane import _slices_kept

    address = str(tmp_path / "serve.sock")
    argv = [sys.executable, "-m", "shmkv", "serve", "--address", address, "--num-blocks", "16"]
    proc = subprocess.Popen(
        argv + ["--no-populate", "--hugepages", "--loop-slice-us", "2500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines, out = _line_reader(proc.stdout), []
        while not out or "pool:" not in out[-1]:
            out.append(lines.get(timeout=60))
            assert out[-1], "serve exited before it served"
        with shmkv.connect(address, timeout=10) as client:
            stats = client.stats()
        memory = stats["pool_memory"]
        assert memory["populate"]["state"] == "off"
        assert stats["loop_slice_us"] == (2500.0 if _slices_kept() else None)
        if not memory["hugepages"]:
            line = lines.get(timeout=10)
            assert line.startswith("  hugepages: not used,") and "huge pages" in line, line
            assert memory["hugepages_fallback"] in line
        else:
            assert "of huge pages" in out[-1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_serve_refuses_a_loop_slice_outside_the_kernels_bounds(tmp_path):
    argv = [sys.executable, "-m", "shmkv", "serve", "--address", str(tmp_path / "s.sock")]
    proc = subprocess.run(
        argv + ["--loop-slice-us", "50"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "must be 0 or lie in [100, 100000]" in proc.stderr
    assert not (tmp_path / "s.sock").exists()


def test_stress_start_does_not_wait_for_a_worker_that_already_finished():
    # A worker can do all its operations and exit before a slower one is up. Its slot is
    # closed then (no longer ready) but finished: waiting for it to be ready again hung
    # the run until the start timeout.
    from shmkv.tools.stress import StressRun

    args = cli.build_parser().parse_args(["stress", "--workers", "2", "--ops", "4"])
    run = StressRun(args)
    done, up = run.slots
    done.finished = True  # reported "done", exited, and its slot was closed
    up.ready = True
    run._wait_ready(timeout=1.0)  # returns: raised "workers not ready within 1.0 s" before
