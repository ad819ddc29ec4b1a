"""``ckptfs history``'s times and table (tools/history.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from ckptfs.tools.history import WhenError, parse_when, table

NOW = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)


def test_ages_and_iso_times_become_seconds_since_the_epoch() -> None:
    assert parse_when("30m", NOW) == NOW.timestamp() - 1800
    assert parse_when("2h", NOW) == NOW.timestamp() - 7200
    assert parse_when("1.5d", NOW) == NOW.timestamp() - 1.5 * 86400
    assert parse_when("2026-12-04", NOW) == datetime(2026, 12, 4, tzinfo=UTC).timestamp()
    assert parse_when("2026-12-04T13:00+01:00") == NOW.timestamp()  # a zone of its own
    for bad in ("yesterday", "5 weeks", "", "2026-13-01"):
        with pytest.raises(WhenError):
            parse_when(bad, NOW)


def test_the_table_aligns_numbers_and_says_when_nothing_matches() -> None:
    assert table([]) == "no checkpoint made durable matches"
    line = {"time": "2026-12-04T12:00:00+00:00", "node": "n1", "size": 3 << 20,
            "close_s": 0.5, "mirrored_s": None, "durable_s": 12.25, "path": "a b/c.pt"}  # fmt: skip
    header, row = table([line]).splitlines()
    assert header.startswith("time (UTC)")
    assert row.split("  ")[0] == "2026-12-04 12:00:00"
    assert row.endswith("a b/c.pt") and "3.0 MiB" in row and " - " in row and "12.25s" in row


def test_a_name_with_escape_sequences_is_printed_escaped() -> None:
    line = {"time": "2026-12-04T12:00:00+00:00", "node": "n1", "size": 1, "close_s": None,
            "mirrored_s": None, "durable_s": None, "path": "a\x1b]0;pwned\x07b\nc.pt"}  # fmt: skip
    text = table([line])
    assert "\x1b" not in text and "\x07" not in text and len(text.splitlines()) == 2
    assert text.endswith("a\\x1b]0;pwned\\x07b\\nc.pt")
