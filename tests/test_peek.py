"""Reading a sequence another process holds through its descriptor
(``KvCacheHandle.descriptor``, ``Client.peek``): no round trip, no reference of the
reader's own, and a check after the copy that the sequence outlived it."""

import struct

import pytest
import workers
from conftest import SPAWN, join_or_kill

import shmkv
from shmkv.client.handle import _PEEK, _PEEK_MAGIC, _PEEK_VERSION


def _write(h, seed: int) -> None:
    """Every layer of ``h``, K and V, from ``workers.pattern`` (seed per layer)."""
    n = h.num_tokens
    for layer in range(h.num_layers):
        h.write(
            layer,
            workers.pattern(seed + layer, n, h.num_heads, h.head_dim),
            workers.pattern(seed + 100 + layer, n, h.num_heads, h.head_dim),
            start=0,
        )


def test_another_process_reads_a_sequence_through_its_descriptor(coord, client):
    h = client.allocate(prompt=list(range(10)))
    _write(h, 5)
    h.commit()
    results = SPAWN.Queue()
    child = SPAWN.Process(
        target=workers.peek_and_read, args=(coord.address, h.descriptor(), 10, 5, results)
    )
    child.start()
    try:
        assert results.get(timeout=60) == (True, 10, True)
    finally:
        assert join_or_kill(child) == 0
    assert coord.ops_by_type.get("export", 0) == 0 and "open" not in coord.ops_by_type
    h.close()


def test_a_peek_holds_nothing_and_its_check_fails_once_the_sequence_is_gone(coord, client):
    reader = shmkv.connect(coord.address, timeout=10)
    try:
        h = client.allocate(prompt=list(range(12)))
        _write(h, 1)
        before = client.stats()
        peek = reader.peek(h.descriptor())
        assert peek.block_table == h.block_table and peek.cache_id == h.cache_id
        peek.check()
        after = client.stats()
        assert (after["sequences"], after["referenced_blocks"]) == (
            before["sequences"],
            before["referenced_blocks"],
        )
        blocks = set(peek.block_table.physical_blocks)
        h.close()  # the only reference: the blocks go back to the pool
        with pytest.raises(shmkv.UnknownCache):
            peek.check()
        # its blocks are another sequence's now, written with other bytes: the check
        # still refuses (what a copy read meanwhile is not the peeked sequence's)
        other = client.allocate(client.stats()["free_blocks"] * coord.config.block_size)
        assert blocks <= set(other.block_table.physical_blocks)
        _write(other, 9)
        with pytest.raises(shmkv.UnknownCache):
            peek.check()
        with pytest.raises(shmkv.UnknownCache):
            reader.peek(_descriptor_of(h))
        other.close()
    finally:
        reader.close()


def _descriptor_of(h) -> bytes:
    """The descriptor ``h`` gave while open (a closed handle gives none)."""
    return _PEEK.pack(
        _PEEK_MAGIC, _PEEK_VERSION, bytes.fromhex(h.client.instance), h._cache_id, h._slot
    )


def test_a_closed_handle_gives_no_descriptor(client):
    h = client.allocate(4)
    h.close()
    with pytest.raises(shmkv.HandleClosed):
        h.descriptor()


def test_peek_without_lock_free_reads_asks_the_coordinator(coord, client):
    reader = shmkv.connect(coord.address, timeout=10)
    try:
        reader.lock_free = False  # as on a machine whose loads may be reordered
        h = client.allocate(prompt=list(range(9)))
        rows = coord.ops_by_type.get("rows", 0)
        peek = reader.peek(h.descriptor())
        assert peek.block_table == h.block_table
        peek.check()
        assert coord.ops_by_type.get("rows", 0) == rows + 2
        h.close()
        with pytest.raises(shmkv.UnknownCache):
            peek.check()
    finally:
        reader.close()


I64_MAX, I64_MIN = (1 << 63) - 1, -(1 << 63)


@pytest.mark.parametrize(
    "damage, error",
    [
        (lambda d: d.decode("latin-1"), shmkv.WrongType),
        (lambda d: 12345, shmkv.WrongType),
        (lambda d: None, shmkv.WrongType),
        (lambda d: d[:-1], shmkv.InvalidArgument),
        (lambda d: d + b"\0", shmkv.InvalidArgument),
        (lambda d: b"", shmkv.InvalidArgument),
        (lambda d: b"XXXX" + d[4:], shmkv.InvalidArgument),
        (lambda d: d[:4] + bytes([_PEEK_VERSION + 1]) + d[5:], shmkv.InvalidArgument),
        (lambda d: d[:8] + b"\xff" * 8 + d[16:], shmkv.InvalidArgument),  # other coordinator
        (lambda d: d[:24] + struct.pack("<q", I64_MAX), shmkv.InvalidArgument),
        (lambda d: d[:24] + struct.pack("<q", I64_MIN), shmkv.InvalidArgument),
        (lambda d: d[:24] + struct.pack("<q", -1), shmkv.InvalidArgument),
        (lambda d: d[:16] + struct.pack("<q", 0) + d[24:], shmkv.InvalidArgument),
        (lambda d: d[:16] + struct.pack("<q", I64_MIN) + d[24:], shmkv.InvalidArgument),
        (lambda d: d[:16] + struct.pack("<q", I64_MAX) + d[24:], shmkv.UnknownCache),
        (lambda d: d[:24] + struct.pack("<q", 1), shmkv.UnknownCache),  # another slot
    ],
)
def test_a_bad_descriptor_is_refused_and_changes_nothing(coord, client, damage, error):
    h = client.allocate(prompt=list(range(8)))
    before = client.stats()
    with pytest.raises(error):
        client.peek(damage(h.descriptor()))
    after = client.stats()
    for key in ("sequences", "referenced_blocks", "free_blocks", "connections"):
        assert after[key] == before[key]
    assert client.peek(h.descriptor()).block_table == h.block_table  # still served
    h.close()


def test_a_descriptor_of_another_coordinator_is_refused(coord, client, small_config, unique_name):
    with (
        shmkv.Coordinator(small_config, name=unique_name + "-2") as other,
        shmkv.connect(other.address, timeout=10) as theirs,
    ):
        h = theirs.allocate(4)
        with pytest.raises(shmkv.InvalidArgument, match="another coordinator"):
            client.peek(h.descriptor())
        h.close()


def test_a_peeked_sequence_torn_down_with_its_coordinator(small_config, unique_name):
    """The reader's coordinator gone: check says so instead of vouching for the bytes."""
    coord = shmkv.Coordinator(small_config, name=unique_name)
    with coord:
        reader = shmkv.connect(coord.address, timeout=10)
        holder = shmkv.connect(coord.address, timeout=10)
        h = holder.allocate(4)
        peek = reader.peek(h.descriptor())
    try:
        with pytest.raises(shmkv.CoordinatorGone):
            peek.check()
    finally:
        holder.close()
        reader.close()
