"""How snnfw's commands and ranks end: as after ``sys.exit``, without the interpreter's teardown.

With torch imported, tearing down every module and object takes 0.3 to 0.8 s once a process's work is done
(measured on 2 CPU cores), and a launcher waits for its slowest rank's. Threads are still joined and exit
handlers still run, as after ``sys.exit``; then the process ends at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Callable, NoReturn


def _status(code) -> int:
    """The exit status ``sys.exit(code)`` gives."""
    return code if isinstance(code, int) else int(code is not None)


def run(main: Callable[[], int]) -> NoReturn:
    """Runs ``main`` and exits with its status.

    Call it before torch is imported: exit handlers run in the reverse order of their registration, so torch's
    then run before the one registered here ends the process. An exception ends the process as usual (its
    traceback, then the whole teardown).
    """
    ending: list[int] = []

    def end() -> None:
        if ending:
            logging.shutdown()  # logging's exit handler was registered before this one
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(ending[0])

    atexit.register(end)
    try:
        status = main()
    except SystemExit as stop:  # argparse's usage errors and --help
        ending.append(_status(stop.code))
        raise
    ending.append(_status(status))
    sys.exit(status)
