"""Where a tail ping waits, as the kernel's scheduler saw it (a one-off diagnostic, not a
benchmark; needs root and tracefs).

    python sched_trace.py host|none [cycles] [allocations/s]

Runs the ping set-up of ``shmkv bench --only tiers`` (128 blocks of 32 layers, 32-block
prompts; a pinger every 0.5 ms, a promoter in alternate 0.5 s phases) against a spawned
coordinator, and records the scheduler's events meanwhile (``sched_switch``,
``sched_waking``; ftrace, on the monotonic clock the pinger stamps its pings with).
Nothing in shmkv is wrapped: the loop runs as it does in the benchmark.

Prints:

* every wake-up of the loop, the pinger and the promoter, by what the CPU it was put on
  was running then (idle, the tier I/O process, the loop, ...): how long until it ran;
* for the pings between p98 and p99.5 of each phase, where their time went, sampled every
  2 us: the loop running, the pinger running, or either of them runnable but not running,
  with what the two CPUs ran meanwhile;
* the kernel's events around the three slowest pings of that band.
"""

import bisect
import collections
import multiprocessing as mp
import os
import re
import sys
import time

import shmkv
from shmkv.bench import tiers as bench

TRACING = "/sys/kernel/tracing/"
POOL_BLOCKS, PROMPT_BLOCKS = 128, 32
OUT = os.path.dirname(os.path.abspath(__file__))


def _write(path, value):
    with open(TRACING + path, "w") as f:
        f.write(value)


def _comm(name):
    with open("/proc/self/comm", "w") as f:
        f.write(name)


def _pinger(address, seconds, queue):
    _comm("pinger")
    bench._pinger(address, seconds, queue)


def _promoter(address, prompts, block_size, go, stop, queue, rate):
    _comm("promoter")
    bench._promoter(address, prompts, block_size, go, stop, queue, rate)


def record(kind, cycles, rate):
    """Run the ping phases with the scheduler's events on: (samples, phases, pids, trace)."""
    cfg = shmkv.PoolConfig(num_blocks=POOL_BLOCKS, **bench.BIG)
    num = max(2 * POOL_BLOCKS // PROMPT_BLOCKS, 4)
    prompts = bench.prompts_for(num, PROMPT_BLOCKS, cfg.block_size, seed=3)
    tiers = [shmkv.HostTier((num * PROMPT_BLOCKS + 8) * cfg.block_nbytes)] if kind == "host" else []
    ctx = mp.get_context("spawn")
    with (
        shmkv.Coordinator.spawn(cfg, name=f"sched-{os.getpid()}", tiers=tiers) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        if kind == "none":
            prompts = prompts[: POOL_BLOCKS // PROMPT_BLOCKS - 1]
            bench.fill(client, prompts)
        else:
            bench.fill(client, prompts)
            bench.evict_all(client)
            bench.wait_idle(client)
        io_pids = set()  # the tier I/O process's threads
        for children in os.listdir(f"/proc/{coord.pid}/task"):
            with open(f"/proc/{coord.pid}/task/{children}/children") as f:
                for child in f.read().split():
                    io_pids.update(int(tid) for tid in os.listdir(f"/proc/{child}/task"))
        queue, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
        promoter = ctx.Process(
            target=_promoter,
            args=(coord.address, prompts, cfg.block_size, go, stop, queue, rate),
        )
        promoter.start()
        assert queue.get(timeout=60)[0] == "ready"
        pinger = ctx.Process(target=_pinger, args=(coord.address, cycles + 3.0, queue))
        pinger.start()
        time.sleep(2.0)
        phases = []
        try:
            _write("tracing_on", "0")
            _write("trace", "")
            _write("trace_clock", "mono")
            _write("buffer_size_kb", "131072")
            _write("set_event", "sched:sched_switch sched:sched_waking")
            _write("tracing_on", "1")
            for _ in range(cycles):
                for busy in (False, True):
                    (go.set if busy else go.clear)()
                    t0 = time.monotonic()
                    time.sleep(0.5)
                    phases.append((t0 + 0.05, time.monotonic(), busy))
            go.clear()
            _write("tracing_on", "0")
            with open(TRACING + "trace") as f:
                trace = f.read()
        finally:
            _write("tracing_on", "0")
            _write("set_event", "")
            _write("trace", "")
        results = dict([queue.get(timeout=120)])
        stop.set()
        results.update([queue.get(timeout=120)])
        promoter.join(30)
        pinger.join(30)
        pids = {"loop": coord.pid, "pinger": pinger.pid, "promoter": promoter.pid}
    return results["pings"], phases, pids, io_pids, trace, results["moved"][2]


_SWITCH = re.compile(
    r"\[(\d+)\] \S+ +([\d.]+): sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=\d+ "
    r"prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)"
)
_WAKING = re.compile(
    r"-(\d+)\s+\[\d+\] \S+ +([\d.]+): sched_waking: comm=(.*?) pid=(\d+) .*target_cpu=(\d+)"
)


class Timeline:
    """Who ran on each CPU when, and every wake-up, from the trace's text."""

    def __init__(self, trace, pids, io_pids):
        self.names = {pid: name for name, pid in pids.items()}
        self.names.update((pid, "tier I/O") for pid in io_pids)
        self.names[0] = "idle"
        self.comm = {}
        self.switches, self.wakings = [], []
        for line in trace.splitlines():
            m = _SWITCH.search(line)
            if m:
                cpu, t, pcomm, ppid, pstate, ncomm, npid = m.groups()
                self.switches.append((float(t), int(cpu), int(ppid), pstate, int(npid)))
                self.comm[int(ppid)], self.comm[int(npid)] = pcomm, ncomm
                continue
            m = _WAKING.search(line)
            if m:
                waker, t, _, pid, target = m.groups()
                self.wakings.append((float(t), int(waker), int(pid), int(target)))
        cpus = sorted({s[1] for s in self.switches})
        self.segments = {cpu: [] for cpu in cpus}  # (start, end, pid)
        current = {}
        for t, cpu, _, _, npid in self.switches:
            if cpu in current:
                self.segments[cpu].append((current[cpu][0], t, current[cpu][1]))
            current[cpu] = (t, npid)
        self.starts = {cpu: [s[0] for s in segs] for cpu, segs in self.segments.items()}
        self.ins, self.outs, self.woken = {}, {}, {}
        for t, _cpu, ppid, _, npid in self.switches:
            self.ins.setdefault(npid, []).append(t)
            self.outs.setdefault(ppid, []).append(t)
        for t, _, pid, target in self.wakings:
            self.woken.setdefault(pid, []).append((t, target))
        self.woken_t = {pid: [w[0] for w in ws] for pid, ws in self.woken.items()}
        self._out_state = {(ppid, t): pstate for t, _, ppid, pstate, _ in self.switches}

    def label(self, pid):
        if pid is None:
            return "?"
        return self.names.get(pid) or self.comm.get(pid, str(pid))

    def running(self, cpu, t):
        i = bisect.bisect_right(self.starts[cpu], t) - 1
        if i < 0 or self.segments[cpu][i][1] <= t:
            return None
        return self.segments[cpu][i][2]

    def on_cpu(self, pid, t):
        return any(self.running(cpu, t) == pid for cpu in self.segments)

    def runnable_on(self, pid, t):
        """The CPU ``pid`` was woken onto, if it is runnable (woken, not yet run) at ``t``."""
        i = bisect.bisect_right(self.woken_t.get(pid, []), t) - 1
        if i < 0:
            return None
        woke, target = self.woken[pid][i]
        ins = self.ins.get(pid, [])
        j = bisect.bisect_right(ins, woke)
        if j < len(ins) and ins[j] <= t:
            return None  # it ran since
        return target

    def preempted(self, pid, t):
        """Whether ``pid`` was switched out runnable (preempted) and not back yet at ``t``."""
        outs, ins = self.outs.get(pid, []), self.ins.get(pid, [])
        i = bisect.bisect_right(outs, t) - 1
        j = bisect.bisect_right(ins, t) - 1
        if i < 0 or (j >= 0 and ins[j] > outs[i]):
            return False
        return self._out_state.get((pid, outs[i]), "S").startswith("R")


def wake_latencies(tl, who_pids):
    print("Wake-up to running, by what the CPU it was put on ran at the wake-up:")
    for name, pid in who_pids.items():
        ins = tl.ins.get(pid, [])
        by = collections.defaultdict(list)
        for woke, target in tl.woken.get(pid, []):
            j = bisect.bisect_right(ins, woke)
            if j < len(ins):
                by[tl.label(tl.running(target, woke))].append(ins[j] - woke)
        for what, values in sorted(by.items(), key=lambda kv: -len(kv[1])):
            if len(values) < 20:
                continue
            values.sort()
            n = len(values)
            p50, p90, p99 = (values[int(n * q)] * 1e6 for q in (0.5, 0.9, 0.99))
            print(
                f"  {name:8s} onto a CPU running {what:10s} n={n:6d} "
                f"p50={p50:6.1f} p90={p90:6.1f} p99={p99:6.1f} us"
            )


def tail_band(samples, phases, promoting):
    mine = [
        (t0, lat)
        for t0, lat in samples
        if any(a <= t0 < b and busy == promoting for a, b, busy in phases)
    ]
    values = sorted(lat for _, lat in mine)
    mine.sort(key=lambda s: -s[1])
    top = len(mine) // 100
    return values[int(0.99 * len(values))], mine[top // 2 : 2 * top]


def where_time_went(tl, pids, band):
    loop, pinger = pids["loop"], pids["pinger"]
    cpus = sorted(tl.segments)
    parts = collections.Counter()
    step = 2e-6
    for t0, lat in band:
        t = t0
        while t < t0 + lat:
            running = [tl.running(cpu, t) for cpu in cpus]
            if pinger in running:
                key = "pinger running"
            elif loop in running:
                key = "loop running"
            else:
                key = None
                for name, pid in (("pinger", pinger), ("loop", loop)):
                    target = tl.runnable_on(pid, t)
                    if target is not None:
                        here = tl.label(tl.running(target, t))
                        other = ", ".join(
                            tl.label(running[i]) for i, cpu in enumerate(cpus) if cpu != target
                        )
                        key = f"{name} woken, waits: its CPU ran {here}, the other {other}"
                        break
                    if tl.preempted(pid, t):
                        ran = ", ".join(tl.label(r) for r in running)
                        key = f"{name} preempted, waits: the CPUs ran {ran}"
                        break
                if key is None:
                    key = "loop asleep, not woken yet"
            parts[key] += step
            t += step
    n = len(band)
    for key, total in parts.most_common(14):
        print(f"    {total / n * 1e6:7.1f} us  {key}")


def show(tl, band, count=3):
    for t0, lat in band[:count]:
        print(f"  a ping of {lat * 1e6:.0f} us (times from its start, us):")
        events = [
            (t, f"cpu{cpu}: {tl.label(p)} ({s}) -> {tl.label(n)}")
            for t, cpu, p, s, n in tl.switches
            if t0 - 50e-6 <= t <= t0 + lat
        ]
        events += [
            (t, f"{tl.label(w)} wakes {tl.label(p)} onto cpu{c}")
            for t, w, p, c in tl.wakings
            if t0 - 50e-6 <= t <= t0 + lat
        ]
        for t, text in sorted(events):
            print(f"    {(t - t0) * 1e6:7.1f}  {text}")


def main(argv):
    kind = argv[1] if len(argv) > 1 else "host"
    cycles = int(argv[2]) if len(argv) > 2 else 8
    rate = float(argv[3]) if len(argv) > 3 else None
    if os.geteuid() != 0:
        print("needs root (the scheduler's trace events)")
        return 1
    if not os.path.exists(TRACING + "trace"):
        os.system(f"mount -t tracefs nodev {TRACING}")
    samples, phases, pids, io_pids, trace, allocations = record(kind, cycles, rate)
    tl = Timeline(trace, pids, io_pids)
    print(f"{kind}: {allocations / (cycles * 0.5):.0f} allocations/s while promoting")
    wake_latencies(tl, pids)
    for promoting in (False, True):
        p99, band = tail_band(samples, phases, promoting)
        mean = sum(lat for _, lat in band) / len(band)
        print(
            f"{'promoting' if promoting else 'idle'}: ping p99 {p99 * 1e6:.0f} us; "
            f"p98-p99.5 band n={len(band)}, mean {mean * 1e6:.0f} us, spent:"
        )
        where_time_went(tl, pids, band)
    print("The slowest pings of the promoting band:")
    show(tl, tail_band(samples, phases, True)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
