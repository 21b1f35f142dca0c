"""Device ledger: what is promised on a device versus what is seen there.

Rules:

1. ``predicted`` is the sum of live reservations (admitted requests, loads, tenants we know).
2. ``observed`` is the last reading (sim ledger, NVML or the worker's report) with the time
   it was *taken*. A reading older than ``freshness_s`` is not trusted: ``headroom`` is
   then ``None``.
3. A grant is *confirmed* when its holder reports the allocation made. Grants not
   confirmed before the reading was taken cannot be in it; they are added to it:
   ``headroom = capacity - margin - max(predicted, observed + unconfirmed)``.
   (Memory released but not yet freed is still in the reading, so it is counted too.)
   A release is remembered as memory coming back (``recently_released``) for ``freshness_s``;
   a request's pages only until a reading taken ``RELEASE_SETTLE_S`` or more after their
   release (that reading shows them freed, or they are not coming back).
4. ``reserve_nowait`` grants only what fits in headroom (never over-commits) and returns
   ``None`` when it does not fit: running out is a value.
5. Every reservation is released exactly once; releasing an unknown id raises KeyError.
6. The weights of a holder that died and will restart are *kept* for it (``keep``): another
   holder's weights load is granted only what leaves them free, until the holder takes them
   back (its own weights reservation) or ``drop_kept``. Requests are not held back by them (a
   restart waits for their pages to come back), and they are not in ``predicted``: the reading
   still shows the dead process's memory until the device frees it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["RELEASE_SETTLE_S", "RETURNING_KINDS", "DeviceLedger", "LedgerStatistics", "Reservation"]

# Releases remembered as memory coming back (``recently_released``): a request's pages, and
# an unloaded model's weights (a demoted service, a worker that died). A tenant is not ours.
RETURNING_KINDS = frozenset({"request", "weights"})
# How long after the ledger releases a request's pages the device may still hold them: the
# worker frees them before it reports the request's end. A reading taken this long after the
# release shows them freed; counting them as coming back after that would make admission wait
# (``Delay``) for memory the reading already shows, up to ``freshness_s``, and spend a request's
# whole delay bound on nothing (a chat that could have demoted a batch service at once). An
# unloaded model's weights keep ``freshness_s``: a process's memory is freed as it exits, which a
# reading may show later (the sim device sees a dead process's memory go within a second).
RELEASE_SETTLE_S = 0.25


@dataclass(frozen=True)
class Reservation:
    """A grant of device bytes to one holder."""

    holder: str
    nbytes: int
    kind: str  # "request" | "weights" | "tenant"
    granted_s: float


@dataclass(frozen=True)
class LedgerStatistics:
    """A frozen snapshot for /v1/status, /metrics, logs and tests."""

    device: str
    capacity_bytes: int
    margin_bytes: int
    predicted_bytes: int
    observed_bytes: int | None
    observed_age_s: float | None
    headroom_bytes: int | None
    reservations: int
    request_reservations: int  # held by requests (the rest: weights and tenants)
    granted_total: int
    released_total: int
    peak_requests: int


@dataclass
class DeviceLedger:
    """Predicted reservations plus observed usage for one device."""

    device: str
    capacity_bytes: int
    margin_bytes: int
    freshness_s: float
    _reservations: dict[str, Reservation] = field(default_factory=dict)
    _observed_bytes: int | None = None
    _observed_at_s: float | None = None
    _granted_total: int = 0
    _released_total: int = 0
    _peak_requests: int = 0
    _recent_releases: deque[tuple[float, int, str]] = field(default_factory=deque)  # (when, bytes, kind)
    _confirmed: dict[str, float] = field(default_factory=dict)
    _kept: dict[str, int] = field(default_factory=dict)  # holder -> weights its restart takes back (rule 6)

    def __repr__(self) -> str:
        return (
            f"<DeviceLedger {self.device} cap={self.capacity_bytes} "
            f"predicted={self.predicted_bytes} observed={self._observed_bytes}>"
        )

    @property
    def predicted_bytes(self) -> int:
        """Sum of live reservations."""
        return sum(r.nbytes for r in self._reservations.values())

    @property
    def usable_bytes(self) -> int:
        """Capacity less the safety margin."""
        return max(0, self.capacity_bytes - self.margin_bytes)

    def observe(self, used_bytes: int, taken_s: float, capacity_bytes: int | None = None) -> None:
        """Record a reading of device usage taken at ``taken_s`` (and the capacity, when
        the device reports it)."""
        self._observed_bytes = max(0, used_bytes)
        self._observed_at_s = taken_s
        if capacity_bytes is not None:
            self.capacity_bytes = capacity_bytes

    def observed_fresh(self, now_s: float) -> int | None:
        """The last reading, or None when it is missing or stale."""
        if self._observed_at_s is None or self._observed_bytes is None:
            return None
        if now_s - self._observed_at_s > self.freshness_s:
            return None
        return self._observed_bytes

    def confirm(self, holder: str, now_s: float) -> None:
        """The holder reports its allocation made on the device at ``now_s``."""
        if holder in self._reservations:
            self._confirmed[holder] = now_s

    def unconfirmed_bytes(self) -> int:
        """Granted bytes that the last reading cannot contain yet."""
        taken = self._observed_at_s if self._observed_at_s is not None else float("-inf")
        return sum(
            r.nbytes for h, r in self._reservations.items() if h not in self._confirmed or self._confirmed[h] >= taken
        )

    def settling_bytes(self) -> int:
        """Confirmed bytes the last reading may show *and* that are still counted as
        unconfirmed (confirmed after it was taken): counted twice until the next reading, so
        they are room coming back within one reading (e.g. a model that just loaded)."""
        taken = self._observed_at_s
        if taken is None:
            return 0  # no reading yet: nothing is counted twice
        return sum(r.nbytes for h, r in self._reservations.items() if self._confirmed.get(h, -math.inf) >= taken)

    def headroom(self, now_s: float) -> int | None:
        """Bytes that may still be reserved, or None when usage cannot be trusted."""
        observed = self.observed_fresh(now_s)
        if observed is None:
            return None
        return self.usable_bytes - max(self.predicted_bytes, observed + self.unconfirmed_bytes())

    def fits(self, nbytes: int, now_s: float, *, settling: bool = False) -> bool:
        """Whether ``nbytes`` may be reserved now (``reserve_nowait`` grants them); with
        ``settling``, counting the room the next reading gives back too (``settling_bytes``)."""
        room = self.headroom(now_s)
        return nbytes >= 0 and room is not None and nbytes <= room + (self.settling_bytes() if settling else 0)

    def reserve_nowait(self, holder: str, nbytes: int, now_s: float, kind: str = "request") -> Reservation | None:
        """Grant ``nbytes`` to ``holder`` if it fits now (a weights load: beside what is kept
        for other holders' restarts, rule 6); ``None`` otherwise."""
        if holder in self._reservations:
            raise KeyError(f"{holder} already holds a reservation")
        kept = self.kept_bytes(but=holder) if kind == "weights" else 0
        if not self.fits(nbytes + kept, now_s):
            return None
        self._kept.pop(holder, None)  # its own, taken back
        res = Reservation(holder=holder, nbytes=nbytes, kind=kind, granted_s=now_s)
        self._reservations[holder] = res
        self._granted_total += 1
        if kind == "request":
            live = sum(1 for r in self._reservations.values() if r.kind == "request")
            self._peak_requests = max(self._peak_requests, live)
        return res

    def force_reserve(self, holder: str, nbytes: int, now_s: float, kind: str) -> Reservation:
        """Record bytes already committed on the device (a loaded model's weights)."""
        if holder in self._reservations:
            raise KeyError(f"{holder} already holds a reservation")
        self._kept.pop(holder, None)
        res = Reservation(holder=holder, nbytes=nbytes, kind=kind, granted_s=now_s)
        self._reservations[holder] = res
        self._granted_total += 1
        return res

    def keep(self, holder: str, nbytes: int) -> None:
        """Rule 6: ``holder`` (released) will take ``nbytes`` of weights back when it restarts."""
        self._kept[holder] = nbytes

    def drop_kept(self, holder: str) -> None:
        """Rule 6: ``holder`` will not restart (parked, or its start failed)."""
        self._kept.pop(holder, None)

    def kept_bytes(self, *, but: str | None = None) -> int:
        """Weights kept for restarts (rule 6), all or all but ``but``'s."""
        return sum(n for h, n in self._kept.items() if h != but)

    def release(self, holder: str, now_s: float | None = None) -> Reservation:
        """Return a reservation; each one exactly once.

        With ``now_s``, the release is remembered for ``freshness_s``: a reading taken
        around then may still show those bytes on the device (see ``recently_released``).
        """
        res = self._reservations.pop(holder)
        self._confirmed.pop(holder, None)
        self._released_total += 1
        if now_s is not None and res.kind in RETURNING_KINDS:
            self._recent_releases.append((now_s, res.nbytes, res.kind))
        return res

    def recently_released(self, now_s: float) -> int:
        """Request and weights bytes released within ``freshness_s``, requests' only when released
        after the last reading less ``RELEASE_SETTLE_S`` (rule 3): memory the reading may still
        show as used, and that is coming back (not another tenant's pressure)."""
        settled = -math.inf if self._observed_at_s is None else self._observed_at_s - RELEASE_SETTLE_S
        self._recent_releases = deque(
            (t, b, kind)
            for t, b, kind in self._recent_releases
            if now_s - t <= self.freshness_s and (kind != "request" or t > settled)
        )
        return sum(b for _, b, _ in self._recent_releases)

    def held_bytes(self, holder: str) -> int:
        """Bytes ``holder`` holds now (0: no reservation)."""
        res = self._reservations.get(holder)
        return res.nbytes if res is not None else 0

    def holds(self, holder: str) -> bool:
        """Whether ``holder`` has a live reservation."""
        return holder in self._reservations

    def reserved_by_kind(self, kind: str) -> int:
        """Bytes held by reservations of one kind."""
        return sum(r.nbytes for r in self._reservations.values() if r.kind == kind)

    def statistics(self, now_s: float) -> LedgerStatistics:
        """A frozen snapshot."""
        age = None if self._observed_at_s is None else max(0.0, now_s - self._observed_at_s)
        return LedgerStatistics(
            device=self.device,
            capacity_bytes=self.capacity_bytes,
            margin_bytes=self.margin_bytes,
            predicted_bytes=self.predicted_bytes,
            observed_bytes=self._observed_bytes,
            observed_age_s=age,
            headroom_bytes=self.headroom(now_s),
            reservations=len(self._reservations),
            request_reservations=sum(1 for r in self._reservations.values() if r.kind == "request"),
            granted_total=self._granted_total,
            released_total=self._released_total,
            peak_requests=self._peak_requests,
        )
