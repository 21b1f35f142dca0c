"""Answer bodies as compact JSON bytes, fast.

An embeddings answer is mostly numbers: the standard library's encoder formats each float
through ``float.__repr__`` (about 1.1 us each here: 0.43 ms for one 384-dimension vector,
over 40 ms, on the event loop, for a batch of a hundred), orjson in about 50 ns. Its floats
are the same shortest round-trip digits, so a client parses the same values.

Rules:

1. ``dumps`` is ``json.dumps(obj, separators=(",", ":")).encode()`` in meaning: the same
   values, compact. The text may differ (orjson writes non-ASCII as UTF-8, not ``\\u``
   escapes, and ``1e-05`` as ``0.00001``); both are JSON any parser reads alike.
2. What orjson refuses (a string with a lone surrogate, an integer over 64 bits, a key that
   is not a string) falls back to the standard library, so nothing that encoded before fails
   now. A non-finite float is ``null`` (orjson) where the standard library wrote ``NaN``,
   which is not JSON.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps"]


def dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode()
