"""The status page says every reason in words: its ``WHY`` table (``http/static/status.html``)
has an entry for every ``Reason`` the gateway can give, so no row shows a bare code."""

from __future__ import annotations

import re
from pathlib import Path

from spillover.core.reasons import Reason

PAGE = (Path(__file__).parents[2] / "src" / "spillover" / "http" / "static" / "status.html").read_text()


def test_every_reason_has_words_on_the_page() -> None:
    table = PAGE[PAGE.index("const WHY = {") : PAGE.index("};", PAGE.index("const WHY = {"))]
    keys = set(re.findall(r"^\s+(\w+):", table, re.MULTILINE))
    assert {r.value for r in Reason} <= keys, sorted({r.value for r in Reason} - keys)
