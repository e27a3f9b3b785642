"""The coordinator: the one process that owns the pool's metadata and answers clients.

Owns every decision about blocks and sequences: which block is free, cached or
referenced, what a sequence holds, who may read or write it, and when a block is
published, promoted or evicted. Where each is decided::

    server.py       Coordinator, SpawnedCoordinator: the loop, its address, its lock,
                    start and stop, the counters' stats; drives the tiers
                    (``shmkv.tiers``); holds the two parts below, made with the pool
    connections.py  Connections: the loop's client sockets: accept, read frames,
                    refuse, dispatch, hold what waits for a tier, answer, drop
    ops.py          Ops: one handler per wire operation: checks the arguments, calls
                    the sequence table, answers
    sequences.py    SequenceTable: every operation on sequences, all or nothing; it
                    composes the parts below, each an object that alone writes its data
    rows.py         one row per sequence: its blocks, lengths and the table writer
    refs.py         references: who holds a sequence, and freeing what nobody holds
    handoffs.py     hand-off tokens between processes
    prefix.py       the prefix index: allocation with a cached prefix, commits, publishing
    growth.py       growing a sequence, copy-on-write, forks, truncates
    decode.py       decode steps over many sequences (batches), kept batches
    allocator.py    BlockAllocator: free blocks, ref counts, LRU eviction
    metrics.py      the Prometheus endpoint
    sched.py        the CPU time slice the loop asks the kernel for

Imports: ``shmkv.errors``, ``shmkv.protocol``, ``shmkv.hashing``, ``shmkv.memory``
(the pool and its tables), ``shmkv.kernels`` and ``shmkv.tiers``. Never the client
package, the integrations nor the tools. This ``__init__`` imports nothing: import the
module you need (``shmkv.Coordinator`` is the public name).
"""
