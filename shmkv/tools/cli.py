"""Command line: ``shmkv serve | stats | demo | stress | bench`` (also ``python -m shmkv``).

Owns argument parsing and the foreground ``serve`` loop. The demo, stress and bench
programs live in their own modules and are imported only when asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys

# Argument types: each raises ArgumentTypeError, which argparse turns into a usage
# message and exit status 2, before anything starts.


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value


def name_arg(text: str) -> str:
    """A coordinator or result name: 1-64 characters, no '/', not starting with '.'."""
    if not text or "/" in text or text.startswith(".") or len(text) > 64 or "\0" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be 1-64 characters without '/' and not start with '.'")
    return text


def path_arg(text: str) -> str:
    """A file or directory path: not empty."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError("path must not be empty")
    return text


def socket_path(text: str) -> str:
    """A Unix socket path: not empty, at most the 107 bytes an address can hold."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError("socket path must not be empty")
    if len(text.encode(errors="surrogateescape")) > 107:
        raise argparse.ArgumentTypeError(
            f"socket path {text!r} is longer than the 107 bytes a Unix socket address "
            "can hold")
    return text


def dtype_arg(text: str) -> str:
    """A pool dtype name (float32, float16, bfloat16)."""
    from ..errors import ShmkvError
    from ..layout import dtype_name
    try:
        return dtype_name(text)
    except ShmkvError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def device_arg(text: str) -> str:
    """'cpu' or 'cuda[:N]'."""
    from ..errors import ShmkvError
    from ..layout import normalize_device
    try:
        return normalize_device(text)
    except ShmkvError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pool_args(p: argparse.ArgumentParser, blocks: int = 1024) -> None:
    p.add_argument("--num-layers", type=positive_int, default=4)
    p.add_argument("--num-kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--num-blocks", type=positive_int, default=blocks)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--dtype", type=dtype_arg, default="float16")
    p.add_argument("--device", type=device_arg, default="cpu")
    p.add_argument("--tp-size", type=positive_int, default=1)


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
    p.add_argument("--name", type=name_arg, default="default")
    p.add_argument("--address", type=socket_path, default=None,
                   help="socket path (overrides --name)")
    p.add_argument("--max-connections", type=positive_int, default=1024)
    _pool_args(p)
    p.set_defaults(func=cmd_serve)
    serve = p

    p = sub.add_parser("stats", help="print a running coordinator's counters")
    p.add_argument("--name", type=name_arg, default="default")
    p.add_argument("--address", type=socket_path, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=positive_float, default=5.0)
    p.set_defaults(func=cmd_stats)

    from . import bench, demo, stress
    for module in (demo, stress, bench):
        module.add_parser(sub)

    args = parser.parse_args(argv)
    if args.func is cmd_serve:
        from ..errors import ShmkvError
        try:  # arguments that are fine alone but not together (heads vs tp_size, say)
            _config(args)
        except ShmkvError as exc:
            serve.error(str(exc))
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
