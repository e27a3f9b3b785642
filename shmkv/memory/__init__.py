"""Pool memory: the bytes every process maps, and their layout.

Owns what a pool is in memory, on either backend, and nothing about who uses it::

    layout.py   PoolConfig, the pool's shape and strides, validation
    pool.py     create the pool in the coordinator, attach to it in workers
    shm.py      the CPU backend: POSIX shared-memory segments passed by descriptor
    cuda.py     the GPU backend: CUDA IPC handles
    tables.py   the metadata segment: block tables and lengths (the coordinator
                writes, every process reads)
    views.py    the pool's two orders, as views of one another (no copy)

Imports: ``shmkv.errors`` and each other; torch only where a backend needs it. Never
the coordinator, the client, the tiers nor the integrations. This ``__init__`` imports
nothing.
"""
