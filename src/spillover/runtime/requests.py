"""The request service: the one owner of a request from "accepted" to "terminal".

Rules:

1. ``submit()`` validates (the endpoint's parser, the model, the prompt's limits), then, under
   the Idempotency-Key's lock (one execution per key, ever, at a time), answers a finished
   key from the journal, or journals ACCEPTED (fsync) *before* anything is queued.
2. From acceptance on, the ``Run`` owns the terminal state and the ``Execution`` owns the
   lease (slot + reservation, released exactly once). Every way a run ends (done, an error,
   a bug, DELETE, the client going away, the server stopping) journals exactly one terminal
   state, in the answer's own wire format, before its last bytes are sent.
3. A request whose queue is already full is refused *before* it is accepted (503 with
   Retry-After; nothing journaled), after its own errors (a chat request is prepared first
   then: one too long for every lane is the 400 it always gets, not a 503 to retry). One that
   loses the last place to a concurrent request while it is being accepted is journaled
   REJECTED (resumable with its key) and gets the same 503.
4. The HTTP layer registers one ``Endpoint`` per route: how a body is read and how an
   answer is encoded (``Encoding``). Nothing here knows HTTP; start-up recovery replays an
   orphan through the same endpoint (``replay``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spillover.core.lifecycle import RESUMABLE, State
from spillover.core.reasons import Reason
from spillover.errors import (
    AnswerNotKept,
    IdempotencyInFlight,
    IdempotencyMismatch,
    InvalidRequest,
    RequestCancelled,
    ServerStopping,
    SpilloverError,
)
from spillover.runtime.journal import JournalRecord, KeyConflict, dumps, stored_json
from spillover.runtime.prepare import GenerationRequest, Prepared, new_request_id, prepare
from spillover.runtime.recovery import end_orphan, orphan_lock
from spillover.runtime.run import Answer, Encoded, Encoding, Run, Streaming, as_error
from spillover.runtime.unary import UnaryEndpoint, UnaryRun

if TYPE_CHECKING:
    from spillover.runtime.executor import Execution
    from spillover.runtime.gateway import Gateway

__all__ = ["Answer", "Encoded", "Encoding", "Endpoint", "Refused", "RequestService", "Run", "Streaming"]

log = logging.getLogger("spillover.request")
# What a resumed request's QUEUED move clears: the answer of the attempt that ended resumable (a
# dropped connection's partial stream, its 499). Kept, GET /v1/requests/{id} showed that answer
# while the resumed run was live, and its delivered tokens kept a restart from replaying it.
RESUMED = {
    "tokens_delivered": 0,
    "status_code": None,
    "response": None,
    "content_type": None,
    "headers": None,
    "error": None,
}
CANCEL_WAIT_S = 2.0  # how long DELETE waits for a cancelled run to journal its end and leave ``live``


@dataclass(frozen=True)
class Endpoint:
    """How one route's bodies are read and its answers written (given by the HTTP layer).
    ``name`` is stored with the body, so a replay after a restart finds its endpoint again."""

    name: str
    parse: Callable[[Any], GenerationRequest]  # a validated request, or InvalidRequest
    stored: Callable[[dict[str, Any]], dict[str, Any]]  # the part of a body that is journaled
    encoding: Callable[[Run], Encoding]


class Refused(Exception):
    """A request refused before it was accepted (nothing journaled), naming the request id
    its error belongs to (the key's request for an Idempotency-Key error); with ``answer``:
    one refused as it was queued, just after its acceptance, whose end is journaled and
    counted in /metrics already (``Run._store``), and ``answer`` its journaled error (naming
    its request id, with its ``spillover`` object: round 54a, it was answered in the shape of
    a refusal before acceptance)."""

    def __init__(self, error: SpilloverError, rid: str, *, answer: Answer | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.rid = rid
        self.answer = answer


class RequestService:
    """Accepts, runs, cancels and replays requests (the rules in the module docstring)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.endpoints: dict[str, Endpoint | UnaryEndpoint] = {}
        # request id -> its run, from acceptance until it ends and every worker it ran on let go of it
        self.live: dict[str, Run | UnaryRun] = {}
        self._leaving: dict[str, asyncio.Future[None]] = {}  # a chat run that ended: resolved as it leaves ``live``
        # Unfinished in the journal at start and not replayed yet (start-up recovery waits for
        # the workers): a DELETE ends one here (``cancel``), and its replay then runs nothing.
        self.orphans: set[str] = set()

    def __repr__(self) -> str:
        return f"<RequestService endpoints={sorted(self.endpoints)} live={len(self.live)}>"

    def register(self, endpoint: Endpoint | UnaryEndpoint) -> None:
        self.endpoints[endpoint.name] = endpoint

    async def submit(
        self,
        endpoint: str,
        body: Any,
        *,
        idem_key: str | None,
        deadline_ms: int | None,
        on_live: Callable[[UnaryRun], None] | None = None,
    ) -> Answer | Run | UnaryRun:
        """Rule 1: a stored answer (a finished Idempotency-Key), or an accepted ``Run``.
        Raises ``Refused`` when the request is not accepted. A unary request whose whole
        answer is awaited here is handed to ``on_live`` once it runs (its client may go away
        meanwhile: the caller cancels it)."""
        ep = self.endpoints[endpoint]
        rid = new_request_id()
        if self.gw.stopping:
            raise Refused(ServerStopping("the gateway is stopping; send it again once it is back"), rid)
        if isinstance(ep, UnaryEndpoint):
            return await self._submit_unary(ep, body, rid, idem_key, deadline_ms, on_live)
        try:
            req = ep.parse(body)
            body_hash = _body_hash(endpoint, body)
            stored = ep.stored(body)
            async with self.gw.keys.hold(idem_key):
                resume: int | None = None
                rec = await self._keyed(idem_key, body_hash)
                if rec is not None:
                    rid = rec.id  # errors about this key name the request it is bound to
                    if rec.state not in RESUMABLE:
                        return stored_answer(rec)
                    resume = rec.attempts
                    req = _with_stored_seed(req, json.loads(rec.body))  # it samples as before
                # The model's own lanes (a 404 or wrong kind is the client's error, before any place).
                sched = self.gw.chat_model(self.gw.registry.resolve(req.model, "chat").id).scheduler
                if sched is not None:  # rule 3 at once
                    lane = "cpu" if req.prefer_cpu else None
                    if not sched.has_place(lane):  # the request's own 400 (too long for every lane) before a 503
                        await prepare(self.gw, req, rid)
                    sched.hold_place(rid, lane)
                try:
                    prep = await prepare(self.gw, req, rid)
                    # The seed it runs with is journaled beside its body (any endpoint's shape): a
                    # replay after a restart, or a resume with its key, samples exactly the same way.
                    body_json = stored_json({"endpoint": endpoint, "body": stored, "seed": prep.seed})
                    return await self._begin(
                        ep,
                        prep,
                        body_json=body_json,
                        body_hash=body_hash,
                        idem_key=idem_key,
                        resume_attempts=resume,
                        deadline_ms=req.deadline_ms or deadline_ms,
                    )
                except KeyConflict as exc:
                    raise _in_flight(exc.existing.id) from exc
                finally:
                    if sched is not None:
                        sched.release_place(rid)  # its job took it, or it ended before
        except SpilloverError as exc:
            raise Refused(exc, rid) from exc

    async def _keyed(self, idem_key: str | None, body_hash: str) -> JournalRecord | None:
        """The finished request an Idempotency-Key is bound to (None: a fresh key, or none);
        raises for a different body (422) or a request still in flight (409). Called under
        the key's lock."""
        if idem_key is None or self.gw.journal is None:
            return None
        rec = await self.gw.journal.by_key(idem_key)
        if rec is None:
            return None
        if rec.body_hash != body_hash:
            raise Refused(
                IdempotencyMismatch(
                    "this Idempotency-Key was used with a different request body", param="Idempotency-Key"
                ),
                rec.id,
            )
        if not rec.terminal or rec.id in self.live:
            raise Refused(_in_flight(rec.id), rec.id)
        return rec

    async def _submit_unary(
        self,
        ep: UnaryEndpoint,
        body: Any,
        rid: str,
        idem_key: str | None,
        deadline_ms: int | None = None,
        on_live: Callable[[UnaryRun], None] | None = None,
    ) -> Answer | UnaryRun:
        """Rule 1 for a request with one whole answer (``runtime.unary``); a streamed one is
        handed back live (its caller takes ``reply()``), and lets go of its place and of
        ``live`` when it ends."""
        failed: SpilloverError | None = None
        held: tuple[Any, str] | None = None  # the request promised a place, and its id
        try:
            try:
                req = ep.parse(body)
                body_hash = _body_hash(ep.name, body)
                stored = ep.stored(body)
                async with self.gw.keys.hold(idem_key):
                    rec = await self._keyed(idem_key, body_hash)
                    if rec is not None:
                        rid = rec.id  # errors about this key name the request it is bound to
                        if rec.state not in RESUMABLE:
                            return stored_answer(rec)
                    deadline_s = deadline_ms / 1000 if deadline_ms is not None else None
                    ep.hold_place(req, rid, deadline_s)  # rule 3: a full queue answers at once, nothing journaled
                    held = (req, rid)
                    run = UnaryRun(self.gw, ep, rid, req, attempt=rec.attempts if rec is not None else 0)
                    if self.gw.journal is not None and rec is None:
                        try:  # ACCEPTED and QUEUED in one durable write
                            await self.gw.journal.accept(
                                rid=rid,
                                idem_key=idem_key,
                                body_hash=body_hash,
                                kind=ep.kind,
                                stream=ep.streams(req),  # as told: its first frame's delivery is noted (rule 5)
                                body=stored_json({"endpoint": ep.name, "body": stored}),
                                model=str(req.model),
                                queued={"attempts": run.attempt + 1},
                            )
                        except KeyConflict as exc:
                            raise _in_flight(exc.existing.id) from exc
                        self.live[rid] = run  # live from here: a retry with its key gets 409
                        if self.gw.stopping:  # accepted while the gateway stopped its requests
                            run.cancel(by_user=False)
                    else:
                        failed = await self._queue_unary(run)
            except SpilloverError as exc:
                raise Refused(exc, rid) from exc
            if failed is None and run.streaming:
                place = held

                def ended() -> None:
                    self.live.pop(run.rid, None)
                    if place is not None:
                        ep.release_place(*place)

                run.on_end = ended
                held = None  # the run lets go of it
                return run
            try:  # outside the key's lock, like a generation: its execution is the run's
                if failed is None and on_live is not None:
                    on_live(run)
                got = await run.fail_now(failed) if failed is not None else await run.reply()
                assert isinstance(got, Answer)
                return got
            finally:
                self.live.pop(run.rid, None)
        finally:
            if held is not None:
                ep.release_place(*held)  # its job took the place, or it ended before

    async def _queue_unary(self, run: UnaryRun) -> SpilloverError | None:
        """Make a unary request live and QUEUED when its acceptance did not queue it (a resumed
        one; a new one without a journal); the error that ends it at once when the QUEUED move
        cannot be journaled (it must not stay where it was)."""
        self.live[run.rid] = run
        if self.gw.journal is not None:
            try:
                await self.gw.journal.move(run.rid, State.QUEUED, attempts=run.attempt + 1, **RESUMED)
            except SpilloverError as exc:
                return exc
        return None

    async def _begin(
        self,
        ep: Endpoint,
        prep: Prepared,
        *,
        body_json: str,
        body_hash: str,
        idem_key: str | None,
        resume_attempts: int | None,
        deadline_ms: int | None = None,
    ) -> Run:
        """Make the request durable (ACCEPTED, or resumed from its record) and only then
        queue it. A request whose queue is already full is refused before anything is journaled."""
        gw = self.gw
        chat = prep.chat or gw.chat
        assert chat.scheduler is not None
        exe = chat.new_execution(
            gw,
            prep.rid,
            prep.tokens,
            prep.max_tokens,
            params=prep.req.sampling() | {"seed": prep.seed, "grammar": prep.grammar},
            incremental=prep.req.stream and prep.req.forced_tool is None,
            allow_shrink=prep.allow_shrink,
            open_ended=prep.open_ended,
            cut=prep.cut,
            attempt=resume_attempts or 0,
            cpu_tokens=prep.cpu_tokens,
        )
        if prep.req.prefer_cpu:
            exe.prefer_cpu()  # 400 (before anything is journaled) when the CPU lane cannot take it
        elif chat.scheduler.spills_over(prep.rid):
            if not exe.fits_cpu():  # too long for the CPU lane: the GPU lane's refusal, nothing journaled
                chat.scheduler.refuse_spill()
            exe.prefer_cpu(Reason.GPU_QUEUE_FULL)
        elif chat.canary_due(gw.device is not None, deadline=deadline_ms is not None):
            exe.prefer_cpu(Reason.CANARY)
        if deadline_ms is not None:
            exe.deadline_s = time.monotonic() + deadline_ms / 1000
        exe.check_queue_nowait()  # rule 3: a full queue answers at once, nothing journaled
        run = Run(gw, prep, exe, self._unregister_when_done(prep.rid, exe))
        run.encoding = ep.encoding(run)
        queued = {"route": chat.scheduler.entry_lane(exe.next_lane), "attempts": exe.attempt + 1}
        if gw.journal is not None and resume_attempts is None:
            # ACCEPTED and QUEUED in one durable write
            await gw.journal.accept(
                rid=prep.rid,
                idem_key=idem_key,
                body_hash=body_hash,
                kind=prep.req.kind,
                stream=prep.req.stream,
                body=body_json,
                model=prep.req.model,
                queued=queued,
            )
        self.live[prep.rid] = run  # visible to DELETE as soon as it is accepted
        if self.gw.stopping:  # accepted while the gateway stopped its requests: stopped too
            run.cancel(by_user=False)
        try:
            if gw.journal is not None and resume_attempts is not None:
                await gw.journal.move(prep.rid, State.QUEUED, **queued, **RESUMED)
            exe.submit_nowait()
        except BaseException as exc:
            self.live.pop(prep.rid, None)  # its events never started: their ``finally`` will not run
            exe.cancel()
            await asyncio.shield(run._end(run._error(exc, committed=False), failed=exc))
            if isinstance(exc, SpilloverError):  # its end is journaled and counted: once
                raise Refused(exc, prep.rid, answer=run._answer()) from exc
            raise
        return run

    async def _unregister_when_done(self, rid: str, exe: Execution) -> AsyncGenerator[Any, None]:
        """The Execution's events; when they end, or the consumer closes this early, the
        Execution is closed too (its lease released), and the request leaves ``live`` once
        every worker it ran on has stopped working on it (``Execution.when_released``). Until
        then a resend with its Idempotency-Key is answered 409 in flight: a resumed run under
        the same id would meet the stopping one's device reservation (a 500 ``KeyError``
        once) and its worker's events."""
        try:
            async with contextlib.aclosing(exe.events()) as events:
                async for ev in events:
                    yield ev
        finally:  # (before ``Run._end`` sets ``ended``: a DELETE then finds ``_leaving``)
            run = self.live.get(rid)
            gone = self._leaving[rid] = asyncio.get_running_loop().create_future()

            def leave() -> None:
                if self.live.get(rid) is run:  # not a later run under the same id
                    self.live.pop(rid, None)
                if self._leaving.get(rid) is gone:
                    del self._leaving[rid]
                gone.set_result(None)

            # It leaves once its end is journaled too: a DELETE meanwhile finds it live, not a
            # request that is neither live nor ended.
            exe.when_released(leave if not isinstance(run, Run) else lambda: run.after_end(leave))

    async def cancel(self, rid: str) -> None:
        """Cancel a live request and wait (bounded) until its end is journaled and it has left
        ``live`` (a resend with its key then gets its stored answer, not 409). An orphan
        whose replay has not begun, and a keyed request that ended resumable (``RESUMABLE``:
        a resend with its key would run it again; it may have ended so just before this
        cancel reached it, its worker perhaps still letting go), is then ended CANCELLED,
        under the lock a replay or resume takes (``orphan_lock``: its key's), so it never runs."""
        if (run := self.live.get(rid)) is not None:
            await self._cancel_run(rid, run)
        if self.gw.journal is None or ((run := self.live.get(rid)) is not None and not run.ended.is_set()):
            return
        rec = await self.gw.journal.get(rid)
        if rec is None or (rec.terminal and not self._cancellable(rec)):
            return
        # Resumable, or not ended: a resume with its key may have begun while the record was
        # read (round 54a: the DELETE found it QUEUED, not live, and answered 200 while it ran
        # to completion). Under the key's lock a resume that began is live.
        async with self.gw.keys.hold(orphan_lock(rec)):
            run = self.live.get(rid)
            if run is None or run.ended.is_set():  # none, or one whose end is journaled
                now = await self.gw.journal.get(rid)
                if now is not None and self._cancellable(now):  # still, under the lock
                    self.orphans.discard(rid)
                    await end_orphan(self.gw, now, RequestCancelled(f"request {rid} was cancelled"))
                return
        await self._cancel_run(rid, run)  # its replay or resume began meanwhile: that run is cancelled

    def _cancellable(self, rec: JournalRecord) -> bool:
        """Whether a DELETE ends this request that is not running: an orphan whose replay has
        not begun, or a keyed request that ended resumable (its key would run it again)."""
        return (rec.id in self.orphans and not rec.terminal) or bool(rec.idem_key and rec.state in RESUMABLE)

    async def _cancel_run(self, rid: str, run: Run | UnaryRun) -> None:
        run.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT_S):
                await run.ended.wait()
                if (gone := self._leaving.get(rid)) is not None:  # and every worker it ran on lets go of it
                    await asyncio.shield(gone)

    def cancel_all(self) -> None:
        """The server is stopping: every live request stops, each journaling its end as
        resumable (``ServerStopping``: the gateway's ``stopping`` is set), not as cancelled."""
        for run in list(self.live.values()):
            run.cancel(by_user=False)

    async def replay(self, rec: JournalRecord) -> None:
        """Run an orphan again (start-up recovery) under its lock (``orphan_lock``: its
        Idempotency-Key's), through its own endpoint, so a retry with its key gets exactly what
        its client would have. If its client resumed it meanwhile (it is live, or no longer
        QUEUED), or a DELETE ended it, nothing runs. It leaves ``orphans`` only once it is live
        (or ended), under the lock: a DELETE finds it in one or the other."""
        assert self.gw.journal is not None
        run: Run | UnaryRun
        async with self.gw.keys.hold(orphan_lock(rec)):
            if rec.id not in self.orphans:  # a DELETE ended it
                return
            try:
                current = await self.gw.journal.get(rec.id)
                if rec.id in self.live or current is None or current.state is not State.QUEUED:
                    return
                try:
                    doc = json.loads(rec.body)
                    ep = self.endpoints[doc["endpoint"]]
                    if isinstance(ep, UnaryEndpoint):
                        run = UnaryRun(self.gw, ep, rec.id, ep.parse(doc["body"]), attempt=rec.attempts)
                        run.unread = True  # nobody reads it: nothing of it is delivered
                        self.live[rec.id] = run
                    else:
                        prep = await prepare(self.gw, _with_stored_seed(ep.parse(doc["body"]), doc), rec.id)
                        run = await self._begin(
                            ep,
                            prep,
                            body_json=rec.body,
                            body_hash=rec.body_hash,
                            idem_key=rec.idem_key,
                            resume_attempts=rec.attempts,
                        )
                        run.unread = True  # nobody reads it: nothing of it is delivered
                except Exception as exc:  # its stored body no longer runs (or a bug): it ends, resumable
                    await self._end_unrunnable(rec, exc)
                    return
            finally:
                self.orphans.discard(rec.id)
        if isinstance(run, UnaryRun):
            try:
                got = await run.reply()
                if isinstance(got, Streaming):  # nobody listens: the stream runs to its journaled end
                    async for _ in got.frames:
                        pass
            finally:
                self.live.pop(rec.id, None)
            return
        reply = await run.reply()
        if isinstance(reply, Streaming):
            async with contextlib.aclosing(reply.frames) as frames:
                async for _ in frames:
                    pass

    async def _end_unrunnable(self, rec: JournalRecord, exc: Exception) -> None:
        assert self.gw.journal is not None
        current = await self.gw.journal.get(rec.id)
        if current is not None and not current.terminal:
            await end_orphan(self.gw, current, as_error(exc, rec.id))

    def replayable(self) -> bool:
        """Whether an orphan can be run again here (some endpoint is registered)."""
        return bool(self.endpoints)


def _body_hash(endpoint: str, body: Any) -> str:
    """What an Idempotency-Key is bound to: the endpoint and the body as sent."""
    try:
        return hashlib.sha256(dumps({"endpoint": endpoint, "body": body}).encode()).hexdigest()
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") is JSON, not text
        raise InvalidRequest("the body contains text that is not valid Unicode (a lone surrogate)") from exc


def _in_flight(rid: str) -> IdempotencyInFlight:
    """The 409 for a key whose request ``rid`` has not ended."""
    return IdempotencyInFlight(
        f"a request with this Idempotency-Key ({rid}) is still in flight", param="Idempotency-Key"
    )


def _with_stored_seed(req: GenerationRequest, doc: dict[str, Any]) -> GenerationRequest:
    """``req`` with the seed its journaled first run used (``doc``: the stored request), when
    it asked for none."""
    seed = doc.get("seed")
    if req.seed is not None or isinstance(seed, bool) or not isinstance(seed, int):
        return req
    return dataclasses.replace(req, seed=seed)


def stored_answer(rec: JournalRecord) -> Answer:
    """A finished request's journaled answer, as it was sent (an Idempotency-Key's replay).
    A completed one whose answer was too large to keep raises ``AnswerNotKept``."""
    if rec.state is State.COMPLETED and rec.response is None:
        raise AnswerNotKept(
            f"request {rec.id} finished and its answer was sent, but the journal did not keep it "
            f"({rec.reason or 'no room'}); send it with a new Idempotency-Key to run it again"
        )
    headers = json.loads(rec.headers or "{}")
    headers["Idempotent-Replayed"] = "true"
    return Answer(rec.status_code or 200, rec.response or b"", headers, rec.content_type or "application/json")
