"""Argument types of the command line: each checks one value and raises
``argparse.ArgumentTypeError``, which argparse turns into a usage message and exit
status 2 before anything starts. Shared by ``shmkv.tools.cli`` and the programs it
runs (demo, stress, bench)."""

from __future__ import annotations

import argparse
import math


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


def _checked(name: str, parse, ok, rule: str, doc: str):
    """An argument type: ``parse`` the text, then refuse values ``ok`` rejects, saying
    ``rule`` (messages quote the value as given)."""

    def check(text: str):
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text.strip()}")
        return value

    check.__name__ = check.__qualname__ = name
    check.__doc__ = doc
    return check


positive_int = _checked(
    "positive_int", _int, lambda v: v >= 1, "must be at least 1", "An integer >= 1."
)
non_negative_int = _checked(
    "non_negative_int", _int, lambda v: v >= 0, "must be 0 or more", "An integer >= 0."
)
positive_float = _checked(
    "positive_float", _float, lambda v: v > 0, "must be greater than 0", "A finite number > 0."
)
non_negative_float = _checked(
    "non_negative_float", _float, lambda v: v >= 0, "must be 0 or more", "A finite number >= 0."
)
spin_arg = _checked(
    "spin_arg",
    _float,
    lambda v: 0 <= v <= 10000,
    "must lie in [0, 10000]",
    "Microseconds of polling, 0-10000.",
)
loop_slice_arg = _checked(
    "loop_slice_arg",
    _float,
    lambda v: v == 0 or 100 <= v <= 100000,
    "must be 0 or lie in [100, 100000]",
    "Microseconds of CPU slice: 0, or 100-100000.",
)
fraction = _checked(
    "fraction", _float, lambda v: 0.0 <= v <= 1.0, "must lie in [0, 1]", "A number in [0, 1]."
)


def name_arg(text: str) -> str:
    """A coordinator or result name: 1-64 characters, no '/', not starting with '.'."""
    if not text or "/" in text or text.startswith(".") or len(text) > 64 or "\0" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be 1-64 characters without '/' and not start with '.'"
        )
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
            f"socket path {text!r} is longer than the 107 bytes a Unix socket address can hold"
        )
    return text


def dtype_arg(text: str) -> str:
    """A pool dtype name (float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8)."""
    from shmkv.errors import ShmkvError
    from shmkv.memory.layout import dtype_name

    try:
        return dtype_name(text)
    except ShmkvError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def device_arg(text: str) -> str:
    """'cpu' or 'cuda[:N]'."""
    from shmkv.errors import ShmkvError
    from shmkv.memory.layout import normalize_device

    try:
        return normalize_device(text)
    except ShmkvError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_arg(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must lie in [0, 65535], got {value}")
    return value


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level_arg(text: str) -> str:
    """A logging level name: debug, info, warning, error or critical (any case)."""
    level = text.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return level
