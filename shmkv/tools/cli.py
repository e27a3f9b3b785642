"""Command line: ``shmkv serve | stats | demo | stress | bench`` (also ``python -m shmkv``).

Owns argument parsing, logging set-up (``--log-level``), the foreground ``serve``
loop and ``stats`` (``--watch`` for a live view). The demo, stress and bench programs
live in their own modules and are imported only when asked for. Every flag has help
text that names its unit; :class:`HelpFormatter` adds its default.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Dict, List, Union

from shmkv.tools.args import (
    LOG_LEVELS,
    device_arg,
    dtype_arg,
    log_level_arg,
    loop_slice_arg,
    name_arg,
    non_negative_int,
    port_arg,
    positive_float,
    positive_int,
    socket_path,
    spin_arg,
)

if TYPE_CHECKING:  # (the tiers are imported when serve asks for them)
    from shmkv.tiers import DiskTier, HostTier
    from shmkv.tiers.redis_store import RedisTier


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says it or
    there is no default to speak of (None, False, a flag that is off)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "default" in text.lower()
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def _pool_args(p: argparse.ArgumentParser, blocks: int = 1024) -> None:
    g = p.add_argument_group("pool")
    g.add_argument(
        "--num-layers", type=positive_int, default=4, help="transformer layers cached per block"
    )
    g.add_argument(
        "--num-kv-heads",
        type=positive_int,
        default=8,
        help="key/value heads (all tensor-parallel ranks together)",
    )
    g.add_argument("--head-dim", type=positive_int, default=64, help="elements per head")
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help=f"blocks in the pool (default: {blocks}, or what --pool-size holds)",
    )
    size.add_argument(
        "--pool-size",
        type=size_arg,
        default=None,
        metavar="BYTES",
        help="pool size instead of --num-blocks: bytes, or K/M/G/T (powers of "
        "1024, e.g. 8G); rounded down to whole blocks",
    )
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    g.add_argument(
        "--dtype",
        type=dtype_arg,
        default="float16",
        help="element type: float32, float16, bfloat16, or quantized "
        "float8_e4m3fn (fp8), float8_e5m2, int8 (1 byte each)",
    )
    g.add_argument(
        "--device",
        type=device_arg,
        default="cpu",
        help="'cpu' (POSIX shared memory) or 'cuda:N' (CUDA IPC)",
    )
    g.add_argument(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks; each owns num_kv_heads / tp_size heads",
    )
    g.add_argument(
        "--max-sequences",
        type=positive_int,
        default=4096,
        help="live sequences at once: the rows of the shared block tables",
    )
    g.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="tokens one sequence may hold: the columns of the shared block "
        "tables (default: the pool's tokens, at most 32768)",
    )
    p.set_defaults(default_num_blocks=blocks)


def _config(args):
    from shmkv.errors import InvalidArgument
    from shmkv.memory.layout import DTYPE_SIZES, PoolConfig

    num_blocks = args.num_blocks or args.default_num_blocks
    dtype = args.dtype or "float16"  # serve's default is None (see --for-model)
    if getattr(args, "pool_size", None):
        block_bytes = (
            args.num_layers
            * 2
            * args.block_size
            * args.num_kv_heads
            * args.head_dim
            * DTYPE_SIZES[dtype]
        )
        num_blocks = args.pool_size // block_bytes
        if num_blocks < 1:
            raise InvalidArgument(
                f"--pool-size {args.pool_size} bytes holds no block of "
                f"{block_bytes} bytes; give a larger size"
            )
    return PoolConfig(
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        num_blocks=num_blocks,
        block_size=args.block_size,
        dtype=dtype,
        device=args.device,
        tp_size=args.tp_size,
        max_sequences=args.max_sequences,
        max_seq_len=args.max_seq_len,
    )


def _address(args) -> str:
    from shmkv.coordinator.server import default_address

    return args.address or default_address(args.name)


def size_arg(text: str) -> int:
    """A size in bytes: a number, or with K, M, G or T (powers of 1024): 8G, 512M."""
    from shmkv.errors import ShmkvError
    from shmkv.tiers import parse_size

    try:
        value = parse_size(text)
    except ShmkvError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def tier_specs(args) -> list:
    """The tiers of ``serve --host-tier-size / --disk-tier / --disk-tier-size``."""
    from shmkv.errors import InvalidArgument
    from shmkv.tiers import DiskTier, HostTier

    if (args.disk_tier is None) != (args.disk_tier_size is None):
        raise InvalidArgument("--disk-tier DIR and --disk-tier-size SIZE go together")
    specs: List[Union[HostTier, DiskTier, RedisTier]] = []
    if args.host_tier_size is not None:
        specs.append(HostTier(args.host_tier_size))
    if args.disk_tier is not None:
        specs.append(DiskTier(args.disk_tier, args.disk_tier_size))
    if getattr(args, "redis_tier", None) is not None:
        from shmkv.tiers.redis_store import RedisTier

        specs.append(RedisTier(args.redis_tier))
    return specs


def _print_tiers(stats: dict) -> None:
    for tier in stats.get("tiers", ()):
        extra = {
            k: v
            for k, v in tier.items()
            if k
            not in (
                "tier",
                "blocks",
                "bytes",
                "capacity_bytes",
                "hits",
                "demotions",
                "promotions",
                "dropped",
                "errors",
            )
        }
        print(
            f"tier {tier['tier']:<5} blocks {tier['blocks']}  bytes {tier['bytes']} of "
            f"{tier['capacity_bytes']}  hits {tier['hits']}  demotions {tier['demotions']}  "
            f"promotions {tier['promotions']}  dropped {tier['dropped']}  errors "
            f"{tier['errors']}" + "".join(f"  {k} {v}" for k, v in extra.items())
        )


# Run by for_model in a child process: transformers' config classes import torch._dynamo,
# which imports triton where it is installed (vLLM's CPU wheel brings it), and triton's
# nanobind module prints some 30 lines of "nanobind: leaked ..." when a process that
# imported it exits. The coordinator imports neither; the child leaves by os._exit.
_READ_MODEL_CONFIG = """
import json, os, sys
try:
    from transformers import AutoConfig
    from shmkv.integrations.hf_config import kv_layout
    layout = kv_layout(AutoConfig.from_pretrained(sys.argv[1]))
    out = dict(layout._asdict(), dtype=str(layout.dtype or "float32").replace("torch.", ""))
except (OSError, ValueError) as exc:
    out = dict(error=f"no Hugging Face config there ({exc})")
except BaseException as exc:
    out = dict(error=f"its config could not be read ({type(exc).__name__}: {exc})")
sys.stdout.write("\\n" + json.dumps(out) + "\\n")
sys.stdout.flush()
os._exit(0)
"""
MODEL_CONFIG_TIMEOUT_S = 300.0  # (importing transformers takes seconds on a busy host)


def for_model(args) -> None:
    """``serve --for-model PATH``: the pool's layers, KV heads and head size, and its dtype
    unless ``--dtype`` is given (as vLLM runs the model: :func:`vllm_auto_dtype`), from
    the Hugging Face config at PATH (a model directory or
    its ``config.json``), as :func:`shmkv.integrations.transformers.pool_config` reads them
    (:func:`shmkv.integrations.hf_config.kv_layout`).

    A plain decoder's ``config.json`` is read here as JSON
    (:func:`shmkv.integrations.hf_config.plain_layout`); any other config by transformers,
    in a child process (see ``_READ_MODEL_CONFIG``), once per ``args``.

    Raises:
        InvalidArgument: no config at PATH, or one that could not be read.
    """
    import subprocess

    from shmkv.errors import InvalidArgument
    from shmkv.integrations.hf_config import plain_layout

    derived = getattr(args, "_model_layout", None)
    path = args.for_model
    if os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))
    if derived is None:
        derived = plain_layout(path)  # (a plain decoder's config.json: no child needed)
    if derived is None:
        here = os.path.abspath(__file__)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            child = subprocess.run(
                [sys.executable, "-c", _READ_MODEL_CONFIG, path],
                capture_output=True,
                text=True,
                env=env,
                timeout=MODEL_CONFIG_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise InvalidArgument(
                f"--for-model {args.for_model}: reading its config took over "
                f"{MODEL_CONFIG_TIMEOUT_S:.0f} s"
            ) from None
        lines = child.stdout.strip().splitlines()
        try:
            derived = json.loads(lines[-1])
        except (IndexError, ValueError):
            raise InvalidArgument(
                f"--for-model {args.for_model}: its config could not be read "
                f"({child.stderr.strip()[-2000:] or f'exit status {child.returncode}'})"
            ) from None
        if "error" in derived:
            raise InvalidArgument(f"--for-model {args.for_model}: {derived['error']}")
        args._model_layout = derived
    args.num_layers, args.num_kv_heads = derived["num_layers"], derived["num_kv_heads"]
    args.head_dim = derived["head_dim"]
    if args.dtype is None:
        args.dtype = vllm_auto_dtype(derived["dtype"])


def vllm_auto_dtype(config_dtype: str) -> str:
    """The dtype ``vllm serve --dtype auto`` (its default) runs a model of ``config_dtype``
    in, so its K/V cache's: the config's float16 or bfloat16 as it is, a float32 (or
    unset) config downcast to bfloat16, as vLLM does on CPUs and on GPUs of compute
    capability 8 and up (vLLM's ``_resolve_auto_dtype``; a GPU without bfloat16 runs
    float16: pass ``--dtype float16`` there, as for any other ``vllm serve --dtype``)."""
    return config_dtype if config_dtype in ("float16", "bfloat16") else "bfloat16"


def cmd_serve(args) -> int:
    from shmkv.coordinator.server import DEFAULT_SPIN_US, Coordinator

    if args.for_model:
        for_model(args)
    coord = Coordinator(
        _config(args),
        address=_address(args),
        max_connections=args.max_connections,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tiers=tier_specs(args),
        spin_us=DEFAULT_SPIN_US if args.spin_us is None else args.spin_us,
        loop_slice_us=args.loop_slice_us,
        populate=not args.no_populate,
        hugepages=args.hugepages,
    )
    coord.open()
    from shmkv.coordinator.server import freeze_startup_objects

    freeze_startup_objects()
    signal.signal(signal.SIGINT, lambda *_: coord.stop())
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    cfg = coord.config
    print(f"shmkv coordinator serving {coord.address}", flush=True)
    print(
        f"  pool: {cfg.num_blocks} blocks x {cfg.block_size} tokens, {cfg.num_layers} layers,"
        f" {cfg.num_kv_heads} kv heads x {cfg.head_dim}, {cfg.dtype}, {cfg.device}, "
        f"{cfg.nbytes / 2**20:.1f} MiB{' of huge pages' if coord.memory.hugepages else ''}",
        flush=True,
    )
    if coord.memory.hugepages_fallback:
        print(f"  hugepages: not used, {coord.memory.hugepages_fallback}", flush=True)
    if coord.metrics_address is not None:
        host, port = coord.metrics_address
        print(f"  metrics: http://{host}:{port}/metrics", flush=True)
    for spec in coord._tier_specs + ([coord._remote_spec] if coord._remote_spec else []):
        print(f"  tier: {spec!r}", flush=True)
    coord.serve_forever()
    print("shmkv coordinator stopped", flush=True)
    return 0


def cmd_stats(args) -> int:
    from shmkv.client.client import connect

    with connect(_address(args), timeout=args.timeout) as client:
        if args.watch is not None:
            return _watch(client, args)
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    width = max(len(k) for k in stats)
    for key in sorted(stats):
        value = stats[key]
        if key == "tiers":
            continue  # one line per tier, below
        if isinstance(value, float):
            value = f"{value:.3f}"
        print(f"{key:<{width}}  {value}")
    _print_tiers(stats)
    return 0


def format_watch(stats: dict, before: dict, interval: float) -> str:
    """The live view of ``shmkv stats --watch``: the pool, the prefix cache and rates
    over the last ``interval`` seconds (``before``: the previous sample, or {})."""

    def rate(new, old):
        return (new - old) / max(interval, 1e-9) if before else 0.0

    hits, misses = stats["prefix_hit_tokens"], stats["prefix_miss_tokens"]
    lines = [
        f"shmkv coordinator {stats['address']}  pid {stats['pid']}  up {stats['uptime_s']:.0f} s",
        f"blocks       {stats['free_blocks']} free, {stats['cached_blocks']} cached, "
        f"{stats['referenced_blocks']} referenced of {stats['num_blocks']} "
        f"({stats['pool_bytes'] / 2**20:.1f} MiB)",
        f"sequences    {stats['sequences']}   connections {stats['connections']}   "
        f"hand-offs outstanding {stats['handoffs']}",
        f"prefix       {hits} hit / {misses} miss tokens "
        f"({100 * hits / max(hits + misses, 1):.1f}% hit)   evictions {stats['evictions']}   "
        f"copy-on-write {stats['cow_copies']}",
        f"requests     {stats['ops']} total, "
        f"{rate(stats['ops'], before.get('ops', 0)):.0f}/s   errors "
        f"{stats.get('request_errors', 0)}",
    ]
    old = before.get("ops_by_type", {})
    busy = sorted(
        ((rate(n, old.get(op, 0)), op) for op, n in stats["ops_by_type"].items()), reverse=True
    )
    busiest = [f"{op} {r:.0f}/s" for r, op in busy if r > 0][:6]
    if busiest:
        lines.append("busiest      " + ", ".join(busiest))
    return "\n".join(lines)


def _watch(client, args) -> int:
    """Sample the coordinator every ``args.watch`` seconds until Ctrl-C (or ``--count``
    samples). On a terminal the view is redrawn in place; otherwise samples follow
    each other."""
    redraw = sys.stdout.isatty() and not args.json
    before: dict = {}
    last, shown = time.monotonic(), 0
    while True:
        stats = client.stats()
        now = time.monotonic()
        if args.json:
            print(json.dumps(stats, sort_keys=True), flush=True)  # one sample per line
        else:
            text = format_watch(stats, before, now - last)
            print(("\x1b[H\x1b[J" if redraw else ("\n" if shown else "")) + text, flush=True)
        before, last, shown = stats, now, shown + 1
        if args.count and shown >= args.count:
            return 0
        time.sleep(args.watch)


def _log_level_flag(p: argparse.ArgumentParser, default) -> None:
    p.add_argument(
        "--log-level",
        type=log_level_arg,
        default=default,
        metavar="LEVEL",
        help=f"log the shmkv messages of this level and above to stderr: "
        f"{', '.join(LOG_LEVELS)} (default: info for serve, warning "
        "otherwise)",
    )


class Parser(argparse.ArgumentParser):
    """The ``shmkv`` parser: ``subcommands`` holds each subcommand's parser by name."""

    subcommands: Dict[str, argparse.ArgumentParser]


def build_parser() -> Parser:
    """The ``shmkv`` argument parser, with every subcommand."""
    parser = Parser(
        prog="shmkv",
        formatter_class=HelpFormatter,
        description="A shared-memory, multi-process, paged KV cache for LLM inference. "
        "'shmkv COMMAND --help' describes each command's flags.",
    )
    _log_level_flag(parser, None)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=argparse.ArgumentParser
    )

    p = sub.add_parser("serve", help="run a coordinator in the foreground")
    p.add_argument(
        "--name",
        type=name_arg,
        default="default",
        help="coordinator name: its socket is NAME.sock in the runtime directory",
    )
    p.add_argument(
        "--address",
        type=socket_path,
        default=None,
        metavar="PATH",
        help="socket path (overrides --name)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=1024,
        help="client connections open at once; more are refused",
    )
    p.add_argument(
        "--metrics-port",
        type=port_arg,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (a TCP port; "
        "0: any free one; default: no metrics server)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics server binds (0.0.0.0: every interface, logged as a warning)",
    )
    p.add_argument(
        "--spin-us",
        type=spin_arg,
        default=None,
        metavar="US",
        help="after serving a request, poll this many microseconds for the next "
        "one before sleeping (skips a wake-up per request under load; 0: "
        "never; never on a one-CPU machine; default: 300)",
    )
    p.add_argument(
        "--loop-slice-us",
        type=loop_slice_arg,
        default=100.0,
        metavar="US",
        help="the CPU slice the loop's thread asks the scheduler for (Linux 6.12+): "
        "short, the loop is picked ahead of the clients it wakes (100-100000; 0: the "
        "thread's own; default: 100)",
    )
    p.add_argument(
        "--no-populate",
        action="store_true",
        help="do not fault in the pool's pages in the background at start (by default "
        "they are, while serving, so that first writes do not each clear a page; "
        "progress in `shmkv stats`)",
    )
    p.add_argument(
        "--hugepages",
        action="store_true",
        help="make a CPU pool of huge pages (reserved by the administrator: sysctl "
        "vm.nr_hugepages); where too few are free, says so and uses /dev/shm",
    )
    p.add_argument(
        "--host-tier-size",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="a host-memory tier under the pool of SIZE (8G, 512M)",
    )
    p.add_argument(
        "--disk-tier",
        default=None,
        metavar="DIR",
        help="a disk tier in DIR, kept across restarts (needs --disk-tier-size)",
    )
    p.add_argument(
        "--disk-tier-size",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="the most bytes of block files the disk tier keeps (64G)",
    )
    p.add_argument(
        "--redis-tier",
        default=None,
        metavar="URL",
        help="share committed blocks with other nodes through Redis/Valkey at "
        "URL (redis://host:6379/0); see shmkv.tiers.redis_store",
    )
    p.add_argument(
        "--for-model",
        default=None,
        metavar="PATH",
        help="take --num-layers, --num-kv-heads and --head-dim from the Hugging Face "
        "config of the model at PATH, and (unless given) --dtype as vllm serve PATH "
        "runs it: the config's float16 or bfloat16, bfloat16 for a float32 config (give "
        "--dtype to match any other vllm serve --dtype)",
    )
    _pool_args(p)
    p.set_defaults(func=cmd_serve, dtype=None)

    p = sub.add_parser("stats", help="print a running coordinator's counters")
    p.add_argument(
        "--name", type=name_arg, default="default", help="name of the coordinator to ask"
    )
    p.add_argument(
        "--address",
        type=socket_path,
        default=None,
        metavar="PATH",
        help="socket path (overrides --name)",
    )
    p.add_argument(
        "--json", action="store_true", help="print JSON (with --watch: one sample per line)"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        help="seconds to wait for the coordinator's answer",
    )
    p.add_argument(
        "--watch",
        type=positive_float,
        nargs="?",
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="redraw a live view every SECONDS (1 when given alone) until "
        "Ctrl-C; default: print once",
    )
    p.add_argument(
        "--count",
        type=non_negative_int,
        default=0,
        help="with --watch: stop after this many samples (0: never)",
    )
    p.set_defaults(func=cmd_stats)

    from shmkv import bench
    from shmkv.tools import demo, stress

    for module in (demo, stress, bench):
        module.add_parser(sub)
    for p in sub.choices.values():
        p.formatter_class = HelpFormatter
        _log_level_flag(p, argparse.SUPPRESS)  # also after the subcommand's name
    parser.subcommands = sub.choices
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (not the stream
    of the moment the handler was made, which a test harness may have closed since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


_log_handler = None


def setup_logging(level: str) -> None:
    """Send the ``shmkv`` loggers' messages of ``level`` and above to stderr (once per
    process: a second call only changes the level)."""
    global _log_handler
    logger = logging.getLogger("shmkv")
    if _log_handler is None:
        _log_handler = _StderrHandler()
        _log_handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        logger.addHandler(_log_handler)
    logger.setLevel(getattr(logging, level.upper()))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    serve = parser.subcommands["serve"]
    setup_logging(args.log_level or ("info" if args.func is cmd_serve else "warning"))
    if args.func is cmd_serve:
        from shmkv.errors import ShmkvError

        try:  # arguments that are fine alone but not together (heads vs tp_size, say)
            if args.for_model:
                for_model(args)
            _config(args)
        except ShmkvError as exc:
            serve.error(str(exc))
    from shmkv.errors import ShmkvError

    try:
        return args.func(args)
    except ShmkvError as exc:
        print(f"shmkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
