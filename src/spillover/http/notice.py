"""The one-line status a person reads about a degraded answer ("answered on CPU: GPU memory
full — slower, context 1,024").

It is the ``notice`` of every answer's ``spillover`` object (None when the GPU served it as
planned), which the Open WebUI filter in ``integrations/open_webui`` shows as a status line;
with ``[server].degraded_notice`` the server also appends it to degraded answers' text for UIs
without plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spillover.runtime.run import Run

__all__ = ["notice"]

WHY = {
    "margin": "GPU memory full",
    "observed_pressure": "GPU memory full",
    "kv_pages_exhausted": "GPU memory full",
    "gpu_busy": "GPU busy",
    "too_long_for_gpu": "too long for the GPU",
    "breaker_open": "GPU paused after repeated failures",
    "gpu_unavailable": "GPU not available",
    "observation_stale": "GPU memory could not be read",
    "canary": "a routine check of the CPU path",
    "gpu_queue_full": "GPU queue full",
    "client_prefers_cpu": "CPU asked for",
    "cpu_lane": "no GPU on this server",
    "cpu_meets_deadline": "the GPU would answer after your deadline",
    "resident_does_not_fit": "the whole model does not fit the GPU",
}


def notice(run: Run) -> str | None:
    """The status line of ``run``'s answer, or None when nothing about it is degraded."""
    i = run.info
    if i is None or (i.route == "gpu" and not i.shrunk):
        return None
    if i.route == "gpu":
        return f"answered on GPU, shortened to fit: at most {i.max_tokens:,} tokens"
    reason = run.reason() or ""
    why = "the GPU failed during this answer" if reason.startswith("failover:") else WHY.get(reason, reason)
    where = f"the smaller fallback model {run.served_model()} on CPU" if run.on_fallback() else "CPU"
    if i.route == "split":
        where = "GPU and CPU together (part of the model on each)"
    return f"answered on {where}: {why} — slower, context {i.kv_tokens:,}"
