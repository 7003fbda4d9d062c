"""Sequence (stateful) models: correlation ids, start/end flags and sequence lengths, as perf_analyzer sends them.

A model served by Triton's sequence batcher takes each request as one step of a sequence named by its
correlation id (`sequence_id`); the first step carries `sequence_start`, the last `sequence_end`. Here:

- a sequence's length is drawn uniformly within ±`variation_pct` % of `length` (at least 1), from the run's
  seed, as perf_analyzer draws it;
- its id is the next free one in `--sequence-id-range START[:END]` (END excluded), taken in turn and
  wrapping around, never one a live sequence still holds (perf_analyzer's counter can hand out an id a long
  sequence still uses);
- the steps of one sequence are sent in order, one at a time (perf_analyzer's `--serial-sequences`): a
  `Slot` is one live sequence at a time, and its lock keeps a second step from leaving before the first is
  answered.

Closed loop: each concurrency slot drives one sequence after another. Open loop: `num_sequences` slots
take the scheduled sends in turn (perf_analyzer's `--num-of-sequences`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from client.errors import PerfClientError

DEFAULT_LENGTH = 20  # perf_analyzer's defaults
DEFAULT_VARIATION_PCT = 20.0
DEFAULT_NUM_SEQUENCES = 4
# Triton's gRPC front end reads an integer correlation id as int64 (tritonclient sends int64_param).
MAX_ID = 2**63 - 1


@dataclass(frozen=True)
class Flags:
    """What one request of a sequence carries."""

    sequence_id: int
    start: bool
    end: bool


@dataclass(frozen=True)
class SequenceOptions:
    """perf_analyzer's sequence flags; `id_end` is excluded, None for no bound."""

    length: int = DEFAULT_LENGTH
    variation_pct: float = DEFAULT_VARIATION_PCT
    id_start: int = 1
    id_end: int | None = None
    num_sequences: int = DEFAULT_NUM_SEQUENCES

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if self.length < 1:
            raise PerfClientError(f"--sequence-length {self.length}: expected a positive integer")
        if not 0 <= self.variation_pct <= 100:
            raise PerfClientError(f"--sequence-length-variation {self.variation_pct:g}: expected 0 to 100 (%)")
        if self.num_sequences < 1:
            raise PerfClientError(f"--num-of-sequences {self.num_sequences}: expected a positive integer")
        if not 1 <= self.id_start <= MAX_ID:
            raise PerfClientError(f"--sequence-id-range {self.id_range}: expected START from 1 to 2**63 - 1")
        if self.id_end is not None and not self.id_start < self.id_end <= MAX_ID + 1:
            raise PerfClientError(f"--sequence-id-range {self.id_range}: expected START < END <= 2**63 "
                                  "(END is excluded)")

    @property
    def id_range(self) -> str:
        return f"{self.id_start}" + (f":{self.id_end}" if self.id_end is not None else "")

    @property
    def ids(self) -> int | None:
        """How many ids the range holds; None without bound."""
        return None if self.id_end is None else self.id_end - self.id_start

    def check_live(self, live: int, load: str) -> None:
        """Refuse a load that keeps more sequences live than the range has ids (they would collide)."""
        if self.ids is not None and live > self.ids:
            raise PerfClientError(f"--sequence-id-range {self.id_range}: {self.ids} ids for {live} live sequences "
                                  f"({load}); expected a range at least that wide")

    def live_sequences(self, concurrency: int | None) -> int:
        """Sequences live at once: one per concurrency slot (closed loop), `num_sequences` (open loop)."""
        return concurrency if concurrency is not None else self.num_sequences


def parse_id_range(text: str) -> tuple[int, int | None]:
    """`START[:END]` -> (START, END or None); PerfClientError naming the flag otherwise."""
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise PerfClientError(f"--sequence-id-range {text!r}: expected START[:END] with integers (END excluded)")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else None


class SequenceIds:
    """Correlation ids in turn from the range, wrapping, skipping those still live."""

    def __init__(self, options: SequenceOptions) -> None:
        self._start, self._count = options.id_start, options.ids
        self._next = 0  # offset from the start of the next id to try
        self._live: set[int] = set()
        self.retired = 0  # ids abandoned this level (retire)

    def take(self) -> int:
        tried = 0
        while True:
            offset = self._next if self._count is None else self._next % self._count
            self._next = offset + 1
            candidate = self._start + offset
            if candidate not in self._live:
                self._live.add(candidate)
                return candidate
            tried += 1
            if self._count is not None and tried >= self._count:  # check_live refuses such a load first
                raise PerfClientError(f"--sequence-id-range: all {self._count} ids are held by live sequences or "
                                      f"by {self.retired} abandoned after a failed step; expected a wider range")

    def give_back(self, sequence_id: int) -> None:
        self._live.discard(sequence_id)

    def retire(self, sequence_id: int) -> None:
        """Keep an abandoned sequence's id out of use for the rest of the level: the server may still hold the
        sequence (until its max_sequence_idle_microseconds), and a new start under that id would join it."""
        self._live.add(sequence_id)
        self.retired += 1

    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._live)


class Slot:
    """One live sequence at a time: `next()` flags a step (a new sequence when none is live), `done()` after
    its answer (the id goes back after the last step). The lock serializes the steps of the open loop."""

    def __init__(self, sequences: Sequences) -> None:
        self._sequences = sequences
        self.lock = asyncio.Lock()
        self.sequence_id: int | None = None
        self._left = 0  # steps still to send in the live sequence
        self._ending = False  # the step in flight is the last
        self._started_now = False  # the step in flight starts its sequence

    @property
    def live(self) -> bool:
        """A sequence started and not ended (its end request not answered yet)."""
        return self.sequence_id is not None

    def next(self) -> Flags:
        start = self.sequence_id is None
        if start:
            self.sequence_id = self._sequences.ids.take()
            self._left = self._sequences.draw_length()
        assert self.sequence_id is not None
        self._left -= 1
        self._ending = self._left == 0
        self._started_now = start
        return Flags(self.sequence_id, start=start, end=self._ending)

    def closing(self) -> Flags:
        """The flags of a request that ends the live sequence now (the level ended in its middle)."""
        assert self.sequence_id is not None
        self._left = 0
        self._ending = True
        return Flags(self.sequence_id, start=False, end=True)

    def done(self) -> None:
        if self._ending and self.sequence_id is not None:
            self._sequences.ids.give_back(self.sequence_id)
            self.sequence_id = None
            self._ending = False

    def failed(self) -> None:
        """The step in flight failed: its sequence is abandoned (its remaining steps would fail too, one after
        another) and the next step starts a new one. A failed start never reached the server's sequence
        batcher, so its id goes back; after a later step the server may still hold the sequence, so its id is
        retired for the level."""
        if self.sequence_id is None:
            return
        if self._started_now:
            self._sequences.ids.give_back(self.sequence_id)
        else:
            self._sequences.ids.retire(self.sequence_id)
        self.sequence_id = None
        self._left = 0
        self._ending = False

    def finish(self, answered: bool) -> None:
        """After a step: `done()` when the server answered it (a --validate mismatch is an answer), else `failed()`."""
        if answered:
            self.done()
        else:
            self.failed()


class Sequences:
    """The sequences of one load level on one model: ids, lengths (seeded) and the slots that drive them."""

    def __init__(self, options: SequenceOptions, seed: np.random.SeedSequence | int | None) -> None:
        self.options = options
        self.ids = SequenceIds(options)
        self._rng = np.random.default_rng(seed if seed is not None else 0)

    def draw_length(self) -> int:
        """A length uniform within ±variation of the base (rounded; at least 1), as perf_analyzer draws it."""
        base, spread = self.options.length, self.options.length * self.options.variation_pct / 100
        if spread == 0:
            return base
        return max(round(base + float(self._rng.uniform(-spread, spread))), 1)

    def length_bounds(self) -> tuple[int, int]:
        """The shortest and longest length `draw_length` can return."""
        base, spread = self.options.length, self.options.length * self.options.variation_pct / 100
        return max(round(base - spread), 1), round(base + spread)

    def slots(self, count: int) -> list[Slot]:
        return [Slot(self) for _ in range(count)]
