"""The client side: what a worker process holds after it attaches to a pool.

Owns the client's connection and everything that resolves into the shared pool without
asking the coordinator: handles and their block tables, batches and their steps, and
the slot arithmetic both use::

    client.py   Client, connect(): attach once, allocate, open, peek, stats; copies a
                promotion's blocks itself when the coordinator asks it to
    link.py     Link: the socket to the coordinator (connect, frames, timeouts, a
                coordinator gone), held by each client
    handle.py   KvCacheHandle: one sequence (write, read, commit, fork, export)
    batch.py    Batch, Step: many sequences advanced by one decode step
    slots.py    (block table, position) -> slot in the pool

Decides nothing about blocks: every allocation, reference and publish is the
coordinator's answer to a request sent through ``link.py``.

Imports: ``shmkv.errors``, ``shmkv.protocol``, ``shmkv.hashing``, ``shmkv.memory``,
``shmkv.kernels`` and ``shmkv.memory.block_io`` (the copies a client runs), plus two
names the coordinator defines for the memory it shares (``PROMOTING``,
``format_cache_id``). Never the coordinator's loop, the integrations nor the tools.
This ``__init__`` imports nothing (``shmkv.Client`` is the public name).
"""
