"""What a rank says when a collective fails because a peer left: that the peer died (run the
same command again: it resumes), or that it stopped on an error of its own (its line says
which; running again changes nothing until that is fixed)."""

from __future__ import annotations

from pyrecover.heartbeat import Heartbeat
from pyrecover.oneline import first_line


class PeerLost(RuntimeError):
    """A collective failed because another rank of the job died (exit code 1, resumable)."""


class PeerStopped(PeerLost):
    """A collective failed because rank `rank` stopped on a user error (`reason`, its own
    line): that rank is named. Exit code 1 like PeerLost: the rank that stopped exits 2, the
    code srun and `train --nproc` report, and stays the only rank named as the cause."""

    def __init__(self, line: str, rank: int, reason: str) -> None:
        super().__init__(line)
        self.rank, self.reason = rank, reason


def peer_lost(exc: BaseException) -> bool:
    """peer_lost tells whether `exc` is a collective failing because a peer process left."""
    import torch.distributed as tdist

    text = str(exc)
    return isinstance(exc, tdist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer",
                            "Broken pipe", "NCCL communicator was aborted"))


def lost(rank: int, exc: BaseException, beats: Heartbeat | None) -> PeerLost:
    """lost is the one line rank `rank` ends with when `exc` is a peer leaving: the rank that
    said it stops on an error (its heartbeat's `say_error`) by name, else a peer that died."""
    stopped = beats.stopped_on_error() if beats is not None else None
    if stopped is not None and stopped[0] != rank:
        return PeerStopped(f"rank {rank}: stopped because rank {stopped[0]} stopped on an "
                           "error (its own line says which)", *stopped)
    return PeerLost(f"rank {rank}: another rank of the job died ({first_line(exc)}); run the "
                    "same command again to resume")
