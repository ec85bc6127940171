"""The hang line: which ranks the others wait for, told by the flight recorder, the stacks or the heartbeats."""

from torchtitan.components.fault_tolerance.hang_report import hang_line, rank_list, ranks_behind


def record(step=3, phase="compute", in_collective=True, collectives=None, where="x.py:1 in f"):
    return {
        "step": step,
        "phase": phase,
        "stalled_seconds": 5.2,
        "where": where,
        "in_collective": in_collective,
        "collectives": collectives or {},
    }


def test_the_flight_recorder_names_the_rank_that_enqueued_fewer_collectives_on_a_group():
    # rank 2 is inside a collective too (an earlier one): only the counts tell it is behind
    records = {rank: record(collectives={"fr:0": 44, "fr:11": 2}) for rank in range(4)}
    records[2] = record(collectives={"fr:0": 43, "fr:11": 2})
    assert ranks_behind(records) == [2]


def test_without_a_flight_recorder_the_ranks_outside_torch_distributed_did_not_arrive():
    records = {0: record(), 1: record(phase="data", in_collective=False), 2: record()}
    assert ranks_behind(records) == [1]


def test_when_every_rank_waits_the_heartbeats_name_the_ranks_at_an_earlier_step_or_phase():
    records = {0: record(step=4, phase="data"), 1: record(step=3, phase="checkpoint"), 2: record(step=4, phase="data")}
    assert ranks_behind(records) == [1]
    assert ranks_behind({0: record(), 1: record()}) == []


def test_the_line_names_the_ranks_behind_where_they_are_the_others_and_the_silent_ones():
    records = {rank: record(collectives={"fr:0": 10}) for rank in (0, 2, 3, 5)}
    records[3] = record(phase="data", in_collective=False, collectives={"fr:0": 9}, where="loader.py:7 in next")
    line = hang_line(records, world_size=6, folder="out/hangs/t", exit_code=124)
    assert line.startswith(
        "error: training hung: rank 3 did not arrive (step 3, data, in loader.py:7 in next; no progress for 5 s); "
        "ranks 0, 2, 5 wait in a collective at step 3 (compute); ranks 1, 4 did not answer (the process is gone or "
        "frozen). Where each rank is: out/hangs/t/rank<N>.txt"
    ), line
    assert "exiting with code 124" in line


def test_a_hang_with_no_rank_behind_says_so():
    line = hang_line({0: record(), 1: record()}, world_size=2, folder="f", exit_code=124)
    assert line.startswith("error: training hung: no rank is behind another; ranks 0-1 wait in a collective at step 3")


def test_rank_lists_are_compact():
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 1, 2, 3, 6, 8, 9]) == "ranks 0-3, 6, 8-9"
