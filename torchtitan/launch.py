"""`python -m torchtitan.launch [torchrun flags] -m torchtitan.train ...`: torchrun that ends in one line.

The trainer prints a user error as one `error:` line and a bug as its traceback; this launcher drops torchrun's
traceback and failure table and adds a line naming the rank and exit code only where that error line is not on the
terminal (a bug, a signal, a rank whose output `--local-ranks-filter` hides: `report_error` hands the line over
through torchrun's error file), and turns Ctrl-C into one line and exit code 130. Where several ranks failed, it
names the cause: a rank killed by a signal before one whose error says it lost that rank. With
fault_tolerance.preemption, torchrun also passes SIGUSR1 (Slurm's warning signal) on to the workers and waits for them
to save (`_with_graceful_stop`), and a run stopped by SIGTERM or SIGUSR1 ends in one line and exit code 143 (the
trainer's `PREEMPTED_EXIT_CODE`). A multi-node rendezvous
endpoint is checked (a port that is a number, a host that resolves) before torchrun starts, and more processes than
CPU cores on a machine without a GPU is a warning line. Before that, the job passes preflight (`_preflight`): a bad
config is one line before torchrun starts a process. torchrun's own log lines are off unless `LOGLEVEL` is set.
run_train.sh uses it in place of `python -m torch.distributed.run`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading

import torch
from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from torchtitan.components.fault_tolerance import PREEMPTED_EXIT_CODE
from torchtitan.components.fault_tolerance.preemption import STOP_SIGNALS
from torchtitan.tools.error_file import leave_error_line
from torchtitan.tools.lost_peer import lost_peer

INTERRUPTED_EXIT_CODE = 130
SIGKILL = 9
SIGTERM = 15  # what torchrun stops the other ranks with once one failed
RESOLVE_TIMEOUT_S = 10.0  # a name server that does not answer takes 5 s per try; a known host resolves in ms


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _quiet_torchrun()
    if not _torchrun_flags_parse(argv):
        return 2
    if code := _preflight(argv):
        return code
    if problem := _rendezvous_problem(argv):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if warning := _more_processes_than_cores(argv):
        print(f"warning: {warning}", file=sys.stderr)
    argv = _with_graceful_stop(argv)
    try:
        run.main(argv)
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if PREEMPTED_EXIT_CODE in codes and codes <= {PREEMPTED_EXIT_CODE, -SIGTERM}:
            # the ranks agreed to stop on a signal (one rank got it) and saved; torchrun's own SIGTERM may reach a rank
            # that was already on its way out
            print(f"stopped by a signal: training stopped{_where_it_stopped(argv)}", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        rank, failure = _root_failure(err)
        code = failure.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        reported = os.path.isfile(failure.error_file) and isinstance(failure.message, str) and failure.message
        if not reported:  # a traceback (a bug) or a signal: say which rank
            hint = (
                "; SIGKILL is often the host running out of memory: lower --training.seq_len or "
                "--training.local_batch_size"
                if code == -SIGKILL
                else ""
            )
            above = " (its output is above)" if _output_shown(failure.local_rank, argv) else ""
            print(f"training failed: rank {rank} {how}{above}{hint}", file=sys.stderr)
        elif not _output_shown(failure.local_rank, argv):
            print(f"training failed: rank {rank} {how}: {failure.message}", file=sys.stderr)
        # else its one error line is on the terminal already: nothing to add
        return code if code > 0 else 1
    except (KeyboardInterrupt, SignalException) as err:
        where = _where_it_stopped(argv)
        if isinstance(err, SignalException) and err.sigval in STOP_SIGNALS:  # torchrun passed it on: they saved
            print(f"stopped by {err.sigval.name}: training stopped{where}", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        print(f"interrupted: training stopped{where}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    return 0


def _preflight(argv: list[str]) -> int:
    """The trainer's checks of its job (`preflight.py`), here before torchrun starts any process, with the world size
    from torchrun's flags: a bad config is one line in seconds, not one per rank after their imports. 2 if it failed.
    Left to the ranks (which check again in any case) where the world size is known only at the rendezvous: a range
    of nodes, or processes per node by device count ("auto", "gpu", "cpu")."""
    if "torchtitan.train" not in argv:
        return 0
    args = run.parse_args(argv)
    min_nodes, nnodes = run.parse_min_max_nnodes(args.nnodes)  # "2" or "1:1" (--standalone) is a node count
    if not args.nproc_per_node.isdigit() or min_nodes != nnodes:
        return 0
    from torchtitan.preflight import check_before_launch

    train_args = argv[argv.index("torchtitan.train") + 1 :]
    return check_before_launch(train_args, int(args.nproc_per_node) * nnodes, nnodes)


def _with_graceful_stop(argv: list[str]) -> list[str]:
    """With fault_tolerance.preemption: torchrun flags, unless the command or the environment sets them, that make it
    pass SIGUSR1 on to the workers as it does SIGTERM (`--signals-to-handle`), and then wait for them while they
    finish two steps and save (`--shutdown-timeout`, from the watchdog's limits; torchrun's own is 30 s, after which
    it kills them)."""
    job = _job_config(argv)
    if job is None or not job.fault_tolerance.preemption:
        return argv
    torchrun_flags = argv[: argv.index("torchtitan.train")] if "torchtitan.train" in argv else argv
    known = {option for action in run.get_args_parser()._actions for option in action.option_strings}
    ft, added = job.fault_tolerance, []
    if "--signals-to-handle" in known and not _given(torchrun_flags, "signals_to_handle"):
        added += ["--signals-to-handle", ",".join(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1"])]
    shutdown_set = _given(torchrun_flags, "shutdown_timeout", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if "--shutdown-timeout" in known and not shutdown_set:
        added += ["--shutdown-timeout", str(2 * ft.first_step_timeout_seconds + ft.save_timeout_seconds)]
    return added + argv


def _given(torchrun_flags: list[str], name: str, *variables: str) -> bool:
    """Whether torchrun's option `name` is set: as a flag (either spelling), or in its PET_ variable or `variables`."""
    flags = {f"--{name}", f"--{name.replace('_', '-')}"}
    in_flags = any(arg.split("=", 1)[0] in flags for arg in torchrun_flags)
    return in_flags or any(v in os.environ for v in (f"PET_{name.upper()}", *variables))


def _root_failure(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    """(rank, failure) to name, the earliest of the first kind there is: a rank killed by a signal other than SIGTERM
    (kill -9, the OOM killer, a crash), a rank that failed with an error of its own, a rank that only lost another
    (`lost_peer`), a rank torchrun stopped itself (SIGTERM, recorded once one rank failed). torchrun's own order is
    by time alone, in whole seconds."""

    def cause_first(rank: int) -> tuple[int, float, int]:
        failure = err.failures[rank]
        if failure.exitcode < 0:
            kind = 3 if failure.exitcode == -SIGTERM else 0
        else:
            kind = 2 if isinstance(failure.message, str) and lost_peer(failure.message) else 1
        return kind, failure.timestamp, rank

    rank = min(err.failures, key=cause_first)
    return rank, err.failures[rank]


def _torchrun_flags_parse(argv: list[str]) -> bool:
    """Parse the torchrun flags first: a bad one (from run_train.sh's TORCHRUN_ARGS) is one line, not torchrun's
    usage text."""

    def error(message: str) -> None:
        raise ValueError(message)

    parser = run.get_args_parser()
    parser.error = error
    try:
        parser.parse_args(argv)
    except ValueError as err:
        print(f"error: torchrun flags: {err}; check TORCHRUN_ARGS (torchrun --help lists the flags)", file=sys.stderr)
        return False
    return True


def _rendezvous_problem(argv: list[str]) -> str | None:
    """What is wrong with a multi-node rendezvous endpoint, before torchrun meets it: a port that is not a number (a
    39-line traceback there) or a host that does not resolve (minutes of retries, then a traceback)."""
    args = run.parse_args(argv)
    endpoint = args.rdzv_endpoint
    if args.standalone or not endpoint:
        return None
    where = f"the rendezvous endpoint {endpoint!r} (RDZV_ENDPOINT, torchrun's --rdzv-endpoint)"
    fix = "set it to host:port of the rendezvous host (the same on every node), e.g. node0:29400"
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    except ValueError as err:  # torch's text names the whole endpoint again
        part = (
            "its port is not a whole number from 0 to 65535" if "port" in str(err) else "its host is no hostname or IP"
        )
        return f"{where}: {part}; {fix}"
    if problem := _resolve_problem(host, port, RESOLVE_TIMEOUT_S):
        return f"{where}: {problem}; {fix}"
    return None


def _resolve_problem(host: str, port: int, timeout_s: float) -> str | None:
    """Why `host` does not resolve within `timeout_s` (getaddrinfo has no timeout of its own), or None."""
    outcome: list[OSError | None] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            outcome.append(None)
        except OSError as err:
            outcome.append(err)

    resolver = threading.Thread(target=resolve, daemon=True)  # left behind, it ends with the process
    resolver.start()
    resolver.join(timeout_s)
    if not outcome:
        return f"its host {host!r} did not resolve within {timeout_s:g} s (no answer from the name server)"
    if outcome[0] is not None:
        return f"its host {host!r} does not resolve ({outcome[0].strerror or outcome[0]})"
    return None


def _more_processes_than_cores(argv: list[str]) -> str | None:
    """Where no GPU takes the work and this node's processes outnumber its CPU cores, what that costs and the fix (a
    run that says nothing just crawls)."""
    nproc = run.parse_args(argv).nproc_per_node  # a number, or torchrun's "auto", "cpu", "gpu"
    cores = _usable_cores()
    if torch.cuda.is_available() or not nproc.isdigit() or int(nproc) <= cores:
        return None
    return (
        f"{nproc} processes per node (NGPU, torchrun's --nproc-per-node) on {cores} CPU cores and no GPU: they take "
        f"turns on the cores and wait for each other in every collective; set NGPU to {cores} or fewer for speed"
    )


def _usable_cores() -> int:
    """The CPU cores this process may run on (all of them where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _quiet_torchrun() -> None:
    """torchrun's loggers (and those its workers make) at CRITICAL, unless the user set LOGLEVEL."""
    if "LOGLEVEL" in os.environ:
        return
    os.environ["LOGLEVEL"] = "CRITICAL"  # read when torch.distributed.elastic makes a logger
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def report_error(line: str) -> None:
    """In a worker: print its one error line, and leave it where torchrun looks for a failed worker's error
    ($TORCHELASTIC_ERROR_FILE), for the launcher to show when this rank's output is filtered out."""
    print(line, file=sys.stderr, flush=True)
    leave_error_line(line)


def _output_shown(local_rank: int, argv: list[str]) -> bool:
    """Whether torchrun shows this local rank's output (`--local-ranks-filter`, e.g. run_train.sh's LOG_RANK)."""
    shown = run.parse_args(argv).local_ranks_filter  # "" shows every rank
    return not shown or str(local_rank) in shown.split(",")


def _where_it_stopped(argv: list[str]) -> str:
    """' after step N; ...' from the run's metrics.jsonl and checkpoint folder (empty if they cannot be read)."""
    try:
        from torchtitan.components.checkpoint_folder import complete_checkpoints

        job = _job_config(argv)
        with open(os.path.join(job.job.dump_folder, "metrics.jsonl")) as f:
            last_step = json.loads(f.readlines()[-1])["step"]
        folder = os.path.join(job.job.dump_folder, job.checkpoint.folder)
        checkpoints = complete_checkpoints(folder) if job.checkpoint.enable and os.path.isdir(folder) else {}
    except Exception:  # a summary line must never turn an interrupt into a traceback
        return ""
    if not checkpoints and not job.checkpoint.enable:
        return f" after step {last_step}; no checkpoint was saved (enable --checkpoint.enable to be able to resume)"
    if not checkpoints:
        return (
            f" after step {last_step}, before its first checkpoint (every {job.checkpoint.interval} steps): rerunning "
            "the same command starts over"
        )
    return (
        f" after step {last_step}; the latest complete checkpoint is {checkpoints[max(checkpoints)]}: run the same "
        "command again to resume from it"
    )


def _job_config(argv: list[str]):
    """The trainer's JobConfig from the command after `-m torchtitan.train`, or None (preflight said why already)."""
    from torchtitan.config import ConfigManager

    try:
        return ConfigManager().parse_args(argv[argv.index("torchtitan.train") + 1 :])
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
