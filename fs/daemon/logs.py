"""Where the daemon's log goes, at which level, in which form.

- A log file (``log``, default ``/run/ckptfs/<mount id>.log``) is written
  through a WatchedFileHandler: after logrotate moves it away, the next line
  reopens the path, so rotation needs no ``copytruncate`` and no signal.
  It is root's alone (0600): it names every user's files.
- Under systemd (stderr is the journal's stream, ``JOURNAL_STREAM``), lines go
  to stderr with the kernel's ``<N>`` priority prefix and no timestamp, so
  that ``journalctl -p warning`` selects them and the journal's own time
  stands.
- ``log_format: json`` writes one JSON object per line (time in UTC ISO-8601,
  level, logger, message), for a log shipper.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# sd-daemon(3) priorities, which journald reads from a "<N>" line prefix.
_JOURNAL_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class PrivateLogFile(logging.handlers.WatchedFileHandler):
    """Created 0600 however often rotation makes it anew (the process's
    umask stays as it is: it shapes no file of the daemon's but this)."""

    def _open(self) -> TextIO:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(self.baseFilename, flags, 0o600)
        os.fchmod(fd, 0o600)  # one made by an older release, or by hand
        return open(fd, "a", encoding=self.encoding, errors=self.errors)


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line)


class JournalLines(logging.Formatter):
    """``<N>`` prefix for journald; the traceback of an exception is folded
    into the same entry's lines, each prefixed, so none loses its priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_JOURNAL_PRIORITY.get(record.levelno, 6)}>"
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return "\n".join(prefix + line for line in text.splitlines())


def under_journald() -> bool:
    """Whether stderr is the stream systemd connected to the journal: it names
    that stream's device and inode in JOURNAL_STREAM (systemd.exec(5))."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup_logging(
    log_file: Path | None, foreground: bool, level: str = "INFO", form: str = "text"
) -> None:
    handlers: list[logging.Handler] = []
    plain = JsonLines() if form == "json" else logging.Formatter(TEXT)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        to_file = PrivateLogFile(log_file)
        to_file.setFormatter(plain)
        handlers.append(to_file)
    if foreground or log_file is None:
        to_stderr = logging.StreamHandler(sys.stderr)
        to_stderr.setFormatter(JournalLines() if under_journald() and form == "text" else plain)
        handlers.append(to_stderr)
    logging.basicConfig(level=level, handlers=handlers, force=True)
