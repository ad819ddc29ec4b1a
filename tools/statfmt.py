"""Human-readable rendering of `ckptfs stat`."""

from __future__ import annotations

from typing import Any


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def peaks_line(peak: dict[str, int] | None) -> str:
    if peak is None:  # a daemon started before this CLI was installed
        return "peaks:   unknown"
    return (
        f"peaks:   own dirty {human(peak['own_dirty'])} + mirrored for others "
        f"{human(peak['mirrored'])} at most, cache in use {human(peak['used'])} at most"
        " (since mount)"
    )


def requests_text(fuse: dict[str, Any]) -> str:
    """How the FUSE requests were answered (fs/fuse/session.py)."""
    r = fuse["requests"]
    return (
        f"requests: {r['fast']} answered inline, {r['handled']} by {fuse['workers']} "
        f"worker task(s) ({r['declined']} declined by a fast path), {r['stateless']} stateless, "
        f"{r.get('interrupts', 0)} interrupted by a stop signal "
        f"({r.get('signals_ignored', 0)} other signal(s) ignored)"
    )


def left_running_text(n: int) -> str:
    if not n:
        return ""
    return f"  ({n} chunk read(s) of interrupted readers still running for other readers)"


# What ``not_shown`` counts (fs/daemon/statview.py): singular and plural.
NOT_SHOWN = {
    "files": ("cached file", "cached files"),
    "taken_over": ("file taken over", "files taken over"),
    "lost": ("lost file", "lost files"),
    "flushing": ("file being flushed", "files being flushed"),
    "history": ("recent checkpoint", "recent checkpoints"),
    "mirrored_files": ("file mirrored here", "files mirrored here"),
    "fallback_paths": ("mirroring fallback", "mirroring fallbacks"),
}


def not_shown_text(counts: dict[str, int]) -> str:
    """Other users' files the daemon counted but did not name to this caller."""
    parts = [
        f"{n} {NOT_SHOWN.get(key, (key, key))[n != 1]}"
        for key, n in counts.items()
        if isinstance(n, int) and n > 0
    ]
    if not parts:
        return ""
    return (
        f"not shown: {', '.join(parts)} of other users in this mount "
        "(only root sees every user's files by name)"
    )


def trouble_text(trouble: dict[str, Any] | None) -> str:
    """Why the store is full or failing: ``(ENOSPC: ... 12s ago)``."""
    if not trouble:
        return ""
    return f" ({trouble['errno']}: {trouble['error']}, {trouble['seconds_ago']:.0f}s ago)"


def format_stat(s: dict[str, Any]) -> str:
    c, fl = s["cache"], s["flush"]
    lines = [
        f"ckptfs at {s['mountpoint']}  node {s['node']}  pid {s['pid']}  "
        f"durability {s['durability']}",
        f"backing: {s['backing']}  health {s['backing_health']}"
        + trouble_text(s.get("backing_error"))
        + left_running_text(c.get("chunk_reads_left_running", 0)),
        f"cache:   {human(c['used'])} used of {human(c['capacity'])}, {human(c['dirty'])} dirty"
        # .get: a daemon started before this CLI was installed has no state.
        f"  (pre-faulted {human(c['prefaulted'])} ({c.get('prefault', 'state unknown')}),"
        f" evicted {human(c['evicted_bytes'])}, spilled {human(c['spilled_bytes'])})",
        peaks_line(c.get("peak")),
        f"backpressure: {c['waiting_writers']} writer(s) waiting now, "
        f"{c['backpressure_events']} event(s), {c['backpressure_seconds']:.1f}s waited",
        f"flush:   {fl['queued']} queued, {len(fl['active'])} active, stored "
        f"{human(fl['bytes_stored'])}, saved by dedup {human(fl['bytes_deduped'])}, "
        f"{human(fl['throughput'])}/s now, hashing {human(fl['hash_throughput'])}/s"
        + (f", cap {human(fl['bandwidth_cap'])}/s" if fl["bandwidth_cap"] else ""),
    ]
    fuse = s.get("fuse") or {}
    if "handles" in fuse:
        lines.append(f"fuse:    {fuse['handles']} open handle(s), {fuse['inodes']} inode(s)")
    if fuse.get("opens_waited_for_rename"):
        lines.append(
            f"         {fuse['opens_waited_for_rename']} open(s) waited for a rename onto "
            f"their name, {fuse['opens_sent_back']} of them sent to walk the path again"
        )
    if "requests" in fuse:
        lines.append(f"         {requests_text(fuse)}")
    pushed = fuse.get("pages_pushed") or {}
    if pushed.get("files") or pushed.get("refused"):
        lines.append(
            f"         saves' head and tail put in the page cache at their close: "
            f"{pushed['files']} file(s), {pushed['bytes'] >> 10} KiB"
            + (f" ({pushed['refused']} not taken)" if pushed.get("refused") else "")
        )
    for p in s.get("peers", []):
        age = p.get("last_heartbeat_age")
        heard = "never" if age is None else f"{age:.1f}s ago"
        lines.append(
            f"peer:    {p['name']} {p['address']}  {p['state']}  last heartbeat {heard}"
            + ("  (buddy)" if p.get("buddy") else "")
        )
    mirroring = s.get("mirroring") or {}
    writer = mirroring.get("writer")
    if writer:
        lines.append(
            f"mirror:  to {writer['buddy']}: {writer['commits']} file(s) mirrored, "
            f"{human(writer['bytes_sent'])} sent, {writer['fallbacks']} fell back to local"
            + (f" (last: {writer['fallback_paths'][-1]})" if writer["fallback_paths"] else "")
            + (
                f", {writer['pages_damaged']} page(s) arrived damaged and were sent again"
                if writer.get("pages_damaged")
                else ""
            )
        )
    if mirroring.get("buddy_for"):
        lines.append(
            f"buddy:   for {', '.join(mirroring['buddy_for'])}: {mirroring['mirrors']} mirror(s), "
            f"{human(mirroring['mirrored_bytes'])} held, {mirroring['takeovers']} taken over"
            + (
                f", {mirroring['kept_for_readers']} kept for open handles here after "
                "their writer let go of them"
                if mirroring.get("kept_for_readers")
                else ""
            )
        )
    rep = s.get("representative")
    if rep:
        lines.append(
            f"representative fetch: {rep['chunks_fetched']} chunk(s) "
            f"({human(rep['bytes_fetched'])}) from peers, {rep['fallbacks']} fallback(s) "
            f"to the store, {rep['chunks_served']} chunk(s) ({human(rep['bytes_served'])}) "
            "served to peers"
        )
    if s["files"]:
        lines.append(f"{'STATE':<9} {'SIZE':>10} {'FLUSHED':>8}  PATH")
        for f in s["files"]:
            done = f["flushed_bytes"] / f["size"] if f["size"] else 1.0
            progress = "100%" if f["state"] == "durable" else f"{done:.0%}"
            lines.append(f"{f['state']:<9} {human(f['size']):>10} {progress:>8}  {f['path']}")
    for lost in s.get("lost", []):
        lines.append(f"LOST      {lost['path']}: {lost['reason']}")
    for f in s.get("taken_over", []):
        lines.append(
            f"TAKEN OVER {f['path']} ({human(f['size'])}) from {f['origin']}, which died: "
            "being made durable from here"
        )
    if s.get("history"):
        lines.append("recent checkpoints (close s / durable s after close / MB/s):")
        for h in s["history"][-5:]:
            lines.append(
                f"  {h['time']}  {h['path']}  {human(h['size'])}  "
                f"{h['close_s']} / {h['durable_s']} / {h['throughput_MBps']}"
            )
    hidden = not_shown_text(s.get("not_shown") or {})  # absent from an older daemon
    if hidden:
        lines.append(hidden)
    return "\n".join(lines)
