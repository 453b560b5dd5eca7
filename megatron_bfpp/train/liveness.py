"""Who is still alive, for ranks that torchrun or srun started (no bfpp-train launcher above them):
each rank beats a counter in the job's store, so a rank failing on communication names the ranks
whose counters stopped instead of a survivor (docs/design-notes.md, "A dead rank under srun")."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Liveness", "RanksLost", "Verdict", "start_liveness"]

_BEAT_INTERVAL = 1.0
_SILENCE = 3.0  # > 2 beats: a live rank's counter moves at least once in this time
_HOST_LINGER = 2.5  # > 2 beats: every rank's heartbeat thread sees a claim before rank 0 exits
_STORE_TIMEOUT_S = 10.0
_PREFIX = "bfpp-liveness/"


class RanksLost(RuntimeError):
    """Ranks that stopped beating; the message is the one line users see."""


class Verdict(enum.Enum):
    REPORT = "report"  # this rank reports its own error
    QUIET = "quiet"  # another rank reports: exit without a word


@dataclasses.dataclass
class Liveness:
    """This rank's view of the job's heartbeats (see the module docstring)."""

    store: Any
    rank: int
    world_size: int
    where: str  # MASTER_ADDR:MASTER_PORT, for the message when the store is gone
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    claim_seen: bool = False  # the heartbeat thread saw that some rank reports

    def beat(self) -> None:
        """The heartbeat thread's loop; ends with the store (nothing left to tell)."""
        while not self.stop.is_set():
            try:
                self.store.add(f"beat/{self.rank}", 1)
                self.claim_seen |= int(self.store.add("reported", 0)) > 0
            except Exception:  # the store is gone: its host died, or the job is ending
                return
            self.stop.wait(_BEAT_INTERVAL)

    def counters(self) -> list[int]:
        return [self.store.add(f"beat/{rank}", 0) for rank in range(self.world_size)]

    def judge(self, error: BaseException) -> Verdict | RanksLost:
        """What this failing rank does with ``error``: report it, stay quiet, or report the ranks
        whose heartbeat stood still for ``_SILENCE`` s (communication failures only)."""
        try:
            lost: list[int] = []
            if isinstance(error, RuntimeError):
                before = self.counters()
                time.sleep(_SILENCE)
                after = self.counters()
                lost = [r for r, n in enumerate(after) if n == before[r] and r != self.rank]
            claimed = int(self.store.add("reported", 1)) == 1  # the first to ask reports
        except Exception:  # the store is gone with its host
            if self.claim_seen or not _first_on_this_node(self.where):
                return Verdict.QUIET
            return RanksLost(
                f"lost the job's rendezvous store at {self.where}: the rank or launcher hosting "
                "it (rank 0 under srun) is gone; stopped"
            )
        if self.rank == 0:  # it may host the store (srun): the others still need it
            time.sleep(_HOST_LINGER)
        if not claimed:
            return Verdict.QUIET
        if not lost:
            return Verdict.REPORT
        if len(lost) == 1:
            who = f"rank {lost[0]} is gone: its heartbeat"
        else:
            who = f"ranks {lost} are gone: their heartbeats"
        return RanksLost(f"{who} stopped (killed, crashed or stopped); stopped the other ranks")


def _first_on_this_node(where: str) -> bool:
    """One rank per node and job creates the marker (its name: the store's address and the
    ranks' common parent, torchrun's agent or srun's step daemon)."""
    name = f"bfpp-lost-store-{where.replace(':', '-')}-{os.getppid()}"
    try:
        fd = os.open(os.path.join(tempfile.gettempdir(), name), os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError:  # no marker possible: better a line per rank than none
        return True
    os.close(fd)
    return True


def start_liveness(rank: int, world_size: int) -> Liveness | None:
    """Join the job's store and start beating; None without ``MASTER_ADDR`` / ``MASTER_PORT``."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            int(port),
            world_size,
            is_master=False,
            timeout=timedelta(seconds=_STORE_TIMEOUT_S),
            wait_for_workers=False,
        )
    except Exception:  # no heartbeat is no reason not to train
        return None
    # torchrun restarts workers on the same store: each attempt counts and claims afresh
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"{_PREFIX}{attempt}/", client)  # type: ignore[attr-defined]
    liveness = Liveness(store=store, rank=rank, world_size=world_size, where=f"{host}:{port}")
    with contextlib.suppress(Exception):
        store.add(f"beat/{rank}", 1)
    threading.Thread(target=liveness.beat, name="bfpp-liveness", daemon=True).start()
    return liveness
