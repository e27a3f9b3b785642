"""The vLLM connector's settings: the ``shmkv.*`` keys of ``kv_connector_extra_config``,
their checks and defaults, and the errors a configuration that does not fit raises.

This module owns what a connector is configured with (:class:`ConnectorSettings`, read
once by the facade and handed to the side it makes) and the names its clients give the
coordinator. It does not connect to anything, nor read vLLM's tensors: the pool and the
registered K/V are checked against the settings by :class:`~shmkv.integrations.vllm.courier.Dialer`
and the worker side. It imports no other module of the connector.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

import shmkv
from shmkv.errors import InvalidArgument
from shmkv.protocol import check_client_name

LAYOUTS = ("cpu", "split", "flash")
# A request whose prefix another engine is computing right now waits for it while that
# engine publishes more of it at least this often (seconds), rather than computing it too.
DEFAULT_WAIT_COMPUTING_S = 5.0
DEFAULT_RETRY_S = 1.0  # (a failed attempt on this host costs a connect() that fails at once)
# How long a lookup may take before it counts as a miss (its request waits for it, others
# are scheduled meanwhile), and the longest vLLM's scheduler thread waits for a hand-off
# made in a step (see the courier). A late lookup costs its request the whole prompt,
# computed and not saved, while a coordinator that stopped answering costs this once (the
# lookups after it miss at once): at 50 ms, saturated replicas on a 2-CPU host counted 3
# of 24 lookups late and computed each of those prefixes again.
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
# An unopened hand-off pins its blocks this long: the workers open a step's hand-offs
# when the step starts, well within it, unless their engine died (Ctrl-C of vllm serve).
HANDOFF_TTL_S = 10.0


class ConnectorConfigError(shmkv.InvalidArgument):
    """The connector's configuration and the coordinator's pool do not fit together
    (block sizes, layers, heads, head size, dtype, or a missing address), or a
    ``kv_connector_extra_config`` key is unknown or has an invalid value."""


class ConnectorLayoutError(ConnectorConfigError, shmkv.LayoutMismatch):
    """The coordinator's pool is not laid out for this engine: its block size, tensor
    parallel size, layers, KV heads, head size or dtype."""


def expected_layout(vllm_config) -> Optional[Dict[str, Any]]:
    """The pool layout (layers, all ranks' KV heads, head size, dtype) the engine of
    ``vllm_config`` will register, as far as its model config tells (None when it does
    not: a model whose layers are not all plain attention; the workers' tensors are
    checked at registration anyway)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    try:
        if getattr(mc, "is_hybrid", False) or getattr(mc, "is_attention_free", False):
            return None
        layers = mc.get_num_layers_by_block_type(pc, "attention")
        heads = mc.get_num_kv_heads(pc) * pc.tensor_parallel_size
        head_dim = mc.get_head_size()
        dtype = mc.dtype if cc.cache_dtype in ("auto", None) else None
    except Exception:  # noqa: BLE001 - an unusual model: checked at registration only
        return None
    if not isinstance(dtype, torch.dtype):
        return None  # a quantized KV cache: its storage dtype is the backend's
    return dict(
        num_layers=int(layers),
        kv_heads=int(heads),
        head_dim=int(head_dim),
        dtype=str(dtype).replace("torch.", ""),
    )


def lookup_name(name: str) -> str:
    """The client name of the scheduler's lookups: ``name`` and ``.lookup`` (``name``
    shortened to keep within the 64 characters of a client name)."""
    return name[: 64 - len(LOOKUP_SUFFIX)] + LOOKUP_SUFFIX


LOOKUP_SUFFIX = ".lookup"


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(f"{key!r} must be a non-empty string, got {value!r}")
    return value


def _seconds(low: float, high: float) -> Callable[[str, Any], float]:
    def check(key: str, value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= float(value) <= high
        ):
            raise ConnectorConfigError(
                f"{key!r} must be a number of seconds in [{low:g}, {high:g}], got {value!r}"
            )
        return float(value)

    return check


def _tokens(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**31:
        raise ConnectorConfigError(
            f"{key!r} must be a whole number of tokens in [0, 2**31], got {value!r}"
        )
    return value


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if value not in allowed:
            raise ConnectorConfigError(f"{key!r} must be one of {allowed}, got {value!r}")
        return value

    return check


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConnectorConfigError(f"{key!r} must be true or false, got {value!r}")
    return value


def _salt(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConnectorConfigError(f"{key!r} must be a string, got {value!r}")
    return value


# Every key the connector reads from ``kv_connector_extra_config``, with its check. Any
# other key is refused at start-up: a misspelled ``"shmkv.slat"`` would otherwise leave
# a tenant unsalted, sharing K/V with every unsalted engine.
SETTINGS: Dict[str, Callable[[str, Any], Any]] = {
    "shmkv.name": _text,
    "shmkv.address": _text,
    "shmkv.salt": _salt,
    "shmkv.model_id": _text,
    "shmkv.client_name": _text,
    "shmkv.retry_s": _seconds(0.0, 3600.0),
    "shmkv.lookup_timeout_s": _seconds(0.001, 60.0),
    "shmkv.handoff_ttl_s": _seconds(1.0, 3600.0),
    "shmkv.wait_computing_s": _seconds(0.0, 600.0),
    "shmkv.wait_min_tokens": _tokens,
    "shmkv.kv_layout": _choice(*LAYOUTS),
    "shmkv.on_load_error": _choice("recompute", "fail"),
    "shmkv.prefault": _boolean,
    "shmkv.layerwise": _boolean,
}


def check_settings(extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``kv_connector_extra_config`` checked: every key known (:data:`SETTINGS`), every
    value of its kind and range; returns the checked values (numbers as floats).

    Raises:
        ConnectorConfigError: an unknown key (the message names the accepted ones), or
            an invalid value (the message says what is accepted).
    """
    extra = dict(extra or {})
    unknown = sorted(str(key) for key in extra if key not in SETTINGS)
    if unknown:
        raise ConnectorConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown} for ShmkvConnector; "
            f"accepted: {sorted(SETTINGS)}"
        )
    return {key: SETTINGS[key](key, value) for key, value in extra.items()}


def client_name(given: Optional[str], engine_id: Optional[str]) -> str:
    """The name this engine's clients give the coordinator (its ``/metrics`` count hits
    by it): ``shmkv.client_name`` if set, else ``vllm-ENGINE_ID`` made a valid name
    (vLLM's ``kv_transfer_config.engine_id``; set it for a name that survives restarts).

    Raises:
        ConnectorConfigError: ``shmkv.client_name`` is not a valid client name.
    """
    if given is not None:
        try:
            return check_client_name(given)
        except InvalidArgument as exc:
            raise ConnectorConfigError(f"shmkv.client_name: {exc}") from None
    name = re.sub(r"[^A-Za-z0-9_.:/-]", "_", f"vllm-{engine_id or 'engine'}")
    return name[:64]


@dataclass(frozen=True)
class ConnectorSettings:
    """What one connector (either side) is configured with, checked: the coordinator's
    ``address``, the ``shmkv.*`` values (defaults filled in), and what it reads of vLLM's
    config (block size, tensor-parallel size, the pool layout the model expects)."""

    address: str
    retry_s: float
    lookup_timeout_s: float
    handoff_ttl_s: float
    wait_computing_s: float  # 0: a request never waits for a prefix another computes
    # A request waits for others (and claims its blocks for others to wait for) only where
    # it would compute more prompt tokens than this itself: one step's budget by default
    wait_min_tokens: int
    client_name: str  # (the scheduler's: NAME.lookup, see lookup_name)
    layout: Optional[str]  # "shmkv.kv_layout", None: detected from vLLM's tensors
    prefault: bool
    layerwise: bool
    recompute: bool  # "shmkv.on_load_error" is "recompute"
    salt: str
    model_id: Optional[str]
    block_size: int  # vLLM's
    tp_size: int
    expected: Optional[Dict[str, Any]]  # expected_layout(vllm_config)
    step_tokens: int = 0  # vLLM's max_num_batched_tokens (0: not known)


def read_settings(vllm_config, kv_transfer_config, scheduler: bool) -> ConnectorSettings:
    """The settings of a connector of ``vllm_config`` (its ``kv_transfer_config``), of the
    scheduler side when ``scheduler`` (its clients' name is ``NAME.lookup``).

    Raises:
        ConnectorConfigError: no address, or both a name and an address; an unknown key
            or an invalid value (:func:`check_settings`); pipeline parallelism.
    """
    extra = check_settings(kv_transfer_config.kv_connector_extra_config)
    if "shmkv.address" in extra and "shmkv.name" in extra:
        raise ConnectorConfigError(
            'give "shmkv.name" or "shmkv.address" in kv_connector_extra_config, not both'
        )
    address = extra.get("shmkv.address")
    if address is None and "shmkv.name" in extra:
        address = shmkv.default_address(extra["shmkv.name"])
    if address is None:
        raise ConnectorConfigError(
            'ShmkvConnector needs kv_connector_extra_config={"shmkv.name": NAME} or '
            '{"shmkv.address": PATH}: the coordinator to use (shmkv serve --name NAME)'
        )
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    if pp_size > 1:
        # Each stage holds only its own layers, and would need its own layer offset,
        # hand-off and commit; until then, refused before any stage maps a layer.
        raise ConnectorConfigError(
            f"ShmkvConnector does not support pipeline parallelism "
            f"(pipeline_parallel_size={pp_size}); run with pipeline_parallel_size=1 "
            f"(tensor parallelism is supported)"
        )
    name = client_name(extra.get("shmkv.client_name"), kv_transfer_config.engine_id)
    step_tokens = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None) or 0)
    if scheduler:
        # The scheduler's lookups count apart, under NAME.lookup (what they found);
        # NAME counts what the engine loaded and computed (count_hits, rank 0).
        name = lookup_name(name)
    return ConnectorSettings(
        address=str(address),
        retry_s=extra.get("shmkv.retry_s", DEFAULT_RETRY_S),
        lookup_timeout_s=extra.get("shmkv.lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S),
        handoff_ttl_s=extra.get("shmkv.handoff_ttl_s", HANDOFF_TTL_S),
        wait_computing_s=extra.get("shmkv.wait_computing_s", DEFAULT_WAIT_COMPUTING_S),
        wait_min_tokens=extra.get("shmkv.wait_min_tokens", step_tokens),
        client_name=name,
        layout=extra.get("shmkv.kv_layout"),
        prefault=extra.get("shmkv.prefault", True),
        layerwise=extra.get("shmkv.layerwise", False),
        recompute=extra.get("shmkv.on_load_error", "recompute") == "recompute",
        salt=extra.get("shmkv.salt", ""),
        model_id=extra.get("shmkv.model_id"),
        block_size=vllm_config.cache_config.block_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        expected=expected_layout(vllm_config),
        step_tokens=step_tokens,
    )
