"""A rank that died (kill -9, the host's out-of-memory killer) reaches the ranks still running as an error of the
collective they were in: gloo's transport says the connection was reset or closed. Told apart here, their line says
that another rank died, instead of a traceback or a failed save blaming the disk; the launcher names the rank."""

from __future__ import annotations

__all__ = ["lost_peer", "lost_peer_line"]

PEER_LOST_WORDS = ("Connection reset by peer", "Connection closed by peer")


def lost_peer(message: str) -> str | None:
    """gloo's words for a peer process that went away mid-collective, if `message` (an error's text) has them."""
    return next((words for words in PEER_LOST_WORDS if words in message), None)


def lost_peer_line(rank: int, step: int, words: str) -> str:
    """step 0: before the first training step."""
    where = f"at step {step}" if step > 0 else "before the first step"
    return (
        f"error: rank {rank} stopped {where}: another rank died (its connection: {words}); the launcher names it. "
        "Run the same command again to resume from the latest checkpoint"
    )
