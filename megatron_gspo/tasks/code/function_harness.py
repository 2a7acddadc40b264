"""Runs inside the sandbox: call a program's function on each test's arguments and report the values.

Usage (the scorer's command line, in the sandbox):

    python function_harness.py PROGRAM FN_NAME PER_TEST_CPU_S STOP_ON_ERROR PRELUDE < arguments.json

Standard input holds a JSON list of argument lists. The program is executed once (module name
"solution", so a `__main__` guard does not run); its function is `FN_NAME` at top level, else
the method of a `Solution` instance (LeetCode style). For each test one JSON line goes to the
standard output the harness started with: {"value": returned value} (JSON round trip: tuples
become lists, sets sorted lists), {"error": "..."} or {"timeout": true} (the test's CPU time
passed PER_TEST_CPU_S), each with "time_s", the call's wall-clock seconds. The program's own
prints go to /dev/null; its standard input is empty.
With STOP_ON_ERROR=1 the harness stops at the first error or timeout (all-or-nothing rewards).
With PRELUDE=1 the program runs in a namespace that already holds the standard imports
(`PRELUDE`: `typing`'s names such as `List`, `collections`, `heapq`, `math`, ...), as
LiveCodeBench's harness gives LeetCode-style code; its own line numbers are unchanged.
A program that cannot be compiled or executed exits 1 with its error on stderr.

Only the standard library is imported: this file runs under the sandbox's interpreter, outside
the package.
"""

import io
import json
import os
import signal
import sys
import time

PRELUDE = """\
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import *
import array, bisect, collections, copy, functools, heapq, itertools, math, operator, random
import re, string, sys, typing
from builtins import *  # noqa: math's pow (no modulus) must not shadow the builtin
"""


class _TestTimeout(BaseException):
    """A test ran past its CPU time (BaseException: a program's `except Exception` cannot swallow it)."""


def _on_timer(signum, frame):
    raise _TestTimeout


def _jsonable(value):
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    raise TypeError(f"a {type(value).__name__} is not a JSON value")


def main(argv):
    """Run the tests named on the command line and standard input; the exit status of the harness."""
    program_path, fn_name, per_test_s, stop_on_error = argv[1], argv[2], float(argv[3]), argv[4] == "1"
    prelude = len(argv) > 5 and argv[5] == "1"
    tests = json.loads(sys.stdin.read())
    results = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    sys.stdin, sys.stdout = io.StringIO(""), open(os.devnull, "w")
    with open(program_path, encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "solution"}
    if prelude:  # compiled apart from the program, so its tracebacks keep their own line numbers
        exec(compile(PRELUDE, "prelude.py", "exec"), namespace)
    exec(compile(source, "main.py", "exec"), namespace)
    target = namespace.get(fn_name)
    if target is None and isinstance(namespace.get("Solution"), type):
        target = getattr(namespace["Solution"](), fn_name, None)
    if not callable(target):
        print(f"the program defines no function {fn_name!r}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGPROF, _on_timer)
    for args in tests:
        start = time.perf_counter()
        try:
            signal.setitimer(signal.ITIMER_PROF, per_test_s)
            try:
                value = target(*args)
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
            line = json.dumps({"value": value, "time_s": time.perf_counter() - start}, default=_jsonable)
        except _TestTimeout:
            line = json.dumps({"timeout": True, "time_s": time.perf_counter() - start})
        except (Exception, SystemExit) as err:  # the program's failure is a test result, not the harness's
            message = f"{type(err).__name__}: {err}"[:500]
            line = json.dumps({"error": message, "time_s": time.perf_counter() - start})
        results.write(line + "\n")
        results.flush()
        if stop_on_error and not line.startswith('{"value"'):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
