"""The warm Python the tests fork their CLIs and servers from (tests/warm_python.py) behaves, to the
test, as the process it stands for: output, exit status, signals, death, and a fresh interpreter
whenever a fork could not be exact. A forked child has a pid other than the client's; a fresh
interpreter is the client itself, `exec`ed."""

import os
import signal
import subprocess
import textwrap
import time

import pytest
from warm_python import SOCKET_VAR, python

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    print(os.getpid(), os.getcwd(), os.environ.get("WARM_TEST"), sys.argv[1:], flush=True)
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
    if sys.argv[1] == "message":
        sys.exit("a message")
    if sys.argv[1] == "raise":
        raise ValueError("boom")
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "term":  # says it got SIGTERM, then exits 7
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), os._exit(7)))
        print("waiting", flush=True)
        time.sleep(60)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    """
)


@pytest.fixture
def program(tmp_path):
    socket_path = os.environ.get(SOCKET_VAR)
    if not socket_path:
        pytest.skip("no warm Python in this run (MEGATRON_GSPO_FRESH_PYTHON=1, or a GPU machine)")
    deadline = time.monotonic() + 120
    while not os.path.exists(socket_path):  # it imports for ~7 s after pytest starts
        assert time.monotonic() < deadline, "the warm Python never listened"
        time.sleep(0.1)
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return path


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run(program, *args):
    env = {**os.environ, "WARM_TEST": "yes"}
    return subprocess.run([*python(), str(program), *args], capture_output=True, text=True, env=env)


def test_a_forked_child_gets_the_arguments_environment_directory_and_streams(program, tmp_path):
    env = {**os.environ, "WARM_TEST": "yes"}
    client = subprocess.Popen(
        [*python(), str(program), "exit", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    out, err = client.communicate(timeout=120)
    pid, cwd, marker, args = out.split(" ", 3)
    assert client.returncode == 0 and int(pid) != client.pid  # forked from the warm Python
    assert (cwd, marker, args.strip()) == (str(tmp_path), "yes", "['exit', '0']")
    assert err == "to stderr\n"


@pytest.mark.parametrize(
    "args, code, stderr_end",
    [
        (["exit", "3"], 3, "to stderr\n"),
        (["message"], 1, "a message\n"),
        (["raise"], 1, "ValueError: boom\n"),
        (["signal"], -signal.SIGKILL, "to stderr\n"),
    ],
    ids=["code", "message", "exception", "signal"],
)
def test_the_client_exits_as_its_child_did(program, args, code, stderr_end):
    done = run(program, *args)
    assert done.returncode == code and done.stderr.endswith(stderr_end), done.stderr


def test_a_signal_to_the_client_reaches_the_child(program):
    client = subprocess.Popen([*python(), str(program), "term"], stdout=subprocess.PIPE, text=True)
    child = int(client.stdout.readline().split()[0])
    assert client.stdout.readline() == "waiting\n"
    assert child != client.pid  # forked: the signal has a hop to make
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=30) == 7 and client.stdout.read() == "got SIGTERM\n"


def test_a_killed_client_takes_its_child_with_it(program):
    client = subprocess.Popen([*python(), str(program), "sleep"], stdout=subprocess.PIPE, text=True)
    child = int(client.stdout.readline().split()[0])
    client.kill()
    client.wait()
    deadline = time.monotonic() + 30
    while _running(child):
        assert time.monotonic() < deadline, "the child outlived its client"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "command, env",
    [
        (["-c", "import os; print(os.getpid())"], {}),  # interpreter options
        (["{program}", "exit", "0"], {"PYTHONPATH": "/nonexistent"}),  # a start-up variable differs
        (["{program}", "exit", "0"], {"OMP_NUM_THREADS": "2"}),
    ],
    ids=["option", "PYTHONPATH", "OMP_NUM_THREADS"],
)
def test_what_a_fork_cannot_reproduce_runs_in_a_fresh_interpreter(program, command, env):
    command = [part.format(program=program) for part in command]
    client = subprocess.Popen(
        [*python(), *command], stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    out, _ = client.communicate(timeout=120)
    assert client.returncode == 0 and int(out.split()[0]) == client.pid  # the client itself, exec'ed
