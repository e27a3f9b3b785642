"""The checks of ``shmkv stress``: the values every process verifies, and the parent's own reads.

Owns the value scheme of a stress run: every K/V value written is a function of a
per-position *tag* and the (layer, K/V, position, head, dim) coordinates
(:func:`expected_kv`), and the tag of a prompt position is a function of its token id
alone (:func:`token_tags`), so a shared prefix (:func:`prefix_tokens`) written by any
process can be checked by any other. Owns, too, the checks the parent makes itself
(:class:`Checks`, an object :class:`~shmkv.tools.stress.StressRun` holds and calls):
hand-off tokens no worker could take are opened and read here; at the end hand-offs in
flight are waited out and leaked blocks counted; with tiers, every shared prefix is read
back once the pool is evicted, from the store through a second coordinator, and from the
restarted coordinator after ``--kill-coordinator``; and the tiers put under the pool for
that (and their temporary directory). It keeps the run's tally of values verified and
reads found corrupted, the parent's and, as the run passes on their reports, the
workers'. It does not start, route or kill workers, check what the workers read, or
decide whether the run passed (:mod:`shmkv.tools.stress` does); the run hands it the
parent's client and the tokens it could not deliver with each call that needs them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

if TYPE_CHECKING:  # (the library is imported by the run, not by the command line)
    from shmkv.client.client import Client
    from shmkv.tiers import DiskTier, HostTier
    from shmkv.tiers.redis_store import RedisTier

TOKEN_TAG_BASE = 1 << 30
# Values must be exact in the pool dtype: integers below 2**(mantissa bits + 1).
_MODULUS = {"float32": 65521, "float64": 65521, "float16": 2039, "bfloat16": 251}
_NUM_PREFIXES = 4
EXPECTED_ERRORS = ("PoolExhausted", "HandoffError")  # errors a worker may meet under pressure
_NUM_PREFIXES_TIERED = 24  # with tiers: more shared prefix blocks than the pool holds


def expected_kv(tags: List[int], start: int, num_layers: int, num_heads: int, head_dim: int, dtype):
    """K/V ``[num_layers, 2, len(tags), num_heads, head_dim]`` for positions from ``start``.

    Position ``start + i`` holds the values of tag ``tags[i]``.
    """
    import torch

    mod = _MODULUS[str(dtype).removeprefix("torch.")]
    tag = torch.tensor(tags, dtype=torch.int64)[None, None, :, None, None]
    pos = torch.arange(start, start + len(tags))[None, None, :, None, None]
    layer = torch.arange(num_layers)[:, None, None, None, None]
    kv = torch.arange(2)[None, :, None, None, None]
    head = torch.arange(num_heads)[None, None, None, :, None]
    dim = torch.arange(head_dim)[None, None, None, None, :]
    value = (tag * 40503 + pos * 9973 + layer * 7919 + kv * 104729 + head * 613 + dim * 31) % mod
    return value.to(dtype)


def prefix_tokens(index: int, length: int) -> List[int]:
    """Token ids of shared prompt prefix ``index`` (the same in every process)."""
    return [(index * 7919 + i * 31 + 11) % 50000 for i in range(length)]


def token_tags(tokens: List[int]) -> List[int]:
    """The tags of prompt positions: a function of the token id only."""
    return [TOKEN_TAG_BASE + t for t in tokens]


class Checks:
    """The parent's checks of a stress run, the tiers it puts under the pool, and the
    run's tally of verified values and corrupted reads (see the module).

    Args:
        args: the parsed command line.

    Attributes (read by the run for its progress and report): ``verified``,
    ``corrupted``, ``samples`` (the first corrupted reads, described), ``handoffs``
    (tokens the parent opened itself: ``drained``, or ``drain_expired`` before it could),
    ``prefix_checks`` (the parent's reads of every prefix, by where they came from).
    """

    def __init__(self, args: Any) -> None:
        self.args = args
        self.verified = 0
        self.corrupted = 0
        self.samples: List[str] = []
        self.handoffs = {"drained": 0, "drain_expired": 0}
        self.tier_dir: Optional[str] = None  # the disk tier's directory (with --tiers)
        self.prefix_checks: Dict[str, dict] = {}  # the parent's reads of every prefix

    def add_reads(self, verified: int, corrupted: int, samples: List[str]) -> None:
        """Count what a worker reported it verified and found corrupted (the first ten
        samples are kept)."""
        self.corrupted += corrupted
        self.verified += verified
        self.samples += samples[: max(0, 10 - len(self.samples))]

    # -- tiers and the store -------------------------------------------------------------

    def num_prefixes(self) -> int:
        """How many shared prompt prefixes the workers use (more with tiers)."""
        a = self.args
        return _NUM_PREFIXES_TIERED if a.tiers or a.redis else _NUM_PREFIXES

    def tier_specs(self, config) -> list:
        """The tiers under the pool: host memory (a quarter of the pool) and a disk
        directory (four times the pool) with ``--tiers``, the store with ``--redis``."""
        from shmkv.tiers import DiskTier, HostTier
        from shmkv.tiers.redis_store import RedisTier

        a = self.args
        specs: List[Union[HostTier, DiskTier, RedisTier]] = []
        if a.tiers:
            if self.tier_dir is None:
                self.tier_dir = a.tier_dir or tempfile.mkdtemp(prefix="shmkv-stress-tiers-")
            specs.append(HostTier(max(1, config.num_blocks // 4) * config.block_nbytes))
            specs.append(DiskTier(self.tier_dir, 4 * config.nbytes))
        if a.redis:
            specs.append(RedisTier(a.redis, timeout=2.0, max_backoff=1.0))
        return specs

    def remove_tier_dir(self) -> None:
        """Remove the disk tier's directory, where :meth:`tier_specs` made a temporary
        one (never ``--tier-dir``'s)."""
        if self.tier_dir is not None and not self.args.tier_dir:
            shutil.rmtree(self.tier_dir, ignore_errors=True)

    def wait_tiers_idle(self, client, timeout: float = 30.0) -> dict:
        """Stats once no tier copy, promotion or store write is pending (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = client.stats()
            io = stats.get("tier_io")
            if io is None or not (
                io["pending"]
                or io["promotions_in_flight"]
                or io.get("scanning")
                or io.get("redis_queued")
            ):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def evict_pool(self, client) -> None:
        """Take every free and cached block once (evicting every cached one), then give
        them back: prefixes read next come from the tiers (once their copies are done)."""
        self.wait_tiers_idle(client)
        stats = client.stats()
        cfg = client.config
        tokens = (stats["free_blocks"] + stats["cached_blocks"]) * cfg.block_size
        per = cfg.max_seq_len - cfg.max_seq_len % cfg.block_size
        counts = [per] * (tokens // per) + ([tokens % per] if tokens % per else [])
        if counts:
            client.close_many(client.allocate_many(counts))
        self.wait_tiers_idle(client)

    def check_prefixes(self, client, label: str) -> dict:
        """Allocate every shared prefix through ``client`` and compare what it hits with
        the tags every worker writes (``label``: where the hits come from). Closed after."""
        import torch

        from shmkv.errors import PoolExhausted

        cfg = client.config
        out = {"prefixes": 0, "hit_tokens": 0, "corrupted": 0, "exhausted": 0}
        for index in range(self.num_prefixes()):
            tokens = prefix_tokens(index, (2 + index % 3) * cfg.block_size)
            try:
                h = client.allocate(prompt=tokens)
            except PoolExhausted:
                out["exhausted"] += 1
                continue
            try:
                cached = h.num_cached_tokens
                out["prefixes"] += 1
                out["hit_tokens"] += cached
                if cached:
                    want = expected_kv(
                        token_tags(tokens[:cached]),
                        0,
                        h.num_layers,
                        h.num_heads,
                        h.head_dim,
                        h.dtype,
                    )
                    got = h.gather_all()[:, :, :cached]
                    self.verified += want.numel()
                    if not torch.equal(got, want):
                        out["corrupted"] += 1
                        self.corrupted += 1
                        self.samples.append(
                            f"{label}: prefix {index} ({cached} cached "
                            "tokens) differs from what the workers wrote"
                        )
            finally:
                h.close()
        self.prefix_checks[label] = out
        return out

    def check_store(self, config, name: str) -> None:
        """A second coordinator (another node) on the same store reads every prefix."""
        from shmkv.client.client import connect
        from shmkv.coordinator.server import Coordinator
        from shmkv.tiers.redis_store import RedisTier

        node = Coordinator(
            config, name=f"{name}-node2", tiers=[RedisTier(self.args.redis, timeout=2.0)]
        )
        node.start()
        try:
            with connect(node.address, timeout=self.args.client_timeout) as client:
                self.check_prefixes(client, "store, read by a second coordinator")
                stats = self.wait_tiers_idle(client)
                self.prefix_checks["store, read by a second coordinator"]["store"] = stats["tiers"][
                    -1
                ]
        finally:
            node.stop()

    # -- the parent's reads --------------------------------------------------------------

    def open_here(self, client: Client, token: bytes, tags: List[int]) -> None:
        """Open an undeliverable token through the parent's ``client``, verify it, and
        close it."""
        import torch

        from shmkv.errors import HandoffError

        try:
            h = client.open(token)
        except HandoffError:
            self.handoffs["drain_expired"] += 1
            return
        self.handoffs["drained"] += 1
        want = expected_kv(tags[: h.num_tokens], 0, h.num_layers, h.num_heads, h.head_dim, h.dtype)
        got = h.gather_all()
        self.verified += want.numel()
        if not torch.equal(got, want):
            self.corrupted += 1
            self.samples.append(f"parent: hand-off {h.cache_id} differs from its tags")
        h.close()

    def final_check(self, client: Client, pending: list) -> dict:
        """Open the ``(token, tags)`` no worker took (``pending``) through the parent's
        ``client``, wait out hand-offs in flight, measure leaks."""
        for token, tags in pending:
            self.open_here(client, token, tags)
        deadline = time.monotonic() + self.args.handoff_ttl + 10.0
        stats = client.stats()
        while (
            stats["handoffs"] or stats["referenced_blocks"] or stats["sequences"]
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = client.stats()
        keys = (
            "num_blocks",
            "free_blocks",
            "cached_blocks",
            "referenced_blocks",
            "sequences",
            "handoffs",
            "connections",
            "evictions",
            "cow_copies",
            "published_blocks",
            "expired_handoffs",
            "prefix_hit_tokens",
            "prefix_miss_tokens",
            "ops",
            "dropped_connections",
        )
        unaccounted = stats["num_blocks"] - stats["free_blocks"] - stats["cached_blocks"]
        return {
            "blocks_leaked": max(unaccounted, stats["referenced_blocks"]),
            "sequences_left": stats["sequences"],
            "handoffs_left": stats["handoffs"],
            "final_stats": {k: stats.get(k) for k in keys},
        }

    def check_restart(self, client: Client, config, name: str) -> dict:
        """After the coordinator's death: the parent's ``client`` sees it gone (and is
        closed), stale socket, fresh start (on the same tiers, whose prefixes it serves
        with the bytes written before the kill), clean stop."""
        from shmkv.client.client import connect
        from shmkv.coordinator.server import Coordinator, default_address
        from shmkv.errors import CoordinatorGone

        out: Dict[str, object] = {
            "parent_client_saw_gone": False,
            "stale_socket": os.path.exists(default_address(name)),
        }
        try:
            client.stats()
        except CoordinatorGone:
            out["parent_client_saw_gone"] = True
        client.close()
        try:
            coord = Coordinator.spawn(config, name=name, tiers=self.tier_specs(config) or None)
        except Exception as exc:
            out["restart"] = f"failed: {type(exc).__name__}: {exc}"
            return out
        try:
            with connect(coord.address, timeout=10) as restarted:
                stats = restarted.stats()
                out["restart"] = (
                    "ok"
                    if stats["free_blocks"] == config.num_blocks
                    else f"unexpected stats {stats}"
                )
                if self.args.tiers or self.args.redis:
                    self.wait_tiers_idle(restarted)  # the disk's index is scanned
                    self.check_prefixes(restarted, "restarted coordinator's tiers")
        finally:
            coord.stop()
        out["socket_removed_after_stop"] = not os.path.exists(coord.address)
        return out
