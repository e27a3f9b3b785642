"""Real vLLM engines for the connector tests and benchmark, each in its own process.

:func:`make_model` saves a small random Llama (no download). :class:`Engine` starts a
vLLM ``LLM`` on it in a spawn child (the engine core in that same process), driven over
a pipe: every request has a timeout, and :meth:`Engine.close` stops the child or kills
it. :class:`FaultyShmkvConnector` is the real connector with one fault that a test can
switch on at run time: the hand-off tokens of the next requests are damaged between the
scheduler's lookup and the workers' load, as when the sequence is lost in between.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

SPAWN = multiprocessing.get_context("spawn")
VOCAB = 512
BLOCK = 128  # vLLM's block size (its CPU kernels take multiples of 32)


def make_model(
    path: str, layers: int = 2, kv_heads: int = 2, head_dim: int = 32, hidden: int = 128
) -> str:
    """Save a random Llama to ``path`` (float32, peaked logits so greedy is stable)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=16384,
        initializer_range=0.2,
        dtype="float32",
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def prompt(seed: int, n: int, prefix=()) -> list:
    """``n`` token ids from ``seed`` (after ``prefix``)."""
    import random

    rng = random.Random(seed)
    return list(prefix) + [rng.randrange(1, VOCAB) for _ in range(n - len(prefix))]


def matched(sched, request, num_computed_tokens: int = 0, timeout: float = 10.0):
    """What a scheduler-side connector answers vLLM for ``request``, asked again while it
    says it does not know yet (None), as vLLM's scheduler asks at each step."""
    deadline = time.monotonic() + timeout
    while True:
        answer = sched.get_num_new_matched_tokens(request, num_computed_tokens)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer
        time.sleep(0.001)


def drained(sched, timeout: float = 10.0) -> None:
    """Wait until a scheduler-side connector's courier has done what was queued on it so
    far (its releases are posted, not waited for: vLLM's thread never waits on them)."""
    sched.connector_scheduler._courier.call(lambda client: None, timeout)


# -- the engine child -----------------------------------------------------------------------

_FAULT = {"handoff": 0}  # requests whose hand-off tokens the next steps damage
# Per request finished, the seconds the timed connectors spent in each of their hooks
# (and in the copies, "_copy_layer"), in order: {"hooks": {...}, "copy": s}.
_HOOK_TIMES: list = []


_SALTS: set = set()  # the cache salts this engine's lookups used (option record_salts)


def _record_salts() -> None:
    """Note every ``cache_salt`` this process's shmkv clients allocate under (through
    ``Client.allocate_many``, which ``allocate`` calls) in ``_SALTS``: a test then reads
    the pool under the engine's own keys (``client.allocate(prompt=..., cache_salt=salt)``)
    without knowing how the connector makes them."""
    from shmkv.client.client import Client

    allocate_many = Client.allocate_many

    def recorded_allocate_many(self, requests, *args, **kwargs):
        requests = list(requests)
        for req in requests:
            if isinstance(req, dict) and req.get("cache_salt") is not None:
                _SALTS.add(bytes(req["cache_salt"]))
        return allocate_many(self, requests, *args, **kwargs)

    Client.allocate_many = recorded_allocate_many


def _track_semaphores() -> set:
    """The names of the POSIX semaphores this process creates from now on and has not
    removed (tqdm's and vLLM's ``multiprocessing`` locks): the engine exits with
    ``os._exit``, which runs no finalizer, so it removes them itself
    (:func:`_unlink_semaphores`) rather than leave them in ``/dev/shm`` until the parent's
    resource tracker ends."""
    from multiprocessing import resource_tracker

    names: set = set()
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def tracked_register(name, rtype):
        if rtype == "semaphore":
            names.add(name)
        register(name, rtype)

    def tracked_unregister(name, rtype):
        names.discard(name)
        unregister(name, rtype)

    resource_tracker.register, resource_tracker.unregister = tracked_register, tracked_unregister
    return names


def _unlink_semaphores(names: set) -> None:
    """Remove the semaphores of :func:`_track_semaphores` (their holders keep them open)
    and tell the resource tracker."""
    import _multiprocessing
    from multiprocessing import resource_tracker

    for name in sorted(names):
        try:
            _multiprocessing.sem_unlink(name)
        except OSError:
            pass  # removed already
        resource_tracker.unregister(name, "semaphore")


def _serve(conn, model: str, kv: dict | None, options: dict) -> None:
    if options.get("nice"):  # (started ahead of its tests: it takes the CPU time left idle)
        os.nice(options["nice"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    # vLLM's own KV cache: 128 MiB unless asked (128k tokens of make_model's defaults; vLLM
    # zeroes all of it at start, and its CPU default, a GiB, costs each engine a second)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # (it would override the bytes)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # torch.compile of the sampler's logprobs costs 7 s on the first request here
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    # several engines share 2 CPUs: no binding of OpenMP threads to cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(options.get("threads", 1)))
    semaphores = _track_semaphores()
    if options.get("record_salts"):
        _record_salts()
    import logging

    logging.getLogger("shmkv").addHandler(logging.StreamHandler())
    logging.getLogger("shmkv").setLevel(logging.WARNING)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    # vLLM collects garbage five times while it starts: with what the imports made out of
    # the collector's reach, that is a second less of each engine's start-up here
    gc.freeze()

    kwargs = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=options.get("max_model_len", 2048),
        enforce_eager=True,
        block_size=options.get("block_size", BLOCK),
        max_num_seqs=options.get("max_num_seqs", 8),
        max_num_batched_tokens=options.get("max_num_batched_tokens", 2048),
        enable_prefix_caching=options.get("prefix_caching", True),
        kv_cache_memory_bytes=options.get("kv_cache_bytes", 128 << 20),
        seed=0,
    )
    if options.get("tp", 1) > 1:  # one worker process per rank, started by vLLM
        kwargs.update(tensor_parallel_size=options["tp"], distributed_executor_backend="mp")
    if kv is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
    try:
        llm = LLM(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        op, args = conn.recv()
        try:
            if op == "stop":
                if options.get("tp", 1) > 1:
                    llm.llm_engine.engine_core.shutdown()  # stops the rank processes
                _unlink_semaphores(semaphores)
                conn.send(("stopped", None))
                conn.close()
                # vLLM's exit handlers take seconds; nothing of this process needs them
                # (the engine core runs here, and shmkv's peers notice the closed socket)
                os._exit(0)
            if op == "reset":
                conn.send(("ok", llm.reset_prefix_cache()))
            elif op == "totals":  # the worker connector's counts since it started
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                conn.send(("ok", dict(get_kv_transfer_group().totals.data)))
            elif op == "hook_times":  # the timed connectors' records since the last ask
                conn.send(("ok", _HOOK_TIMES.copy()))
                _HOOK_TIMES.clear()
            elif op == "salts":  # the cache salts shmkv was asked under (record_salts)
                conn.send(("ok", sorted(_SALTS)))
            elif op == "fault":
                previous, _FAULT["handoff"] = _FAULT["handoff"], args
                conn.send(("ok", previous))
            elif op == "generate":
                prompts, max_tokens = args
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0,
                    logprobs=1,
                    detokenize=False,
                    ignore_eos=True,
                )
                t0 = time.perf_counter()
                outs = llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
                )
                wall = time.perf_counter() - t0
                result = []
                for out in outs:
                    o = out.outputs[0]
                    lps = [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]
                    ttft = None
                    m = getattr(out, "metrics", None)
                    if (
                        m is not None
                        and getattr(m, "first_token_ts", 0)
                        and getattr(m, "scheduled_ts", 0)
                    ):
                        ttft = m.first_token_ts - m.scheduled_ts
                    result.append(
                        dict(
                            tokens=list(o.token_ids),
                            logprobs=lps,
                            num_cached_tokens=out.num_cached_tokens,
                            ttft=ttft,
                        )
                    )
                conn.send(("ok", dict(outputs=result, wall=wall)))
            else:
                conn.send(("error", f"unknown op {op}"))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Engine:
    """A vLLM engine in a spawn child; ``kv`` is a ``KVTransferConfig``'s keywords."""

    def __init__(self, model: str, kv: dict | None = None, timeout: float = 240.0, **options):
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(
            target=_serve, args=(child, model, kv, options), name="vllm-engine"
        )  # not daemonic: TP ranks are its children
        self.proc.start()
        child.close()
        self._pending = None
        self.started = time.monotonic()
        self._timeout = timeout

    def wait_ready(self) -> "Engine":
        """Wait for the engine to start; raises with its error when it did not."""
        status, value = self._recv(self._timeout)
        if status != "ready":
            self.close()
            raise RuntimeError(f"engine did not start: {value}")
        return self

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            self.close()
            raise TimeoutError(f"engine gave no answer within {timeout} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"engine died (exit code {self.proc.exitcode})") from None

    def call(self, op: str, args=None, timeout: float = 120.0):
        self.send(op, args)
        return self.result(timeout)

    def send(self, op: str, args=None) -> None:
        """Send a request without waiting for its answer (see :meth:`result`)."""
        self.conn.send((op, args))

    def result(self, timeout: float = 120.0):
        status, value = self._recv(timeout)
        if status != "ok":
            raise RuntimeError(f"engine error: {value}")
        return value

    def generate(self, prompts, max_tokens: int = 8, timeout: float = 120.0) -> list:
        """Greedy outputs: one dict per prompt (tokens, logprobs, num_cached_tokens, ttft)."""
        return self.call("generate", (prompts, max_tokens), timeout)["outputs"]

    def close(self) -> None:
        """Stop the engine (kill it after 10 s)."""
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
                deadline = time.monotonic() + 10
                while self.conn.poll(max(0.0, deadline - time.monotonic())):
                    if self.conn.recv()[0] == "stopped":  # (an answer still pending goes)
                        break
            except (OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


def connector_config(
    address: str,
    connector: str = "ShmkvConnector",
    module: str = "shmkv.integrations.vllm",
    **extra,
) -> dict:
    """``KVTransferConfig`` keywords for shmkv at ``address``: the engine connects again
    at once to a coordinator started later, and its lookups wait up to 10 s (not the
    default tens of ms: several engines share this machine's two CPUs, and a test whose
    hit matters must not see a late lookup as a miss)."""
    settings = {"shmkv.address": address, "shmkv.retry_s": 0, "shmkv.lookup_timeout_s": 10}
    return dict(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config={**settings, **extra},
    )


# -- a connector with one switchable fault --------------------------------------------------


def __getattr__(name: str):
    """``FaultyShmkvConnector`` and ``NullHitConnector``, made on first use: importing
    this module (as the tests do) does not import vLLM; the engine child imports it when
    vLLM loads the class."""
    if name == "NullHitConnector":
        return _null_hit_connector()
    if name in ("TimedShmkvConnector", "TimedExportShmkvConnector", "TimedExampleConnector"):
        return _timed_connector(name)
    if name != "FaultyShmkvConnector":
        raise AttributeError(name)
    from shmkv.integrations.vllm import ShmkvConnector, ShmkvConnectorScheduler

    class FaultyScheduler(ShmkvConnectorScheduler):
        """The scheduler side, losing the sequences of :class:`FaultyShmkvConnector`."""

        def _source(self, state):
            descriptor = super()._source(state)
            if descriptor is not None and _FAULT["handoff"] > 0:
                _FAULT["handoff"] -= 1
                state.handle.close()  # the lookup's reference goes, as a lost one's would
            return descriptor

        def _made_tokens(self, state):  # (the hand-offs made with the lookup)
            return self._damaged(state, super()._made_tokens(state))

        def _export(self, state):
            return self._damaged(state, super()._export(state))

        def _damaged(self, state, tokens):
            if tokens and _FAULT["handoff"] > 0 and state.load != (0, 0):
                _FAULT["handoff"] -= 1
                state.handle.close()  # the lookup's reference goes, as a lost one's would
                return [t[:-1] + bytes([t[-1] ^ 0xFF]) for t in tokens]
            return tokens

    class FaultyShmkvConnector(ShmkvConnector):
        """:class:`ShmkvConnector` whose scheduler loses the sequence of the next
        ``_FAULT["handoff"]`` requests that have a hit to load, between the lookup and the
        load: a load read through the handle's descriptor finds the sequence gone, a
        hand-off token is damaged (the workers cannot open it)."""

        scheduler_class = FaultyScheduler

    globals()[name] = FaultyShmkvConnector
    return FaultyShmkvConnector


def _null_hit_connector():
    """A connector that claims every prompt's full blocks short of its last token as an
    external hit and loads nothing (vLLM computes the rest over whatever its blocks
    hold): what an external hit costs vLLM itself, whoever supplies the K/V. For timing
    only (``shmkv bench --only vllm``); its outputs are meaningless."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    class NullHitConnector(KVConnectorBase_V1):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            n = len(request.prompt_token_ids or ())
            hit = (n - 1) // BLOCK * BLOCK
            return max(0, hit - num_computed_tokens), False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return None

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context, **kwargs):
            return None

        def wait_for_layer_load(self, layer_name):
            return None

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            return None

        def wait_for_save(self):
            return None

        def request_finished(self, request, block_ids):
            return False, None

    globals()["NullHitConnector"] = NullHitConnector
    return NullHitConnector


# -- the connector with its hooks timed ------------------------------------------------------

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "clear_connector_metadata",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "request_finished",
)


def _timed_connector(name: str):
    """:class:`ShmkvConnector` whose vLLM hooks (and copies) are timed, for the benchmark:
    each request's totals go to ``_HOOK_TIMES`` when vLLM reports it finished (the engine
    op ``hook_times`` takes them). ``TimedExportShmkvConnector`` also hands every request's
    sequence to the workers as hand-off tokens (``export``, ``open``, ``close``), as the
    connector did before loads were read through the lookup's descriptor.
    ``TimedExampleConnector`` is vLLM's in-tree ``ExampleConnector`` timed the same way
    (its loads, file reads and copies, all inside ``start_load_kv``: no ``copy`` of its
    own)."""
    import time

    if name == "TimedExampleConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector as base,
        )
    else:
        from shmkv.integrations.vllm import ShmkvConnector as base

    current = {"hooks": {}, "copy": 0.0}

    def timed(method):
        def run(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                if method.__name__ == "_copy_layer":
                    current["copy"] += spent
                else:
                    hooks = current["hooks"]
                    hooks[method.__name__] = hooks.get(method.__name__, 0.0) + spent
                if method.__name__ == "request_finished":
                    _HOOK_TIMES.append(dict(hooks=dict(current["hooks"]), copy=current["copy"]))
                    current["hooks"], current["copy"] = {}, 0.0

        return run

    namespace = {h: timed(getattr(base, h)) for h in HOOKS}
    if hasattr(base, "worker_class"):  # (the copies are the worker side's)
        worker = base.worker_class
        namespace["worker_class"] = type(
            name + "Worker", (worker,), {"_copy_layer": timed(worker._copy_layer)}
        )
    if name == "TimedExportShmkvConnector":

        def _hand_over(self, state, item):
            item.tokens = self._export(state)
            state.exported = True

        namespace["scheduler_class"] = type(
            name + "Scheduler", (base.scheduler_class,), {"_hand_over": _hand_over}
        )
    cls = type(name, (base,), namespace)
    globals()[name] = cls
    return cls
