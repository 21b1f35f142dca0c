"""Turn a stream of token bytes into text deltas, honouring stop strings.

Pure and engine-independent: feed bytes, get the text that is safe to deliver now.
Text that might be the start of a stop string is held back until it is decided.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

__all__ = ["StopScanner"]


@dataclass
class StopScanner:
    """Incremental UTF-8 decoder plus stop-string matcher."""

    stops: tuple[str, ...] = ()
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    _pending: str = ""
    stopped: bool = False

    def feed(self, data: bytes) -> str:
        """Add token bytes; return the text that can be delivered now ("" if none)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        return self._release()

    def finish(self) -> str:
        """End of generation: return whatever is still held back (unless stopped)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        out, self._pending = self._pending, ""
        return out

    def _release(self) -> str:
        text = self._pending
        first = -1
        for stop in self.stops:
            idx = text.find(stop)
            if idx >= 0 and (first < 0 or idx < first):
                first = idx
        if first >= 0:
            self.stopped = True
            self._pending = ""
            return text[:first]
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        cut = len(text) - hold
        out, self._pending = text[:cut], text[cut:]
        return out
