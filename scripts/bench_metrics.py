"""Benchmark: the coordinator's ping latency while its ``/metrics`` endpoint is scraped.

    python scripts/bench_metrics.py [--runs 5] [--cycles 10] [--phase-s 1.0] [--rate 10]
                                    [--out benchmarks/results/metrics-scrape]

The coordinator runs in its own process (``Coordinator.spawn``, with its metrics server
on a free loopback port). One spawned process pings it throughout, a little apart; a
second spawned process scrapes ``/metrics`` at ``--rate`` scrapes a second during
alternate phases (idle, scraped, idle, ...) of ``--phase-s`` seconds, so both
conditions of a run meet the same background load (pings within 50 ms of a phase
change are not counted). Each of ``--runs`` runs gives the p99 of both conditions and
their ratio (paired); the summary states the median ratio and its spread (min, max).
A last run scrapes back to back (as fast as one process can), for reference.

The bound this checks (issue 29, item 7): ping p99 while scraped at 10 Hz within 1.2x
of idle. Results go to ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import shmkv  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")
BOUND = 1.2


def _pinger(address, stop, queue):
    """Ping until ``stop``: (start time, latency) of each ping, 0.5 ms apart."""
    with shmkv.connect(address, timeout=60) as client:
        for _ in range(200):
            client.request("ping")
        queue.put(("ready", None))
        samples = []
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
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n"
                     b"Accept: text/plain\r\n\r\n")
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


def _scraper(port, go, stop, queue, rate):
    """Scrape ``/metrics`` while ``go`` is set, ``rate`` times a second (0: back to
    back)."""
    num, failed, nbytes, busy = 0, 0, 0, 0.0
    queue.put(("ready", None))
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        t0 = time.monotonic()
        while go.is_set():
            t1 = time.monotonic()
            try:
                nbytes = _scrape(port)
                num += 1
            except OSError:
                failed += 1
            if rate:
                time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t1)))
        busy += time.monotonic() - t0
    queue.put(("scrapes", (num, failed, nbytes, busy)))


def p99(values) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def run(address, port, cycles, phase_s, rate) -> dict:
    """One paired run: alternating idle and scraped phases, pinged throughout."""
    q = SPAWN.Queue()
    go, stop = SPAWN.Event(), SPAWN.Event()
    scraper = SPAWN.Process(target=_scraper, args=(port, go, stop, q, rate))
    scraper.start()
    assert q.get(timeout=120)[0] == "ready"
    pinger = SPAWN.Process(target=_pinger, args=(address, stop, q))
    pinger.start()
    assert q.get(timeout=120)[0] == "ready"   # the pinger imported, connected, warmed up
    time.sleep(0.2)
    phases = []
    for _ in range(cycles):
        for busy in (False, True):
            (go.set if busy else go.clear)()
            t0 = time.monotonic()
            time.sleep(phase_s)
            phases.append((t0 + 0.05, time.monotonic(), busy))
    go.clear()
    stop.set()
    results = dict(q.get(timeout=120) for _ in range(2))
    for proc in (scraper, pinger):
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    lat = {False: [], True: []}
    for t0, latency in results["pings"]:
        for start, end, busy in phases:
            if start <= t0 < end:
                lat[busy].append(latency)
                break
    num, failed, nbytes, busy_s = results["scrapes"]
    out = {}
    for busy, label in ((False, "idle"), (True, "scraped")):
        values = sorted(lat[busy])
        out[label] = {"p50_us": values[len(values) // 2] * 1e6, "p99_us": p99(values) * 1e6,
                      "pings": len(values)}
    out["ratio_p99"] = out["scraped"]["p99_us"] / out["idle"]["p99_us"]
    out["scrapes"] = num
    out["scrapes_failed"] = failed
    out["scrapes_per_s"] = num / max(busy_s, 1e-9)
    out["body_bytes"] = nbytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--phase-s", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()

    cfg = shmkv.PoolConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=256,
                           block_size=16, dtype=torch.float16)
    name = f"bench-metrics-{os.getpid()}"
    with shmkv.Coordinator.spawn(cfg, name=name, metrics_port=0) as coord:
        with shmkv.connect(coord.address, timeout=60) as client:
            port = client.stats()["metrics_port"]
            for i in range(32):   # something to report: sequences, hits, ops of several kinds
                h = client.allocate(prompt=list(range(i % 4 * 16, i % 4 * 16 + 48)))
                h.commit()
                if i % 2:
                    h.close()
            _scrape(port)
            runs = []
            for i in range(args.runs):
                runs.append(run(coord.address, port, args.cycles, args.phase_s, args.rate))
                r = runs[-1]
                print(f"run {i}: idle p99 {r['idle']['p99_us']:.1f} us, scraped p99 "
                      f"{r['scraped']['p99_us']:.1f} us, ratio {r['ratio_p99']:.3f} "
                      f"({r['scrapes']} scrapes at {r['scrapes_per_s']:.1f}/s, "
                      f"{r['scrapes_failed']} failed)", flush=True)
            flat_out = run(coord.address, port, max(2, args.cycles // 2), args.phase_s, 0)
            print(f"back to back: idle p99 {flat_out['idle']['p99_us']:.1f} us, scraped p99 "
                  f"{flat_out['scraped']['p99_us']:.1f} us, ratio "
                  f"{flat_out['ratio_p99']:.3f} ({flat_out['scrapes_per_s']:.0f} scrapes/s)",
                  flush=True)
    ratios = [r["ratio_p99"] for r in runs]
    summary = {"median_ratio_p99": statistics.median(ratios), "min_ratio_p99": min(ratios),
               "max_ratio_p99": max(ratios), "bound": BOUND,
               "within_bound": statistics.median(ratios) <= BOUND,
               "runs_within_bound": sum(r <= BOUND for r in ratios), "runs": len(ratios)}
    print(f"median ratio {summary['median_ratio_p99']:.3f} (min {min(ratios):.3f}, max "
          f"{max(ratios):.3f}); bound {BOUND}: "
          f"{'met' if summary['within_bound'] else 'NOT met'}")
    result = {"args": vars(args), "machine": {"cpus": os.cpu_count(),
                                              "python": platform.python_version(),
                                              "platform": platform.platform(),
                                              "host": socket.gethostname()},
              "runs": runs, "back_to_back": flat_out, "summary": summary}
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(result))


def markdown(result: dict) -> str:
    a, s = result["args"], result["summary"]
    lines = [
        "# Ping latency while `/metrics` is scraped",
        "",
        f"`python scripts/bench_metrics.py --runs {a['runs']} --cycles {a['cycles']} "
        f"--phase-s {a['phase_s']} --rate {a['rate']:g}`: a spawned coordinator "
        "(its own process, default `spin_us`), one process pinging it 0.5 ms apart "
        f"throughout, another scraping `/metrics` at {a['rate']:g} Hz in alternate phases "
        f"of {a['phase_s']:g} s ({a['cycles']} idle and {a['cycles']} scraped phases a run; "
        "pings within 50 ms of a phase change not counted). Paired: each run's ratio is "
        "its scraped p99 over its own idle p99. "
        f"Machine: {result['machine']['cpus']} CPUs, Python {result['machine']['python']}, "
        f"{result['machine']['platform']}.",
        "",
        "| run | idle p50 (us) | idle p99 (us) | scraped p50 (us) | scraped p99 (us) | "
        "p99 ratio | scrapes (failed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["runs"]):
        lines.append(f"| {i} | {r['idle']['p50_us']:.1f} | {r['idle']['p99_us']:.1f} | "
                     f"{r['scraped']['p50_us']:.1f} | {r['scraped']['p99_us']:.1f} | "
                     f"{r['ratio_p99']:.3f} | {r['scrapes']} ({r['scrapes_failed']}) |")
    b = result["back_to_back"]
    lines += [
        "",
        f"**Median p99 ratio {s['median_ratio_p99']:.3f}** (spread over {s['runs']} runs: "
        f"min {s['min_ratio_p99']:.3f}, max {s['max_ratio_p99']:.3f}; "
        f"{s['runs_within_bound']} of {s['runs']} runs within {s['bound']}x). "
        f"Bound: p99 while scraped at 10 Hz within {s['bound']}x of idle: "
        f"**{'met' if s['within_bound'] else 'not met'}**.",
        "",
        f"For reference, scraped back to back by one process ({b['scrapes_per_s']:.0f} "
        f"scrapes/s, {b['body_bytes']} bytes each): idle p99 {b['idle']['p99_us']:.1f} us, "
        f"scraped p99 {b['scraped']['p99_us']:.1f} us (ratio {b['ratio_p99']:.2f}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
