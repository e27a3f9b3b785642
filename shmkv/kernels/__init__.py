"""Compute over the pool: paged attention and the native code under it.

    attention.py  paged attention over a pool's pages: the arguments, the plan a model
                  step's layers share
    gather.py     how a plan's sequences are grouped, their pages gathered (into an
                  AttentionWorkspace) and attended (SDPA, or the native decode kernel)
    native.py     loads the C libraries built with the package (``csrc/``), chooses
                  nothing at build time: the C picks its AVX2 / AVX-512 path by what
                  the CPU reports
    csrc/         the C sources (built by ``setup.py`` at install)

Imports: ``shmkv.errors`` and each other. Never the coordinator, the client nor the
tiers. This ``__init__`` imports nothing.
"""
