"""The sections run: ``shmkv bench`` with no ``--only``, or ``--only`` of its sections.

Owns the order of the sections (:data:`SECTIONS`: data, attach, control, handoff,
scaling, memory, batch; each measured by its own module of this package), the record
of one run (``benchmarks/results/NAME.json``: every figure, every point of every
sweep, host, notes), its Markdown (the figure table and the grids) and the plots of
its sections (``benchmarks/plots/NAME-SECTION.png``). ``NAME`` is ``full`` or
``quick`` unless ``--name`` or ``--only`` says otherwise.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import platform
import time
from typing import List

from shmkv.bench.attach import bench_attach, bench_memory
from shmkv.bench.batch import _split, bench_batch
from shmkv.bench.control import bench_control
from shmkv.bench.core import (
    MIB,
    MODEL,
    Figure,
    Options,
    _Cleanup,
    _percentile,
    _shm_entries,
    _size,
    format_table,
    markdown_table,
    pyplot,
    result_base,
    table_rows,
    write_results,
)
from shmkv.bench.data import _REFERENCE, DATA_OPS, bench_data
from shmkv.bench.handoff import bench_handoff
from shmkv.bench.scaling import bench_scaling

SECTIONS = ("data", "attach", "control", "handoff", "scaling", "memory", "batch")


def format_markdown(figures: List[Figure], series: dict) -> str:
    """The table as Markdown, followed by the data-plane ratio grid."""
    out = markdown_table(table_rows(figures)).split("\n")
    points = series.get("data")
    if points:
        lengths = sorted({p["n"] for p in points})
        out += [
            "",
            "Data plane, ratio to the contiguous copy, per block size and sequence length:",
            "",
            "| op | block size | " + " | ".join(f"n={n}" for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths),
        ]
        for op, label, _base, _target in DATA_OPS:
            for bs in sorted({p["block_size"] for p in points}):
                by_n = {p["n"]: p[op + "_ratio"] for p in points if p["block_size"] == bs}
                out.append(
                    f"| {label} | {bs} | "
                    + " | ".join(f"{by_n[n]:.2f}" if n in by_n else "-" for n in lengths)
                    + " |"
                )
        for base, ref in _REFERENCE.items():
            for bs in sorted({p["block_size"] for p in points}):
                by_n = {p["n"]: p[ref] / p[base] for p in points if p["block_size"] == bs}
                out.append(
                    f"| reference: {ref.replace('_', ' ')} (fresh tensor) | {bs} | "
                    + " | ".join(f"{by_n[n]:.2f}" if n in by_n else "-" for n in lengths)
                    + " |"
                )
    batch = series.get("batch")
    if batch:
        out += [
            "",
            "Batched decode step, milliseconds per step (32 layers, 8 KV heads x 128, "
            "bfloat16, block size 16, 512-token shared context):",
            "",
            "| B | floor (bf16 rows) | floor (16-byte rows) | batch step | of which "
            "extend(1) | per-handle | batch / floor | per-handle / batch |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in batch["decode"]:
            out.append(
                f"| {p['batch_size']} | {p['floor_s'] * 1e3:.3f} | "
                f"{p['floor_16b_s'] * 1e3:.3f} | {p['batch_s'] * 1e3:.3f} | "
                f"{p['extend_s'] * 1e3:.3f} | {p['per_handle_s'] * 1e3:.3f} | "
                f"{p['batch_s'] / p['floor_s']:.2f} | "
                f"{p['per_handle_s'] / p['batch_s']:.1f} |"
            )
        c = batch["control"]
        out += [
            "",
            "Where a control-plane call goes (microseconds; table and msgpack timed in "
            "process, wire = ping round trips, other = the rest):",
            "",
            "| call | total | coordinator table | msgpack, both sides | wire (ping) | "
            "other | Step built by the client |",
            "|---|---|---|---|---|---|---|",
        ]
        for prefix, label in (
            ("alloc", "allocate_many([1]*256) + close_many"),
            ("extend", "batch.extend(1), 256 sequences"),
        ):
            split = _split(c, prefix)
            out.append(
                f"| {label} | {split['total_us']:.0f} | {split['table_us']:.0f} | "
                f"{split['codec_us']:.0f} | {split['ping_us']:.0f} | "
                f"{split['other_us']:.0f} | "
                + (f"{split['step_build_us']:.0f} |" if "step_build_us" in split else "- |")
            )
    return "\n".join(out)


def draw_plots(series: dict, plot_dir: str, name: str) -> List[str]:
    """One PNG per measured section; returns the paths written."""
    plt = pyplot()
    os.makedirs(plot_dir, exist_ok=True)
    written = []

    def save(fig, section):
        path = os.path.join(plot_dir, f"{name}-{section}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "data" in series:
        points = series["data"]
        fig, axes = plt.subplots(3, 2, figsize=(11, 11), sharex=True)
        for ax, (op, label, base, target) in zip(axes.flat, DATA_OPS):
            bound = float(target.split()[1])
            for i, bs in enumerate(sorted({p["block_size"] for p in points})):
                rows = sorted((p for p in points if p["block_size"] == bs), key=lambda p: p["n"])
                ax.plot(
                    [p["n"] for p in rows],
                    [p[op + "_ratio"] for p in rows],
                    marker="o",
                    color=f"C{i}",
                    label=f"block size {bs}",
                )
                if op in ("gather_all", "key_cache"):
                    ax.plot(
                        [p["n"] for p in rows],
                        [p[_REFERENCE[base]] / p[base] for p in rows],
                        color=f"C{i}",
                        linestyle=":",
                        alpha=0.6,
                        label=f"clone (fresh tensor), bs {bs}" if i == 0 else None,
                    )
            ax.axhline(bound, color="red", linestyle="--", label=f"target {bound}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{label} / {base.replace('_', ' ')}")
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel("bandwidth ratio")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        axes.flat[4].legend(fontsize=7)
        save(fig, "data")
    if "attach" in series:
        points = series["attach"]
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [p["pool_bytes"] / MIB for p in points]
        ax.plot(x, [p["warm_s"] * 1e3 for p in points], marker="o", label="attach (median)")
        ax.plot(
            x,
            [p["baseline_s"] * 1e3 for p in points],
            marker=".",
            alpha=0.6,
            label=f"{_size(points[0]['pool_bytes'])} pool, timed alternately",
        )
        ax.plot(
            x,
            [p["cold_s"] * 1e3 for p in points],
            marker="x",
            linestyle=":",
            label="first attach in the process",
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pool size (MiB)")
        ax.set_ylabel("shmkv.connect (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "attach")
    if "latency" in series or "throughput" in series:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        if "latency" in series:
            labels, p50, p99 = [], [], []
            for place, lat in series["latency"].items():
                for kind, values in lat.items():
                    labels.append(f"{kind}\n{place}")
                    p50.append(_percentile(values, 50))
                    p99.append(_percentile(values, 99))
            bars = range(len(labels))
            axes[0].bar([i - 0.2 for i in bars], p50, width=0.4, label="p50")
            axes[0].bar([i + 0.2 for i in bars], p99, width=0.4, label="p99")
            axes[0].set_xticks(list(bars), labels, fontsize=7)
            axes[0].set_ylabel("round trip (us)")
            axes[0].set_title("one request (echo = raw msgpack server)")
            axes[0].legend()
        if "throughput" in series:
            rows = series["throughput"]
            for kind in ("allocate_many+close_many", "allocate+close", "BlockPool"):
                axes[1].plot(
                    [r["batch"] for r in rows], [r[kind] for r in rows], marker="o", label=kind
                )
            axes[1].axhline(500000, color="red", linestyle="--", label="target (batch >= 256)")
            axes[1].set_xscale("log", base=2)
            axes[1].set_yscale("log")
            axes[1].set_xlabel("blocks per call")
            axes[1].set_ylabel("blocks allocated + freed per s")
            axes[1].legend(fontsize=8)
            axes[1].grid(alpha=0.3)
        save(fig, "control")
    if "handoff" in series:
        med = series["handoff"]["median_s"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(med), [v * 1e3 for v in med.values()], color=["C0", "C1", "C2"])
        ax.set_ylabel("end to end (ms)")
        ax.set_title(f"hand-off of {series['handoff']['bytes'] / MIB:.0f} MiB of K/V")
        save(fig, "handoff")
    if "scaling" in series:
        points = series["scaling"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        n = [p["workers"] for p in points]
        axes[0].plot(n, [p["ops_per_s"] for p in points], marker="o")
        axes[0].set_ylabel("aggregate ops/s")
        axes[1].plot(n, [p["bytes_per_s"] / 1e9 for p in points], marker="o")
        axes[1].set_ylabel("aggregate GB/s (write_all + gather_all(out=))")
        for ax in axes:
            ax.set_xlabel("worker processes")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        save(fig, "scaling")
    if "memory" in series:
        points = series["memory"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        x = [p["pool_bytes"] / MIB for p in points]
        for ax, who in zip(axes, ("coordinator", "worker")):
            keys = (
                ["coordinator"] if who == "coordinator" else ["worker_attached", "worker_touched"]
            )
            for key in keys:
                if points[0][key] is None:
                    continue
                for kind, style in (("rss", "-"), ("uss", "--"), ("anon", ":")):
                    ax.plot(
                        x,
                        [p[key][kind] / MIB for p in points],
                        marker="o",
                        linestyle=style,
                        label=f"{key.replace('_', ' ')} {kind.upper()}",
                    )
            ax.plot(x, x, color="grey", alpha=0.4, label="pool size")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("pool size (MiB)")
            ax.set_ylabel("MiB")
            ax.set_title(who)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        save(fig, "memory")
    if "batch" in series:
        points = series["batch"]["decode"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        b = [p["batch_size"] for p in points]
        ax = axes[0]
        for key, label, style in (
            ("batch_s", "batch: extend(1) + step.write x32", "-"),
            ("per_handle_s", "per handle: extend_many + h.write", "-"),
            ("floor_s", "floor: index_copy_ x64 (bf16 rows)", "--"),
            ("floor_16b_s", "floor, 16-byte rows", ":"),
        ):
            ax.plot(b, [p[key] * 1e3 for p in points], marker="o", linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(b, [str(x) for x in b])
        ax.set_yscale("log")
        ax.set_xlabel("sequences in the step (B)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title("decode step, 32 layers, 512-token context")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1]
        control = series["batch"]["control"]
        parts = ("table_us", "codec_us", "ping_us", "other_us", "step_build_us")
        part_labels = ("coordinator table", "msgpack", "wire (ping)", "other", "Step (client)")
        for row, prefix in enumerate(("alloc", "extend")):
            split, left = _split(control, prefix), 0.0
            for i, (part, part_label) in enumerate(zip(parts, part_labels)):
                width = max(0.0, split.get(part, 0.0))
                ax.barh(
                    row, width, left=left, color=f"C{i}", label=part_label if row == 0 else None
                )
                left += width
            # The parts are timed apart (and on a shared machine): mark the measured whole.
            ax.plot(
                [split["total_us"]],
                [row],
                marker="|",
                markersize=40,
                color="black",
                linestyle="none",
                label="measured call" if row == 0 else None,
            )
        ax.set_yticks([0, 1], ["allocate_many\n+ close_many", "batch.extend(1)"])
        ax.set_xlabel("microseconds, 256 sequences")
        ax.set_title("where a control-plane call goes")
        ax.legend(fontsize=8, markerscale=0.3)
        save(fig, "batch")
    return written


# -- driver ---------------------------------------------------------------------------------


def run(opts: Options) -> dict:
    """Run the selected sections; returns the record that is written as JSON."""
    import torch

    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    opts.threads = torch.get_num_threads()
    started = time.time()
    t0 = time.perf_counter()
    shm_before = _shm_entries()
    cleanup = _Cleanup()
    figures: List[Figure] = []
    series: dict = {}
    cache: dict = {}
    timings = {}
    from shmkv.tools.progress import ProgressBar  # a live bar on a terminal, nothing otherwise

    bar = ProgressBar("bench", total=sum(s in opts.sections for s in SECTIONS), unit="sections")
    try:
        for section in SECTIONS:
            if section not in opts.sections:
                continue
            s0 = time.perf_counter()
            bar.update(description=f"bench: {section}")
            print(f"shmkv bench: {section} ...", flush=True)
            if section == "data":
                figures += bench_data(opts, cleanup, series)
            elif section == "attach":
                figures += bench_attach(opts, cleanup, series, cache)
            elif section == "control":
                figures += bench_control(opts, cleanup, series)
            elif section == "handoff":
                figures += bench_handoff(opts, cleanup, series)
            elif section == "scaling":
                figures += bench_scaling(opts, cleanup, series)
            elif section == "memory":
                figures += bench_memory(opts, cleanup, series, cache)
            elif section == "batch":
                figures += bench_batch(opts, cleanup, series, cache)
            timings[section] = time.perf_counter() - s0
            print(f"shmkv bench: {section} done in {timings[section]:.1f} s", flush=True)
            bar.advance()
    finally:
        bar.close()
        cleanup.close()
    notes = list(cache.get("notes", []))
    leftover = multiprocessing.active_children()
    if leftover:
        notes.append(f"helper processes still alive at the end: {leftover}")
    new_shm = sorted(_shm_entries() - shm_before)
    if new_shm:
        notes.append(f"new /dev/shm entries at the end: {new_shm}")
    return {
        "name": opts.name,
        "quick": opts.quick,
        "sections": list(opts.sections),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": time.perf_counter() - t0,
        "section_s": timings,
        "repeats": opts.repeats,
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_avg": os.getloadavg(),
        },
        "model": MODEL,
        "figures": [dataclasses.asdict(f) for f in figures],
        "series": series,
        "notes": notes,
    }


def cmd_sections(args) -> int:
    """``shmkv bench`` over the sections (all of them, or those of ``--only``)."""
    sections = tuple(args.only) if args.only else SECTIONS
    mode = "quick" if args.quick else "full"
    name = args.name or (mode if not args.only else f"{mode}-{'-'.join(args.only)}")
    repeats = args.repeats or (5 if args.quick else 7)
    opts = Options(
        quick=args.quick,
        repeats=repeats,
        sections=sections,
        out_dir=args.out,
        name=name,
        threads=args.threads,
    )
    record = run(opts)
    figures = [Figure(**f) for f in record["figures"]]
    print()
    print(format_table(figures))
    try:
        plots = draw_plots(record["series"], os.path.join(opts.out_dir, "plots"), name)
    except ImportError:
        plots = []
        record["notes"].append(
            "matplotlib is not installed: plots skipped (pip install 'shmkv[plot]')"
        )
    json_path, md_path = write_results(
        result_base(name, opts.out_dir), record, format_markdown(figures, record["series"])
    )
    for note in record["notes"]:
        print(f"note: {note}")
    missed = [f for f in figures if f.met is False]
    print(
        f"\n{sum(f.met is True for f in figures)} targets met, {len(missed)} missed; "
        f"{record['duration_s']:.0f} s; results in {json_path} and {md_path}"
        + (f"; plots in {os.path.dirname(plots[0])}" if plots else "")
    )
    return 0
