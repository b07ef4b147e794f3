"""ReadAgreement: before a read of sharded state all-gathers across Horovod processes, every rank confirms it.

Horovod collectives cannot time out. A save on rank 0 alone (Horovod's usual pattern) of ZeRO-sharded state would
wait in `hvd.allgather` for ranks that never come, until Horovod's stall shutdown ends the job without a word of
why. So before such a gather each rank writes what it reads into the job's rendezvous key-value store (the HTTP
server Gloo's ranks meet at, started by `tfdist launch --backend horovod` or `horovodrun --gloo`), and rank 0
decides: every rank there with the same read, go; a rank missing after `timeout_s`, or reading something else,
every rank that came gets a ConfigError that names the missing ranks and the fix. Saves that every rank makes (TF's
custom-loop tutorial: every worker calls `checkpoint.save()`) then work unchanged.

Under Horovod's MPI controller (`mpirun`, `horovodrun --mpi`) there is no such server: the same messages go as
non-blocking MPI point-to-point messages (mpi4py) instead. Without either (mpi4py missing), `from_environment`
returns None and such reads are refused up front (tfdist.zero.owned_slots.SlotShards).
"""

from __future__ import annotations

import itertools
import os
import time

from tfdist.comm.agreement_stores import HttpStore, MpiStore
from tfdist.errors import ConfigError

__all__ = ["ReadAgreement"]

_instances = itertools.count(1)  # strategies are created in the same order on every rank: same scope names


class ReadAgreement:
    """Agreement of every rank on each read of sharded state, through a store every rank reaches.

    Args:
        rank, size: this process's Horovod rank and the number of processes.
        store: where the ranks leave their messages (`tfdist.comm.agreement_stores`): an `HttpStore` at the
            rendezvous server's "host:port", or an `MpiStore`.
        timeout_s: how long rank 0 waits for every rank to make the same read (a rank that is not rank 0 waits
            twice as long for rank 0's verdict).
        instance: names this agreement's keys; by default the count of agreements made in this process, the same
            on every rank since every rank creates its strategies in the same order.

    Example (2 ranks under `tfdist launch --backend horovod -n 2`, or `mpirun -np 2`):
        >>> agreement = ReadAgreement.from_environment(hvd.rank(), hvd.size(), timeout_s=60)
        >>> agreement.agree("slot 'momentum' of dense/kernel")   # on both ranks: returns; on one: ConfigError
    """

    def __init__(self, rank: int, size: int, store: HttpStore | MpiStore, timeout_s: float,
                 instance: int | None = None):
        self.rank, self.size, self.store, self.timeout_s = int(rank), int(size), store, float(timeout_s)
        self._instance = next(_instances) if instance is None else int(instance)
        self._reads = 0
        self._broken: str | None = None

    @classmethod
    def from_environment(cls, rank: int, size: int, timeout_s: float, mpi: bool = False) -> ReadAgreement | None:
        """Over the Gloo rendezvous store when the launcher set one up, else over MPI messages when Horovod
        runs its MPI controller (`mpi`) and mpi4py is installed, else None (one process needs none)."""
        if size < 2:
            return None
        host, port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        if host and port:
            return cls(rank, size, HttpStore(f"{host}:{port}"), timeout_s)
        if mpi:
            try:
                return cls(rank, size, MpiStore(), timeout_s)
            except ImportError:  # mpi4py comes with the horovod extra; without it reads are refused up front
                return None
        return None

    def agree(self, what: str) -> None:
        """Returns once every rank makes this same read (the `what`-th of its reads); raises ConfigError if a rank
        does not come within the timeout or reads something else. Every rank must call it in the same order."""
        if self._broken is not None:
            raise ConfigError(f"{self._broken} An earlier read of sharded state on this rank failed, so the ranks' "
                              "reads are no longer in step: restart the job (BackupAndRestore resumes it).")
        self._reads += 1
        scope = f"tfdist-read-{self._instance}-{self._reads}"
        self.store.put(scope, f"rank{self.rank}", what, readers=[0])
        verdict = self._decide(scope, what) if self.rank == 0 else self._await_verdict(scope)
        if self._reads > 2:  # every rank has passed the read before the previous one: its keys are not needed
            old = f"tfdist-read-{self._instance}-{self._reads - 2}"
            self.store.delete(old, f"rank{self.rank}")
            if self.rank == 0:
                self.store.delete(old, "verdict")
        if verdict != "go":
            self._broken = verdict
            raise ConfigError(verdict)

    # --- rank 0 decides, the others follow ------------------------------------------------------------------
    def _decide(self, scope: str, what: str) -> str:
        others = [r for r in range(1, self.size)]
        seen: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout_s
        for pause in _pauses():
            for r in others:
                if r not in seen:
                    value = self.store.get(scope, f"rank{r}")
                    if value is not None:
                        seen[r] = value
            if len(seen) == len(others) or time.monotonic() > deadline:
                break
            time.sleep(pause)
        # A rank that gave up waiting for this verdict must not be told to go.
        withdrawn = [r for r in others if self.store.get(scope, f"withdrawn{r}") is not None]
        missing = [r for r in others if r not in seen or r in withdrawn]
        other_reads = {r: v for r, v in seen.items() if v != what and r not in missing}
        if missing:
            verdict = (f"reading sharded state ({what}) needs every rank, and rank(s) {missing} did not make this "
                       f"read within {self.timeout_s:g} s. {_FIX}")
        elif other_reads:
            verdict = (f"the ranks read different sharded state at the same point: rank 0 {what!r}, "
                       + ", ".join(f"rank {r} {v!r}" for r, v in sorted(other_reads.items()))
                       + f". Every rank must run the same save code. {_FIX}")
        else:
            verdict = "go"
        self.store.put(scope, "verdict", verdict, readers=others)
        return verdict

    def _await_verdict(self, scope: str) -> str:
        deadline = time.monotonic() + 2 * self.timeout_s
        for pause in _pauses():
            verdict = self.store.get(scope, "verdict")
            if verdict is not None:
                return verdict
            if time.monotonic() > deadline:
                break
            time.sleep(pause)
        self.store.put(scope, f"withdrawn{self.rank}", "1", readers=[0])
        verdict = self.store.get(scope, "verdict")  # rank 0 may have decided just before the withdrawal reached it
        if verdict is not None:
            return verdict
        return (f"reading sharded state needs every rank, and rank 0 did not make this read within "
                f"{2 * self.timeout_s:g} s. {_FIX}")


_FIX = ("Under HorovodStrategy with zero_stage, a save (model.save, save_weights, tf.train.Checkpoint) reads the "
        "shards of every process, so every rank must take part: run the same save on every rank (as in TF's "
        "custom-loop tutorial, each rank writing its own path), or use tfdist.training.save_model(model, path), "
        "tfdist.training.ModelCheckpoint / BackupAndRestore (rank 0 writes).")


def _pauses():
    pause = 0.002
    while True:
        yield pause
        pause = min(pause * 2, 0.2)
