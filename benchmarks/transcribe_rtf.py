"""Transcription speed through the gateway vs bare faster-whisper: same model, same threads.

For each audio length, one file (``spillover.testing.audio.speech_of``: the spoken clip
repeated, with a second of silence between) is timed through ``POST /v1/audio/transcriptions``
(the official openai client, ``verbose_json``) and through a bare ``faster_whisper.WhisperModel`` in this process (same
model folder, int8 on the CPU, same threads, beam size and decoding options as the worker),
interleaved round by round. Prints the real-time factor of each (seconds of work per second
of audio; lower is faster), their ratio bare/gateway (target >= 0.95: the gateway costs at
most 5 %) and checks the segments' text is identical.

    .venv/bin/python -m benchmarks.transcribe_rtf [--rounds 5] [--seconds 10,60] [--threads 1]

On the sim device the "GPU" worker computes on the CPU in int8 like the bare model, so the
ratio is the gateway's own cost: the multipart upload, storing and fsyncing it, the
gateway's decode check, the journal, the worker channel and the worker's own decode of the
file. The gateway serves chat and transcription; the chat model is idle.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): import the package from the folder above
    sys.path.insert(0, f"{sys.path[0]}/..")

from benchmarks._common import median
from spillover.testing import GatewayProcess
from spillover.testing.audio import speech_of


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", default="10,60")
    ap.add_argument("--threads", type=int, default=1, help="must match [[services]].n_threads (default 1)")
    a = ap.parse_args()
    import openai
    from faster_whisper import WhisperModel

    from spillover.config import load_config
    from spillover.engine.audio import decode
    from spillover.engine.whisper_meta import default_whisper_model_dir

    beam = next(s.beam_size for s in load_config().services if s.kind == "transcription")
    bare = WhisperModel(default_whisper_model_dir(), device="cpu", compute_type="int8", cpu_threads=a.threads,
                        num_workers=1, local_files_only=True)  # fmt: skip

    def bare_run(path: str) -> list[str]:
        samples = decode(path, max_s=3600).samples  # the worker decodes the file too
        segs, _ = bare.transcribe(samples, beam_size=beam, temperature=[0.0], condition_on_previous_text=False,
                                  vad_filter=False)  # fmt: skip
        return [s.text for s in segs]

    ok = True
    tmp = Path(sys.argv[0]).resolve().parent / ".transcribe_rtf.wav"
    with GatewayProcess(["--gpu", "sim:2048"], services=("chat", "transcription")) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        print(f"whisper tiny.en int8, {a.threads} thread(s), beam {beam}, median of {a.rounds} rounds")
        print(f"{'audio s':>7} {'bare RTF':>9} {'gateway RTF':>12} {'ratio':>7} {'route':>6} identical")
        try:
            for seconds in [float(x) for x in a.seconds.split(",")]:
                audio = speech_of(seconds)
                tmp.write_bytes(audio)
                client.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio))  # warm-up
                bare_run(str(tmp))
                b_t, g_t, same, routes = [], [], True, set()
                for _ in range(a.rounds):
                    t0 = time.perf_counter()
                    ref = bare_run(str(tmp))
                    b_t.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    raw = client.audio.transcriptions.with_raw_response.create(
                        model="whisper-1", file=("a.wav", audio), response_format="verbose_json"
                    )
                    got = raw.parse()
                    g_t.append(time.perf_counter() - t0)
                    routes.add(raw.headers["x-spillover-route"])
                    same = same and [s.text for s in (got.segments or [])] == ref
                ratio = median(b_t) / median(g_t)
                print(f"{seconds:>7.0f} {median(b_t) / seconds:>9.3f} {median(g_t) / seconds:>12.3f} {ratio:>7.3f} "
                      f"{'/'.join(sorted(routes)):>6} {same}")  # fmt: skip
                ok = ok and same and (seconds < 30 or ratio >= 0.95)
        finally:
            tmp.unlink(missing_ok=True)
    print("target: ratio >= 0.95 on files of 30 s and more, identical text:", "MET" if ok else "NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
