"""Truncate (slots given back, blocks past the new end released) and decode over slots
reserved ahead (``Batch.extend(reserve=)``, ``Step.advance``)."""

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
        max_sequences=32,
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


def _kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, n, H, D, generator=g)


def _write(step, kv: torch.Tensor) -> None:
    """Every layer of ``kv`` ([L, 2, T, H, D]) through the step's writes."""
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
