"""Run `python ARGS...` as a user would, in a process forked from multiprocessing's fork server.

The server has imported torch and titanlite once per test process (tests/conftest.py names
what it preloads), so a script's run no longer starts with 2 to 3 s of CPU spent importing
them; on 2 cores, the suite's hundred-odd script runs spent about a quarter of its time
there. The child is a new process all the same: its own pid, working folder, environment,
sys.argv and sys.path[0], its stdout and stderr in files, and an exit status made the way
the interpreter makes one (SystemExit's code, 1 and a traceback for an uncaught error), after
the interpreter's own exit steps (threads joined, atexit handlers run, streams flushed).

What a fork cannot reproduce stays with a real `subprocess` run: a test that a module is
not imported (the server imported it), interpreter options (-X, -W, -B), torchrun and bash
launches, and the environment variables read only while torch imports (OMP_NUM_THREADS is
re-applied below, as torchrun's workers see it).
"""

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from titanlite.parallel import exit_process


def _exit_status(error: BaseException) -> int:
    """The status Python's own exit gives for an error that ends the main module."""
    if isinstance(error, SystemExit):
        if error.code is None:
            return 0
        if isinstance(error.code, int):
            return error.code
        print(error.code, file=sys.stderr)
        return 1
    # Without this module's frame, which a plain interpreter's traceback does not have.
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    return 1


def _redirect_output(stdout_path: str, stderr_path: str | None) -> None:
    """Point fds 1 and 2 at the files (stderr into stdout's file when it has none of its own),
    buffered as the interpreter buffers them: stderr by line, stdout by line too under
    PYTHONUNBUFFERED, else by block."""
    stdout = os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    stderr = stdout if stderr_path is None else os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {stdout, stderr}:
        os.close(fd)
    stdout_buffering = 1 if os.environ.get("PYTHONUNBUFFERED") else -1
    sys.stdout = open(1, "w", buffering=stdout_buffering, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _fork_spawned_ranks() -> None:
    """Have the script's torch.multiprocessing starts with `spawn` fork from a fork server of
    its own instead, which imports titanlite once for all its ranks rather than once per rank.
    A rank forked from there is as fresh as a spawned one: the server imported its modules in a
    process of its own, so nothing the script changed reaches the rank; it unpickles its
    arguments and imports the script as __mp_main__, as a spawned rank does. It ends without the
    interpreter's teardown, as every forked process does."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["titanlite.train", "tests.gc_frozen"])
    start_processes = mp.start_processes

    def forked(*args, start_method: str = "spawn", **kwargs):
        method = "forkserver" if start_method == "spawn" else start_method
        return start_processes(*args, start_method=method, **kwargs)

    mp.start_processes = forked


def _run_as_main(
    args: list[str], cwd: str, environ: dict[str, str], stdout: str, stderr: str | None, fork_ranks: bool
) -> None:
    os.setsid()  # its own process group, as start_new_session gives: a test may signal the group
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    _redirect_output(stdout, stderr)
    if "OMP_NUM_THREADS" in environ:  # read at torch's import, which the server did
        import torch

        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    if fork_ranks:
        _fork_spawned_ranks()
    status = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.modules.pop(args[1], None)  # the server imported it; `python -m` runs it fresh
            sys.path[0] = cwd
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = str(Path(args[0]).resolve())
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = str(Path(script).parent)
            runpy.run_path(script, run_name="__main__")
    except BaseException as error:  # noqa: BLE001 (the interpreter's own handling, below)
        status = _exit_status(error)
    exit_process(status)


def start_python(
    args: list,
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    stdout: Path,
    stderr: Path | None,
    fork_ranks: bool = False,
) -> multiprocessing.Process:
    """Start `python *args` (a script path, `-m module` or `-c code`, then its arguments) in
    a forked child writing to the files `stdout` and `stderr` (None: into stdout's file), as
    Popen(start_new_session=True) would: the child leads a process group of its own.
    fork_ranks: the ranks the script spawns with torch.multiprocessing fork from a fork server
    instead (_fork_spawned_ranks), for a script whose ranks' start is not what is tested.
    The result is a multiprocessing.Process: .pid, .exitcode (None while it runs, -N after
    signal N) and .join(timeout)."""
    for path in (stdout, stderr):  # there to read even if the child dies before writing
        if path is not None:
            Path(path).write_bytes(b"")
    environ = dict(os.environ if env is None else env)
    outputs = (str(stdout), stderr and str(stderr))
    child_args = (list(map(str, args)), str(cwd or os.getcwd()), environ, *outputs, fork_ranks)
    process = multiprocessing.get_context("forkserver").Process(target=_run_as_main, args=child_args)
    process.start()
    return process


def run_python(
    args: list[str],
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    fork_ranks: bool = False,
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)` with
    the run forked from the fork server: the same result object (returncode, stdout, stderr),
    and subprocess.TimeoutExpired after killing the child's process group at `timeout`."""
    with tempfile.TemporaryDirectory(prefix="titanlite-script-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = start_python(args, cwd=cwd, env=env, stdout=out, stderr=err, fork_ranks=fork_ranks)
        process.join(timeout)
        if process.exitcode is None:
            kill_group(process)
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    return subprocess.CompletedProcess([sys.executable, *args], process.exitcode, stdout, stderr)


def kill_group(process: multiprocessing.Process) -> None:
    """SIGKILL the child and everything it started (its own ranks, a checkpoint writer)."""
    try:
        os.killpg(process.pid, 9)
    except ProcessLookupError:
        pass
    process.join()
