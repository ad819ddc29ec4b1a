"""Human-readable rendering of `ckptfs stat`.

By default, what an operator acts on: the health of the store and of the
daemon, the bytes not yet durable and when they should be, backpressure,
peers, files taken over or lost, the last checkpoints made durable, and the
files themselves when they are few. ``verbose`` adds the internals (cache,
read-ahead, FUSE, memory, store calls, peer counters) and every file.
``--json`` has all of it (and more). docs/OPERATIONS.md explains each line.
"""

from __future__ import annotations

import time
from typing import Any

LABEL = 14  # the width of the label column
SHORT = 5  # a list this long is shown one line per item without --verbose
RECENT = 3  # checkpoints shown without --verbose
PEERS_BY_NAME = 8  # more peers than this are counted by state, not named
VERBOSE_HINT = "ckptfs stat --verbose lists them"


def shown(path: str) -> str:
    """A file name as a terminal may print it: a user chooses their file
    names, and a name holding escape sequences must not drive the terminal
    of the root who lists it. Non-printable characters become escapes."""
    if path.isprintable():
        return path
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in path)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def duration(seconds: float) -> str:
    """``0.4 s``, ``42 s``, ``3m05s``, ``2h07m``, ``3d04h``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def row(label: str, text: str) -> str:
    """One line: ``label:`` in the label column (blank for a continuation)."""
    return f"{label + ':' if label else '':<{LABEL}}{text}"


def rows(label: str, texts: list[str]) -> list[str]:
    """The label on the first line only, the others aligned under it."""
    return [row(label if i == 0 else "", t) for i, t in enumerate(texts)]


def shortened(items: list[str], verbose: bool) -> list[str]:
    """Every item under --verbose, else the first SHORT and how many more."""
    if verbose or len(items) <= SHORT:
        return items
    return [*items[:SHORT], f"... and {len(items) - SHORT} more ({VERBOSE_HINT})"]


# ----- what an operator acts on ---------------------------------------------------


def header(s: dict[str, Any]) -> str:
    up = f"  up {duration(s['uptime'])}" if "uptime" in s else ""
    return (
        f"ckptfs at {s['mountpoint']}  node {s['node']}  durability {s['durability']}"
        f"{up}  pid {s['pid']}"
    )


def trouble_text(trouble: dict[str, Any] | None) -> str:
    """Why the store is full or failing: ``(ENOSPC: ..., 12 s ago)``."""
    if not trouble:
        return ""
    return f" ({trouble['errno']}: {trouble['error']}, {duration(trouble['seconds_ago'])} ago)"


def health_text(s: dict[str, Any]) -> str:
    store = f"store {s['backing_health']}" + trouble_text(s.get("backing_error"))
    if s["backing_health"] == "down":
        store += " (a call got no answer within the timeout; retried every few seconds)"
    # .get: a daemon started before this CLI was installed does not say.
    daemon = f"daemon {s.get('daemon_health', 'unknown')}"
    failing = s["flush"].get("failing", 0)
    if failing:
        daemon += f" ({count(failing, 'flush')} failed in a row; the log says why)"
    return f"{store}; {daemon}"


def data_text(s: dict[str, Any]) -> str:
    """Bytes and files by state: dirty, mirrored (on the buddy), flushing, durable."""
    p = s["progress"]
    parts = [f"{human(p['dirty']['bytes'])} dirty ({count(p['dirty']['files'], 'file')})"]
    if p["mirrored"]["files"] or s["durability"] == "buddy":
        m = p["mirrored"]
        parts.append(f"{human(m['bytes'])} mirrored ({count(m['files'], 'file')})")
    f = p["flushing"]
    done = f", {f['flushed'] / f['bytes']:.0%} flushed" if f["bytes"] else ""
    parts.append(f"{human(f['bytes'])} flushing ({count(f['files'], 'file')}{done})")
    d = p["durable"]
    parts.append(f"{human(d['bytes'])} durable ({count(d['files'], 'file')})")
    return ", ".join(parts)


def eta_text(s: dict[str, Any]) -> str:
    """When the bytes not yet durable should be, from the measured flush rate."""
    p = s["progress"]
    if not p["to_store"]:
        return "now (nothing left to store)"
    left = f"{human(p['to_store'])} to store"
    if p["eta_seconds"] is None:
        return f"unknown: {left}, nothing flushed in the last 10 s"
    cap = s["flush"].get("bandwidth_cap")
    return (
        f"about {duration(p['eta_seconds'])}: {left} at {human(p['rate'])}/s "
        "(measured over the last 10 s)" + (f", capped at {human(cap)}/s" if cap else "")
    )


def backpressure_text(s: dict[str, Any]) -> str:
    c = s["cache"]
    return (
        f"{count(c['waiting_writers'], 'writer')} waiting now; "
        f"{c['backpressure_seconds']:.1f} s waited in {count(c['backpressure_events'], 'wait')} "
        f"since mount; cache {human(c['used'])} of {human(c['capacity'])} in use"
    )


def peers_text(peers: list[dict[str, Any]]) -> str:
    """Each peer's state (grouped by state when there are many), the buddy marked."""
    if len(peers) <= PEERS_BY_NAME:
        return ", ".join(
            f"{p['name']} {p['state']}" + (" (buddy)" if p.get("buddy") else "") for p in peers
        )
    by_state: dict[str, list[str]] = {}
    for p in peers:
        by_state.setdefault(p["state"], []).append(p["name"])
    parts = [f"{len(by_state.pop('alive', []))} alive"]
    parts += [f"{state}: {', '.join(names)}" for state, names in sorted(by_state.items())]
    buddy = next((p for p in peers if p.get("buddy")), None)
    if buddy is not None:
        parts.append(f"buddy {buddy['name']} {buddy['state']}")
    return "; ".join(parts)


def mirrored_text(mirroring: dict[str, Any]) -> str:
    """Bytes sent to the buddy, and held here for the nodes this one is buddy of."""
    parts = []
    writer = mirroring.get("writer")
    if writer:
        fell = writer["fallbacks"]
        parts.append(
            f"to {writer['buddy']}: {human(writer['bytes_sent'])} sent since mount"
            + (f" ({count(fell, 'file')} fell back to local durability)" if fell else "")
        )
    if mirroring.get("buddy_for"):
        parts.append(
            f"here for {', '.join(mirroring['buddy_for'])}: "
            f"{human(mirroring['mirrored_bytes'])} held ({count(mirroring['mirrors'], 'file')})"
        )
    return "; ".join(parts)


def taken_over_lines(s: dict[str, Any], verbose: bool) -> list[str]:
    items = [
        f"{shown(f['path'])} ({human(f['size'])}) from {f['origin']}, which died: "
        "being made durable from here"
        for f in s.get("taken_over", [])
    ]
    return rows("taken over", shortened(items, verbose))


def lost_lines(s: dict[str, Any], verbose: bool) -> list[str]:
    items = [f"{shown(f['path'])}: {f['reason']}" for f in s.get("lost", [])]
    hidden = (s.get("not_shown") or {}).get("lost", 0)
    if hidden:
        items.append(f"{count(hidden, 'file')} of other users (not shown)")
    return rows("lost", shortened(items, verbose) or ["none"])


def when(stamp: str, today: str) -> str:
    """A history time (UTC ISO-8601, ``2026-12-03T21:43:03+00:00``): the
    time alone if ``today`` (a UTC date), else the day and the minute."""
    day, _, clock = stamp.partition("T")
    return f"{clock[:8]}Z" if day == today else f"{day} {clock[:5]}Z"


def recent_lines(s: dict[str, Any], verbose: bool) -> list[str]:
    history = s.get("history") or []
    listed = history if verbose else history[-RECENT:]
    today = time.strftime("%Y-%m-%d", time.gmtime())
    items = []
    for h in reversed(listed):  # the newest first
        line = f"{when(h['time'], today):<9}  {human(h['size']):>10}  {shown(h['path'])}"
        if verbose:
            mirrored = f", mirrored {h['mirrored_s']} s" if h.get("mirrored_s") != "" else ""
            line += (
                f"  (closed in {h['close_s']} s{mirrored}, durable {h['durable_s']} s "
                f"after the close, {h['throughput_MBps']} MB/s)"
            )
        items.append(line)
    return rows("recent", items or ["none since mount"])


def file_line(f: dict[str, Any]) -> str:
    if f["state"] == "durable":
        done = "100%"
    elif f["state"] == "flushing" and f["size"]:
        done = f"{min(f['flushed_bytes'], f['size']) / f['size']:.0%}"
    else:
        done = ""
    return f"{f['state']:<9} {human(f['size']):>10} {done:>5}  {shown(f['path'])}"


def files_lines(s: dict[str, Any], verbose: bool) -> list[str]:
    files = s.get("files") or []
    if not files:
        return []
    if verbose or len(files) <= SHORT:
        return rows("files", [file_line(f) for f in files])
    return [row("files", f"{len(files)} ({VERBOSE_HINT})")]


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


def operator_lines(s: dict[str, Any], verbose: bool) -> list[str]:
    lines = [header(s), row("health", health_text(s))]
    if "progress" in s:  # absent from a daemon started before this CLI was installed
        lines += [row("data", data_text(s)), row("durable in", eta_text(s))]
    lines.append(row("backpressure", backpressure_text(s)))
    if s.get("peers"):
        lines.append(row("peers", peers_text(s["peers"])))
    mirrored = mirrored_text(s.get("mirroring") or {})
    if mirrored:
        lines.append(row("mirrored", mirrored))
    unconfirmed = s["cache"].get("unconfirmed", 0)
    if unconfirmed:
        text = (
            f"{count(unconfirmed, 'file')} kept from before a crash that the store has not "
            "answered for yet; asked again until it does"
        )
        lines.append(row("unconfirmed", text))
    lines += taken_over_lines(s, verbose)
    lines += lost_lines(s, verbose)
    lines += recent_lines(s, verbose)
    lines += files_lines(s, verbose)
    return lines


# ----- internals (--verbose) ------------------------------------------------------


def counters_text(counters: dict[str, Any], prefix: str = "") -> str:
    """``reads 3, bytes read 12.0 MiB``: every counter a section has, by its
    key (less ``prefix``); byte counts in units."""
    return ", ".join(
        f"{key.removeprefix(prefix).replace('_', ' ')} "
        + (human(value) if "bytes" in key or key == "budget" else str(value))
        for key, value in counters.items()
    )


def left_running_text(n: int) -> str:
    if not n:
        return ""
    return f"; {n} chunk read(s) of interrupted readers still running for other readers"


def peaks_text(peak: dict[str, int] | None) -> str:
    if peak is None:  # a daemon started before this CLI was installed
        return "unknown"
    return (
        f"own dirty {human(peak['own_dirty'])} + mirrored for others "
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


def store_text(s: dict[str, Any]) -> str:
    calls = s.get("backing_calls") or {}
    return (
        f"{s['backing']}; {calls.get('total', 0)} calls, {calls.get('slow', 0)} slow, "
        f"{calls.get('timed_out', 0)} timed out"
        + left_running_text(s["cache"].get("chunk_reads_left_running", 0))
    )


def cache_lines(c: dict[str, Any]) -> list[str]:
    chunk_reads = {k: v for k, v in c.items() if k.startswith("chunk_") and isinstance(v, int)}
    lines = [
        row(
            "cache",
            f"{human(c['used'])} used of {human(c['capacity'])}, {human(c['dirty'])} in dirty "
            f"pages of {human(c.get('page_size', 0))}, frames {human(c.get('frames', 0))}; "
            # .get: a daemon started before this CLI was installed has no state.
            f"pre-faulted {human(c['prefaulted'])} ({c.get('prefault', 'state unknown')}); "
            f"evicted {human(c['evicted_bytes'])}, spilled {human(c['spilled_bytes'])}"
            + (f"; at {c['dir']}" if c.get("dir") else ""),
        ),
        row("peaks", peaks_text(c.get("peak"))),
    ]
    if chunk_reads:
        lines.append(row("chunk reads", counters_text(chunk_reads, "chunk_")))
    if c.get("readahead"):
        lines.append(row("read-ahead", counters_text(c["readahead"])))
    if c.get("remote_reads"):
        lines.append(row("remote reads", counters_text(c["remote_reads"])))
    return lines


def memory_text(memory: dict[str, int]) -> str:
    return ", ".join(f"{key} {human(value)}" for key, value in memory.items())


def flush_text(fl: dict[str, Any]) -> str:
    return (
        f"{fl['queued']} queued, {len(fl['active'])} active, stored "
        f"{human(fl['bytes_stored'])}, saved by dedup {human(fl['bytes_deduped'])}, "
        f"{human(fl['throughput'])}/s now, hashing {human(fl['hash_throughput'])}/s"
        + (f", cap {human(fl['bandwidth_cap'])}/s" if fl["bandwidth_cap"] else "")
        + f"; {count(fl.get('files_durable', 0), 'file')} made durable, "
        f"{count(fl.get('failures', 0), 'failure')} since mount"
    )


def fuse_lines(fuse: dict[str, Any]) -> list[str]:
    texts = []
    if "handles" in fuse:
        texts.append(f"{fuse['handles']} open handle(s), {fuse['inodes']} inode(s)")
    if fuse.get("opens_waited_for_rename"):
        texts.append(
            f"{fuse['opens_waited_for_rename']} open(s) waited for a rename onto "
            f"their name, {fuse['opens_sent_back']} of them sent to walk the path again"
        )
    if "requests" in fuse:
        texts.append(requests_text(fuse))
    pushed = fuse.get("pages_pushed") or {}
    if pushed.get("files") or pushed.get("refused"):
        texts.append(
            f"saves' head and tail put in the page cache at their close: "
            f"{pushed['files']} file(s), {pushed['bytes'] >> 10} KiB"
            + (f" ({pushed['refused']} not taken)" if pushed.get("refused") else "")
        )
    return rows("fuse", texts)


def peer_line(p: dict[str, Any]) -> str:
    age = p.get("last_heartbeat_age")
    heard = "never" if age is None else f"{age:.1f} s ago"
    rtt = p.get("rtt_ms")
    return row(
        f"peer {p['name']}",
        f"{p['address']}  {p['state']}"
        + ("  (buddy)" if p.get("buddy") else "")
        + f"  last heartbeat {heard}"
        + (f", rtt {rtt} ms" if rtt is not None else "")
        + (f", {count(p['failures'], 'failure')}" if p.get("failures") else "")
        + (f", last error: {p['last_error']}" if p.get("last_error") else ""),
    )


def mirroring_lines(mirroring: dict[str, Any]) -> list[str]:
    lines = []
    writer = mirroring.get("writer")
    if writer:
        lines.append(
            row(
                "mirror",
                f"to {writer['buddy']}: {writer['commits']} file(s) mirrored, "
                f"{human(writer['bytes_sent'])} sent, {writer['fallbacks']} fell back to local"
                + (
                    f" (last: {shown(writer['fallback_paths'][-1])})"
                    if writer["fallback_paths"]
                    else ""
                )
                + (
                    f", {writer['pages_damaged']} page(s) arrived damaged and were sent again"
                    if writer.get("pages_damaged")
                    else ""
                ),
            )
        )
    if mirroring.get("buddy_for"):
        lines.append(
            row(
                "buddy",
                f"for {', '.join(mirroring['buddy_for'])}: {mirroring['mirrors']} mirror(s), "
                f"{human(mirroring['mirrored_bytes'])} held, {mirroring['takeovers']} taken over"
                + (
                    f", {mirroring['kept_for_readers']} kept for open handles here after "
                    "their writer let go of them"
                    if mirroring.get("kept_for_readers")
                    else ""
                ),
            )
        )
    return lines


def representative_text(rep: dict[str, Any]) -> str:
    return (
        f"{rep['chunks_fetched']} chunk(s) ({human(rep['bytes_fetched'])}) from peers, "
        f"{rep['fallbacks']} fallback(s) to the store, {rep['chunks_served']} chunk(s) "
        f"({human(rep['bytes_served'])}) served to peers"
    )


def internal_lines(s: dict[str, Any]) -> list[str]:
    lines = [row("store", store_text(s)), *cache_lines(s["cache"])]
    if s.get("memory"):
        lines.append(row("memory", memory_text(s["memory"])))
    lines.append(row("flush", flush_text(s["flush"])))
    lines += fuse_lines(s.get("fuse") or {})
    lines += [peer_line(p) for p in s.get("peers", [])]
    lines += mirroring_lines(s.get("mirroring") or {})
    if s.get("peer_reads"):
        lines.append(row("peer reads", counters_text(s["peer_reads"])))
    if s.get("representative"):
        lines.append(row("representative", representative_text(s["representative"])))
    return lines


def format_stat(s: dict[str, Any], verbose: bool = False) -> str:
    lines = operator_lines(s, verbose)
    if verbose:
        lines += internal_lines(s)
    hidden = not_shown_text(s.get("not_shown") or {})  # absent from an older daemon
    if hidden:
        lines.append(hidden)
    return "\n".join(lines)
