"""The status page says every reason in words: its ``WHY`` table (``http/static/status.html``)
has an entry for every ``Reason`` the gateway can give, and its ``READY_WHY`` table one for
every reason a replica's readiness mode was picked, so no row shows a bare code."""

from __future__ import annotations

import re
from pathlib import Path

from spillover.core.readiness import Why
from spillover.core.reasons import Reason

PAGE = (Path(__file__).parents[2] / "src" / "spillover" / "http" / "static" / "status.html").read_text()


def _keys(name: str) -> set[str]:
    table = PAGE[PAGE.index(f"const {name} = {{") : PAGE.index("};", PAGE.index(f"const {name} = {{"))]
    return set(re.findall(r"^\s+(\w+):", table, re.MULTILINE))


def test_every_reason_has_words_on_the_page() -> None:
    keys = _keys("WHY")
    # and what a chat model's row says while none of its workers can start
    assert {r.value for r in Reason} | {"model_load_failed"} <= keys, sorted({r.value for r in Reason} - keys)


def test_every_readiness_reason_has_words_on_the_page() -> None:
    keys = _keys("READY_WHY")  # no_gpu_lane had none: the Services table showed the bare code
    assert {w.value for w in Why} <= keys, sorted({w.value for w in Why} - keys)
