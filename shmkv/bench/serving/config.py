"""The serving suite's settings: deployments, routes, datasets, sizes (``--quick`` or
not), the servers' environment and limits.
"""

from __future__ import annotations

from typing import Any, Dict

NAME = "serving"
BLOCK = 128  # vLLM's block size on the CPU, and the pool's (docs/vllm.md: one key a block)
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 256  # the model of the vllm suite
MAX_MODEL_LEN = 4096
REPLICAS = 3
DEPLOYMENTS = {
    "a": "3 replicas, round robin, no connector",
    "b": "3 replicas, cache aware, no connector",
    "c": "3 replicas, round robin, shmkv",
    "d": "3 replicas, cache aware, shmkv",
    "e": "1 replica, no connector",
}
# deployment -> (replica set, router policy or None: straight to replica 0)
ROUTES = {
    "a": ("plain", "round_robin"),
    "b": ("plain", "cache_aware"),
    "c": ("shmkv", "round_robin"),
    "d": ("shmkv", "cache_aware"),
    "e": ("plain", None),
}
DATASETS = ("prefix", "chat", "zipf", "random")
# What the servers run with here: quiet, offline, and fit for a shared 2-CPU machine.
SERVER_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
UNSET_ENV = ("VLLM_CPU_KVCACHE_SPACE",)  # it would override --kv-cache-memory-bytes
# vLLM's own KV cache per replica (--kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE, whole
# GiB only, is taken out of the servers' environment): 64k tokens of this model, several
# runs' prompts. With 1 GiB each, six replicas grew to some 17 GiB and the kernel's OOM
# killer ended a worker on this 23 GiB machine shared with other jobs.
KV_CACHE_BYTES = 256 << 20
MEMORY_NEEDED = 12 << 30  # what the six replicas, coordinator and routers took at most
START_TIMEOUT_S = 900.0  # seven servers starting at once on two busy CPUs
RUN_TIMEOUT_S = 900.0  # one vllm bench serve run
PERCENTILES = "50,99"


# -- sizes -----------------------------------------------------------------------------------


def sizes(quick: bool) -> Dict[str, Dict[str, Any]]:
    """Each dataset's shape, full or ``--quick``."""
    if quick:
        return {
            "prefix": dict(num_prefixes=2, prefix_len=1024, suffix_len=32, requests=8, out=8),
            "chat": dict(sessions=3, out=8),
            "zipf": dict(num_prefixes=4, prefix_len=1024, suffix_len=32, requests=12, s=2.0, out=8),
            "random": dict(input_len=512, requests=8, out=8),
            "probe": dict(input_len=32, out=32, requests=3, reps=1),
            "faults": dict(
                num_prefixes=8,
                prefix_len=1024,
                suffix_len=32,
                requests=40,
                s=1.0,
                out=8,
                rate=2.0,
                pool_blocks=48,
            ),
        }
    return {
        "prefix": dict(num_prefixes=4, prefix_len=3072, suffix_len=64, requests=24, out=16),
        "chat": dict(sessions=6, out=16),
        "zipf": dict(num_prefixes=8, prefix_len=2048, suffix_len=64, requests=24, s=2.0, out=16),
        "random": dict(input_len=1024, requests=16, out=16),
        "probe": dict(input_len=32, out=96, requests=6, reps=3),
        # faults under load: 12 prefixes of 8 blocks (96) over a pool of 48, a host tier of
        # 16 and a disk tier; Poisson arrivals at a rate every deployment sustains here
        "faults": dict(
            num_prefixes=12,
            prefix_len=1024,
            suffix_len=64,
            requests=72,
            s=1.0,
            out=16,
            rate=2.0,
            pool_blocks=48,
        ),
    }


# -- the model's tokenizer and the datasets (pure) ------------------------------------------
