"""The report of ``shmkv stress`` as text (:func:`format_report`): what the run did, what
it checked, and why it passed or failed. The report itself is ``shmkv.tools.stress``'s.
"""

from __future__ import annotations

from shmkv.tools.stress_checks import EXPECTED_ERRORS


def format_report(report: dict) -> str:
    """The report as plain text."""
    ran = f"{report['elapsed_s']:.1f} s"
    if "coordinator_kill" in report:
        ran += " until the coordinator was SIGKILLed"
    lines = [
        f"shmkv stress: {report['args']['workers']} workers, {ran}, "
        f"{report['ops_total']} ops ({report['ops_per_s']:.0f}/s), kill rate "
        f"{report['args']['kill_rate']}/s, {report['worker_kills']} worker kills, "
        f"{report['worker_restarts']} restarts"
    ]
    lines.append("ops by type:")
    width = max([len(k) for k in report["latency_ms"]] + [10])
    for name, count in report["ops"].items():
        lat = report["latency_ms"].get(name, {})
        lines.append(
            f"  {name:<{width}} {count:>9}   p50 {lat.get('p50_ms', 0):8.3f} ms   "
            f"p99 {lat.get('p99_ms', 0):8.3f} ms"
        )
    lines.append(
        "errors by type: "
        + (", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none")
        + f" (expected under pressure: {', '.join(EXPECTED_ERRORS)})"
    )
    h = report["handoffs"]
    lines.append(
        f"hand-offs between workers: {h['sent']} sent, {h['routed']} routed, "
        f"{h['drained']} opened by the parent at the end, {h['drain_expired']} "
        "expired before that"
    )
    lines.append(f"values verified: {report['values_verified']:,}")
    lines.append(f"corrupted reads: {report['corrupted_reads']}")
    for sample in report["corruption_samples"]:
        lines.append(f"  {sample}")
    leaked = report.get("blocks_leaked")
    lines.append(
        "blocks leaked: "
        + ("n/a (" + report.get("note", "") + ")" if leaked is None else str(leaked))
    )
    if "final_stats" in report:
        fs = report["final_stats"]
        lines.append(
            f"  final: free {fs['free_blocks']} + cached {fs['cached_blocks']} of "
            f"{fs['num_blocks']}, referenced {fs['referenced_blocks']}, sequences "
            f"{fs['sequences']}, hand-offs {fs['handoffs']}, evictions "
            f"{fs['evictions']}, copy-on-write {fs['cow_copies']}, expired hand-offs "
            f"{fs['expired_handoffs']}, dropped connections "
            f"{fs['dropped_connections']}"
        )
    for tier in report.get("tiers") or []:
        lines.append(
            f"  tier {tier['tier']}: {tier.get('blocks', 0)} blocks, "
            f"{tier.get('demotions', 0)} demotions, {tier.get('promotions', 0)} "
            f"promotions, {tier.get('dropped', 0)} dropped, "
            f"{tier.get('errors', 0)} errors"
        )
    for label, check in report.get("prefix_checks", {}).items():
        lines.append(
            f"prefixes read back ({label}): {check['prefixes']}, "
            f"{check['hit_tokens']} tokens hit, {check['corrupted']} corrupted"
        )
    lines.append(
        f"/dev/shm entries left: {len(report['shm_entries_left'])}"
        + (f" {report['shm_entries_left']}" if report["shm_entries_left"] else "")
    )
    lines.append(f"socket file left: {report['socket_left']}")
    if "coordinator_kill" in report:
        ck = report["coordinator_kill"]
        det = ck["detect_s_max"]
        lines.append(
            f"coordinator SIGKILLed: {ck['workers_saw_gone']} workers saw "
            f"CoordinatorGone (missing: {ck['workers_missing'] or 'none'}), "
            f"detection p50 {ck['detect_s_p50'] or 0:.3f} s, max "
            f"{det if det is not None else float('nan'):.3f} s, in ops "
            f"{ck['ops_seen_in']}; valid handles after: "
            f"{ck['valid_handles_after_gone']}"
        )
        lines.append(
            f"  parent client saw CoordinatorGone: {ck.get('parent_client_saw_gone')}"
            f"; stale socket: {ck.get('stale_socket')}; new coordinator on the "
            f"same name: {ck.get('restart')}; its socket removed at stop: "
            f"{ck.get('socket_removed_after_stop')}"
        )
    if report["worker_crashes"] or report["unexpected_exits"]:
        lines += ["worker crashes:"] + [f"  {c}" for c in report["worker_crashes"]]
        lines += [f"  {c}" for c in report["unexpected_exits"]]
    lines.append("PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failures"]))
    return "\n".join(lines)
