"""Circuit breaker per GPU worker: one enum, one transition table, one ``advance()``.

Rules:

1. CLOSED counts failures; ``failure_threshold`` failures within ``window_s`` open it.
   A failure marked ``severe`` (a classified OOM, a crash, a driver reset) opens it at once.
2. OPEN refuses work until ``cooldown_s`` has passed (``tick``), then goes HALF_OPEN.
   Each re-open within ``flap_window_s`` doubles the cooldown, up to ``cooldown_max_s``
   (hysteresis against flapping).
3. HALF_OPEN lets at most ``half_open_probes`` requests through; ``close_after_successes``
   successes close it, any failure re-opens it.
4. Success in CLOSED clears the failure count.
5. Every probe ends in an event: success, failure, or ``PROBE_RELEASED`` (the probe was
   cancelled, or ended for a reason that says nothing about the device, such as a client's
   bad schema); a released probe frees its place and counts neither way.
6. HALF_OPEN is bounded: a probe still in flight ``probe_timeout_s`` after it started
   re-opens the breaker (``tick``), so no lost probe pins it half-open.
7. A GPU attempt that starts while HALF_OPEN is a probe of that round (``probe_started``:
   the round is ``opens``). When an attempt ends (``attempt_ended``), its outcome is an
   event (``ATTEMPT_OUTCOMES``); while HALF_OPEN only the current round's probes report
   success or their release, and any failure counts, probe or not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

__all__ = [
    "ATTEMPT_OUTCOMES",
    "BreakerEvent",
    "BreakerPolicy",
    "BreakerState",
    "Circuit",
    "advance",
    "allows",
    "attempt_ended",
    "probe_started",
]


class Circuit(str, Enum):
    """The three breaker states."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(str, Enum):
    """What can happen to a breaker."""

    SUCCESS = "success"
    FAILURE = "failure"
    SEVERE_FAILURE = "severe_failure"
    TICK = "tick"
    PROBE = "probe"
    PROBE_RELEASED = "probe_released"


@dataclass(frozen=True)
class BreakerPolicy:
    """Breaker thresholds (configuration)."""

    failure_threshold: int = 3
    window_s: float = 30.0
    cooldown_s: float = 2.0
    cooldown_max_s: float = 30.0
    flap_window_s: float = 60.0
    half_open_probes: int = 1
    close_after_successes: int = 2
    probe_timeout_s: float = 660.0  # the gateway passes [breaker].probe_timeout_s; same default


@dataclass(frozen=True)
class BreakerState:
    """A breaker snapshot; ``advance`` returns a new one."""

    circuit: Circuit = Circuit.CLOSED
    failures: int = 0
    first_failure_s: float = 0.0
    opened_at_s: float = 0.0
    cooldown_s: float = 0.0
    probes_in_flight: int = 0
    probe_successes: int = 0
    opens: int = 0
    probe_started_s: float = 0.0  # when the oldest probe in flight started

    def retry_after_s(self, now_s: float) -> float:
        """Seconds until an OPEN breaker will try HALF_OPEN (0 otherwise)."""
        if self.circuit is not Circuit.OPEN:
            return 0.0
        return max(0.0, self.opened_at_s + self.cooldown_s - now_s)


def _open(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    flapping = b.opens > 0 and now_s - b.opened_at_s < p.flap_window_s
    cooldown = min(p.cooldown_max_s, b.cooldown_s * 2) if flapping else p.cooldown_s
    return BreakerState(
        circuit=Circuit.OPEN,
        opened_at_s=now_s,
        cooldown_s=max(cooldown, p.cooldown_s),
        opens=b.opens + 1,
    )


def _closed_failure(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    if b.failures and now_s - b.first_failure_s <= p.window_s:
        failures, first = b.failures + 1, b.first_failure_s
    else:
        failures, first = 1, now_s
    if failures >= p.failure_threshold:
        return _open(b, now_s, p)
    return replace(b, failures=failures, first_failure_s=first)


def _half_open_success(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    successes = b.probe_successes + 1
    if successes >= p.close_after_successes:
        return replace(BreakerState(), opens=b.opens, opened_at_s=b.opened_at_s, cooldown_s=b.cooldown_s)
    return replace(b, probe_successes=successes, probes_in_flight=max(0, b.probes_in_flight - 1))


def _tick_open(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    if now_s >= b.opened_at_s + b.cooldown_s:
        return replace(b, circuit=Circuit.HALF_OPEN, probes_in_flight=0, probe_successes=0)
    return b


def _probe(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    started = b.probe_started_s if b.probes_in_flight else now_s
    return replace(b, probes_in_flight=b.probes_in_flight + 1, probe_started_s=started)


def _probe_released(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    return replace(b, probes_in_flight=max(0, b.probes_in_flight - 1))


def _tick_half_open(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    if b.probes_in_flight and now_s - b.probe_started_s > p.probe_timeout_s:
        return _open(b, now_s, p)  # a probe that never reported: treat it as a failure
    return b


def _same(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    return b


def _clear(b: BreakerState, now_s: float, p: BreakerPolicy) -> BreakerState:
    if not b.failures and not b.first_failure_s:  # every success of a healthy worker: nothing to clear
        return b
    return replace(b, failures=0, first_failure_s=0.0)


_C, _O, _H = Circuit.CLOSED, Circuit.OPEN, Circuit.HALF_OPEN
_E = BreakerEvent
TABLE = {
    (_C, _E.SUCCESS): _clear,
    (_C, _E.FAILURE): _closed_failure,
    (_C, _E.SEVERE_FAILURE): _open,
    (_C, _E.TICK): _same,
    (_C, _E.PROBE_RELEASED): _same,  # a cancelled request admitted while closed
    (_O, _E.SUCCESS): _same,  # a request admitted before the trip finished fine
    (_O, _E.FAILURE): _same,
    (_O, _E.SEVERE_FAILURE): _same,
    (_O, _E.TICK): _tick_open,
    (_O, _E.PROBE_RELEASED): _same,
    (_H, _E.SUCCESS): _half_open_success,
    (_H, _E.FAILURE): _open,
    (_H, _E.SEVERE_FAILURE): _open,
    (_H, _E.TICK): _tick_half_open,
    (_H, _E.PROBE): _probe,
    (_H, _E.PROBE_RELEASED): _probe_released,
}


def advance(b: BreakerState, event: BreakerEvent, now_s: float, p: BreakerPolicy) -> BreakerState:
    """Apply one event; an event the table does not list for this state raises ValueError."""
    step = TABLE.get((b.circuit, event))
    if step is None:
        raise ValueError(f"breaker: {event.value} is not allowed in {b.circuit.value}")
    return step(b, now_s, p)


def allows(b: BreakerState, p: BreakerPolicy) -> bool:
    """Whether a new GPU request may pass now (call ``advance(TICK)`` first)."""
    if b.circuit is Circuit.CLOSED:
        return True
    if b.circuit is Circuit.HALF_OPEN:
        return b.probes_in_flight < p.half_open_probes
    return False


# Rule 7: how a GPU attempt's end feeds the breaker. ``ok`` | ``failed`` | ``severe`` count;
# ``cancelled`` and ``client`` (the request's own fault) only end a probe.
ATTEMPT_OUTCOMES: dict[str, BreakerEvent] = {
    "ok": BreakerEvent.SUCCESS,
    "failed": BreakerEvent.FAILURE,
    "severe": BreakerEvent.SEVERE_FAILURE,
    "cancelled": BreakerEvent.PROBE_RELEASED,
    "client": BreakerEvent.PROBE_RELEASED,
}


_PROBE_ENDS = (BreakerEvent.SUCCESS, BreakerEvent.PROBE_RELEASED)


def probe_started(b: BreakerState, now_s: float, p: BreakerPolicy) -> tuple[BreakerState, int | None]:
    """Rule 7: a GPU attempt starts now; while HALF_OPEN it is a probe of round ``opens``
    (returned), else it is no probe (None)."""
    if b.circuit is not Circuit.HALF_OPEN:
        return b, None
    b = advance(b, BreakerEvent.PROBE, now_s, p)
    return b, b.opens


def attempt_ended(
    b: BreakerState, outcome: str, probe_round: int | None, now_s: float, p: BreakerPolicy
) -> BreakerState:
    """Rule 7: a GPU attempt (a probe of ``probe_round``, or None) ended with ``outcome``."""
    ev = ATTEMPT_OUTCOMES[outcome]
    current_probe = probe_round is not None and probe_round == b.opens
    if (
        b.circuit is Circuit.HALF_OPEN
        and not current_probe
        and ev in (BreakerEvent.SUCCESS, BreakerEvent.PROBE_RELEASED)
    ):
        return b  # admitted before this round: says nothing of the probes
    return advance(b, ev, now_s, p)
