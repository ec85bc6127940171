"""What the command lines share: the scripts' argument parser, and an exit that a closed stdout keeps quiet."""

import argparse
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are one `error:` line (not the usage block first); --help still prints the usage."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)


def run_cli(main: Callable[[], int]) -> NoReturn:
    """`sys.exit(main())` for a `python -m` command whose output may go to a reader that stops early (`| head`): once
    the reader has closed the pipe, the command ends quietly, as a tool stopped by SIGPIPE does (exit code 141), not
    in a BrokenPipeError traceback."""
    try:
        try:
            code = main()
        finally:  # also after --help's SystemExit: what is still buffered would fail in Python's flush at exit
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # where that flush at exit cannot fail
        sys.exit(128 + signal.SIGPIPE)
    sys.exit(code)
