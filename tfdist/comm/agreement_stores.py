"""Where ranks leave the messages of a ReadAgreement: Horovod's rendezvous HTTP store (Gloo) or MPI messages.

A store offers `put(scope, key, value, readers)`, `get(scope, key)` (None until the value is there) and
`delete(scope, key)`. `readers` are the ranks that will `get` the key: the HTTP store keeps every key where every
rank can read it and ignores them; the MPI store sends the value to those ranks, which find it in their inbox.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence

from tfdist.errors import ConfigError

__all__ = ["HttpStore", "MpiStore"]


class HttpStore:
    """Horovod's RendezvousHTTPServer (PUT/GET/DELETE /scope/key), the server Gloo's ranks meet at: started by
    `tfdist launch --backend horovod` and `horovodrun --gloo`, found through HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT."""

    def __init__(self, address: str):
        self.address = address

    def put(self, scope: str, key: str, value: str, readers: Sequence[int] = ()) -> None:
        del readers  # every rank can read every key
        self._call(urllib.request.Request(self._url(scope, key), data=value.encode(), method="PUT")).close()

    def get(self, scope: str, key: str) -> str | None:
        try:
            with self._call(urllib.request.Request(self._url(scope, key))) as response:
                return response.read().decode()
        except _NotFound:
            return None

    def delete(self, scope: str, key: str) -> None:
        try:
            self._call(urllib.request.Request(self._url(scope, key), method="DELETE")).close()
        except _NotFound:
            pass

    def _url(self, scope: str, key: str) -> str:
        return f"http://{self.address}/{scope}/{key}"

    def _call(self, request: urllib.request.Request):
        try:
            return urllib.request.urlopen(request, timeout=30)
        except urllib.error.HTTPError as err:
            if err.code == 404:
                raise _NotFound from None
            raise ConfigError(f"reading sharded state: the job's rendezvous store at {self.address} answered "
                              f"{err.code} to {request.get_method()} {request.full_url}.") from None
        except (urllib.error.URLError, OSError) as err:
            raise ConfigError(f"reading sharded state: the job's rendezvous store at {self.address} "
                              f"(HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT) cannot be reached ({err}); is the launcher "
                              "(tfdist launch, horovodrun) still running?") from None


class _NotFound(Exception):
    pass


# Horovod talks over its own duplicate of MPI_COMM_WORLD, so this tag cannot meet its messages; it only has to
# stay clear of tags a user's own mpi4py code sends on COMM_WORLD.
MPI_TAG = 0x7FD1


class MpiStore:
    """Point-to-point MPI messages (mpi4py, non-blocking) under Horovod's MPI controller (`mpirun`, `horovodrun
    --mpi`), where there is no rendezvous server: `put` sends (scope, key, value) to each reader, `get` first
    moves every message that has arrived into this rank's inbox. Nothing ever blocks on a rank that is absent.

    No collective is involved (creating the store, or a read on one rank alone, must not wait for the others),
    so the messages go over COMM_WORLD with their own tag rather than over a duplicated communicator.
    """

    def __init__(self, comm=None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self._comm = comm
        self.rank = comm.Get_rank()
        self._inbox: dict[tuple[str, str], str] = {}
        self._sending: list = []  # requests of messages still in flight (their buffers must stay alive)

    def put(self, scope: str, key: str, value: str, readers: Sequence[int] = ()) -> None:
        for rank in readers:
            if rank == self.rank:
                self._inbox[(scope, key)] = value
            else:
                self._sending.append(self._comm.isend((scope, key, value), dest=rank, tag=MPI_TAG))
        self._sending = [r for r in self._sending if not r.Test()]

    def get(self, scope: str, key: str) -> str | None:
        from mpi4py import MPI

        status = MPI.Status()
        while self._comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI_TAG, status=status):
            got_scope, got_key, value = self._comm.recv(source=status.Get_source(), tag=MPI_TAG)
            self._inbox[(got_scope, got_key)] = value
        return self._inbox.get((scope, key))

    def delete(self, scope: str, key: str) -> None:
        self._inbox.pop((scope, key), None)
