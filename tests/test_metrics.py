"""Operations: Prometheus metrics scraped from a served coordinator follow real
traffic; connects, drops, refusals and limits are logged; the library prints nothing."""

import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import shmkv


def scrape(coord) -> dict:
    """``{(sample name, sorted labels): value}`` of one scrape of ``/metrics``."""
    host, port = coord.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("shmkv_"), family.name
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def blocks(samples: dict, state: str) -> float:
    return value(samples, "shmkv_blocks", tier="pool", state=state)


def settle(coord, connections: int) -> None:
    """Wait until the coordinator's loop has seen closed connections (a close is not a
    request: nothing answers it)."""
    deadline = time.monotonic() + 10
    while coord.stats()["connections"] != connections and time.monotonic() < deadline:
        time.sleep(0.01)


def test_metrics_follow_real_traffic(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=2, num_kv_heads=2, head_dim=4, num_blocks=8, block_size=4, dtype=torch.float32
    )
    with shmkv.Coordinator(cfg, name=unique_name, metrics_port=0, max_connections=2) as coord:
        m = scrape(coord)
        assert blocks(m, "free") == 8 and blocks(m, "cached") == 0
        assert blocks(m, "referenced") == 0
        assert value(m, "shmkv_pool_bytes") == cfg.nbytes
        assert value(m, "shmkv_pool_blocks") == 8
        assert value(m, "shmkv_connections_open") == 0
        assert value(m, "shmkv_connections_total", event="accepted") == 0

        with shmkv.connect(coord.address, timeout=10) as client:
            prompt = list(range(12))  # three full blocks
            h = client.allocate(prompt=prompt)
            h.commit()
            m = scrape(coord)
            assert value(m, "shmkv_connections_open") == 1
            assert value(m, "shmkv_connections_total", event="accepted") == 1
            assert blocks(m, "referenced") == 3 and blocks(m, "free") == 5
            assert value(m, "shmkv_prefix_miss_tokens_total") == 12
            assert value(m, "shmkv_prefix_hit_tokens_total") == 0

            again = client.allocate(prompt=prompt + [99])  # a prefix hit of 12 tokens
            m = scrape(coord)
            assert value(m, "shmkv_prefix_hit_tokens_total") == 12
            assert value(m, "shmkv_prefix_miss_tokens_total") == 13

            branch = h.fork()  # copy on write
            branch.write(0, torch.ones(1, 2, 4), torch.ones(1, 2, 4), start=11)
            m = scrape(coord)
            assert value(m, "shmkv_cow_copies_total") == 1

            token = branch.export(ttl=30)  # a hand-off
            assert value(scrape(coord), "shmkv_handoffs_outstanding") == 1
            client.open(token).close()
            m = scrape(coord)
            assert value(m, "shmkv_handoffs_total", event="exported") == 1
            assert value(m, "shmkv_handoffs_total", event="opened") == 1
            assert value(m, "shmkv_handoffs_outstanding") == 0

            for handle in (branch, again, h):  # cached, then evicted
                handle.close()
            m = scrape(coord)
            assert blocks(m, "cached") == 3 and blocks(m, "referenced") == 0
            client.allocate(8 * 4).close()  # needs every block
            m = scrape(coord)
            assert value(m, "shmkv_evictions_total") == 3
            assert blocks(m, "free") == 8

            with pytest.raises(shmkv.PoolExhausted):
                client.allocate(9 * 4)
            assert value(scrape(coord), "shmkv_request_errors_total") == 1

            with shmkv.connect(coord.address, timeout=10):  # the second of two allowed
                with pytest.raises(shmkv.LimitExceeded):
                    shmkv.connect(coord.address, timeout=10)
            settle(coord, 1)
            m = scrape(coord)
            assert value(m, "shmkv_connections_total", event="refused") == 1
            assert value(m, "shmkv_connections_total", event="closed") == 1

            # ops by type, and a histogram that counts each served request once
            ops = client.stats()["ops_by_type"]
            m = scrape(coord)
            for op, num in ops.items():
                got = value(m, "shmkv_ops_total", op=op)
                assert got >= num  # stats itself came after
                count = value(m, "shmkv_request_duration_seconds_count", op=op)
                inf = value(m, "shmkv_request_duration_seconds_bucket", op=op, le="+Inf")
                assert count == inf == got
                assert value(m, "shmkv_request_duration_seconds_sum", op=op) > 0
            assert value(m, "shmkv_ops_total", op="fork") == 1
            assert value(m, "shmkv_ops_total", op="export") == 1
        settle(coord, 0)
        m = scrape(coord)
        assert value(m, "shmkv_connections_open") == 0
        assert value(m, "shmkv_connections_total", event="closed") == 2
        assert blocks(m, "free") + blocks(m, "cached") == 8
    with pytest.raises(OSError):  # stopped with the coordinator
        urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics_address[1]}/metrics", timeout=2)


def _hit_and_miss(m: dict, client: str) -> tuple:
    return (
        m.get(("shmkv_client_prefix_hit_tokens_total", (("client", client),))),
        m.get(("shmkv_client_prefix_miss_tokens_total", (("client", client),))),
    )


def test_prefix_hits_are_counted_per_client_name(unique_name, tmp_path):
    """Each client names itself at connect; /metrics counts its prompt tokens hit and
    missed under that name (unnamed ones together), summing to the pool's counts, and
    keeps them after it disconnects. A promotion that ends early moves its tokens from
    the asking client's hits to its misses."""
    cfg = shmkv.PoolConfig(
        num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=32, block_size=4, dtype=torch.float32
    )
    prompt = list(range(16))  # four full blocks
    with shmkv.Coordinator(
        cfg,
        name=unique_name,
        metrics_port=0,
        tiers=[shmkv.DiskTier(str(tmp_path / "disk"), 1 << 20)],
    ) as coord:
        with (
            shmkv.connect(coord.address, name="engine-a", timeout=10) as a,
            shmkv.connect(coord.address, name="engine-b", timeout=10) as b,
            shmkv.connect(coord.address, name="engine-b", timeout=10) as b2,
            shmkv.connect(coord.address, timeout=10) as anon,
        ):
            h = a.allocate(prompt=prompt)
            h.write(0, torch.ones(16, 1, 4), torch.ones(16, 1, 4))
            h.commit()
            b.allocate(prompt=prompt + [7]).close()  # 16 hit, 1 missed
            b2.allocate(prompt=prompt[:8]).close()  # 8 hit, same name
            anon.allocate(prompt=[50, 51, 52, 53]).close()  # 4 missed
            anon.allocate(8).close()  # no prompt: not counted
            m = scrape(coord)
            assert _hit_and_miss(m, "engine-a") == (0, 16)
            assert _hit_and_miss(m, "engine-b") == (24, 1)
            assert _hit_and_miss(m, "unnamed") == (0, 4)
            for i, kind in enumerate(("hit", "miss")):
                total = value(m, f"shmkv_prefix_{kind}_tokens_total")
                assert total == sum(
                    v[i] for v in (_hit_and_miss(m, c) for c in ("engine-a", "engine-b", "unnamed"))
                )
            h.close()
        settle(coord, 0)
        assert _hit_and_miss(scrape(coord), "engine-b") == (24, 1)  # kept past the close
        with pytest.raises(shmkv.InvalidArgument, match="client name"):
            shmkv.connect(coord.address, name="a b", timeout=10)
        with pytest.raises(shmkv.InvalidArgument, match="client name"):
            shmkv.connect(coord.address, name="x" * 65, timeout=10)

        # from disk: the prompt leaves the pool, its third block's file is damaged, so
        # the promotion ends after two blocks and engine-c's hit shrinks to 8 tokens
        with shmkv.connect(coord.address, timeout=10) as filler:
            wait_tiers(filler)
            filler.allocate(32 * 4).close()  # evicts every cached block
            wait_tiers(filler)
        from shmkv import hashing

        key = hashing.block_keys(prompt, 4, hashing.root_key())[2]
        path = tmp_path / "disk" / "blocks" / (key.hex() + ".kv")
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
        with shmkv.connect(coord.address, name="engine-c", timeout=10) as c:
            got = c.allocate(prompt=prompt)
            assert got.num_cached_tokens == 8
            got.close()
        m = scrape(coord)
        assert _hit_and_miss(m, "engine-c") == (8, 8)
        assert value(m, "shmkv_prefix_hit_tokens_total") == 24 + 8
        assert value(m, "shmkv_prefix_miss_tokens_total") == 16 + 1 + 4 + 8


def wait_tiers(client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        io = client.stats()["tier_io"]
        if not io["pending"] and not io["scanning"] and not io["promotions_in_flight"]:
            return
        assert time.monotonic() < deadline, f"tiers still busy: {io}"
        time.sleep(0.01)


def test_a_busy_metrics_port_is_a_clear_error(small_config, unique_name):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        coord = shmkv.Coordinator(
            small_config, name=unique_name, metrics_port=busy.getsockname()[1]
        )
        with pytest.raises(shmkv.ShmkvError, match="metrics"):
            coord.start()
        coord.stop()
    finally:
        busy.close()
    with pytest.raises(shmkv.InvalidArgument):
        shmkv.Coordinator(small_config, name=unique_name, metrics_port=70000)


def test_connects_drops_refusals_and_limits_are_logged(small_config, unique_name, caplog):
    caplog.set_level(logging.DEBUG, logger="shmkv")
    with shmkv.Coordinator(
        small_config, name=unique_name, max_connections=2, max_handoffs=1
    ) as coord:
        with shmkv.connect(coord.address, timeout=10) as client:
            h = client.allocate(4)
            h.export(ttl=30)
            with pytest.raises(shmkv.LimitExceeded):
                h.export(ttl=30)
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a peer speaking nonsense
            raw.settimeout(10)
            raw.connect(coord.address)
            raw.sendall(b"\x00\x00\x00\x01\xc1")  # 0xc1 is never valid msgpack
            while raw.recv(4096):  # the error frame, then EOF:
                pass  # the coordinator dropped it
            raw.close()
            with shmkv.connect(coord.address, timeout=10):  # the second of two allowed
                with pytest.raises(shmkv.LimitExceeded):
                    shmkv.connect(coord.address, timeout=10)
        settle(coord, 0)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("shmkv")]
    text = "\n".join(message for _level, message in records)

    def at(level, *words):
        return any(lvl == level and all(w in msg for w in words) for lvl, msg in records)

    assert at(logging.INFO, "connection 1 from pid"), text
    assert at(logging.WARNING, "limit hit", "hand-offs outstanding"), text
    assert at(logging.WARNING, "refused pid", "max_connections=2"), text
    assert at(
        logging.INFO, "connection 1", "dropped: closed by the client", "references released"
    ), text
    assert at(logging.WARNING, "dropped: protocol error"), text


def test_the_library_prints_nothing_by_itself(tmp_path):
    # No logging configured: warnings (a refusal, a limit) must not reach stderr.
    script = textwrap.dedent(f"""
        import torch, shmkv
        cfg = shmkv.PoolConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4,
                               block_size=4, dtype=torch.float32)
        with shmkv.Coordinator(cfg, address={str(tmp_path / "c.sock")!r},
                               max_connections=1, metrics_port=0) as coord:
            with shmkv.connect(coord.address, timeout=10) as client:
                try:
                    shmkv.connect(coord.address, timeout=10)
                except shmkv.LimitExceeded:
                    pass
                try:
                    client.allocate(100)
                except shmkv.PoolExhausted:
                    pass
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)


# -- the endpoint is bounded -----------------------------------------------------------------


def parse(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_idle_connections_make_no_threads_and_a_scrape_still_succeeds(small_config, unique_name):
    with shmkv.Coordinator(small_config, name=unique_name, metrics_port=0) as coord:
        host, port = coord.metrics_address
        scrape(coord)
        threads = threading.active_count()
        idle = []
        try:
            for _ in range(300):
                sock = socket.create_connection((host, port), timeout=10)
                idle.append(sock)
            assert threading.active_count() <= threads  # no thread per connection
            m = scrape(coord)  # a real scrape gets through
            assert blocks(m, "free") == small_config.num_blocks
            assert threading.active_count() <= threads
            idle[0].settimeout(10)
            assert idle[0].recv(1) == b""  # the oldest were closed
        finally:
            for sock in idle:
                sock.close()
        assert coord._metrics.num_closed >= 300 - coord._metrics.max_connections


def test_an_idle_connection_is_closed_after_its_timeout(small_config, unique_name):
    from shmkv.coordinator.metrics import MetricsServer

    with shmkv.Coordinator(small_config, name=unique_name) as coord:
        server = MetricsServer(coord, 0, timeout=0.3)
        try:
            sock = socket.create_connection(server.address, timeout=10)
            sock.sendall(b"GET /metr")  # never finished
            assert sock.recv(1) == b""  # closed, not held forever
            sock.close()
            with urllib.request.urlopen(server.url, timeout=10) as response:
                assert b"shmkv_pool_blocks" in response.read()
            raw = socket.create_connection(server.address, timeout=10)
            raw.sendall(b"GET /" + b"x" * 10000)  # a head past 8 KiB
            assert raw.recv(64).startswith(b"HTTP/1.1 431")
            raw.close()
        finally:
            server.close()
        with pytest.raises(shmkv.InvalidArgument):
            MetricsServer(coord, 0, max_connections=0)


def test_a_client_dropping_early_prints_nothing(tmp_path):
    script = textwrap.dedent(f"""
        import socket, struct, time, urllib.request, torch, shmkv
        cfg = shmkv.PoolConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4,
                               block_size=4, dtype=torch.float32)
        with shmkv.Coordinator(cfg, address={str(tmp_path / "c.sock")!r},
                               metrics_port=0) as coord:
            host, port = coord.metrics_address
            url = f"http://{{host}}:{{port}}/metrics"
            def reset(sock):   # close with RST, as a killed scraper does
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            for i in range(5):
                socket.create_connection((host, port), timeout=10).close()
                s = socket.create_connection((host, port), timeout=10)
                s.sendall(b"GET /metrics HTTP/1.1\\r\\n")
                time.sleep(0.05)
                reset(s)
                s = socket.create_connection((host, port), timeout=10)
                s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
                reset(s)
                s = socket.create_connection((host, port), timeout=10)
                s.sendall(b"\\xff\\xfe garbage\\r\\n\\r\\n")
                s.close()
            time.sleep(0.3)
            with urllib.request.urlopen(url, timeout=10) as response:
                assert b"shmkv_pool_blocks" in response.read()
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)


@pytest.mark.parametrize("host", ["", "0.0.0.0"])
def test_a_bind_beyond_loopback_is_logged(small_config, unique_name, caplog, host):
    caplog.set_level(logging.WARNING, logger="shmkv")
    with shmkv.Coordinator(
        small_config, name=unique_name, metrics_port=0, metrics_host=host
    ) as coord:
        assert coord.metrics_address[0] == "0.0.0.0"
        with urllib.request.urlopen(
            f"http://127.0.0.1:{coord.metrics_address[1]}/metrics", timeout=10
        ) as response:
            assert response.status == 200
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("shmkv")
    ]
    assert any("every interface" in w and "reachable from other machines" in w for w in warnings), (
        warnings
    )


def test_a_loopback_bind_logs_no_warning(small_config, unique_name, caplog):
    caplog.set_level(logging.WARNING, logger="shmkv")
    with shmkv.Coordinator(small_config, name=unique_name, metrics_port=0):
        pass
    assert not [r for r in caplog.records if r.name.startswith("shmkv.coordinator.metrics")]


def test_the_collector_gives_the_endpoints_series(small_config, unique_name):
    from prometheus_client import CollectorRegistry, generate_latest

    from shmkv.coordinator.metrics import CoordinatorCollector

    with shmkv.Coordinator(small_config, name=unique_name, metrics_port=0) as coord:
        with shmkv.connect(coord.address, timeout=10) as client:
            client.allocate(prompt=list(range(8))).close()
            registry = CollectorRegistry(auto_describe=False)
            registry.register(CoordinatorCollector(coord))
            settle(coord, 1)
            served = scrape(coord)
            collected = parse(generate_latest(registry).decode())
    uptime = ("shmkv_uptime_seconds", ())
    assert served.pop(uptime) > 0 and collected.pop(uptime) > 0
    assert collected == served  # (a scrape is no request: nothing moved between)


def test_scrapes_close_together_share_a_render_and_are_never_stale(small_config, unique_name):
    with (
        shmkv.Coordinator(small_config, name=unique_name, metrics_port=0) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        socks = [socket.create_connection(coord.metrics_address, timeout=10) for _ in range(5)]
        for sock in socks:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in socks:
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            sock.close()
            assert data.startswith(b"HTTP/1.1 200") and b"shmkv_pool_blocks" in data
        for expected in range(1, 6):  # each answer is rendered after its request
            client.ping()
            assert value(scrape(coord), "shmkv_ops_total", op="ping") == expected
        head = socket.create_connection(coord.metrics_address, timeout=10)
        head.sendall(b"HEAD /metrics HTTP/1.1\r\n\r\n")
        data = b""
        while chunk := head.recv(65536):
            data += chunk
        head.close()
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"\r\n\r\n")
        assert b"shmkv_" not in data


def test_every_series_is_documented_in_operations(small_config, unique_name, tmp_path):
    """docs/operations.md's table names every family the exporter gives (tiers on), and
    nothing it does not give."""
    import pathlib
    import re

    from shmkv.coordinator.metrics import families

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    table = {
        name
        for row in doc.splitlines()
        if row.startswith("| `shmkv_")
        for name in re.findall(r"`(shmkv_\w+)`", row.split("|")[1])
    }
    with shmkv.Coordinator(
        small_config,
        name=unique_name,
        tiers=[shmkv.HostTier(1 << 20), shmkv.DiskTier(str(tmp_path), 1 << 20)],
    ) as coord:
        given = {
            name + ("_total" if kind == "counter" else "")
            for name, kind, _doc, _samples in families(coord)
        }
    assert given - table == set(), "not documented"
    assert table - given == set(), "documented but not exported"


def test_an_engine_reports_what_it_loaded_under_its_own_name(unique_name):
    """``count_hits`` adds an engine's own report (what it loaded, what it computed
    instead) to its name's counters only; bad counts are refused and change nothing."""
    cfg = shmkv.PoolConfig(
        num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=16, block_size=4, dtype=torch.float32
    )
    with shmkv.Coordinator(cfg, name=unique_name, metrics_port=0) as coord:
        with (
            shmkv.connect(coord.address, name="engine-r", timeout=10) as engine,
            shmkv.connect(coord.address, name="other", timeout=10) as other,
        ):
            engine.count_hits(96, 40)
            engine.count_hits(0, 0)  # (nothing to send)
            engine.flush()
            m = scrape(coord)
            assert _hit_and_miss(m, "engine-r") == (96, 40)
            assert _hit_and_miss(m, "other") == (0, 0) and other.is_alive()
            assert value(m, "shmkv_prefix_hit_tokens_total") == 0  # the pool's own: untouched
            for bad in (-1, 1.5, True, "3"):
                with pytest.raises(shmkv.InvalidArgument, match="hit_tokens"):
                    engine.count_hits(bad, 0)
            engine._link.post("count_hits", hit_tokens=(1 << 40) + 1, miss_tokens=0)
            with pytest.raises(shmkv.OutOfRange, match="count_hits"):
                engine.flush()
            engine._link.post("count_hits", hit_tokens=-5, miss_tokens=0)
            with pytest.raises(shmkv.OutOfRange, match="count_hits"):
                engine.flush()
            assert engine.is_alive()
            assert _hit_and_miss(scrape(coord), "engine-r") == (96, 40)
