"""spillover.http.jsonout: the same values as json.dumps, compact, and nothing that json
encoded fails."""

from __future__ import annotations

import json
import math
import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillover.http import jsonout

NUMBERS = st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
SCALARS = st.none() | st.booleans() | NUMBERS | st.text()
DOCS = st.recursive(
    SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids, max_size=4), max_leaves=20
)


@given(DOCS)
def test_any_document_parses_back_to_the_same_values(doc: object) -> None:
    out = jsonout.dumps(doc)
    assert isinstance(out, bytes)
    assert json.loads(out) == json.loads(json.dumps(doc))


def test_an_embeddings_floats_keep_every_bit() -> None:
    rng = random.Random(7)
    vec = list(struct.unpack("<384f", struct.pack("<384f", *(rng.uniform(-1, 1) for _ in range(384)))))
    back = json.loads(jsonout.dumps({"embedding": vec}))["embedding"]
    assert [struct.pack("<d", x) for x in back] == [struct.pack("<d", x) for x in vec]


def test_it_is_compact() -> None:
    assert jsonout.dumps({"a": [1, 2.5, None], "b": "x"}) == b'{"a":[1,2.5,null],"b":"x"}'


@pytest.mark.parametrize(
    "doc",
    [
        {"text": "a\ud800b"},  # a lone surrogate (a JSON \ud800 escape parses to one)
        {"n": 2**70},  # an integer over 64 bits
        {1: "int key"},  # a key that is not a string
    ],
)
def test_what_orjson_refuses_falls_back_to_json(doc: object) -> None:
    assert jsonout.dumps(doc) == json.dumps(doc, separators=(",", ":")).encode()


def test_a_non_finite_float_is_null_which_is_json() -> None:
    out = jsonout.dumps({"x": [math.nan, math.inf, 1.0]})
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) == {"x": [None, None, 1.0]}
