"""A Jepsen-style history, written as JSONL while the drill runs.

Records (one JSON object per line, all with ``t`` in seconds since the drill started):

- ``invoke`` / ``ok`` / ``fail`` / ``info``: one client operation (``op``) and its outcome:
  ``ok`` done, ``fail`` definitely not done, ``info`` unknown (the connection broke);
- ``fault``: an injected fault;
- ``sample``: periodic device ledger, lanes, breaker and host RSS;
- ``tool``: a side effect applied by the simulated agent tool;
- ``final``: the journal's last word on a request id, fetched at the end.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["Recorder"]


class Recorder:
    """Thread-safe JSONL writer that keeps the history in memory too."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self.history: list[dict[str, Any]] = []
        self._ops = 0

    def __repr__(self) -> str:
        return f"<Recorder {self.path} records={len(self.history)}>"

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def next_op(self) -> int:
        with self._lock:
            self._ops += 1
            return self._ops

    def write(self, record_type: str, /, **fields: Any) -> dict[str, Any]:
        rec = {"type": record_type, "t": self.now(), **fields}
        with self._lock:
            self.history.append(rec)
            self._fh.write(json.dumps(rec, default=str) + "\n")
            self._fh.flush()
        return rec

    def close(self) -> None:
        with self._lock:
            self._fh.close()
