"""Truncate (slots given back, blocks past the new end released) and decode over slots
reserved ahead (``Batch.extend(reserve=)``, ``Step.advance`` / ``next_decode``), and
their hostile uses: stale steps (descriptors on another client, advanced steps), prefix
sharing, forks by another client, bounds, wrong tensors, quantized pools and
ShmkvCache's handles after a generate."""

import pytest
import torch

import shmkv

L, H, D, BS = 2, 4, 8, 4


@pytest.fixture
def cfg():
    return shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=64,
        block_size=BS,
        dtype=torch.float32,
        max_sequences=64,
        max_seq_len=64,
    )


@pytest.fixture
def coord(cfg, unique_name):
    with shmkv.Coordinator(cfg, name=unique_name) as c:
        yield c


@pytest.fixture
def client(coord):
    with shmkv.connect(coord.address, timeout=20) as c:
        yield c


@pytest.fixture
def other(coord):
    with shmkv.connect(coord.address, timeout=20) as c:
        yield c


def _kv(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, n, H, D, generator=g).to(dtype)


def _write(step, kv: torch.Tensor) -> None:
    for layer in range(L):
        step.write(layer, kv[layer, 0].contiguous(), kv[layer, 1].contiguous())


def test_truncate_gives_back_slots_and_blocks_and_keeps_the_rest(client, coord):
    h = client.allocate(10)  # 3 blocks
    kv = _kv(10, 1)
    h.write_all(kv, 0)
    free = client.stats()["free_blocks"]
    assert h.truncate(5) == 1  # 2 blocks hold 5 tokens
    assert h.num_tokens == 5 and len(h.block_table.physical_blocks) == 2
    assert client.stats()["free_blocks"] == free + 1
    assert torch.equal(h.gather_all(), kv[:, :, :5])
    assert h.truncate(5) == 0  # nothing to give back
    # the sequence grows again from its new end, over the slots it gave back
    h.extend(4)
    more = _kv(4, 2)
    h.write_all(more, 5)
    assert torch.equal(h.gather_all(), torch.cat([kv[:, :, :5], more], 2))
    assert h.truncate(0) == 3 and h.num_tokens == 0
    coord.table.check_invariants()


@pytest.mark.parametrize("bad", [11, 2**63 - 1, 2**64, -1])
def test_truncate_past_the_end_or_negative_is_refused_and_changes_nothing(client, bad):
    h = client.allocate(10)
    free = client.stats()["free_blocks"]
    with pytest.raises(shmkv.OutOfRange, match="only shortens|outside|holds"):
        h.truncate(bad)
    batch = client.batch([h])
    with pytest.raises((shmkv.OutOfRange, shmkv.InvalidArgument, shmkv.LimitExceeded)):
        batch.truncate([bad])
    assert h.num_tokens == 10 and client.stats()["free_blocks"] == free


def test_truncate_refuses_wrong_types(client):
    h = client.allocate(6)
    for bad in (True, 2.0, "3", None):
        with pytest.raises(shmkv.WrongType):
            h.truncate(bad)
    with pytest.raises(shmkv.InvalidArgument, match="one per sequence|ints"):
        client.batch([h]).truncate([1, 2])
    assert h.num_tokens == 6


def test_truncate_of_a_sequence_with_another_reference_is_refused(client, coord):
    h = client.allocate(9)
    view = h.with_sequence_length(9)  # could read past a new end
    with pytest.raises(shmkv.InvalidArgument, match="references"):
        h.truncate(2)
    with pytest.raises(shmkv.InvalidArgument, match="fixed length"):
        view.truncate(2)
    assert h.num_tokens == 9 and view.num_tokens == 9
    view.close()
    assert h.truncate(2) == 2
    coord.table.check_invariants()


def test_all_or_none_over_a_batch(client):
    a, b = client.allocate(8), client.allocate(3)
    batch = client.batch([a, b])
    with pytest.raises(shmkv.OutOfRange):
        batch.truncate([4, 5])  # b holds 3
    assert (a.num_tokens, b.num_tokens) == (8, 3)
    assert batch.truncate([4, 3]) == 1
    assert (a.num_tokens, b.num_tokens) == (4, 3)


def test_a_published_block_truncated_into_is_copied_on_the_next_write(client, coord):
    prompt = list(range(100, 108))  # 2 full blocks
    h = client.allocate(prompt=prompt)
    kv = _kv(8, 3)
    h.write_all(kv, 0)
    assert h.commit() == 2  # both published
    h.truncate(6)  # into the second, published block
    h.extend(2)
    other = _kv(2, 4)
    h.write_all(other, 6)  # must not write the published block
    assert torch.equal(h.gather_all(), torch.cat([kv[:, :, :6], other], 2))
    hit = client.allocate(prompt=prompt)
    assert hit.num_cached_tokens == 8
    assert torch.equal(hit.gather_all(), kv)  # what the prefix cache serves is unchanged
    coord.table.check_invariants()


def test_prefix_keys_past_the_new_end_are_dropped(client, coord):
    prompt = list(range(1, 9))
    h = client.allocate(prompt=prompt)
    h.extend(4, tokens=[9, 10, 11, 12])  # 3 keyed blocks
    h.write_all(_kv(12, 5), 0)
    h.truncate(10)  # inside the third keyed block: no keys from there on
    h.extend(2, tokens=[77, 78])  # other tokens than the first time
    h.write_all(_kv(2, 6), 10)
    assert h.commit() == 2  # the third block has no key: never published
    assert client.allocate(prompt=list(range(1, 13))).num_cached_tokens == 8
    # truncated at a block boundary, keys stay open and the next ids key the next block
    g = client.allocate(prompt=list(range(200, 208)))
    g.extend(4, tokens=[1, 2, 3, 4])
    g.truncate(8)
    g.extend(4, tokens=[5, 6, 7, 8])
    g.write_all(_kv(12, 7), 0)
    assert g.commit() == 3
    assert client.allocate(prompt=list(range(200, 208)) + [5, 6, 7, 8]).num_cached_tokens == 12
    coord.table.check_invariants()


def test_a_step_that_outlives_a_truncate_does_not_write_released_blocks(client):
    h = client.allocate(4)
    batch = client.batch([h])
    step = batch.extend(4)  # slots 4..7: a second block
    batch.truncate(4)  # that block is released...
    other = client.allocate(4)  # ...and goes to another sequence
    mine = _kv(4, 8)
    other.write_all(mine, 0)
    k = torch.ones(4, H, D)
    with pytest.raises(shmkv.StaleStep):
        step.write(0, k, k)
    assert torch.equal(other.gather_all(), mine)


def test_decode_over_slots_reserved_ahead(client, coord):
    hs = [client.allocate(5), client.allocate(5)]
    batch = client.batch(hs)
    base = _kv(5, 9)
    for h in hs:
        h.write_all(base, 0)
    written = []
    step = batch.extend(1, reserve="block")  # position 5; 6 and 7 reserved
    assert [h.num_tokens for h in hs] == [8, 8]
    round_trips = 1
    for t in range(9):
        assert step.positions.tolist() == [5 + t, 5 + t]
        kv = _kv(2, 100 + t)  # [L, 2, B=2, H, D]: one token a sequence
        _write(step, kv)
        written.append(kv)
        nxt = step.advance()
        if nxt is None:
            nxt = batch.extend(1, reserve="block")
            round_trips += 1
        step = nxt
    # tokens 5..13 written; the last step (14) and the reserved 15 given back
    assert step.positions.tolist() == [14, 14]
    assert round_trips == 3  # at positions 5, 8 and 12 (not once a token)
    assert batch.truncate(step.seq_lens - 1) == 0
    for i, h in enumerate(hs):
        assert h.num_tokens == 14
        want = torch.cat([base] + [kv[:, :, i : i + 1] for kv in written], 2)
        assert torch.equal(h.gather_all(), want)
    coord.table.check_invariants()


def test_reserve_is_checked(client):
    h = client.allocate(3)
    batch = client.batch([h])
    for bad, err in ((-1, shmkv.InvalidArgument), (1.5, shmkv.WrongType), (True, shmkv.WrongType)):
        with pytest.raises(err):
            batch.extend(1, reserve=bad)
    with pytest.raises(shmkv.InvalidArgument, match="one int count"):
        batch.extend([1], reserve=2)
    with pytest.raises(shmkv.LimitExceeded):
        batch.extend(1, reserve=2**62)
    assert h.num_tokens == 3
    step = batch.extend(1, reserve=0)
    assert h.num_tokens == 4 and step.num_tokens == 1


def test_a_kept_batch_steps_right_after_a_truncate(client, coord):
    hs = [client.allocate(3) for _ in range(3)]
    batch = client.batch(hs)
    for _ in range(6):  # long enough for the coordinator to keep the batch
        batch.extend(1)
    batch.truncate([4, 5, 6])
    step = batch.extend(1)
    assert step.positions.tolist() == [4, 5, 6]
    assert [h.num_tokens for h in hs] == [5, 6, 7]
    again = batch.extend(1)
    assert again.positions.tolist() == [5, 6, 7]
    coord.table.check_invariants()


def test_next_decode_crosses_reserved_blocks_with_no_round_trip(client, coord):
    hs = [client.allocate(3), client.allocate(3)]
    batch = client.batch(hs)
    base = _kv(3, 11)
    for h in hs:
        h.write_all(base, 0)
    sent = []
    request = client.request

    def counted(op, **args):
        sent.append(op)
        return request(op, **args)

    client.request = counted
    step = batch.extend(1, reserve=12)  # positions 3..15: four blocks, one round trip
    written = []
    for t in range(13):
        assert step.positions.tolist() == [3 + t, 3 + t]
        kv = _kv(2, 200 + t)
        _write(step, kv)
        written.append(kv)
        if t < 12:
            step = step.next_decode()
            assert step is not None
    assert step.next_decode() is None  # position 16 is not reserved: extend then
    assert sent == ["extend_batch"] or sent == ["extend_kept"]
    client.request = request
    for i, h in enumerate(hs):
        want = torch.cat([base] + [kv[:, :, i : i + 1] for kv in written], 2)
        assert torch.equal(h.gather_all(), want)
    coord.table.check_invariants()


def test_next_decode_after_a_fork_copies_the_shared_block_first(client):
    h = client.allocate(2)
    batch = client.batch([h])
    step = batch.extend(1, reserve=5)  # positions 2..7 reserved
    kv = _kv(1, 12)
    _write(step, kv)
    child = h.fork()  # every block shared now
    before = child.gather_all()
    nxt = step.next_decode()
    assert nxt is not None
    other = _kv(1, 13)
    _write(nxt, other)
    assert torch.equal(child.gather_all(), before)  # the fork's bytes never change
    assert torch.equal(h.gather_all()[:, :, 3:4], other)


# -- hostile uses -------------------------------------------------------------------------


def _free(client) -> int:
    return client.stats()["free_blocks"]


# -- stale steps ------------------------------------------------------------------------------


def test_a_descriptor_step_on_another_client_cannot_write_a_block_released_and_reused(
    client, other, coord
):
    h = client.allocate(4)
    h.write_all(_kv(4, 1), 0)
    batch = client.batch([h])
    step = batch.extend(4)  # positions 4..7: a second block
    remote = other.step_from(step.descriptor())
    assert remote.slot_mapping.tolist() == step.slot_mapping.tolist()
    assert batch.truncate(4) == 1  # the second block released...
    taker = client.allocate(4)  # ...and given to another sequence
    mine = _kv(4, 2)
    taker.write_all(mine, 0)
    ones = torch.ones(4, H, D)
    with pytest.raises(shmkv.StaleStep):
        remote.write(0, ones, ones)
    with pytest.raises(shmkv.StaleStep):
        remote.write_all(torch.ones(L, 2, 4, H, D))
    assert torch.equal(taker.gather_all(), mine)
    assert torch.equal(h.gather_all(), _kv(4, 1))
    coord.table.check_invariants()


def test_a_descriptor_step_cannot_write_a_released_block_that_is_still_free(client, other, coord):
    h = client.allocate(4)
    batch = client.batch([h])
    step = batch.extend(4)
    remote = other.step_from(step.descriptor())
    block = int(step.slot_mapping[0]) // BS
    batch.truncate(4)
    ones = torch.ones(4, H, D)
    with pytest.raises(shmkv.StaleStep):
        remote.write(0, ones, ones)  # the block is nobody's: no write
    # the block, taken next, holds no byte of the refused write
    taker = client.allocate(4)
    assert block in taker.block_table.physical_blocks
    assert not bool((client.pool[block] == 1).all())
    coord.table.check_invariants()


def test_a_descriptor_made_before_a_truncate_is_refused_when_rebuilt_after(client, other, coord):
    h = client.allocate(4)
    batch = client.batch([h])
    desc = batch.extend(4).descriptor()
    batch.truncate(4)
    with pytest.raises(shmkv.StaleStep):
        other.step_from(desc)
    coord.table.check_invariants()


def test_a_descriptor_step_past_a_truncate_inside_the_block_writes_only_the_owned_block(
    client, other, coord
):
    """No block released: the epoch stays; a stale write may land only in the sequence's
    own block, never in another sequence's."""
    h = client.allocate(5)
    base = _kv(5, 3)
    h.write_all(base, 0)
    neighbour = client.allocate(8)
    theirs = _kv(8, 4)
    neighbour.write_all(theirs, 0)
    batch = client.batch([h])
    step = batch.extend(2)  # positions 5, 6: the second block
    remote = other.step_from(step.descriptor())
    assert batch.truncate(5) == 0
    before = client.pool.clone()
    remote.write_all(torch.full((L, 2, 2, H, D), 7.0))
    changed = (client.pool != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set(h.block_table.physical_blocks)
    assert torch.equal(neighbour.gather_all(), theirs)
    assert h.num_tokens == 5 and torch.equal(h.gather_all(), base)
    coord.table.check_invariants()


def test_an_advanced_step_that_outlives_a_truncate_does_not_write_a_reused_block(client, coord):
    h = client.allocate(4)
    batch = client.batch([h])
    step = batch.extend(1, reserve=7)  # positions 4..11: blocks 1 and 2
    steps = [step]
    while int(step.positions[0]) < 9:
        step = step.next_decode()
        assert step is not None
        steps.append(step)
    assert "_root" in step.__dict__  # position 9: advanced from the step at 8
    assert batch.truncate(5) == 1  # block 2 released
    taker = client.allocate(4)
    mine = _kv(4, 5)
    taker.write_all(mine, 0)
    one = torch.ones(1, H, D)
    for s in steps[4:]:  # positions 8 and 9: the released block
        with pytest.raises(shmkv.StaleStep):
            s.write(0, one, one)
    assert torch.equal(taker.gather_all(), mine)
    coord.table.check_invariants()


def test_advance_and_next_decode_stop_after_a_truncate(client, coord):
    h = client.allocate(2)
    batch = client.batch([h])
    step = batch.extend(1, reserve=5)  # positions 2..7
    nxt = step.advance()
    assert nxt is not None
    batch.truncate(nxt.seq_lens)  # 4: the slot of the next step given back
    assert step.advance() is None and nxt.advance() is None
    assert nxt.next_decode() is None  # position 4 is not reserved any more
    assert h.num_tokens == 4
    coord.table.check_invariants()


def test_a_step_made_before_another_client_forks_cannot_write_the_shared_block(
    client, other, coord
):
    h = client.allocate(2)
    h.write_all(_kv(2, 6), 0)
    batch = client.batch([h])
    step = batch.extend(1, reserve=5)  # positions 2..7
    _write(step, _kv(1, 7))
    nxt = step.next_decode()  # position 3, made before the fork
    theirs = other.open(h.export(30))
    child = theirs.fork()  # another process shares every block
    with pytest.raises(shmkv.InvalidArgument, match="references"):
        h.truncate(2)  # the export's handle is another reference
    theirs.close()
    before = child.gather_all()
    with pytest.raises(shmkv.StaleStep):
        _write(nxt, _kv(1, 8))
    assert torch.equal(child.gather_all(), before)
    again = step.next_decode()  # from a fresh read: the shared block is copied first
    assert again is not None
    new = _kv(1, 9)
    _write(again, new)
    assert torch.equal(child.gather_all(), before)
    assert torch.equal(h.gather_all()[:, :, 3:4], new)
    assert h.truncate(4) == 1  # held once now: positions 4..7 given back
    assert torch.equal(child.gather_all(), before)
    coord.table.check_invariants()


# -- kept batches, truncate to 0, bounds ----------------------------------------------------


def test_a_kept_batch_truncated_then_reserving_ahead_steps_right(client, coord):
    hs = [client.allocate(3) for _ in range(3)]
    batch = client.batch(hs)
    for _ in range(6):  # long enough for the coordinator to keep the batch
        batch.extend(1)
    assert [h.num_tokens for h in hs] == [9, 9, 9]
    batch.truncate([4, 5, 6])
    step = batch.extend(1, reserve="block")  # [5, 6, 7] after: one more fits every block
    assert step.positions.tolist() == [4, 5, 6]
    assert [h.num_tokens for h in hs] == [6, 7, 8]
    nxt = step.next_decode()
    assert nxt is not None and nxt.positions.tolist() == [5, 6, 7]
    kv = _kv(3, 10)
    _write(nxt, kv)
    assert nxt.next_decode() is None
    after = batch.extend(1)
    assert after.positions.tolist() == [6, 7, 8]
    assert [h.num_tokens for h in hs] == [7, 8, 9]
    again = batch.extend(1)
    assert again.positions.tolist() == [7, 8, 9]
    for i, h in enumerate(hs):
        assert torch.equal(h.gather_all()[:, :, 5 + i : 6 + i], kv[:, :, i : i + 1])
    coord.table.check_invariants()


def test_a_kept_batch_steps_right_after_a_handle_truncate(client, coord):
    """A truncate through one handle (not the batch) must not leave the batch stepping
    from its old lengths."""
    hs = [client.allocate(3) for _ in range(2)]
    batch = client.batch(hs)
    for _ in range(6):
        batch.extend(1)
    hs[0].truncate(5)
    step = batch.extend(1)
    assert step.positions.tolist() == [5, 9]
    assert [h.num_tokens for h in hs] == [6, 10]
    assert batch.extend(1).positions.tolist() == [6, 10]
    coord.table.check_invariants()


def test_truncate_to_zero_then_reserve_a_block(client, coord):
    h = client.allocate(6)
    h.write_all(_kv(6, 11), 0)
    free = _free(client)
    batch = client.batch([h])
    assert batch.truncate(0) == 2
    assert h.num_tokens == 0 and _free(client) == free + 2
    step = batch.extend(1, reserve="block")  # position 0; 1..3 reserved
    assert h.num_tokens == 4 and len(h.block_table.physical_blocks) == 1
    written = []
    for t in range(4):
        assert step.positions.tolist() == [t]
        kv = _kv(1, 20 + t)
        _write(step, kv)
        written.append(kv)
        nxt = step.next_decode()
        if t < 3:
            assert nxt is not None
            step = nxt
        else:
            assert nxt is None
    assert torch.equal(h.gather_all(), torch.cat(written, 2))
    assert batch.truncate(0) == 1 and h.num_tokens == 0
    assert batch.extend(1, reserve=3).positions.tolist() == [0]
    coord.table.check_invariants()


def test_reserve_past_max_seq_len_is_refused_and_changes_nothing(client, coord):
    h = client.allocate(60)
    batch = client.batch([h])
    free = _free(client)
    for reserve in (4, 10, 64):
        with pytest.raises(shmkv.LimitExceeded):
            batch.extend(1, reserve=reserve)
        assert h.num_tokens == 60 and _free(client) == free
    step = batch.extend(1, reserve=3)  # exactly up to 64
    assert h.num_tokens == 64 and step.positions.tolist() == [60]
    with pytest.raises(shmkv.LimitExceeded):
        batch.extend(1, reserve="block")
    assert h.num_tokens == 64
    batch.truncate(63)
    step = batch.extend(1, reserve="block")  # the block is full: nothing reserved
    assert h.num_tokens == 64 and step.positions.tolist() == [63]
    assert step.next_decode() is None
    coord.table.check_invariants()


def test_reserve_past_max_seq_len_in_a_batch_changes_no_sequence(client, coord):
    a, b = client.allocate(10), client.allocate(58)
    batch = client.batch([a, b])
    free = _free(client)
    with pytest.raises(shmkv.LimitExceeded):
        batch.extend(1, reserve=6)  # b would reach 65
    assert (a.num_tokens, b.num_tokens) == (10, 58) and _free(client) == free
    coord.table.check_invariants()


def test_reserve_with_the_pool_exhausted_changes_nothing(client, coord):
    hogs = [client.allocate(64) for _ in range(3)] + [client.allocate(56)]  # 62 blocks
    h = client.allocate(4)  # 63: one block left
    batch = client.batch([h])
    assert _free(client) == 1
    with pytest.raises(shmkv.PoolExhausted):
        batch.extend(1, reserve=7)  # 12 tokens: two blocks more
    assert h.num_tokens == 4 and _free(client) == 1
    step = batch.extend(1, reserve=3)  # the last block
    assert h.num_tokens == 8 and _free(client) == 0 and step.positions.tolist() == [4]
    assert len(hogs) == 4
    coord.table.check_invariants()


# -- prefix sharing -------------------------------------------------------------------------


def test_truncating_a_prefix_hit_never_changes_the_publisher_or_the_cache(client, coord):
    prompt = list(range(300, 308))  # 2 full blocks
    a = client.allocate(prompt=prompt)
    kv = _kv(8, 12)
    a.write_all(kv, 0)
    assert a.commit() == 2
    b = client.allocate(prompt=prompt + [1, 2])
    assert b.num_cached_tokens == 8
    b.write_all(_kv(2, 13), 8)
    assert b.truncate(6) == 1  # into the second, shared block
    batch = client.batch([b])
    step = batch.extend(1, reserve="block")  # position 6; 7 reserved
    first = _kv(1, 14)
    _write(step, first)
    nxt = step.next_decode()
    assert nxt is not None
    second = _kv(1, 15)
    _write(nxt, second)
    assert torch.equal(a.gather_all(), kv)
    assert torch.equal(b.gather_all(), torch.cat([kv[:, :, :6], first, second], 2))
    hit = client.allocate(prompt=prompt)
    assert hit.num_cached_tokens == 8 and torch.equal(hit.gather_all(), kv)
    coord.table.check_invariants()


def test_truncating_the_publisher_with_a_hit_alive_keeps_the_hit(client, coord):
    prompt = list(range(400, 412))  # 3 full blocks
    a = client.allocate(prompt=prompt)
    kv = _kv(12, 16)
    a.write_all(kv, 0)
    assert a.commit() == 3
    b = client.allocate(prompt=prompt)
    assert b.num_cached_tokens == 12
    assert a.truncate(5) == 1  # the third block stays with b (and the cache)
    a.extend(3)
    a.write_all(_kv(3, 17), 5)
    batch = client.batch([a])
    step = batch.extend(1, reserve=3)  # positions 8..11, a fresh block
    _write(step, _kv(1, 18))
    assert torch.equal(b.gather_all(), kv)
    b.close()
    hit = client.allocate(prompt=prompt)
    assert hit.num_cached_tokens == 12 and torch.equal(hit.gather_all(), kv)
    coord.table.check_invariants()


def test_truncating_a_fork_never_changes_its_parent(client, coord):
    h = client.allocate(10)
    kv = _kv(10, 19)
    h.write_all(kv, 0)
    child = h.fork()
    assert child.truncate(5) == 1
    batch = client.batch([child])
    step = batch.extend(1, reserve="block")
    while step is not None:
        _write(step, torch.full((L, 2, 1, H, D), 3.0))
        step = step.next_decode()
    assert torch.equal(h.gather_all(), kv)
    assert child.num_tokens == 8
    assert torch.equal(child.gather_all()[:, :, :5], kv[:, :, :5])
    assert bool((child.gather_all()[:, :, 5:] == 3.0).all())
    assert h.truncate(2) == 2  # the parent's own blocks 1 and 2 (1 is shared: kept by child)
    assert torch.equal(child.gather_all()[:, :, :5], kv[:, :, :5])
    coord.table.check_invariants()


# -- wrong tensors ----------------------------------------------------------------------------


def test_a_wrong_tensor_to_an_advanced_step_is_refused_and_writes_nothing(client, coord):
    hs = [client.allocate(1), client.allocate(1)]
    batch = client.batch(hs)
    step = batch.extend(1, reserve=2)  # positions 1..3
    nxt = step.advance()
    assert nxt is not None and "_root" in nxt.__dict__
    before = client.pool.clone()
    good = torch.zeros(2, H, D)
    bad = [
        (torch.zeros(3, H, D), good, shmkv.InvalidArgument),  # three tokens, not two
        (torch.zeros(2, H + 1, D), good, shmkv.InvalidArgument),
        (good, torch.zeros(2, H, D - 1), shmkv.InvalidArgument),
        (torch.zeros(2, H, D, dtype=torch.float64), good, (shmkv.InvalidArgument, shmkv.WrongType)),
        (torch.zeros(H, 2, D).transpose(0, 1), good, shmkv.InvalidArgument),  # not contiguous
        (good.numpy(), good, shmkv.WrongType),
    ]
    for k, v, err in bad:
        with pytest.raises(err):
            nxt.write(0, k, v)
    for layer, err in ((L, shmkv.OutOfRange), (-1, shmkv.OutOfRange), (True, shmkv.WrongType)):
        with pytest.raises(err):
            nxt.write(layer, good, good)
    with pytest.raises(shmkv.InvalidArgument):
        nxt.write_all(torch.zeros(L, 2, 3, H, D))
    assert torch.equal(client.pool, before)
    # a good write after the refused ones lands where it should
    kv = _kv(2, 21)
    _write(nxt, kv)
    for i, h in enumerate(hs):
        assert torch.equal(h.gather_all()[:, :, 2:3], kv[:, :, i : i + 1])
    coord.table.check_invariants()


# -- quantized pools, large batches --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_decode_over_reserved_slots_in_a_quantized_pool(dtype, unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=L, num_kv_heads=H, head_dim=D, num_blocks=64, block_size=BS, dtype=dtype
    )
    with (
        shmkv.Coordinator(cfg, name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        hs = [client.allocate(3), client.allocate(6)]
        batch = client.batch(hs)
        step = batch.extend(1, reserve=9)
        written = []
        for t in range(10):
            raw = torch.randint(-100, 100, (L, 2, 2, H, D), dtype=torch.int8)
            kv = raw.view(dtype) if dtype != torch.int8 else raw
            _write(step, kv)
            written.append(kv)
            nxt = step.next_decode()
            if t < 9:
                assert nxt is not None
                step = nxt
        batch.truncate(step.seq_lens)
        for i, (h, start) in enumerate(zip(hs, (3, 6))):
            assert h.num_tokens == start + 10
            got = h.gather_all()[:, :, start:].contiguous().view(torch.uint8)
            want = torch.cat([kv[:, :, i : i + 1] for kv in written], 2).contiguous()
            assert torch.equal(got, want.view(torch.uint8))
        coord.table.check_invariants()


def test_decode_over_reserved_slots_in_a_batch_past_the_copy_unit_threshold(client, coord):
    """64 sequences: a step's writes take the per-write copy-unit views (>= 64 tokens),
    an advanced step adding its shift to the root's index."""
    hs = [client.allocate(1 + i % 2) for i in range(64)]  # 64 blocks: the pool
    batch = client.batch(hs)
    step = batch.extend(1, reserve="block")  # up to the end of every first block
    assert step.num_tokens == 64
    written = []
    while step is not None:
        kv = _kv(64, 30 + len(written))
        _write(step, kv)
        written.append((step.positions.clone(), kv))
        step = step.next_decode()
    assert len(written) >= 2
    for i, h in enumerate(hs):
        got = h.gather_all()
        for positions, kv in written:
            pos = int(positions[i])
            assert torch.equal(got[:, :, pos : pos + 1], kv[:, :, i : i + 1])
    coord.table.check_invariants()


# -- ShmkvCache ------------------------------------------------------------------------------


def _model(layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attn", ["sdpa", "shmkv"])
@pytest.mark.parametrize("new_tokens", [1, 2, 3, 5, 9])
def test_shmkv_cache_handles_hold_what_the_rows_stored(attn, new_tokens, unique_name):
    from shmkv.integrations.transformers import ShmkvCache, pool_config

    model = _model()
    model.set_attn_implementation(attn)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    cfg = pool_config(model.config, num_blocks=64, block_size=4)
    with (
        shmkv.Coordinator(cfg, name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
        ShmkvCache(client) as cache,
    ):
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                max_new_tokens=new_tokens,
                do_sample=False,
            )
        stored = out.shape[1] - 1  # the last token is never forwarded
        assert cache.get_seq_length() == stored
        handles = cache.handles
        assert [h.num_tokens for h in handles] == [stored, stored]
        assert [h.num_tokens for h in cache.handles] == [stored, stored]  # asked twice
        # no block held past what the rows store
        assert all(len(h.block_table.physical_blocks) == -(-stored // 4) for h in handles)
        coord.table.check_invariants()
        # generating again from the cache continues over what it stored
        with torch.no_grad():
            again = model.generate(
                out,
                attention_mask=torch.ones_like(out),
                past_key_values=cache,
                max_new_tokens=3,
                do_sample=False,
            )
        assert [h.num_tokens for h in cache.handles] == [again.shape[1] - 1] * 2
        coord.table.check_invariants()


def test_shmkv_cache_batch_one_handle_matches_dynamic_cache(unique_name):
    from transformers import DynamicCache

    from shmkv.integrations.transformers import ShmkvCache, pool_config

    model = _model()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        want = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=ref,
            max_new_tokens=6,
            do_sample=False,
        )
    cfg = pool_config(model.config, num_blocks=64, block_size=4)
    with (
        shmkv.Coordinator(cfg, name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
        ShmkvCache(client) as cache,
    ):
        with torch.no_grad():
            got = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                max_new_tokens=6,
                do_sample=False,
            )
        assert got.tolist() == want.tolist()
        h = cache.handle
        n = got.shape[1] - 1
        assert h.num_tokens == n
        for layer in range(h.num_layers):
            torch.testing.assert_close(
                h.key_cache(layer), ref.layers[layer].keys[0, :, :n].transpose(0, 1)
            )
            torch.testing.assert_close(
                h.value_cache(layer), ref.layers[layer].values[0, :, :n].transpose(0, 1)
            )
        coord.table.check_invariants()
