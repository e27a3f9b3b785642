"""Point-to-point moves between two nodes (``shmkv.integrations.distributed``): two spawned
processes, each with its own coordinator (its own pool) and a Gloo process group of
world size 2 over loopback."""

from __future__ import annotations

import datetime
import hashlib
import socket
import traceback

import pytest
import torch
from conftest import SPAWN, join_or_kill

import shmkv

LAYERS, HEADS, DIM, BS = 3, 4, 8, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_for(tokens, start: int, heads: int = HEADS, dim: int = DIM) -> torch.Tensor:
    """Deterministic K/V of ``tokens`` at positions ``start..``: what a model would
    compute, as a function of (token id, position) only, so both nodes can check it."""
    n = len(tokens)
    ids = torch.tensor(tokens, dtype=torch.float32).view(1, 1, n, 1, 1)
    pos = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1, 1)
    layer = torch.arange(LAYERS, dtype=torch.float32).view(LAYERS, 1, 1, 1, 1)
    which = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    grid = torch.arange(heads * dim, dtype=torch.float32).view(1, 1, 1, heads, dim)
    return (ids * 1000 + pos + layer * 0.5 + which * 0.25 + grid * 1e-3).contiguous()


def _config(head_dim: int = DIM, device: str = "cpu") -> shmkv.PoolConfig:
    return shmkv.PoolConfig(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=head_dim,
        num_blocks=64,
        block_size=BS,
        dtype=torch.float32,
        device=device,
    )


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()


def node(rank: int, port: int, name: str, role: str, prompt: list, extra: dict, results):
    """One node: its own coordinator and client, a group of two (Gloo unless ``extra``
    says ``backend``), one move."""
    from shmkv.integrations import distributed as sd

    device = extra.get("device", "cpu")
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    torch.distributed.init_process_group(
        extra.get("backend", "gloo"),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        with (
            shmkv.Coordinator(_config(extra.get("head_dim", DIM), device), name=name) as coord,
            shmkv.connect(coord.address, timeout=10) as client,
        ):
            results.put((role, *_run(role, client, sd, prompt, extra)))
    except BaseException as exc:
        results.put((role, "error", type(exc).__name__, str(exc), traceback.format_exc()))
    finally:
        torch.distributed.destroy_process_group()


def _send_then_disown(client, sd, prompt):
    """Node A's side of a move by hand, up to the last block, then a trailer that says
    the sequence no longer had the blocks it was read from."""
    h = client.allocate(prompt=prompt)
    h.write_all(kv_for(prompt, 0), start=0)
    h.commit()
    cfg, cpu = client.config, torch.device("cpu")
    link = sd._Link(1, None, 20, cpu)
    fp = sd._fingerprint_words(cfg)
    root = client.request("info", cache_id=h._cache_id)["root"]
    link.send_i64(
        [
            sd.MAGIC,
            sd.VERSION,
            sd.OK,
            len(prompt),
            len(prompt),
            len(root),
            fp[0],
            fp[1],
            1,
            cfg.block_size,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.itemsize,
            cfg.tp_size,
            0,
        ],
        "header",
    )
    link.wait(link.isend(torch.tensor(prompt, dtype=torch.int64)), "ids")
    link.wait(link.isend(torch.frombuffer(bytearray(root), dtype=torch.uint8)), "root")
    status, have, num_send, _ = link.recv_i64(4, "reply")
    rows = sd._block_rows(client)
    for block in list(h.block_table.physical_blocks)[have // BS :]:
        buf = torch.empty(rows.shape[1] * rows.shape[2], dtype=torch.uint8)
        sd._gather(rows, [block], buf)
        link.wait(link.isend(buf), "K/V")
    link.send_i64([sd.ERR_SENDER], "trailer")
    h.close()
    return "ok", status, num_send


def _run(role, client, sd, prompt, extra):
    if role == "A" and extra.get("disown"):
        return _send_then_disown(client, sd, prompt)
    if role == "B" and extra.get("disown"):
        try:
            sd.recv_sequence(client, 0, timeout=20)
            refused = None
        except sd.MoveFailed as exc:
            refused = str(exc)
        st = client.stats()
        with client.allocate(prompt=prompt) as again:
            return "ok", refused, st["sequences"], again.num_cached_tokens
    if role == "A":  # prefill, then hand the sequence to node B
        if extra.get("fragment"):  # every other pool block belongs to another sequence
            h, others = client.allocate(0), []
            for lo in range(0, len(prompt), BS):
                h.extend(len(prompt[lo : lo + BS]), tokens=prompt[lo : lo + BS])
                others.append(client.allocate(1))
        else:
            h = client.allocate(prompt=prompt, cache_salt=extra.get("salt"))
        h.write_all(kv_for(prompt, 0, h.num_heads, h.head_dim).to(h.device), start=0)
        h.commit()
        stats = sd.send_sequence(
            h,
            1,
            tokens=prompt,
            timeout=20,
            chunk_bytes=extra.get("chunk_bytes", sd.DEFAULT_CHUNK_BYTES),
        )
        digest = _digest(h.gather_all())
        h.close()
        return "ok", stats, digest
    # role B: maybe hold a prefix already, receive, then decode on
    cached = extra.get("cached", 0)
    if cached:
        pre = client.allocate(prompt=prompt[:cached], cache_salt=extra.get("salt"))
        pre.write_all(kv_for(prompt[:cached], 0).to(pre.device), start=0)
        pre.commit()
        pre.close()  # its blocks stay cached, published
    if extra.get("fragment"):  # free blocks with holes between them
        plain = [client.allocate(BS) for _ in range(40)]
        for i, p in enumerate(plain):
            if i % 2:
                p.close()
    h = sd.recv_sequence(client, 0, timeout=20)
    got = h.gather_all().cpu()
    same = torch.equal(got, kv_for(prompt, 0))
    digest = _digest(got)
    received = (h.num_tokens, h.num_cached_tokens)
    new = [7, 8, 9]
    start = h.extend(len(new), tokens=new)
    h.write_all(kv_for(new, start).to(h.device), start=start)
    h.commit()
    decoded = torch.equal(h.gather_all().cpu(), kv_for(prompt + new, 0))
    k, v = h.kv_cache(1)
    expected = kv_for(prompt + new, 0)
    decoded = (
        decoded and torch.equal(k.cpu(), expected[1, 0]) and torch.equal(v.cpu(), expected[1, 1])
    )
    salt = extra.get("salt")
    # published on B (under the sender's salt): a full prefix hit now
    again = client.allocate(prompt=prompt + new, cache_salt=salt)
    reused = again.num_cached_tokens
    again.close()
    info = (*received, reused)
    if salt is not None:  # and none without the salt
        with client.allocate(prompt=prompt + new) as unsalted:
            info += (unsalted.num_cached_tokens,)
    h.close()
    return "ok", info, digest, same, decoded


def _move(unique_name, prompt, a_extra=None, b_extra=None, timeout=90):
    port = free_port()
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=node,
            args=(0, port, unique_name + "-a", "A", prompt, a_extra or {}, results),
            name="node-A",
        ),
        SPAWN.Process(
            target=node,
            args=(1, port, unique_name + "-b", "B", prompt, b_extra or {}, results),
            name="node-B",
        ),
    ]
    for p in procs:
        p.start()
    try:
        out = dict(
            (r[0], r[1:]) for r in (results.get(timeout=timeout), results.get(timeout=timeout))
        )
    finally:
        for p in procs:
            join_or_kill(p, 30)
    return out


def _ok(out, role):
    if out[role][0] != "ok":
        pytest.fail(f"node {role}: {out[role][1]}: {out[role][2]}\n{out[role][3]}")
    return out[role][1:]


def test_prefill_on_a_continues_decoding_on_b(unique_name):
    prompt = list(range(100, 137))  # 37 tokens: 9 full blocks and a partial one
    out = _move(unique_name, prompt, a_extra={"chunk_bytes": 3 * 4096})  # several chunks
    stats, digest_a = _ok(out, "A")
    info, digest_b, same, decoded = _ok(out, "B")
    assert digest_a == digest_b and same  # B's K/V equals A's, byte for byte
    assert decoded  # and decoding goes on from there on B
    assert info == (37, 0, 40)  # nothing cached before; all 10 blocks published
    assert stats.num_sent_tokens == 37 and stats.num_sent_blocks == 10
    block_bytes = LAYERS * 2 * BS * HEADS * DIM * 4
    assert stats.sent_bytes == 10 * block_bytes


def test_a_prefix_already_on_b_is_not_sent(unique_name):
    prompt = list(range(500, 530))  # 30 tokens; B holds the first 16 already
    out = _move(unique_name, prompt, b_extra={"cached": 16})
    stats, digest_a = _ok(out, "A")
    info, digest_b, same, decoded = _ok(out, "B")
    assert same and decoded and digest_a == digest_b
    assert info[:2] == (30, 16)
    assert stats.num_reused_tokens == 16 and stats.num_sent_tokens == 14
    assert stats.num_sent_blocks == 4  # blocks 4..7 (the last one partial)


@pytest.mark.parametrize("chunk_bytes", [3 * 4096, 1 << 20])
def test_fragmented_block_tables_move_through_staging(unique_name, chunk_bytes):
    prompt = list(range(900, 1000))  # 25 blocks, none next to another
    out = _move(
        unique_name,
        prompt,
        a_extra={"fragment": True, "chunk_bytes": chunk_bytes},
        b_extra={"fragment": True},
    )
    stats, digest_a = _ok(out, "A")
    info, digest_b, same, decoded = _ok(out, "B")
    assert same and decoded and digest_a == digest_b
    assert info == (100, 0, 100) and stats.num_sent_blocks == 25


def test_different_layouts_refuse_to_move(unique_name):
    out = _move(unique_name, list(range(10)), b_extra={"head_dim": DIM * 2})
    assert out["A"][:2] == ("error", "LayoutMismatch")
    assert out["B"][:2] == ("error", "LayoutMismatch")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pools_move_over_gloo_through_host_memory(unique_name):
    prompt = list(range(300, 337))
    extra = {"device": "cuda:0", "chunk_bytes": 3 * 4096}
    out = _move(unique_name, prompt, a_extra=extra, b_extra={"device": "cuda:0", "cached": 8})
    stats, digest_a = _ok(out, "A")
    info, digest_b, same, decoded = _ok(out, "B")
    assert same and decoded and digest_a == digest_b and stats.num_reused_tokens == 8


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL between two ranks needs two CUDA GPUs",
)
def test_cuda_pools_move_over_nccl(unique_name):
    prompt = list(range(300, 337))
    a = {"device": "cuda:0", "backend": "nccl"}
    b = {"device": "cuda:1", "backend": "nccl", "cached": 8}
    out = _move(unique_name, prompt, a_extra=a, b_extra=b)
    stats, digest_a = _ok(out, "A")
    info, digest_b, same, decoded = _ok(out, "B")
    assert same and decoded and digest_a == digest_b and stats.num_reused_tokens == 8


def test_a_salted_sequence_is_published_under_its_salt_on_b_without_passing_it(unique_name):
    """A allocated the sequence with a cache salt and sends it without ``cache_salt``:
    B's blocks are published under the salted keys (its coordinator knew the salt's
    root), so B hits them with that salt and never without it; a prefix B held under
    the salt is reused."""
    prompt = list(range(40, 70))  # 30 tokens
    salt = b"tenant-7"
    out = _move(unique_name, prompt, a_extra={"salt": salt}, b_extra={"salt": salt, "cached": 8})
    stats, digest_a = _ok(out, "A")
    info, digest_b, same, decoded = _ok(out, "B")
    assert same and decoded and digest_a == digest_b
    assert info == (30, 8, 32, 0)  # 8 reused under the salt, 32 hit, 0 unsalted
    assert stats.num_reused_tokens == 8


def test_blocks_the_sender_no_longer_had_once_read_are_discarded_by_the_receiver(unique_name):
    """The trailer after the last block says the sending sequence lost or replaced its
    blocks while they were read: B keeps no sequence and publishes nothing of them."""
    prompt = list(range(800, 812))  # 3 full blocks
    out = _move(unique_name, prompt, a_extra={"disown": True}, b_extra={"disown": True})
    status, num_send = _ok(out, "A")
    assert status == 0 and num_send == 3
    refused, sequences, hit = _ok(out, "B")
    assert refused is not None and "discarded" in refused
    assert sequences == 0 and hit == 0
