"""What a rank says when a collective fails because a peer left: that the peer died (run the
same command again: it resumes), or that it stopped on an error of its own (its line says
which; running again changes nothing until that is fixed)."""

from __future__ import annotations

from pyrecover.heartbeat import Heartbeat


class PeerLost(RuntimeError):
    """A collective failed because another rank of the job died (exit code 1, resumable)."""


class PeerStopped(RuntimeError):
    """A collective failed because another rank stopped on a user error (exit code 2: no
    retry helps until that is fixed): that rank is named."""


def peer_lost(exc: BaseException) -> bool:
    """peer_lost tells whether `exc` is a collective failing because a peer process left."""
    import torch.distributed as tdist

    text = str(exc)
    return isinstance(exc, tdist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer",
                            "Broken pipe", "NCCL communicator was aborted"))


def lost(rank: int, exc: BaseException, beats: Heartbeat | None) -> PeerLost | PeerStopped:
    """lost is the one line rank `rank` ends with when `exc` is a peer leaving: the rank that
    said it stops on an error (its heartbeat's `say_error`) by name, else a peer that died."""
    stopped = beats.stopped_on_error() if beats is not None else None
    if stopped is not None and stopped != rank:
        return PeerStopped(f"rank {rank}: stopped because rank {stopped} stopped on an error "
                           "(its own line says which)")
    return PeerLost(f"rank {rank}: another rank of the job died ({first_line(exc)}); run the "
                    "same command again to resume")


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
