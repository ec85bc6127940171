"""The one line a hang ends with: from where every rank said it was, which ranks the others wait for.

Each rank's record (the watchdog writes it into the c10d store):

    step, phase       its last heartbeat (PHASES, in the order a step runs them)
    stalled_seconds   how long it has been there
    where             the innermost frame of its main thread, "file:line in function"
    in_collective     whether that frame is torch.distributed's (waiting for other ranks)
    collectives       {process group: collectives this rank has enqueued on it} from torch's flight recorder

The ranks behind are told apart by the first of these that separates them: the flight recorder (on a group, a rank
that enqueued fewer collectives than another member has not reached the one the others wait in), the stacks (ranks
not waiting inside torch.distributed while others are), then the heartbeats (an earlier step or phase).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["PHASES", "hang_line", "rank_list", "ranks_behind"]

PHASES = ("data", "compute", "validation", "checkpoint", "step_end")
"""A step's phases in the order the training loop enters them (a checkpoint load before the first step is
`checkpoint` of the step it resumes from)."""


def ranks_behind(records: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks (of those that answered) the others wait for; empty when nothing tells them apart."""
    behind: set[int] = set()
    groups = {group for record in records.values() for group in record["collectives"]}
    for group in groups:
        counts = {rank: rec["collectives"][group] for rank, rec in records.items() if group in rec["collectives"]}
        most = max(counts.values())
        behind |= {rank for rank, count in counts.items() if count < most}
    if behind:
        return sorted(behind)
    waiting = {rank for rank, record in records.items() if record["in_collective"]}
    if waiting and len(waiting) < len(records):
        return sorted(set(records) - waiting)
    position = {rank: (record["step"], PHASES.index(record["phase"])) for rank, record in records.items()}
    furthest = max(position.values(), default=None)
    return sorted(rank for rank, at in position.items() if at < furthest)


def hang_line(records: dict[int, dict[str, Any]], world_size: int, folder: str, exit_code: int) -> str:
    """`error: training hung: ...`: the ranks behind with where they are, the others, the ranks that did not answer,
    the dump folder and the exit code."""
    behind = ranks_behind(records)
    missing = [rank for rank in range(world_size) if rank not in records]
    parts = []
    for ranks in _by_position(behind, records):
        first = records[ranks[0]]
        parts.append(
            f"{rank_list(ranks)} did not arrive (step {first['step']}, {first['phase']}, in {first['where']}; no "
            f"progress for {first['stalled_seconds']:.0f} s)"
        )
    waiting = [rank for rank in sorted(records) if rank not in behind]
    for ranks in _by_position(waiting, records):
        first = records[ranks[0]]
        how = "wait" if len(ranks) > 1 else "waits"
        inside = "in a collective" if first["in_collective"] else f"in {first['where']}"
        parts.append(f"{rank_list(ranks)} {how} {inside} at step {first['step']} ({first['phase']})")
    if missing:
        parts.append(f"{rank_list(missing)} did not answer (the process is gone or frozen)")
    if not behind and not missing:
        parts.insert(0, "no rank is behind another")
    return (
        f"error: training hung: {'; '.join(parts)}. Where each rank is: {folder}/rank<N>.txt (its Python stacks; "
        f"rank<N>.flight_recorder.json: its collectives); exiting with code {exit_code}, torchrun's --max-restarts "
        "resume from the last checkpoint"
    )


def rank_list(ranks: Iterable[int]) -> str:
    """`rank 3`, `ranks 0-3, 6`."""
    ranks = sorted(ranks)
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _by_position(ranks: list[int], records: dict[int, dict[str, Any]]) -> list[list[int]]:
    """`ranks` grouped by (step, phase, waiting in a collective), in rank order of each group's first rank."""
    groups: dict[tuple, list[int]] = {}
    for rank in ranks:
        record = records[rank]
        groups.setdefault((record["step"], record["phase"], record["in_collective"]), []).append(rank)
    return sorted(groups.values())
