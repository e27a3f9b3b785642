"""Command line: ``shmkv serve | stats | demo | stress | bench`` (also ``python -m shmkv``).

Owns argument parsing and the foreground ``serve`` loop. The demo, stress and bench
programs live in their own modules and are imported only when asked for.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys


def _pool_args(p: argparse.ArgumentParser, blocks: int = 1024) -> None:
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=blocks)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp-size", type=int, default=1)


def _config(args):
    from ..layout import PoolConfig
    return PoolConfig(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                      head_dim=args.head_dim, num_blocks=args.num_blocks,
                      block_size=args.block_size, dtype=args.dtype, device=args.device,
                      tp_size=args.tp_size)


def _address(args) -> str:
    from ..coordinator import default_address
    return args.address or default_address(args.name)


def cmd_serve(args) -> int:
    from ..coordinator import Coordinator
    coord = Coordinator(_config(args), address=_address(args),
                        max_connections=args.max_connections)
    coord.open()
    signal.signal(signal.SIGINT, lambda *_: coord.stop())
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    cfg = coord.config
    print(f"shmkv coordinator serving {coord.address}", flush=True)
    print(f"  pool: {cfg.num_blocks} blocks x {cfg.block_size} tokens, {cfg.num_layers} layers,"
          f" {cfg.num_kv_heads} kv heads x {cfg.head_dim}, {cfg.dtype}, {cfg.device}, "
          f"{cfg.nbytes / 2**20:.1f} MiB", flush=True)
    coord.serve_forever()
    print("shmkv coordinator stopped", flush=True)
    return 0


def cmd_stats(args) -> int:
    from ..client import connect
    with connect(_address(args), timeout=args.timeout) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    width = max(len(k) for k in stats)
    for key in sorted(stats):
        value = stats[key]
        if isinstance(value, float):
            value = f"{value:.3f}"
        print(f"{key:<{width}}  {value}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="shmkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run a coordinator in the foreground")
    p.add_argument("--name", default="default")
    p.add_argument("--address", default=None, help="socket path (overrides --name)")
    p.add_argument("--max-connections", type=int, default=1024)
    _pool_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("stats", help="print a running coordinator's counters")
    p.add_argument("--name", default="default")
    p.add_argument("--address", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=cmd_stats)

    from . import bench, demo, stress
    for module in (demo, stress, bench):
        module.add_parser(sub)

    args = parser.parse_args(argv)
    from ..errors import ShmkvError
    try:
        return args.func(args)
    except ShmkvError as exc:
        print(f"shmkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
