"""Suite ``metrics``: the coordinator's ping latency while its ``/metrics`` endpoint is
scraped.

    shmkv bench --only metrics [--quick] [-- --runs 5 --cycles 24 --phase-s 0.3 --rate 10]

The coordinator runs in its own process (``Coordinator.spawn``, with its metrics server
on a free loopback port). One spawned process pings it throughout, a little apart; a
second spawned process scrapes ``/metrics`` at ``--rate`` scrapes a second during
alternate phases (idle, scraped, idle, ...) of ``--phase-s`` seconds, so both
conditions of a run meet the same background load (pings within 50 ms of a phase
change are not counted). Each of ``--runs`` runs gives the p99 of both conditions and
their ratio (paired); the summary states the median ratio and its spread (min, max).
A last run scrapes back to back (as fast as one process can), for reference.

The bound this checks (issue 29, item 7): ping p99 while scraped at 10 Hz within 1.2x
of idle. Results go to ``OUT.json`` and ``OUT.md`` (default
``benchmarks/results/metrics-scrape``; a quick run of ``shmkv bench`` writes
``metrics-scrape-quick``).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import shmkv
from shmkv.bench.core import SPAWN, p99, result_base, spread, write_results

BOUND = 1.2
NAME = "metrics-scrape"

# (ping start, its latency) in seconds, as the pinger reports them
Ping = Tuple[float, float]


def _pinger(address: str, stop: Any, queue: Any) -> None:
    """Ping until ``stop``: (start time, latency) of each ping, 0.5 ms apart."""
    with shmkv.connect(address, timeout=60) as client:
        for _ in range(200):
            client.request("ping")
        queue.put(("ready", None))
        samples: List[Ping] = []
        while not stop.is_set():
            t0 = time.monotonic()
            client.request("ping")
            samples.append((t0, time.monotonic() - t0))
            time.sleep(0.0005)
    queue.put(("pings", samples))


def _scrape(port: int) -> int:
    """One ``GET /metrics`` over a plain socket, as lean as a Go scraper (urllib would
    cost the machine more CPU than the server's side); returns the body's size."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: text/plain\r\n\r\n")
        data = bytearray()
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") or b"shmkv_uptime_seconds" not in body:
        raise OSError(f"bad answer: {head[:40]!r}")
    return len(body)


def _serve_body(listener: socket.socket, body: bytes) -> None:
    """The control's server: answer every connection with ``body`` (as /metrics would)."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
    )
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            conn.sendall(head + body)


def _scraper(
    port: int, nbytes: int, go: Any, stop: Any, queue: Any, rate: float, label: str
) -> None:
    """Scrape ``/metrics`` at ``port`` while ``go`` is set, ``rate`` times a second (0:
    back to back). With ``nbytes`` (the control), scrape a server of this process that
    answers as many bytes instead: the same work on the machine, none in the
    coordinator's process."""
    if nbytes:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        body = (b"x" * (nbytes - 21)) + b"\nshmkv_uptime_seconds"  # passes _scrape's check
        threading.Thread(target=_serve_body, args=(listener, body), daemon=True).start()
    num, failed, size, busy = 0, 0, 0, 0.0
    queue.put(("ready", None))
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        t0 = time.monotonic()
        while go.is_set():
            t1 = time.monotonic()
            try:
                size = _scrape(port)
                num += 1
            except OSError:
                failed += 1
            if rate:
                time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t1)))
        busy += time.monotonic() - t0
    queue.put((label, (num, failed, size, busy)))


def run(
    address: str, port: int, nbytes: int, cycles: int, phase_s: float, rate: float
) -> Dict[str, Any]:
    """One paired run: phases idle, scraped, control, idle, scraped, control, ...,
    pinged throughout."""
    q = SPAWN.Queue()
    stop = SPAWN.Event()
    gates = {"scraped": SPAWN.Event(), "control": SPAWN.Event()}
    workers = [
        SPAWN.Process(target=_scraper, args=(port, 0, gates["scraped"], stop, q, rate, "scraped")),
        SPAWN.Process(
            target=_scraper, args=(port, nbytes, gates["control"], stop, q, rate, "control")
        ),
    ]
    for proc in workers:
        proc.start()
        assert q.get(timeout=120)[0] == "ready"
    pinger = SPAWN.Process(target=_pinger, args=(address, stop, q))
    pinger.start()
    assert q.get(timeout=120)[0] == "ready"  # the pinger imported, connected, warmed up
    time.sleep(0.2)
    phases: List[Tuple[float, float, str]] = []
    for _ in range(cycles):
        for label in ("idle", "scraped", "control"):
            if label in gates:
                gates[label].set()
            t0 = time.monotonic()
            time.sleep(phase_s)
            if label in gates:
                gates[label].clear()
            phases.append((t0 + 0.05, time.monotonic(), label))
    stop.set()
    results = dict(q.get(timeout=120) for _ in range(3))
    for proc in [*workers, pinger]:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    lat: Dict[str, List[float]] = {"idle": [], "scraped": [], "control": []}
    for t0, latency in results["pings"]:
        for start, end, label in phases:
            if start <= t0 < end:
                lat[label].append(latency)
                break
    out: Dict[str, Any] = {}
    for label, values in lat.items():
        values = sorted(values)
        out[label] = {
            "p50_us": values[len(values) // 2] * 1e6,
            "p99_us": p99(values) * 1e6,
            "pings": len(values),
        }
    for label in gates:
        num, failed, size, busy_s = results[label]
        out[label].update(
            scrapes=num, failed=failed, per_s=num / max(busy_s, 1e-9), body_bytes=size
        )
    out["ratio_p99"] = out["scraped"]["p99_us"] / out["idle"]["p99_us"]
    out["control_ratio_p99"] = out["control"]["p99_us"] / out["idle"]["p99_us"]
    return out


def summarise(runs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The median p99 ratios of ``runs`` and their spread, against :data:`BOUND`."""
    ratios = spread([r["ratio_p99"] for r in runs])
    controls = spread([r["control_ratio_p99"] for r in runs])
    return {
        "median_ratio_p99": ratios["median"],
        "min_ratio_p99": ratios["min"],
        "max_ratio_p99": ratios["max"],
        "bound": BOUND,
        "within_bound": ratios["median"] <= BOUND,
        "runs_within_bound": sum(r["ratio_p99"] <= BOUND for r in runs),
        "runs": ratios["n"],
        "median_control_ratio_p99": controls["median"],
        "min_control_ratio_p99": controls["min"],
        "max_control_ratio_p99": controls["max"],
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=24)
    parser.add_argument("--phase-s", type=float, default=0.3)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument(
        "--out",
        default=None,
        help=f"results path without extension (default: benchmarks/results/{NAME})",
    )
    args = parser.parse_args(argv)
    args.out = args.out or result_base(NAME)

    load_before = os.getloadavg()[0]
    cfg = shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        num_blocks=256,
        block_size=16,
        dtype=torch.float16,
    )
    name = f"bench-metrics-{os.getpid()}"
    with shmkv.Coordinator.spawn(cfg, name=name, metrics_port=0) as coord:
        with shmkv.connect(coord.address, timeout=60) as client:
            port = client.stats()["metrics_port"]
            for i in range(32):  # something to report: sequences, hits, ops of several kinds
                h = client.allocate(prompt=list(range(i % 4 * 16, i % 4 * 16 + 48)))
                h.commit()
                if i % 2:
                    h.close()
            nbytes = _scrape(port)
            runs = []
            for i in range(args.runs):
                runs.append(run(coord.address, port, nbytes, args.cycles, args.phase_s, args.rate))
                r = runs[-1]
                print(
                    f"run {i}: p99 idle {r['idle']['p99_us']:.1f} us, scraped "
                    f"{r['scraped']['p99_us']:.1f} us (ratio {r['ratio_p99']:.3f}), control "
                    f"{r['control']['p99_us']:.1f} us (ratio {r['control_ratio_p99']:.3f}); "
                    f"{r['scraped']['scrapes']} scrapes at {r['scraped']['per_s']:.1f}/s, "
                    f"{r['scraped']['failed']} failed",
                    flush=True,
                )
            flat_out = run(coord.address, port, nbytes, max(2, args.cycles // 4), args.phase_s, 0)
            print(
                f"back to back: p99 idle {flat_out['idle']['p99_us']:.1f} us, scraped "
                f"{flat_out['scraped']['p99_us']:.1f} us (ratio {flat_out['ratio_p99']:.3f}, "
                f"{flat_out['scraped']['per_s']:.0f} scrapes/s), control ratio "
                f"{flat_out['control_ratio_p99']:.3f}",
                flush=True,
            )
    s = summarise(runs)
    print(
        f"median ratio {s['median_ratio_p99']:.3f} (min {s['min_ratio_p99']:.3f}, max "
        f"{s['max_ratio_p99']:.3f}); control {s['median_control_ratio_p99']:.3f} (min "
        f"{s['min_control_ratio_p99']:.3f}, max {s['max_control_ratio_p99']:.3f}); bound "
        f"{BOUND}: {'met' if s['within_bound'] else 'NOT met'}"
    )
    result = {
        "args": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "host": socket.gethostname(),
            "loadavg_1min": [load_before, os.getloadavg()[0]],
        },
        "runs": runs,
        "back_to_back": flat_out,
        "summary": s,
    }
    write_results(args.out, result, markdown(result))
    return 0


def markdown(result: Dict[str, Any]) -> str:
    a, s = result["args"], result["summary"]
    lines = [
        "# Ping latency while `/metrics` is scraped",
        "",
        f"`shmkv bench --only metrics -- --runs {a['runs']} --cycles {a['cycles']} "
        f"--phase-s {a['phase_s']} --rate {a['rate']:g}`: a spawned coordinator "
        "(its own process, default `spin_us`), one process pinging it 0.5 ms apart "
        f"throughout, and phases of {a['phase_s']:g} s in turn: idle; scraped (another "
        f"process GETs `/metrics` at {a['rate']:g} Hz); control (a third process does the "
        "same GETs at the same rate against a server of its own answering as many bytes: "
        "the same work on the machine, none in the coordinator's process). "
        f"{a['cycles']} cycles a run; pings within 50 ms of a phase change not counted. "
        "Paired: each ratio is a condition's p99 over the same run's idle p99. "
        f"Machine: {result['machine']['cpus']} CPUs, Python {result['machine']['python']}, "
        f"{result['machine']['platform']}; 1-minute load average "
        f"{result['machine']['loadavg_1min'][0]:.1f} before, "
        f"{result['machine']['loadavg_1min'][1]:.1f} after.",
        "",
        "| run | idle p50 (us) | idle p99 (us) | scraped p99 (us) | ratio | control p99 (us) "
        "| control ratio | scrapes (failed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["runs"]):
        lines.append(
            f"| {i} | {r['idle']['p50_us']:.1f} | {r['idle']['p99_us']:.1f} | "
            f"{r['scraped']['p99_us']:.1f} | {r['ratio_p99']:.3f} | "
            f"{r['control']['p99_us']:.1f} | {r['control_ratio_p99']:.3f} | "
            f"{r['scraped']['scrapes']} ({r['scraped']['failed']}) |"
        )
    b = result["back_to_back"]
    lines += [
        "",
        f"**Median p99 ratio scraped/idle {s['median_ratio_p99']:.3f}** (spread over "
        f"{s['runs']} runs: min {s['min_ratio_p99']:.3f}, max {s['max_ratio_p99']:.3f}; "
        f"{s['runs_within_bound']} of {s['runs']} runs within {s['bound']}x); control/idle "
        f"{s['median_control_ratio_p99']:.3f} (min {s['min_control_ratio_p99']:.3f}, max "
        f"{s['max_control_ratio_p99']:.3f}). Bound: p99 while scraped at 10 Hz within "
        f"{s['bound']}x of idle: **{'met' if s['within_bound'] else 'not met'}** (median).",
        "",
        f"For reference, scraped back to back by one process "
        f"({b['scraped']['per_s']:.0f} scrapes/s, {b['scraped']['body_bytes']} bytes each): "
        f"idle p99 {b['idle']['p99_us']:.1f} us, scraped {b['scraped']['p99_us']:.1f} us "
        f"(ratio {b['ratio_p99']:.2f}), control {b['control']['p99_us']:.1f} us "
        f"(ratio {b['control_ratio_p99']:.2f}).",
        "",
    ]
    return "\n".join(lines)


def cli_args(quick: bool, out_dir: str, name: Optional[str] = None) -> List[str]:
    """The arguments ``shmkv bench --only metrics`` runs :func:`main` with (a quick run:
    two runs of six cycles, written as ``metrics-scrape-quick``)."""
    name = name or (f"{NAME}-quick" if quick else NAME)
    return (["--runs", "2", "--cycles", "6"] if quick else []) + [
        "--out",
        result_base(name, out_dir),
    ]


if __name__ == "__main__":
    sys.exit(main())
