"""What every Ollama route writes the same way: timestamps, durations, the API version."""

from __future__ import annotations

from datetime import datetime, timezone

# The Ollama release whose API shapes these routes follow: clients read /api/version to
# decide what a server can do (structured outputs, thinking, tool calls).
OLLAMA_VERSION = "0.12.0"


def timestamp(at: datetime | float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes `created_at` and `modified_at`; `at` is a datetime
    or a POSIX time (a file's mtime); None is now."""
    if at is None:
        at = datetime.now(timezone.utc)
    elif not isinstance(at, datetime):
        at = datetime.fromtimestamp(at, timezone.utc)
    return at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    """Ollama's durations are integer nanoseconds."""
    return max(int(seconds * 1e9), 0)
