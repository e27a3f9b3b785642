"""Suite ``data``: the data plane (``write_all``, ``write`` per layer, ``gather_all``,
``key_cache``) against ``copy_`` of the same bytes, per block size and sequence length.

A sequence whose blocks are every other block of the pool; what it reads back is
checked bit for bit before it is timed. Part of the sections run (``shmkv bench``).
"""

from __future__ import annotations

from typing import List

from shmkv.bench.core import (
    BenchError,
    Figure,
    Options,
    _check,
    _Cleanup,
    _median,
    _model_config,
    _pattern,
    _same_bits,
    _unique,
    interleaved,
)

# -- 1. data plane ---------------------------------------------------------------------------

# (op key, label, baseline key, target); "clone_*" are references for fresh outputs.
DATA_OPS = (
    ("write_all", "write_all", "copy_all", ">= 0.7"),
    ("write", "write per layer", "copy_all", ">= 0.7"),
    ("gather_all_out", "gather_all(out=)", "copy_all", ">= 0.8"),
    ("key_cache_out", "key_cache(out=)", "copy_layer", ">= 0.8"),
    ("gather_all", "gather_all()", "copy_all", ">= 0.8"),
    ("key_cache", "key_cache()", "copy_layer", ">= 0.8"),
)
_REFERENCE = {"copy_all": "clone_all", "copy_layer": "clone_layer"}


def bench_data(opts: Options, cleanup: _Cleanup, series: dict) -> List[Figure]:
    """Write and gather bandwidth against a contiguous copy of the same bytes."""
    import torch

    from shmkv.client.client import connect
    from shmkv.coordinator.server import Coordinator

    lengths = (128, 1024, 4096) if opts.quick else (128, 256, 512, 1024, 2048, 4096, 8192)
    block_sizes = (8, 16, 32, 64)
    probe = _model_config(1)
    L, H, D = probe.num_layers, probe.num_kv_heads, probe.head_dim
    dtype = getattr(torch, probe.dtype)
    max_n = max(lengths)
    buffers = {
        "source": _pattern(L * 2 * max_n * H * D, dtype),
        "all": torch.zeros(L * 2 * max_n * H * D, dtype=dtype),
        "layer": torch.zeros(max_n * H * D, dtype=dtype),
    }
    points = []
    for bs in block_sizes:
        # Room for the measured sequence and a filler taking every other block.
        cfg = _model_config(2 * (max_n // bs) + 2, block_size=bs)
        coord = cleanup.add(Coordinator(cfg, name=_unique("data")).start())
        client = connect(coord.address)
        try:
            for n in lengths:
                points.append(_data_point(client, buffers, n, opts.repeats))
        finally:
            client.close()
            cleanup.remove(coord)
    buffers.clear()
    series["data"] = points

    figures = []
    for op, label, base, target in DATA_OPS:
        for bs in block_sizes:
            rows = [p for p in points if p["block_size"] == bs]
            for p in rows:
                p[op + "_ratio"] = p[op] / p[base]
            worst = min(rows, key=lambda p: p[op + "_ratio"])
            ratio = worst[op + "_ratio"]
            params = {
                "block_size": bs,
                "n": worst["n"],
                "ratios": {p["n"]: round(p[op + "_ratio"], 3) for p in rows},
            }
            if op in ("gather_all", "key_cache"):  # fresh outputs: what a clone gets
                params["reference_ratios"] = {
                    p["n"]: round(p[_REFERENCE[base]] / p[base], 3) for p in rows
                }
            figures.append(
                Figure(
                    "data",
                    f"{label} bs={bs} (worst: n={worst['n']})",
                    worst[op] / 1e9,
                    "GB/s",
                    worst[base] / 1e9,
                    base.replace("_", " "),
                    ratio,
                    target,
                    _check(ratio, target),
                    params=params,
                )
            )
    return figures


def _data_point(client, buffers: dict, n: int, repeats: int) -> dict:
    cfg = client.config
    L, H, D, bs = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    handle = client.allocate(0)
    filler = client.allocate(0)
    try:
        for _ in range(n // bs):  # interleave the two tables: no two neighbours are adjacent
            client.extend_many([(handle, bs), (filler, bs)])
        kv = buffers["source"][: L * 2 * n * H * D].view(L, 2, n, H, D)
        out_all = buffers["all"][: kv.numel()].view_as(kv)
        layer_src = kv[3, 0]
        out_layer = buffers["layer"][: layer_src.numel()].view_as(layer_src)

        def write_layers():
            for layer in range(L):
                handle.write(layer, kv[layer, 0], kv[layer, 1], 0)

        handle.write_all(kv, 0)
        if not (_same_bits(handle.gather_all(), kv) and _same_bits(handle.key_cache(3), layer_src)):
            raise BenchError(f"data plane read back wrong values (n={n}, block_size={bs})")
        times = interleaved(
            {
                "copy_all": lambda: out_all.copy_(kv),
                "clone_all": kv.clone,
                "write_all": lambda: handle.write_all(kv, 0),
                "write": write_layers,
                "gather_all_out": lambda: handle.gather_all(out=out_all),
                "gather_all": handle.gather_all,
                "copy_layer": lambda: out_layer.copy_(layer_src),
                "clone_layer": layer_src.clone,
                "key_cache_out": lambda: handle.key_cache(3, out=out_layer),
                "key_cache": lambda: handle.key_cache(3),
            },
            repeats if n >= 1024 else 3 * repeats,
        )  # small points are cheap: more runs
        all_bytes = kv.numel() * kv.element_size()
        layer_bytes = layer_src.numel() * layer_src.element_size()
        point = {"n": n, "block_size": bs, "bytes_all": all_bytes, "bytes_layer": layer_bytes}
        for name, samples in times.items():
            nbytes = layer_bytes if "layer" in name or "key_cache" in name else all_bytes
            point[name] = nbytes / _median(samples)
            point[name + "_s"] = _median(samples)
        return point
    finally:
        client.close_many([handle, filler])
