"""fast_exit: a process ends with its status once its threads are joined and its exit handlers have run, without
the interpreter's teardown."""

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys, threading, time
from snnfw import fast_exit

class TornDown:
    def __del__(self):
        print("torn down")

def main():
    global kept
    kept = TornDown()  # a module global: deleted only by the interpreter's teardown
    atexit.register(print, "exit handler")  # registered after fast_exit's, so it runs before the end
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
    print("main")  # to a pipe, so buffered until the end flushes it
    {body}

fast_exit.run(main)
"""


def run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("body, status", [("return 3", 3), ("return 0", 0), ("sys.exit(2)", 2)])
def test_the_status_after_threads_and_handlers_without_teardown(body, status):
    done = run(body)
    assert done.returncode == status, done.stderr
    assert done.stdout.split() == ["main", "thread", "joined", "exit", "handler"], done.stdout


def test_an_exception_ends_as_usual_with_its_traceback_and_teardown():
    done = run("raise ValueError('bad')")
    assert done.returncode == 1
    assert "ValueError: bad" in done.stderr and "torn down" in done.stdout, (done.stdout, done.stderr)
