"""The tiers suite's report: the markdown of each measurement."""

from __future__ import annotations

import os
from typing import Dict, List


def _commands(commands: dict) -> str:
    """ "`CMD` (part, part); ..." for the commands that last ran each part."""
    parts: Dict[str, List[str]] = {}
    for part, command in commands.items():
        parts.setdefault(command, []).append(part)
    return "; ".join(f"`{command}` ({', '.join(names)})" for command, names in parts.items())


def _slice_line(ping: dict) -> str:
    """What CPU slice the coordinators' loop thread ran with (``loop_slice_us``)."""
    own = "The coordinators' loop thread ran with its own CPU slice"
    if "loop_slice_us" not in ping.get("disk", {}):
        return f"{own} (a build before `loop_slice_us`)."
    got = ping["disk"]["loop_slice_us"]
    if got is None:
        return f"{own} (`loop_slice_us` 0, or a kernel that keeps none)."
    return f"The coordinators' loop thread asked for a CPU slice of {got:g} us (`loop_slice_us`)."


def markdown(res: dict) -> str:
    lines = [
        "# Tiers under the pool",
        "",
        f"Machine: {os.cpu_count()} cores, shared with other work (1-minute load average "
        f"after each part: "
        + ", ".join(f"{k} {v:.1f}" for k, v in res.get("load_average", {}).items())
        + ").",
        "Reproduce: `shmkv bench --only tiers` (every part), or with `-- --only "
        "PART ...` (the parts given; the others stay as they were). This file: "
        + _commands(res.get("commands", {}))
        + ".",
        f"Tier copies run in: {res.get('tier_copies', 'threads of the coordinator')}.",
        "",
    ]
    d = res.get("disk_bandwidth")
    if d:
        lines += [
            "## Promotion from disk vs a plain sequential read of the same files",
            "",
            f"{d['blocks']} blocks of {d['block_bytes'] // 1024} KiB, "
            f"{d['blocks_per_request']} per request.",
            "",
            "| page cache | promotion GB/s | plain read GB/s | ratio |",
            "|---|---|---|---|",
        ]
        for cache in ("cold", "warm"):
            r = d[cache]
            lines.append(
                f"| {cache} | {r['promotion_GBps']:.2f} | {r['plain_read_GBps']:.2f} "
                f"| {r['ratio']:.2f} |"
            )
        lines.append("")
    h = res.get("host_bandwidth")
    if h:
        lines += [
            "## Promotion from the host tier vs a plain copy",
            "",
            f"{h['blocks']} blocks of {h['block_bytes'] // 1024} KiB, "
            f"{h['blocks_per_request']} per request, passes of each alternating: promotion "
            f"{h['promotion_GBps']:.2f} GB/s, plain copy {h['plain_copy_GBps']:.2f} GB/s "
            f"(numpy's copyto; medians), ratio **{h['ratio']:.2f}** (the median of "
            + (
                f"{len(h['ratios'])} pairs, {min(h['ratios']):.2f}-{max(h['ratios']):.2f})."
                if h.get("ratios")
                else "the passes)."
            ),
            "",
        ]
        if h.get("ratios_same_copy"):
            same = h["ratios_same_copy"]
            lines += [
                "Promotions copy with the native row copy (stores past the caches). The same "
                f"copy alone, in a third pass of each round: {h['row_copy_GBps']:.2f} GB/s; "
                f"promotion against it {h['ratio_same_copy']:.2f} ({min(same):.2f}-"
                f"{max(same):.2f}): what the round trips and bookkeeping cost.",
                "",
            ]
        elif h.get("row_copy"):
            lines += [f"No native row copy here ({h['row_copy']}): promotions copy with numpy.", ""]
    p = res.get("ping")
    if p:
        lines += [
            "## Ping while another process promotes",
            "",
            'The last three rows are controls. "no tier": the same number of '
            'allocations a second as the host run, each a pool hit ("promoted '
            "blocks/s\": blocks hit), so the loop's own work for those requests. "
            '"pings alone": a process sending as many requests a second as the '
            "host run did (an allocation and a release per promoting request), each "
            'a ping ("promoted blocks/s": 0). "copies alone": a process copying '
            "as many blocks a second as the host run promoted, at the tier I/O "
            "process's priority, sending no request.",
            "",
            _slice_line(p),
            "",
            "| tier | idle p50 us | idle p99 us | promoting p50 us | promoting p99 us | "
            "p99 ratio | promoted blocks/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind, r in p.items():
            if kind == "runs":
                continue
            lines.append(
                f"| {kind} | {r['idle']['p50_us']:.0f} | {r['idle']['p99_us']:.0f} | "
                f"{r['promoting']['p50_us']:.0f} | {r['promoting']['p99_us']:.0f} | "
                f"{r['p99_ratio']:.2f} | "
                f"{r['promoting']['promoted_blocks_per_s']:.0f} |"
            )
        lines.append("")
    runs = (p or {}).get("runs")
    if runs:
        lines += [
            f"Every run's p99 ratio ({len(runs)} runs, one after another; the table above "
            "is the last):",
            "",
            "| tier | "
            + " | ".join(f"run {i + 1}" for i in range(len(runs)))
            + " | min | median | max | runs <= 2x |",
            "|---|" + "---|" * (len(runs) + 4),
        ]
        for kind in runs[0]:
            got = [run[kind] for run in runs]
            lines.append(
                f"| {kind} | "
                + " | ".join(f"{v:.2f}" for v in got)
                + f" | {min(got):.2f} | {sorted(got)[len(got) // 2]:.2f} | {max(got):.2f} | "
                f"{sum(v <= 2 for v in got)} of {len(got)} |"
            )
        lines.append("")
    w = res.get("loop_cold")
    if w:
        gaps = [str(g) for g in w["gaps_ms"]]
        lines += [
            "## The loop's work for one request, back to back and after a pause",
            "",
            "The coordinator's own calls in one process, no socket: median of 200, "
            "each after a sleep of the given length (the loop sleeps between "
            "requests; its code and data then come back from memory). What a ping "
            "waits for when it arrives behind such a request.",
            "",
            "| work | "
            + " | ".join(f"{float(g):g} ms pause, us" for g in gaps)
            + f" | {float(gaps[-1]):g} ms / back to back |",
            "|---|" + "---|" * (len(gaps) + 1),
        ]
        for label, row in w["work"].items():
            lines.append(
                f"| {label} | "
                + " | ".join(f"{row[g]:.1f}" for g in gaps)
                + f" | {row[gaps[-1]] / row[gaps[0]]:.1f}x |"
            )
        lines.append("")
    c = res.get("chat")
    if c:
        lines += [
            "## Multi-turn chat trace",
            "",
            f"`{c['trace']}`: {c['requests']} requests, working set "
            f"{c['working_set_blocks']} blocks, pool {c['pool_blocks']} blocks "
            f"(block size {c['block_size']}).",
            "",
            "| run | prefix-hit rate | prompt tokens | prefill tokens | cached blocks "
            "checked (wrong) |",
            "|---|---|---|---|---|",
        ]
        for label in ("pool alone", "pool + host tier (1x pool) + disk tier"):
            r = c[label]
            lines.append(
                f"| {label} | {r['hit_rate']:.1%} | {r['prompt_tokens']} | "
                f"{r['prefill_tokens']} | {r['blocks_checked']} ({r['blocks_wrong']}) |"
            )
        io = c["pool + host tier (1x pool) + disk tier"].get("tier_io") or {}
        lines += [
            "",
            f"Pool evictions whose block no tier had yet (write-behind behind): "
            f"{io.get('lost_evictions')}.",
        ]
        lines += [
            "",
            f"Prefill tokens saved by the tiers: **{c['prefill_tokens_saved_by_tiers']}**.",
            "",
        ]
    r = res.get("restart")
    if r:
        lines += [
            "## Restart with blocks on disk",
            "",
            f"{r['blocks_on_disk']} blocks on disk. Coordinator process start to ready "
            f"{r['process_start_to_ready_s']:.2f} s; ready to the first disk hit "
            f"**{r['ready_to_first_disk_hit_s'] * 1e3:.0f} ms** "
            f"({r['allocations_until_hit']} allocations); ready to every header "
            f"checked {r['ready_to_scan_done_s'] * 1e3:.0f} ms.",
            "",
        ]
    return "\n".join(lines)
