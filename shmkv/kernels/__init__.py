"""Compute over the pool: paged attention and the native code under it.

    attention.py  paged decode attention over a pool's blocks (torch and native paths)
    native.py     loads the C libraries built with the package (``csrc/``), chooses
                  nothing at build time: the C picks its AVX2 / AVX-512 path by what
                  the CPU reports
    csrc/         the C sources (built by ``setup.py`` at install)

Imports: ``shmkv.errors`` and each other. Never the coordinator, the client nor the
tiers. This ``__init__`` imports nothing.
"""
