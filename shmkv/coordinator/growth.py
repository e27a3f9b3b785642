"""Growth of sequences: extends, copy-on-write, prepared writes, forks and truncates.

Owns reserving more slots in a sequence or in every sequence of a batch (the general
path, one sequence at a time; the array fast paths are ``shmkv.coordinator.decode``),
making the blocks a write needs writable in place (claimed when only this sequence
holds them, else copied on write, through the ``copy_block`` callback, counted in
``cow_copies``), forking a sequence (every block shared, copy-on-write on the next
write) and truncating one. Each call plans, checks everything, then applies (all or
none).

Owns no table state of its own: a sequence's blocks and length are stored by
``shmkv.coordinator.rows`` (:meth:`~shmkv.coordinator.rows.Rows.append_blocks`,
:meth:`~shmkv.coordinator.rows.Rows.set_length`,
:meth:`~shmkv.coordinator.rows.Rows.add_tokens`,
:meth:`~shmkv.coordinator.rows.Rows.replace_block`,
:meth:`~shmkv.coordinator.rows.Rows.truncate`, :meth:`~shmkv.coordinator.rows.Rows.publish`),
its prefix keys and commits by ``shmkv.coordinator.prefix``
(:meth:`~shmkv.coordinator.prefix.Prefix.extend_keys`,
:meth:`~shmkv.coordinator.prefix.Prefix.inherit`,
:meth:`~shmkv.coordinator.prefix.Prefix.truncate_keys`,
:meth:`~shmkv.coordinator.prefix.Prefix.check_settled`), and its references by
``shmkv.coordinator.refs`` (:meth:`~shmkv.coordinator.refs.Refs.held`,
:meth:`~shmkv.coordinator.refs.Refs.batch_sequences`,
:meth:`~shmkv.coordinator.refs.Refs.ref`). Blocks come from and go back to the pool.
"""

from __future__ import annotations

from array import array
from typing import Callable, List, Optional, Sequence as Seq, Tuple, Union

from shmkv import hashing
from shmkv.coordinator.prefix import Prefix
from shmkv.coordinator.refs import Refs
from shmkv.coordinator.rows import Rows, Sequence, _check_count, format_cache_id
from shmkv.errors import InvalidArgument, OutOfRange, PoolExhausted, WrongType


class Growth:
    """Extends, copy-on-write, prepared writes, forks and truncates (see the module doc).

    Args:
        rows: the rows part (every store of blocks and lengths).
        refs: the references part (what a connection holds).
        prefix: the prefix part (keys, commits, the early-answer rule).
        copy_block: ``copy_block(src, dst)`` copies one block's K/V bytes (all ranks).
    """

    def __init__(
        self, rows: Rows, refs: Refs, prefix: Prefix, copy_block: Callable[[int, int], None]
    ):
        self._rows = rows
        self._refs = refs
        self._prefix = prefix
        self.pool = rows.pool
        self.block_size = rows.block_size
        self.copy_block = copy_block
        self.counters = {"cow_copies": 0}

    def _writable(self, seq: Sequence, index: int) -> bool:
        """Whether block ``index`` of ``seq`` can be written in place (claims it if so)."""
        block_id = seq.block_ids[index]
        return self.pool.owner[block_id] == seq.cache_id or self.pool.claim(block_id, seq.cache_id)

    def _needs_copy(self, seq: Sequence, index: int) -> bool:
        """Whether writing block ``index`` of ``seq`` needs a private copy first: it is
        neither this sequence's to write nor claimable (shared or published)."""
        pool, block_id = self.pool, seq.block_ids[index]
        return pool.owner[block_id] != seq.cache_id and not (
            pool.ref_cnt[block_id] == 1 and pool.block_key[block_id] is None
        )

    def _cow(self, seq: Sequence, index: int) -> None:
        """Give block ``index`` of ``seq`` a private copy (the caller counted it)."""
        self._rows.touch(seq.slot)
        old = seq.block_ids[index]
        new = self.pool.allocate(1, seq.cache_id)
        assert new is not None
        self.copy_block(old, new[0])
        self._rows.replace_block(seq, index, new[0])
        self.pool.decref((old,))
        self.counters["cow_copies"] += 1

    def _plan_extend(
        self, conn_id: int, item: object
    ) -> Tuple[Sequence, int, Optional[List[int]], int, bool]:
        if not (isinstance(item, (list, tuple)) and len(item) in (2, 3)):
            raise WrongType(
                "extend item must be [cache_id, num_tokens] or [cache_id, num_tokens, tokens]"
            )
        seq = self._refs.held(conn_id, item[0])
        num = _check_count("num_tokens", item[1])
        tokens = item[2] if len(item) == 3 else None
        if tokens is not None:
            if not isinstance(tokens, list) or len(tokens) != num:
                raise InvalidArgument(f"tokens must be a list of {num} token ids")
            try:
                hashing.pack_tokens(tokens)
            except (OverflowError, TypeError):
                raise InvalidArgument("token ids must be ints in the int64 range") from None
        partial = seq.num_tokens % self.block_size
        self._rows.check_length(seq.num_tokens + num, lambda: format_cache_id(seq.cache_id))
        total = self._rows.blocks_for(seq.num_tokens + num)
        need = total - len(seq.block_ids)
        copy_last = bool(num and partial and self._needs_copy(seq, len(seq.block_ids) - 1))
        return seq, num, tokens, need, copy_last

    def extend_many(self, conn_id: int, items: Seq) -> List[dict]:
        """Reserve token slots in several sequences, all or none.

        ``items`` are ``[cache_id, num_tokens]`` or ``[cache_id, num_tokens, tokens]``.
        Returns, per item, ``{"start", "num_tokens", "table_from", "blocks"}``:
        ``blocks`` replaces the block table from index ``table_from`` on. A shared
        partly filled last block gets a private copy first (copy-on-write).
        """
        plans = [self._plan_extend(conn_id, item) for item in items]
        if len({id(plan[0]) for plan in plans}) != len(plans):
            raise InvalidArgument("extend_many names a sequence twice")
        need = sum(plan[3] + plan[4] for plan in plans)
        if need > self.pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: need {need} blocks, {self.pool.num_available} free or "
                f"evictable (num_blocks={self.pool.num_blocks}); free handles or raise num_blocks"
            )
        results = []
        for seq, num, tokens, need_blocks, copy_last in plans:
            table_from = len(seq.block_ids)
            if num and seq.num_tokens % self.block_size:
                table_from -= 1
                if copy_last:
                    self._cow(seq, table_from)
                else:
                    self._writable(seq, table_from)
            start = seq.num_tokens
            if need_blocks:
                new = self.pool.allocate(need_blocks, seq.cache_id)
                assert new is not None  # (counted above)
                self._rows.append_blocks(seq, new, start + num)
            else:
                self._rows.set_length(seq, start + num)
            self._prefix.extend_keys(seq, num, tokens)
            results.append(
                {
                    "start": start,
                    "num_tokens": seq.num_tokens,
                    "table_from": table_from,
                    "blocks": seq.block_ids[table_from:],
                }
            )
        return results

    def extend_general(
        self,
        conn_id: int,
        cache_ids: Seq[int],
        counts: Union[int, Seq[int]],
        tokens: Optional[List[List[int]]] = None,
    ) -> array[int]:
        """``SequenceTable.extend_batch`` one sequence at a time: any counts, token ids,
        copies of shared last blocks, new blocks; names every error. ``counts`` were
        checked to lie in ``[0, max_seq_len]`` (the facade did)."""
        seqs = self._refs.batch_sequences(conn_id, cache_ids)
        num_seqs = len(seqs)
        if isinstance(counts, int):
            counts = [counts] * num_seqs
        elif len(counts) != num_seqs:
            raise InvalidArgument(f"{len(counts)} counts for a batch of {num_seqs} sequences")
        if tokens is not None:
            if not isinstance(tokens, list) or len(tokens) != num_seqs:
                raise InvalidArgument(
                    f"tokens must be one list of token ids per sequence ({num_seqs})"
                )
            for ids, num in zip(tokens, counts):
                if not isinstance(ids, list) or len(ids) != num:
                    raise InvalidArgument(
                        f"tokens must hold exactly the step's count of token "
                        f"ids for each sequence (expected {num})"
                    )
                try:
                    hashing.pack_tokens(ids)
                except (OverflowError, TypeError):
                    raise InvalidArgument("token ids must be ints in the int64 range") from None
        bs, owner, pool = self.block_size, self.pool.owner, self.pool
        max_len = self._rows.max_seq_len
        # Pass 1, check and count. Most decode steps add a token to a block the sequence
        # already owns; only the others (a new block, a shared last block) are listed.
        need, special = 0, []
        for i, (seq, num) in enumerate(zip(seqs, counts)):
            if not num:
                continue
            old = seq.num_tokens
            if old + num > max_len:
                self._rows.check_length(old + num, format_cache_id(seq.cache_id))
            have = len(seq.block_ids)
            if old + num <= have * bs and (
                not old % bs or owner[seq.block_ids[-1]] == seq.cache_id
            ):
                continue  # the plain case: no block, no copy
            special.append(i)
            total = (old + num + bs - 1) // bs
            if total > have:
                need += total - have
            if (
                old % bs
                and owner[seq.block_ids[-1]] != seq.cache_id
                and self._needs_copy(seq, have - 1)
            ):
                need += 1
        if need > pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: the step needs {need} blocks, {pool.num_available} free or "
                f"evictable (num_blocks={pool.num_blocks}); free handles or raise num_blocks"
            )
        # Pass 2, apply: the plain case is a length store; the listed ones take blocks.
        rows = self._rows
        for i in special:
            seq, num = seqs[i], counts[i]
            old, have = seq.num_tokens, len(seq.block_ids)
            if old % bs and owner[seq.block_ids[-1]] != seq.cache_id:
                if self._needs_copy(seq, have - 1):
                    self._cow(seq, have - 1)
                else:
                    pool.claim(seq.block_ids[-1], seq.cache_id)
            total = (old + num + bs - 1) // bs
            if total > have:
                new = pool.allocate(total - have, seq.cache_id)
                assert new is not None  # (counted above)
                rows.append_blocks(seq, new, old)  # blocks first, the length below
        lens = array("q", bytes(8 * len(seqs)))
        for i in rows.add_tokens(seqs, counts, lens):
            self._prefix.extend_keys(seqs[i], counts[i], tokens[i] if tokens is not None else None)
        return lens

    def prepare_batch(
        self, conn_id: int, cache_ids: Seq[int], starts: Seq[int], counts: Seq[int]
    ) -> array:
        """Make slots ``[starts[i], starts[i] + counts[i])`` of each sequence writable in
        place (a step over slots already reserved, such as a prompt's prefill), all or
        none. Returns every sequence's current length (int64 array)."""
        seqs = self._refs.batch_sequences(conn_id, cache_ids)
        if not len(starts) == len(counts) == len(seqs):
            raise InvalidArgument(
                f"starts and counts need one entry per sequence "
                f"({len(seqs)}), got {len(starts)} and {len(counts)}"
            )
        bs, plans, num_copies = self.block_size, [], 0
        for seq, start, num in zip(seqs, starts, counts):
            if start < 0 or num < 0 or start + num > seq.num_tokens:
                raise OutOfRange(
                    f"slots [{start}, {start + num}) of "
                    f"{format_cache_id(seq.cache_id)} are not all reserved "
                    f"({seq.num_tokens} are); extend first"
                )
            if num:
                first, last = start // bs, (start + num - 1) // bs
                copies = [i for i in range(first, last + 1) if self._needs_copy(seq, i)]
                num_copies += len(copies)
                plans.append((seq, first, last, copies))
        if num_copies > self.pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: copy-on-write needs {num_copies} blocks, "
                f"{self.pool.num_available} free or evictable"
            )
        for seq, first, last, copies in plans:
            for i in range(first, last + 1):
                if i in copies:
                    self._cow(seq, i)
                else:
                    self._writable(seq, i)
        return array("q", [seq.num_tokens for seq in seqs])

    def prepare_write(self, conn_id: int, cache_id: int, start: int, num_tokens: int) -> dict:
        """Make the blocks of slots ``[start, start + num_tokens)`` writable in place.

        Blocks only this sequence references are claimed; shared or published blocks
        get a private copy (copy-on-write). Returns the sequence's info (full table).
        """
        seq = self._refs.held(conn_id, cache_id)
        _check_count("start", start)
        _check_count("num_tokens", num_tokens)
        if start + num_tokens > seq.num_tokens:
            raise OutOfRange(
                f"slots [{start}, {start + num_tokens}) lie past the "
                f"{seq.num_tokens} reserved in {format_cache_id(cache_id)}; "
                f"extend first"
            )
        if num_tokens:
            first, last = start // self.block_size, (start + num_tokens - 1) // self.block_size
            copies = {i for i in range(first, last + 1) if self._needs_copy(seq, i)}
            if len(copies) > self.pool.num_available:
                raise PoolExhausted(
                    f"pool exhausted: copy-on-write needs {len(copies)} "
                    f"blocks, {self.pool.num_available} free or evictable"
                )
            for i in range(first, last + 1):
                if i in copies:
                    self._cow(seq, i)
                else:
                    self._writable(seq, i)
        return seq.info()

    def fork(self, conn_id: int, cache_id: int) -> dict:
        """A new sequence sharing every block of ``cache_id`` (copy-on-write on writes),
        with its committed blocks and its loss guard (``shmkv.coordinator.prefix``, early answers).

        Raises:
            NotSettled: a tier still copies blocks of it in (the coordinator holds a fork
                asked then until they are in).
        """
        parent = self._refs.held(conn_id, cache_id)
        self._prefix.check_settled(parent, "fork")
        self._rows.check_slots(1)
        child = self._rows.new_sequence(parent.root, None)
        self.pool.incref(parent.block_ids)
        self._rows.touch(parent.slot)  # its last block is shared now
        self._prefix.inherit(parent, child)
        self._rows.publish(child, list(parent.block_ids), parent.num_tokens)
        self._refs.ref(conn_id, child)
        return child.info()

    def truncate_batch(self, conn_id: int, cache_ids: Seq[int], num_tokens: Seq[int]) -> int:
        """Shorten each sequence of a batch to ``num_tokens[i]`` tokens, all or none: its
        slots past that are given back (slots reserved ahead and never written, tokens
        rejected by a draft model), and the blocks past its new last one are released.
        Blocks that stay keep their bytes and their sharing: a kept block that is shared
        or published is copied on the next write, as any. Prefix keys past the new end
        are dropped; when the end falls inside a keyed block, the sequence gets no keys
        from there on (the ids of that block's first tokens are not kept). Returns the
        number of blocks released. Refused for a sequence with more than one reference
        (a clone, a fixed-length view or an export could read past the new end).

        A step made before the truncate that writes a released block fails on its next
        write (the epoch moves, and the block is no longer the sequence's).
        """
        seqs = self._refs.batch_sequences(conn_id, cache_ids)
        if len(num_tokens) != len(seqs):
            raise InvalidArgument(
                f"num_tokens needs one entry per sequence ({len(seqs)}), got {len(num_tokens)}"
            )
        for seq, num in zip(seqs, num_tokens):
            if seq.num_refs > 1:
                # A clone, a fixed-length view or an export may read past the new end.
                raise InvalidArgument(
                    f"truncate of {format_cache_id(seq.cache_id)}: it has {seq.num_refs} "
                    "references (clones, views or exports); only a sequence held once "
                    "can be truncated (fork it, and truncate the fork)"
                )
            if not 0 <= num <= seq.num_tokens:
                raise OutOfRange(
                    f"truncate of {format_cache_id(seq.cache_id)} to {num} tokens: it holds "
                    f"{seq.num_tokens} (a truncate only shortens)"
                )
        released = 0
        for seq, num in zip(seqs, num_tokens):
            if num == seq.num_tokens:
                continue
            dropped = self._rows.truncate(seq, num)
            if dropped:
                self.pool.decref(reversed(dropped))  # (tail first, as a release does)
                released += len(dropped)
            self._prefix.truncate_keys(seq, num)
        if released:
            # Writers that checked their blocks' owners check again: a released block is
            # no longer theirs to write, though their handle stays open.
            self.pool.epoch[0] += 1
        return released
