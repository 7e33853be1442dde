"""Which sealed blocks are verified at each step.

Prefix hits are verified every step, before the step reads them; ``all``
verifies every sealed block every step; ``sample:N`` verifies N a step on
average, batched every :attr:`Sampling.SAMPLE_BATCH_STEPS` steps, from two
round robins: the sealed blocks live requests hold (each at least once a
sweep; a turn passes for one a prefix hit verified since), then, on what
they leave of the batch up to 1/:attr:`Sampling.UNHELD_SHARE` of it, the
sealed blocks nobody holds.  Taking a batch costs its size, not the number
of sealed blocks.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence


class Sampling:
    """The verification schedule and its round robins."""

    __slots__ = ()

    def _init_sampling(self) -> None:
        #: the sampled verification's round robin: sealed blocks that live
        #: requests hold (read by their attention every step, with no other
        #: check), the next to verify on the left, and the set of blocks in
        #: it.  A block met that is no longer sealed, or no longer held,
        #: leaves it; a held one comes back when a prefix hit takes it up
        #: (a cached block nobody holds is verified when it is served, before
        #: the step that reads it, on the batch's spare budget: ``_cold``,
        #: and when it is evicted).  Taking a batch costs its size, not the
        #: number of sealed blocks (a pool on a GPU has 1e5-1e6, mostly
        #: cached and unheld: the sample goes to the blocks being read)
        self._sweep: deque[int] = deque()
        self._in_sweep: set[int] = set()
        #: sealed blocks verified at a prefix hit since their last turn in
        #: the round robin: their next turn passes without a second
        #: verification.  Each held block is still verified at least once
        #: per sweep, and the sample goes to the blocks no hit verifies (a
        #: system prompt's blocks, hit by every new request, are verified
        #: there already)
        self._hit_verified: set[int] = set()
        #: the round robin of sealed blocks nobody holds (a finished
        #: request's cached blocks, servable as prefix hits), as
        #: ``_sweep``: verified on the sampled batch's spare budget (what
        #: the held blocks leave of it, up to :data:`UNHELD_SHARE`), so a
        #: scribble on one is found even
        #: if it is never served; entries no longer sealed, or held again,
        #: leave as they are met.  Every such block is also verified when
        #: vLLM evicts it (:meth:`uncache`)
        self._cold: deque[int] = deque()
        self._in_cold: set[int] = set()
        self._tick = 0

    #: ``sample:N`` verifies N sealed blocks per step on average, batched:
    #: N x this many blocks every this many steps.  A verification's cost is
    #: mostly its fixed number of tensor ops, not its number of blocks, so
    #: the batch pays that fixed cost once per 8 steps instead of every step
    #: (measured: ``python -m benchmarks.device``).
    SAMPLE_BATCH_STEPS = 8

    #: of a sampled batch, what the held blocks leave goes to the sealed
    #: blocks nobody holds, up to 1/this of the batch: nothing reads them,
    #: and each is verified anyway when served (a prefix hit) and when
    #: evicted, so their turn only finds a scribble sooner (or on a block
    #: that is never served nor evicted).  Measured on the tiny traffic
    #: (``benchmarks.workercost``): the whole spare budget made the
    #: sampled batches about twice as costly
    UNHELD_SHARE = 8

    def verify_step(self, layers, hit_blocks: Sequence[int] = ()) -> None:
        """This step's checksum verification, as one batched gather: the
        sealed blocks served as prefix hits (every step, before the step
        reads them) and the sampled ones (round robin, see
        :data:`SAMPLE_BATCH_STEPS`; every sealed block every step with
        ``all``)."""
        if self.pending_sums:
            self._drain()
        if self.checksum == "off" or not (self.sums or self.pending_sums):
            return
        self._tick += 1
        if not hit_blocks and self.checksum != "all" and self._tick % self.SAMPLE_BATCH_STEPS:
            return  # nothing to verify this step
        whys = dict.fromkeys(hit_blocks, "at prefix hit")
        if self.checksum == "all":
            for b in self.sums:
                whys.setdefault(b, "every step")
        elif self.checksum == "sample":
            if hit_blocks:  # (verified below: sealed ones are checked)
                sealed = self.sealed
                self._hit_verified.update(b for b in hit_blocks if b in sealed)
            if self._tick % self.SAMPLE_BATCH_STEPS == 0:
                n = self.checksum_sample * self.SAMPLE_BATCH_STEPS
                chosen = self._sample(n)
                for b in chosen:
                    whys.setdefault(b, "sampled")
                spare = min(n - len(chosen), -(-n // self.UNHELD_SHARE))
                if spare > 0 and self._cold:
                    unheld = self._sample_cold(spare)
                    for b in unheld:
                        whys.setdefault(b, "sampled, held by nobody")
                    self.counters["verified_unheld"] += len(unheld)
        self.verify(layers, whys)

    def _sample(self, n: int) -> list[int]:
        """The blocks to verify among the next ``n`` turns of the round
        robin: sealed, held blocks (each at most once), moved to its end,
        less those verified at a prefix hit since their last turn (this
        step's hits among them), whose turn passes.  Blocks met that are no
        longer sealed or held leave it (each is met once and left once, so
        a batch costs about ``n`` steps of the loop)."""
        sweep, sealed, held, chosen = self._sweep, self.sealed, self.holders, []
        hit_verified, turns = self._hit_verified, 0
        for _ in range(len(sweep)):
            if turns >= n:
                break
            b = sweep.popleft()
            if b in sealed and b in held:
                turns += 1
                sweep.append(b)
                if b in hit_verified:
                    hit_verified.discard(b)
                else:
                    chosen.append(b)
            else:
                self._in_sweep.discard(b)
                hit_verified.discard(b)
        return chosen

    def _sample_cold(self, n: int) -> list[int]:
        """The next ``n`` sealed blocks nobody holds, in round robin: the
        sampled batch's spare budget (what the held blocks left of it, at
        most :data:`UNHELD_SHARE`), so the sample still goes to the blocks
        being read first, and the batch's size stays within what
        ``sample:N`` says.  Blocks met that are no
        longer sealed (evicted: verified then) or held again (back in the
        held round robin at their hit) leave it."""
        cold, sealed, held, chosen = self._cold, self.sealed, self.holders, []
        for _ in range(len(cold)):
            if len(chosen) >= n:
                break
            b = cold.popleft()
            if b in sealed and b not in held:
                cold.append(b)
                chosen.append(b)
            else:
                self._in_cold.discard(b)
        return chosen

    def _sweep_in(self, blocks: list[int]) -> None:
        """Sealed ``blocks``, now held, join the sampled round robin
        (at its end) unless they are in it."""
        sweep, in_sweep, sealed = self._sweep, self._in_sweep, self.sealed
        for b in blocks:
            if b not in in_sweep and b in sealed:
                in_sweep.add(b)
                sweep.append(b)

    def _cold_in(self, blocks: list[int]) -> None:
        """Sealed ``blocks`` nobody holds join the round robin of unheld
        blocks (at its end) unless they are in it."""
        cold, in_cold = self._cold, self._in_cold
        for b in blocks:
            if b not in in_cold:
                in_cold.add(b)
                cold.append(b)
