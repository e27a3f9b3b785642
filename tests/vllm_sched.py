"""Scheduler-level helpers of the vLLM connector tests that need no engine
(``test_vllm_connector.py``, ``test_vllm_lookups.py``): the pool, vLLM's config, the
connector's two roles, a step of vLLM's scheduler, and a bounded wait."""

import time

import torch
from vllm_engine import BLOCK, connector_config

import shmkv

LAYERS, HEADS, DIM = 2, 2, 32  # make_model()'s


def pool_config(num_blocks: int = 256, **kw) -> shmkv.PoolConfig:
    spec = dict(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        num_blocks=num_blocks,
        block_size=32,
        dtype=torch.float32,
    )
    spec.update(kw)
    return shmkv.PoolConfig(**spec)


def vllm_config(model, address, parallel=None, **extra):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048
        ),
        cache_config=CacheConfig(block_size=BLOCK),
        parallel_config=ParallelConfig(**(parallel or {})),
        kv_transfer_config=KVTransferConfig(**connector_config(address, **extra)),
    )


def roles():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


def caches(nb: int = 8) -> dict:
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(nb, HEADS, BLOCK, 2 * DIM)
        for i in range(LAYERS)
    }


def step(worker, meta):
    """What vLLM's model runner does with a step's metadata around the forward."""
    from vllm.v1.outputs import KVConnectorOutput

    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    out = KVConnectorOutput(
        invalid_block_ids=errors, kv_connector_worker_meta=worker.build_connector_worker_meta()
    )
    worker.clear_connector_metadata()
    return out


def until(cond, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
