"""
title: spillover status
author: spillover
version: 0.1.0
license: Apache-2.0
description: Shows above an answer when spillover served it degraded (e.g. on CPU because GPU memory was full).
requirements:
"""

# Install: Open WebUI → Admin Panel → Functions → "+" (import), paste this file, save, enable it,
# and turn it on for the spillover model (or globally). It needs nothing from spillover's
# Python package: it reads the `spillover` object that spillover sends in the first chunk of
# every stream and in a chunk whenever the route changes (a failover), and shows that
# object's `notice` (spillover writes the sentence) as the message's status line.

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, Field

Emitter = Callable[[dict[str, Any]], Awaitable[None]]
MAX_TRACKED = 256  # streams whose last shown status is remembered (a bound, not a cache)


def status_line(sp: dict[str, Any], show_normal: bool) -> str | None:
    """The line to show for one `spillover` object, or None (nothing to say)."""
    notice = sp.get("notice")
    if isinstance(notice, str) and notice:
        return notice
    if show_normal and sp.get("route") == "gpu":
        return "answered on GPU"
    return None


class Filter:
    class Valves(BaseModel):
        priority: int = Field(default=0, description="Order among filters (lower runs first).")
        show_normal: bool = Field(default=False, description="Also say 'answered on GPU' when nothing is degraded.")

    def __init__(self) -> None:
        self.valves = self.Valves()
        self._shown: OrderedDict[str, str] = OrderedDict()  # completion id -> the status shown

    async def stream(self, event: dict[str, Any], __event_emitter__: Emitter | None = None) -> dict[str, Any]:
        """Each streamed chunk, unchanged; a chunk with a `spillover` object whose status
        differs from the one shown for this answer updates the message's status line."""
        sp = event.get("spillover")
        if not isinstance(sp, dict) or __event_emitter__ is None:
            return event
        line = status_line(sp, self.valves.show_normal)
        key = str(event.get("id") or sp.get("request_id") or "")
        if line is None or self._shown.get(key) == line:
            return event
        self._shown[key] = line
        self._shown.move_to_end(key)
        while len(self._shown) > MAX_TRACKED:
            self._shown.popitem(last=False)
        await __event_emitter__({"type": "status", "data": {"description": line, "done": True, "hidden": False}})
        return event

    def outlet(self, body: dict[str, Any]) -> dict[str, Any]:
        return body
