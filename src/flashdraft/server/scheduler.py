"""Slots, the one worker thread that runs the engine, and the prompt cache.

The engine is not thread-safe, so only the worker thread touches its caches. Each slot owns a Sequence (its
caches) and a draft policy that keeps learning across the slot's requests. The worker advances every busy slot
by one stream event per round (one decoding step, or a few when text is held back; one pass of a prompt longer
than one prefill pass), so slots share the model fairly and a long prompt does not stall the other slots'
streams. Where the decoder batches steps (SpeculativeDecoder.batches: the CPU's module path, the GPU's fused
layers of float weights) and more than one slot is busy, the round's decoding steps of every slot run as one
batched step: each stream stops at its launched step (StepLaunched), one flush runs them all (one target pass
over every slot's rows), then each stream collects its own; with CUDA graphs the flush only queues the batched
step, and each stream launches its next step, flushed in the same round, before collecting the one before (the
device runs a round while the host commits the last one's tokens). The worker
checks each job's cancel flag before every step: a disconnected client stops its generation within one step or
pass. Events reach the request's asyncio queue through loop.call_soon_threadsafe, so the event loop
(and with it /health and /metrics) never waits on the model.

PromptCache: prefixes evicted from the server's slots, kept in host memory (llama-server's --cache-ram).

A slot holds one conversation's caches; when it takes a prompt that shares less with them than they hold, those
rows would be lost. With a prompt cache the slot's reusable prefix is first copied to host memory, and a later
prompt that shares more with a kept prefix than with any slot gets those rows copied back instead of
recomputing them (a user coming back to an earlier conversation, agents taking turns on one slot). Entries are
dropped least recently used first to stay within the byte budget; a prefix that another entry already holds is
not kept twice. Copies go through SpeculativeDecoder.snapshot / copy_prefix, so the rows restored are exactly
the rows saved: output is what a cold prefill gives (greedy), as with prefix reuse within a slot. With a HostArena
(the server's, on a GPU) the copies take their host memory from it, made once at load, instead of pinning new
memory per prefix; entries are dropped as needed to make room in it.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

from flashdraft.engine.generator import AdaptiveDraft, Delta, PromptProgress, StepLaunched, set_batch
from flashdraft.engine.speculative import Sequence, SpeculativeDecoder, shared_prefix
from flashdraft.models.kv_cache import ArenaFull, HostArena
from flashdraft.server.errors import APIError
from flashdraft.server.requests import DELTA, ENDED, ERROR, PROGRESS, RESULT, Job

log = logging.getLogger("flashdraft.server")


MIN_ROWS = 16  # shorter prefixes cost more to keep track of than to recompute


def _holds(tokens: list[int], other: list[int]) -> bool:
    """Whether a prefix kept for `tokens` holds every row a sequence of `other` could reuse (all but its last)."""
    return shared_prefix(tokens, other) >= len(other) - 1


def _nbytes(seq: Sequence) -> int:
    return seq.target_cache.nbytes() + (seq.draft_cache.nbytes() if seq.draft_cache is not None else 0)


def _tensors(seq: Sequence) -> list:
    """The key and value tensors of seq's caches."""
    caches = [seq.target_cache] + ([seq.draft_cache] if seq.draft_cache is not None else [])
    return [t for cache in caches for t in cache.k + cache.v]


class PromptCache:
    def __init__(self, decoder: SpeculativeDecoder, max_bytes: int | None, arena: HostArena | None = None):
        """max_bytes: the budget for the kept prefixes' caches (None: no limit); arena: host memory the copies take
        (None: each copy allocates its own)."""
        self.decoder = decoder
        self.max_bytes = max_bytes
        self.arena = arena
        self.entries: OrderedDict[int, Sequence] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.bytes = 0

    def save(self, seq: Sequence) -> bool:
        """Keep seq's reusable prefix (called before the slot's caches are overwritten); True if it was kept."""
        tokens = seq.tokens
        if len(tokens) - 1 < MIN_ROWS or self._touch_holder(tokens):  # too short, or already kept (or more of it)
            return False
        snap = self._snapshot(seq)
        if snap is None or snap.projected < MIN_ROWS:
            return False
        size = _nbytes(snap)
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        for key in [k for k, e in self.entries.items() if _holds(snap.tokens, e.tokens)]:
            self._drop(key)  # the new entry holds it too
        while self.max_bytes is not None and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[self._next_id] = snap
        self._next_id += 1
        self.bytes += size
        return True

    def _touch_holder(self, tokens: list[int]) -> bool:
        """Whether an entry already holds what `tokens` could reuse (it becomes the most recently used)."""
        key = next((key for key, entry in self.entries.items() if _holds(entry.tokens, tokens)), None)
        if key is not None:
            self.entries.move_to_end(key)
        return key is not None

    def _snapshot(self, seq: Sequence) -> Sequence | None:
        """seq's reusable prefix copied to host memory: into the arena, dropping the least recently used entries
        until it fits, or to memory of its own without one. None, dropping nothing, for a prefix that the empty
        arena or the budget could not hold or too short to keep (measured on meta tensors, no bytes, once the
        arena is found full)."""
        if self.arena is None:
            return self.decoder.snapshot(seq)
        worth_room = None  # measured at the first ArenaFull
        while True:
            try:
                return self.decoder.snapshot(seq, self.arena)
            except ArenaFull:
                if worth_room is None:
                    worth_room = self._worth_room(seq)
                if not self.entries or not worth_room:
                    return None
                self._drop(next(iter(self.entries)))

    def _worth_room(self, seq: Sequence) -> bool:
        """Whether seq's prefix is worth dropping kept ones for: long enough to keep, and within the empty arena
        and the budget."""
        shape = self.decoder.snapshot(seq, "meta")
        return shape is not None and shape.projected >= MIN_ROWS and self.arena.fits(_tensors(shape)) and (
            self.max_bytes is None or _nbytes(shape) <= self.max_bytes)

    def restore(self, seq: Sequence, prompt: list[int], have: int) -> int:
        """Copy the kept prefix sharing the most with `prompt` into seq's caches if it holds more than `have`
        reusable rows; returns the rows restored (0 when none was better)."""
        best_key, best_rows = None, have
        for key, entry in self.entries.items():
            rows = self.decoder.reusable_rows(entry, prompt)
            if rows > best_rows:
                best_key, best_rows = key, rows
        if best_key is None:
            return 0
        self.decoder.copy_prefix(seq, self.entries[best_key], best_rows)
        self.entries.move_to_end(best_key)
        return best_rows

    def warm_up(self, seq: Sequence, rows: int = 4 * MIN_ROWS) -> None:
        """Copy `rows` positions of an empty slot's caches (their values unused) to host memory and back once, at
        load, and forget the copies: what a save meets on first use (the staging buffer's device memory, the first
        transfers into the arena) is then met before a request waits on it. On the H200 the second request's first
        token, the first to save a prefix, came 10 ms later than the next ones (docs/performance.md). Nothing is
        copied into an arena too small for the copy (then no prefix fits in it either)."""
        for cache in [seq.target_cache] + ([seq.draft_cache] if seq.draft_cache is not None else []):
            n = min(rows, cache.capacity)
            try:
                snap = cache.snapshot(n, self.arena if self.arena is not None else "cpu")
            except ArenaFull:
                return
            cache.copy_prefix(snap, n)

    def _drop(self, key: int) -> None:
        self.bytes -= _nbytes(self.entries.pop(key))


@dataclass
class Slot:
    id: int
    sequence: object
    policy: object                  # a DraftPolicy, or 0 for plain decoding
    job: Job | None = None
    iterator: object = None
    n_prompt: int = 0
    n_decoded: int = 0
    requests: int = 0
    choice: int = 0                 # which of the job's n choices is being generated
    choice_events: int = 0          # events the current choice has given
    last_used: int = 0              # when the slot last took a job (the scheduler's count of jobs started)

    def state(self, context_size: int, batched: bool) -> dict:
        """/slots' entry: llama-server's fields, the decoding steps of the slot's current (or last) request with
        their drafts (tau: tokens committed a step), whether its steps run batched with the other slots', and its
        draft policy."""
        job, seq = self.job, self.sequence  # read once: the worker may finish it meanwhile
        steps, drafted, accepted = seq.steps, seq.drafted, seq.accepted
        state = {"id": self.id, "is_processing": job is not None, "id_task": job.id if job else None,
                 "n_ctx": context_size, "n_prompt_tokens": self.n_prompt, "n_decoded": self.n_decoded,
                 "requests": self.requests, "n_steps": steps, "draft_n": drafted, "draft_n_accepted": accepted,
                 "tau": (steps + accepted) / steps if steps else None, "batched_steps": batched}
        policy_state = getattr(self.policy, "state", None)
        if callable(policy_state):
            state["draft_policy"] = policy_state()
        return state


class Scheduler:
    def __init__(self, engine, n_slots: int, fixed_draft: int | None, metrics, prompt_cache: PromptCache | None = None,
                 context_shift: bool = False):
        """fixed_draft: None = each slot gets the engine's default policy (engine.make_policy()); an int = that
        fixed draft length on every step (0 = plain decoding). prompt_cache: where slots leave the prefixes they
        are about to lose (--cache-ram), None for none. context_shift: a full context drops old tokens and goes on
        (--context-shift) instead of ending the generation."""
        self.engine = engine
        self.context_shift = context_shift
        self.metrics = metrics
        self.prompt_cache = prompt_cache
        self.slots = [Slot(i, engine.new_sequence(), engine.make_policy() if fixed_draft is None else fixed_draft)
                      for i in range(n_slots)]
        self.pending: deque[Job] = deque()
        self._started = 0  # jobs started, the clock of Slot.last_used
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- called from the event loop ----------------------------------------------------------------------------

    def start(self, warm_up: list | None = None) -> float | None:
        """Start the worker thread. warm_up: None for no warm-up, else the sampling settings to warm up with
        besides greedy (Engine.warm_up on every slot's sequence: each has graphs of its own). The worker runs it
        before it takes any job and this waits for it, so that what a thread makes on first use (the CUDA
        libraries' per-thread handles, with the graphs and compiled layers) is made in the thread that serves,
        not in the loading thread; the slots' draft policies learn nothing from it. Returns the warm-up's seconds
        (None: no warm-up, or nothing to warm up); an error in it is raised here and the worker ends."""
        outcome: dict = {}
        done = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(warm_up, outcome, done), name="flashdraft-worker",
                                        daemon=True)
        self._thread.start()
        done.wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("seconds")

    def _work(self, warm_up: list | None, outcome: dict, done: threading.Event) -> None:
        """The worker thread: the warm-up, if asked for (its outcome handed to start()), then the jobs."""
        try:
            if warm_up is not None:
                seconds = [self.engine.warm_up(slot.sequence, warm_up) for slot in self.slots]
                outcome["seconds"] = None if None in seconds else sum(seconds)
                if self.prompt_cache is not None:
                    self.prompt_cache.warm_up(self.slots[0].sequence)
        except BaseException as e:  # noqa: BLE001 - raised by start(), in the thread that loads the model
            outcome["error"] = e
            return
        finally:
            done.set()
        self._run()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                job.post(ENDED, "shutdown")
                return
            job.on_cancel = self._withdraw
            self.pending.append(job)
            self._cv.notify()

    def _withdraw(self, job: Job) -> None:
        """A queued job whose client left: out of the queue now, not when a slot frees (its handler would wait
        that long, and with the slots busy for good, forever)."""
        with self._cv:
            if job in self.pending:
                self.pending.remove(job)
                job.post(ENDED, "cancelled")

    def stop(self) -> None:
        """End every job (their clients get the end of their stream) and stop the worker after its current step.
        Safe to call from a signal handler: it does not wait."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def busy(self) -> int:
        return sum(1 for s in self.slots if s.job is not None)

    @property
    def deferred(self) -> int:
        return len(self.pending)

    @property
    def batches(self) -> bool:
        """Whether the slots' steps run batched while more than one is busy (several slots, a decoder that batches)."""
        return len(self.slots) > 1 and self.engine.decoder.batches

    def slots_state(self) -> list[dict]:
        return [s.state(self.engine.context_size, self.batches) for s in self.slots]

    # --- the worker thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._assign():
                    self._cv.wait()
                if self._stopping:
                    break
                active = [s for s in self.slots if s.job is not None]
            self.metrics.on_round(len(active))
            self._price_drafts(active)
            # slots whose step waits to run batched with the others' (StepLaunched): one flush runs them all, then
            # each collects its step
            waiting = [slot for slot in active if self._advance(slot)]
            while waiting:  # (a step whose text is held back, or a pipelined one, is followed by its next one)
                self.metrics.on_batch(self.engine.decoder.flush())
                waiting = [slot for slot in waiting if self._advance(slot)]
            self.metrics.on_batched_tokens(self.engine.decoder.batched_tokens)
            if self.engine.decoder.graphs is not None:
                self.metrics.on_graph_captures(self.engine.decoder.graphs.captured)
        with self._cv:
            for slot in self.slots:
                if slot.job is not None:
                    slot.job.post(ENDED, "shutdown")
                    self._release(slot)
            while self.pending:
                self.pending.popleft().post(ENDED, "shutdown")

    def _batching(self) -> bool:
        """Whether a slot's next step waits to run batched with the other slots' (the stream asks before each
        launch): while more than one slot is busy; a lone stream keeps its steps pipelined (graphed steps queue the
        next one while the host reads the last)."""
        return self.busy > 1

    def _price_drafts(self, active: list[Slot]) -> None:
        """Tell the busy slots' draft policies how many streams step together this round (their steps' batched
        pass prices drafting: AdaptiveDraft.set_streams; one where slots step in turn), and with several the one
        length their drafting steps take (batch_length: few compositions, few graphs)."""
        set_batch([slot.policy for slot in active if isinstance(slot.policy, AdaptiveDraft)],
                  len(active) if self.batches else 1)

    def _assign(self) -> bool:
        """Give queued jobs (oldest first) to free slots; True when any slot has work."""
        while self.pending:
            free = [s for s in self.slots if s.job is None]
            if not free:
                break
            job = self.pending.popleft()
            if job.cancelled.is_set():
                job.post(ENDED, "cancelled")
                continue
            try:
                slot = self._slot_for(job, free)
            except Exception as e:  # a failure placing a job (copying a prefix in) ends that job, not the worker
                log.exception("request %d: could not be given a slot", job.id)
                for s in free:  # a copy may have stopped halfway: nothing these caches hold is reused
                    s.sequence.tokens = []
                job.post(ERROR, e)
                continue
            self._start(slot, job)
        return any(s.job is not None for s in self.slots)

    def _slot_for(self, job: Job, free: list[Slot]) -> Slot:
        """The free slot whose caches hold the longest prefix of the job's prompt (a conversation goes back to
        its slot), else the one unused longest (its caches the least likely to be asked for again). When another
        slot, busy or not, holds more of the prompt, its rows are copied over (a system prompt shared by several
        conversations is run once). With a prompt cache, the slot's own prefix goes there first if the prompt
        would overwrite part of it, and a kept prefix sharing more with the prompt than any slot comes back."""
        prompt = job.request.prompt_ids
        if not job.request.cache_prompt:
            slot = min(free, key=lambda s: s.last_used)
            self._keep(slot, 0)
            return slot
        shared = {s.id: shared_prefix(s.sequence.tokens, prompt) for s in self.slots}
        slot = max(free, key=lambda s: (shared[s.id], -s.last_used))
        self._keep(slot, shared[slot.id])
        donor = max(self.slots, key=lambda s: shared[s.id])
        decoder = self.engine.decoder
        have = decoder.reusable_rows(slot.sequence, prompt)
        if shared[donor.id] > shared[slot.id]:
            rows = decoder.reusable_rows(donor.sequence, prompt)
            if rows > have:
                decoder.copy_prefix(slot.sequence, donor.sequence, rows)
                have = rows
        if self.prompt_cache is not None:
            self.prompt_cache.restore(slot.sequence, prompt, have)
        return slot

    def _keep(self, slot: Slot, shared: int) -> None:
        """Leave the slot's prefix in the prompt cache when the next prompt keeps only `shared` tokens of it."""
        if self.prompt_cache is not None and shared < len(slot.sequence.tokens) - 1:
            try:
                self.prompt_cache.save(slot.sequence)
            except Exception:  # noqa: BLE001 - host memory short (pinned or not): the prefix is not kept, no more
                log.warning("slot %d: its prefix could not be kept in host memory", slot.id, exc_info=True)

    def _start(self, slot: Slot, job: Job, choice: int = 0) -> None:
        """Start one of the job's choices (they run one after another on the slot)."""
        r = job.request
        job.slot_id = slot.id
        slot.job, slot.n_prompt, slot.choice, slot.choice_events = job, len(r.prompt_ids), choice, 0
        if choice == 0:
            slot.n_decoded = 0
            slot.requests += 1
            self._started += 1
            slot.last_used = self._started
        slot.iterator = self.engine.stream(r.prompt_ids, r.choice_params(choice), draft=slot.policy,
                                           sequence=slot.sequence, n_min=r.n_min, n_max=r.n_max,
                                           reuse_prefix=r.cache_prompt, context_shift=self.context_shift,
                                           n_keep=r.n_keep, prompt_progress=True,
                                           batch_steps=self._batching)

    def _release(self, slot: Slot) -> None:
        if slot.iterator is not None:
            slot.iterator.close()  # stops the generation at once
        slot.job, slot.iterator = None, None

    def _advance(self, slot: Slot) -> bool:
        """Take the slot's next stream event; True when it is a step waiting for the round's batched flush."""
        job = slot.job
        if job.cancelled.is_set():
            log.info("slot %d: request %d cancelled after %d tokens", slot.id, job.id, slot.n_decoded)
            job.post(ENDED, "cancelled")
            self._release(slot)
            return False
        try:
            event = next(slot.iterator)
        except Exception as e:  # a failure inside the model must end this request only, never the worker
            error = _constraint_error(job, slot, e)
            if error is None:
                log.exception("slot %d: request %d failed", slot.id, job.id)
            job.post(ERROR, error or e, slot.choice)
            self._release(slot)
            return False
        if isinstance(event, StepLaunched):
            return True
        if isinstance(event, PromptProgress):  # one pass of a prompt: the other slots step before the next
            if job.request.return_progress and job.request.stream:
                job.post(PROGRESS, event, slot.choice)
            return False
        slot.choice_events += 1
        self.metrics.on_step()
        if isinstance(event, Delta):
            slot.n_decoded += len(event.token_ids)
            job.post(DELTA, event, slot.choice)
            return False
        self.metrics.on_result(event)
        log.info("slot %d: request %d done: %s", slot.id, job.id, event.summary())
        job.post(RESULT, event, slot.choice)
        if slot.choice + 1 < job.request.n:
            slot.iterator.close()
            self._start(slot, job, slot.choice + 1)
            return False
        self._release(slot)
        return False


def _constraint_error(job: Job, slot: Slot, error: Exception) -> APIError | None:
    """A grammar the engine could not compile (a ValueError before the first event) as the 400 naming the field
    it came from; None for any other failure."""
    r = job.request
    if slot.choice_events or not isinstance(error, ValueError) or r.params.constraint is None:
        return None
    field = r.constraint_field or "grammar"
    return APIError(400, f"'{field}' cannot be used: {error}", param=field)
