"""The scripts' argument parser."""

import argparse
import sys
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are one `error:` line (not the usage block first); --help still prints the usage."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)
