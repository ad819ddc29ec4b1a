"""The daemon's log settings and how its version reaches the CLI."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from ckptfs import __version__
from ckptfs.fs.config import ConfigError, load_config
from ckptfs.fs.daemon import logs
from ckptfs.tools import control


@pytest.fixture
def root_logging() -> Iterator[None]:
    """setup_logging replaces the root logger's handlers: put them back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_log_level_and_format_come_from_the_file_the_environment_and_the_flag(
    tmp_path: Path,
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("log_level: warning\nlog_format: json\n")
    loaded = load_config(config, environ={})
    assert (loaded.log_level, loaded.log_format) == ("WARNING", "json")
    assert load_config(config, environ={"CKPTFS_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert load_config(config, {"log_level": "ERROR"}, environ={}).log_level == "ERROR"
    assert load_config(None, environ={}).log_level == "INFO"
    with pytest.raises(ConfigError) as bad:
        load_config(None, {"log_level": "chatty"}, environ={})
    assert "log_level" in str(bad.value) and "chatty" in str(bad.value)
    with pytest.raises(ConfigError) as bad:
        load_config(None, {"log_format": "xml"}, environ={})
    assert "log_format" in str(bad.value)


def test_peers_in_the_environment_is_refused_rather_than_ignored() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, environ={"CKPTFS_PEERS": "n1=a:1,n2=b:2"})
    assert "CKPTFS_PEERS" in str(refused.value) and "config file" in str(refused.value)


def test_json_lines_carry_utc_time_level_logger_message_and_traceback() -> None:
    record = logging.LogRecord("ckptfs.x", logging.ERROR, __file__, 1, "saved %s", ("a/b",), None)
    try:
        raise OSError(5, "Input/output error")
    except OSError:
        record.exc_info = sys.exc_info()
    line = json.loads(logs.JsonLines().format(record))
    assert line["level"] == "ERROR" and line["logger"] == "ckptfs.x"
    assert line["message"] == "saved a/b"
    assert "OSError" in line["traceback"]
    when = datetime.fromisoformat(line["time"])
    assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0
    assert abs(when.timestamp() - record.created) < 0.002


def test_journal_lines_give_every_line_its_priority() -> None:
    fmt = logs.JournalLines()
    warn = logging.LogRecord("ckptfs", logging.WARNING, __file__, 1, "store slow", (), None)
    assert fmt.format(warn) == "<4>WARNING ckptfs: store slow"
    err = logging.LogRecord("ckptfs", logging.ERROR, __file__, 1, "flush failed", (), None)
    try:
        raise ValueError("bad manifest")
    except ValueError:
        err.exc_info = sys.exc_info()
    lines = fmt.format(err).splitlines()
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines), lines
    info = logging.LogRecord("ckptfs", logging.INFO, __file__, 1, "durable", (), None)
    assert fmt.format(info).startswith("<6>")


def test_under_journald_only_when_stderr_is_the_stream_systemd_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with open(tmp_path / "err", "w") as err:
        monkeypatch.setattr(sys, "stderr", err)
        st = os.fstat(err.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert logs.under_journald()
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
        assert not logs.under_journald()
        monkeypatch.setenv("JOURNAL_STREAM", "garbage")
        assert not logs.under_journald()
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not logs.under_journald()


@pytest.mark.usefixtures("root_logging")
def test_a_log_file_moved_away_by_logrotate_is_written_again_at_its_path(tmp_path: Path) -> None:
    path = tmp_path / "run" / "m.log"
    path.parent.mkdir()
    path.write_text("")  # one an older release made, readable by all
    path.chmod(0o644)
    logs.setup_logging(path, foreground=False, level="INFO")
    assert path.stat().st_mode & 0o777 == 0o600
    log = logging.getLogger("ckptfs.test")
    log.debug("below the level")
    log.info("before rotation")
    path.rename(tmp_path / "m.log.1")  # what logrotate does without copytruncate
    log.info("after rotation")
    assert "before rotation" in (tmp_path / "m.log.1").read_text()
    text = path.read_text()
    assert "after rotation" in text and "before rotation" not in text
    # Root's alone, the new file too: the log names every user's files.
    assert path.stat().st_mode & 0o777 == 0o600
    assert "below the level" not in text + (tmp_path / "m.log.1").read_text()


def test_the_cli_says_once_when_the_daemon_runs_another_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(control, "_warned", set())
    control._warn_if_other_version(Path("/ckpt/a"), {"ok": True, "version": __version__})
    assert err.getvalue() == ""
    control._warn_if_other_version(Path("/ckpt/a"), {"ok": True, "version": "0.0.9"})
    control._warn_if_other_version(Path("/ckpt/a"), {"ok": True, "version": "0.0.9"})
    assert err.getvalue().count("\n") == 1, err.getvalue()
    assert "/ckpt/a runs ckptfs 0.0.9" in err.getvalue() and __version__ in err.getvalue()
    control._warn_if_other_version(Path("/ckpt/b"), {"ok": True})  # a daemon before versions
    assert "/ckpt/b runs ckptfs older than 0.1.0" in err.getvalue()
