"""Allocations answered before their tier blocks are in (``allocate(..., wait=False)``),
and the views of such a sequence: until its promotion has settled only its holders write
it, every other view says what is still coming (or refuses), and nothing of it is
published past the first block that did not arrive until every rank has written from
there (``commit(start=)``, a batch step's commit).

Copies from the host tier run in the coordinator's threads, held at a gate the test
opens (``held``); a block named in ``held.fail`` fails its copy after leaving bytes
nobody wrote in its pool block, as a copy that breaks off half-way does. So every
publishing of a block nobody wrote shows as wrong bytes read back by another request.
"""

import contextlib
import errno
import os
import signal
import threading
import time

import pytest
from test_tiers import (
    BS,
    in_tier_only,
    make_config,
    prompts_of,
    read_prompt,
    tier_coordinator,
    token_kv,
    wait_idle,
    write_prompt,
)

import shmkv
from shmkv import hashing, protocol, tiers as tiers_mod
from shmkv.memory import block_io

POISON = 0xAB  # what a failed copy leaves in its pool block


class Held:
    """Copies from the host tier into the pool wait for :attr:`gate`; those of the keys in
    :attr:`fail` then leave :data:`POISON` in their block and fail (an I/O error)."""

    def __init__(self, monkeypatch):
        self.gate = threading.Event()
        self.fail: set = set()
        self.num_copied = 0
        orig = block_io.Mover._op_h2p
        held = self

        def op(mover, copy):
            if not held.gate.wait(20):
                raise OSError(errno.ETIMEDOUT, "the test never opened the gate")
            if copy.key in held.fail:
                for pool in mover.pool_np:
                    pool[copy.block][...] = POISON
                raise OSError(errno.EIO, "Input/output error (injected)")
            orig(mover, copy)
            held.num_copied += 1

        monkeypatch.setattr(block_io.Mover, "_op_h2p", op)


@pytest.fixture
def held(monkeypatch):
    monkeypatch.setattr(tiers_mod, "IO_PROCESS", False)  # (copies in this process's threads)
    monkeypatch.setattr(shmkv.Client, "copy_promotions", False)
    h = Held(monkeypatch)
    yield h
    h.gate.set()  # (no copier thread is left waiting)


@contextlib.contextmanager
def held_coordinator(held, cfg, name):
    """``tier_coordinator`` with two clients, the gate opened before it stops (no copy is
    left waiting for it, whatever the test did)."""
    with tier_coordinator(cfg, name, clients=2) as parts:
        try:
            yield parts
        finally:
            held.gate.set()


def key_of(prompt, index: int) -> bytes:
    return hashing.block_keys(prompt, BS, hashing.root_key())[index]


def write_kv(h, prompt, start: int, end: int) -> None:
    """Write the K/V of ``prompt[start:end]`` into ``h`` (every layer)."""
    for layer in range(h.num_layers):
        k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
        h.write(layer, k[start:end].contiguous(), v[start:end].contiguous(), start=start)


def until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


PROMPT = prompts_of(1, 3)[0] + [7, 8]  # 3 full blocks and 2 tokens


def _short_early(coord, client, held, lost: int = 1):
    """``PROMPT`` allocated early, its promotion ended with block ``lost`` failed."""
    held.fail = {key_of(PROMPT, lost)}
    held.gate.set()
    h = client.allocate(prompt=PROMPT, wait=False)
    assert h.num_cached_tokens == 3 * BS
    until(lambda: not coord._promoting, "the promotion never ended")
    return h


def test_a_rewrite_in_chunks_publishes_only_what_each_chunk_wrote(unique_name, held):
    """A holder writes past the promised hit and commits with ``start`` before it
    settles; the promotion came up short; it then writes again from the hit in chunks.
    Each chunk's commit publishes what the chunks so far cover, never the lost block's
    rest (it did: the first chunk's commit published the whole prompt, and another
    request read the failed copy's bytes as a hit)."""
    cfg = make_config(num_blocks=8)
    with held_coordinator(held, cfg, unique_name) as (coord, client, other):
        in_tier_only(client, PROMPT[: 3 * BS])
        h = _short_early(coord, client, held)
        write_kv(h, PROMPT, 3 * BS, len(PROMPT))
        assert h.commit(start=3 * BS) == 1  # not settled: it believes the promised hit
        assert h.settle() == BS
        write_kv(h, PROMPT, BS, BS + 2)  # the first chunk: half of the lost block
        assert h.commit(BS + 2, start=BS) == 1  # (commit answers the blocks published)
        assert read_prompt(other, PROMPT) == (BS, True)  # (block 1 fails in the tier too)
        write_kv(h, PROMPT, BS + 2, 2 * BS + 1)
        assert h.commit(2 * BS + 1, start=BS + 2) == 2
        assert h.commit(start=3 * BS) == 2  # (a start past what was written again)
        # (block 2 comes from the host tier, which holds its written bytes)
        assert read_prompt(other, PROMPT) == (3 * BS, True)
        write_kv(h, PROMPT, 2 * BS + 1, len(PROMPT))
        assert h.commit(start=2 * BS + 1) == 3
        assert read_prompt(other, PROMPT) == (3 * BS, True)
        h.close()
        coord.table.check_invariants()


def test_a_fork_after_a_short_promotion_keeps_its_loss_guard(unique_name, held):
    """A fork of a sequence whose early promotion came up short, made before anyone
    wrote the lost blocks, publishes nothing past them until it writes them itself (it
    published them: nobody had written them)."""
    cfg = make_config(num_blocks=10)
    with held_coordinator(held, cfg, unique_name) as (coord, client, other):
        in_tier_only(client, PROMPT[: 3 * BS])
        h = _short_early(coord, client, held)
        child = h.fork()
        assert child.num_promoting_tokens == 0
        child.commit()
        assert read_prompt(other, PROMPT) == (BS, True)
        write_kv(child, PROMPT, 3 * BS, len(PROMPT))
        child.commit(start=3 * BS)
        assert read_prompt(other, PROMPT) == (BS, True)
        write_kv(child, PROMPT, BS, len(PROMPT))
        child.commit(start=BS)
        assert read_prompt(other, PROMPT) == (3 * BS, True)
        child.close()
        h.close()
        coord.table.check_invariants()


def test_a_fork_of_an_unsettled_sequence_waits_for_its_promotion(unique_name, held):
    """A fork asked while the tier still copies waits for the copies (as ``settle``
    does), then forks the settled sequence: the child is not promoting, and it is held
    to the parent's loss guard."""
    cfg = make_config(num_blocks=10)
    with held_coordinator(held, cfg, unique_name) as (coord, client, other):
        in_tier_only(client, PROMPT[: 3 * BS])
        held.fail = {key_of(PROMPT, 1)}
        h = client.allocate(prompt=PROMPT, wait=False)
        got: dict = {}
        thread = threading.Thread(target=lambda: got.setdefault("child", h.fork()))
        thread.start()
        try:
            time.sleep(0.3)
            assert thread.is_alive(), "the fork did not wait for the promotion"
            assert coord._promoting == {h._cache_id: 1}
        finally:
            held.gate.set()
            thread.join(20)
        child = got["child"]
        assert not coord._promoting
        assert (child.num_promoting_tokens, child.settle()) == (0, 0)
        assert h.settle() == BS
        child.commit()
        write_kv(h, PROMPT, 3 * BS, len(PROMPT))
        h.commit(start=3 * BS)
        assert read_prompt(other, PROMPT) == (BS, True)
        write_kv(child, PROMPT, BS, len(PROMPT))
        child.commit(start=BS)
        assert read_prompt(other, PROMPT) == (3 * BS, True)
        child.close()
        h.close()
        coord.table.check_invariants()


def test_other_views_of_an_unsettled_sequence_say_what_is_coming(unique_name, held):
    """While the tier copies: a clone, a fixed-length view and a handle opened from a
    hand-off report the blocks still coming (they reported none, and read another
    request's K/V there); a peek refuses with ``NotSettled`` (it read them). Once
    settled, all of them read the written bytes."""
    cfg = make_config(num_blocks=12)
    prompt = prompts_of(1, 4)[0]
    with held_coordinator(held, cfg, unique_name) as (coord, client, other):
        in_tier_only(client, prompt)
        held.fail = set()
        h = client.allocate(prompt=prompt, wait=False)
        assert (h.num_promoting_tokens, h.num_resident_tokens) == (len(prompt), 0)
        with pytest.raises(shmkv.NotSettled, match="settle"):
            other.peek(h.descriptor())
        other.lock_free = False  # (as where loads may be reordered: the rows are asked)
        with pytest.raises(shmkv.NotSettled, match="settle"):
            other.peek(h.descriptor())
        other.lock_free = True
        clone = h.clone_handle()
        view = h.with_sequence_length(BS)
        opened = other.open(h.export(ttl=30))
        for v in (clone, view, opened):
            assert v.num_cached_tokens == len(prompt)
            assert (v.num_promoting_tokens, v.num_resident_tokens) == (len(prompt), 0)
        assert other.request("info", cache_id=h._cache_id)["promoting"] == 4
        held.gate.set()
        assert opened.settle() == len(prompt)
        assert opened.num_promoting_tokens == 0
        other.lock_free = False
        other.peek(h.descriptor()).check()
        other.lock_free = True
        peek = other.peek(h.descriptor())
        blocks = list(peek.block_table.physical_blocks)
        for layer in range(cfg.num_layers):
            k, _v = token_kv(prompt, layer, cfg.num_kv_heads, cfg.head_dim)
            got = other.pool[blocks, layer, 0].reshape(len(prompt), *k.shape[1:])
            assert got.equal(k)
        peek.check()
        assert clone.settle() == len(prompt)
        assert view.key_cache(0).equal(token_kv(prompt, 0, cfg.num_kv_heads, cfg.head_dim)[0][:BS])
        info = other.request("info", cache_id=opened._cache_id)
        assert "promoting" not in info
        for v in (clone, view, opened, h):
            v.close()
        coord.table.check_invariants()


def test_a_batch_step_commit_says_where_its_writes_began(unique_name, held):
    """A batch step that writes from the settled hit of a short early promotion
    publishes the prompt when it commits, as ``handle.commit(start=)`` does (it sent no
    start: later requests got 4 of 12 tokens)."""
    cfg = make_config(num_blocks=8)
    with held_coordinator(held, cfg, unique_name) as (coord, client, other):
        in_tier_only(client, PROMPT[: 3 * BS])
        h = _short_early(coord, client, held)
        assert h.settle() == BS
        step = client.batch([h]).prefill(start=BS)
        for layer in range(cfg.num_layers):
            k, v = token_kv(PROMPT, layer, cfg.num_kv_heads, cfg.head_dim)
            step.write(layer, k[BS:].contiguous(), v[BS:].contiguous())
        step.commit()
        assert read_prompt(other, PROMPT) == (3 * BS, True)
        h.close()


def test_a_batch_commit_with_bad_starts_is_refused_and_changes_nothing(unique_name, held):
    cfg = make_config(num_blocks=8)
    with held_coordinator(held, cfg, unique_name) as (coord, client, other):
        in_tier_only(client, PROMPT[: 3 * BS])
        h = _short_early(coord, client, held)
        assert h.settle() == BS
        write_kv(h, PROMPT, BS, len(PROMPT))
        ids = protocol.pack_i64s([h._cache_id])
        lens = protocol.pack_i64s([len(PROMPT)])
        for starts, error in (
            (protocol.pack_i64s([BS, BS]), shmkv.InvalidArgument),
            (protocol.pack_i64s([-1]), shmkv.InvalidArgument),
            (b"\x00" * 7, shmkv.WrongType),
        ):
            with pytest.raises(error):
                client.request("commit_batch", ids=ids, num_tokens=lens, starts=starts)
        assert read_prompt(other, PROMPT) == (BS, True)
        light = client.allocate(3)  # (a plain sequence: checked the same way)
        with pytest.raises(shmkv.InvalidArgument):
            client.request(
                "commit_batch",
                ids=protocol.pack_i64s([light._cache_id]),
                num_tokens=protocol.pack_i64s([3]),
                starts=protocol.pack_i64s([0, 0]),
            )
        client.request("commit_batch", ids=ids, num_tokens=lens, starts=protocol.pack_i64s([BS]))
        assert read_prompt(other, PROMPT) == (3 * BS, True)
        light.close()
        h.close()


def test_close_from_a_signal_handler_during_the_clients_own_copies(unique_name, monkeypatch):
    """A signal handler closes the client while that same thread runs the client's own
    promotion copies. close() cannot wait for them (it waited 2 x the timeout for the
    lock its own thread held, then closed the connection; the interrupted copy then
    landed in blocks the coordinator had freed and given to another prompt). It returns
    at once; the copy under way ends, no other begins, then the client closes and the
    allocation raises ``HandleClosed``. Another prompt written meanwhile reads back
    exactly."""
    monkeypatch.setattr(shmkv.Client, "copy_promotions", True)
    cfg = make_config(num_blocks=6)
    prompt, other = prompts_of(2, 6)
    orig = block_io.Mover._op_h2p
    gate, closed = threading.Event(), threading.Event()
    state: dict = {"copies": 0}

    def copy_in(mover, copy):
        state["copies"] += 1
        if state["copies"] == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # (its handler runs in this thread, now)
        gate.wait(20)
        orig(mover, copy)

    def on_signal(signum, frame):
        began = time.monotonic()
        state["client"].close()
        state["close_s"] = time.monotonic() - began
        closed.set()

    with tier_coordinator(cfg, unique_name) as (coord, writer):
        in_tier_only(writer, prompt)
        free = writer.stats()["free_blocks"] + writer.stats()["cached_blocks"]
        client = state["client"] = shmkv.connect(coord.address, timeout=1)

        def write_other():
            closed.wait(20)
            try:
                write_prompt(writer, other)  # (into the blocks the closing client had)
                state["wrote"] = True
            except shmkv.PoolExhausted:  # (they are still held: the client is not gone)
                state["wrote"] = False
            finally:
                gate.set()

        writer_thread = threading.Thread(target=write_other)
        writer_thread.start()
        monkeypatch.setattr(block_io.Mover, "_op_h2p", copy_in)
        previous = signal.signal(signal.SIGUSR1, on_signal)
        try:
            with pytest.raises(shmkv.HandleClosed):
                client.allocate(prompt=prompt)
        finally:
            signal.signal(signal.SIGUSR1, previous)
            gate.set()
            closed.set()
            writer_thread.join(20)
            client.close()
        monkeypatch.setattr(block_io.Mover, "_op_h2p", orig)
        assert state["close_s"] < 0.5, "close() waited for the copies its own thread ran"
        assert state["copies"] == 1  # the one under way ended; no other began
        assert not client.is_alive()
        if state["wrote"]:
            assert read_prompt(writer, other) == (len(other), True)
        st = wait_idle(writer)
        assert st["tier_io"]["promotions_in_flight"] == 0
        assert not [e.pins for e in coord.tiers.host.index.values() if e.pins]
        assert st["free_blocks"] + st["cached_blocks"] == free
        write_prompt(writer, other)
        assert read_prompt(writer, other) == (len(other), True)
