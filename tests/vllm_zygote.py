"""Test processes that start a vLLM engine, forked from an interpreter that has imported vLLM.

Importing vLLM costs about 10 s of CPU on the 2-core CI machine, more than starting an engine
of the tiny test models; the suite runs dozens of such processes (engine runners, drills and
their reference engines). `popen` and `run` take the arguments `subprocess.Popen` / `run`
would for `python SCRIPT ARGS...` or `python -c CODE ARGS...` and start the same program in a
child forked from a "zygote": a process of this file that imported torch and vLLM once and
then forks one child per request. The child is a new process as the kernel sees it (its own
pid, session when asked, environment, working directory and standard streams, passed as
descriptors), runs the script as `__main__`, its threads and atexit handlers at exit as the
interpreter would, and vLLM's own worker processes spawn as they do from any script.

Only what the interpreter decides at start-up is shared, so a zygote serves only requests
whose environment matches the one it started with, except for variables vLLM and kvoffload
read when an engine is built (`LAZY`); another environment gets its own zygote, and anything
else (no fixed PYTHONHASHSEED, another interpreter, interpreter flags, a machine with NVIDIA
devices, KVO_TEST_ZYGOTE=0) a plain `subprocess.Popen`. The zygote is single-threaded when
it forks (it only imports and waits), reaps its children, reports each exit status over the
requester's connection, and exits when the process that started it does. Its children find it
through KVO_VLLM_ZYGOTE, so a drill's reference engine forks from the drill's zygote too.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

# read when an engine is built, not at import (vllm.envs is evaluated lazily until an engine
# core caches it; the connector reads its test hooks when it is constructed)
LAZY = frozenset(
    {
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_PORT",
        "KVOFFLOAD_TEST_FAULT",
    }
)
ZYGOTE_ENV = "KVO_VLLM_ZYGOTE"  # a zygote's socket, in its children's environment
MAX_ZYGOTES = 3  # per test process; each holds an imported vLLM (~0.5 GB)
START_TIMEOUT_S = 180.0

_zygotes: dict[tuple, _Zygote] = {}
_lock = threading.Lock()


def _key(env: dict[str, str]) -> tuple:
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k not in LAZY and k != ZYGOTE_ENV and not k.startswith("PYTEST_")
        )
    )


def _program(args: list[str], env: dict[str, str]) -> list[str] | None:
    """`args` without the interpreter when a zygote can run it, else None. Only with a fixed
    PYTHONHASHSEED: forked children share their zygote's hash seed, where processes started
    without one each draw their own (vLLM's block hashes of a process depend on it)."""
    if os.environ.get("KVO_TEST_ZYGOTE", "1") == "0" or os.path.exists("/dev/nvidiactl"):
        return None
    if not env.get("PYTHONHASHSEED", "").isdigit():
        return None
    if len(args) < 2 or os.path.realpath(str(args[0])) != os.path.realpath(sys.executable):
        return None
    rest = [str(a) for a in args[1:]]
    if rest[0] == "-c":
        return rest if len(rest) >= 2 else None
    if rest[0].startswith("-") or not rest[0].endswith(".py"):
        return None
    return rest


class _Zygote:
    def __init__(self, env: dict[str, str] | None, socket_path: str = "") -> None:
        if env is None:  # the zygote that forked this process, for its nested requests
            self.socket, self.proc, self.dir = socket_path, None, ""
            return
        self.dir = tempfile.mkdtemp(prefix="kvo-zygote-")
        self.socket = os.path.join(self.dir, "z.sock")
        self.log = open(os.path.join(self.dir, "zygote.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.socket],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._ready = False

    def connect(self) -> socket.socket:
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.socket)
                self._ready = True
                return s
            except OSError:
                s.close()
                gone = self.proc is None or self.proc.poll() is not None
                if gone or time.monotonic() > end:
                    raise RuntimeError(f"the vLLM zygote did not start:\n{self.tail()}") from None
                time.sleep(0.05)

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            if not self.dir:
                return ""
            return Path(self.dir, "zygote.log").read_text(errors="replace")[-4000:]
        return ""

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.socket)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.dir, "zygote.log"))
            os.rmdir(self.dir)


@atexit.register
def _close_all() -> None:
    for z in list(_zygotes.values()):
        z.close()
    _zygotes.clear()


def _zygote_for(env: dict[str, str]) -> _Zygote | None:
    """The zygote for this environment: this process's own, else a new one (at most
    MAX_ZYGOTES). A process forked by a zygote asks that one first (it refuses another
    environment)."""
    key = _key(env)
    with _lock:
        z = _zygotes.get(key)
        if z is not None and z.proc.poll() is not None:
            z.close()
            del _zygotes[key]
            z = None
        if z is None:
            if len(_zygotes) >= MAX_ZYGOTES:
                return None
            z = _zygotes[key] = _Zygote(env)
        return z


class _Refused(Exception):
    """The zygote serves another environment."""


class Forked:
    """The subset of `subprocess.Popen` the tests use, for a child of a zygote."""

    def __init__(
        self,
        zygote: _Zygote,
        program: list[str],
        env: dict[str, str],
        cwd: str,
        fds: tuple[int, int, int],
        new_session: bool,
    ) -> None:
        self.args = [sys.executable, *program]
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self._buf = b""
        self._conn = zygote.connect()
        request = {"program": program, "env": env, "cwd": cwd, "new_session": new_session}
        socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], list(fds))
        reply = self._read_line(START_TIMEOUT_S)
        if reply is not None and "refused" in reply:
            self._conn.close()
            raise _Refused(reply["refused"])
        if reply is None or "pid" not in reply:
            raise RuntimeError(f"the vLLM zygote refused {program[:2]}: {reply}\n{zygote.tail()}")
        self.pid = int(reply["pid"])

    def _read_line(self, timeout: float | None) -> dict | None:
        buf = self._buf
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            r, _, _ = select.select([self._conn], [], [], left)
            if not r:
                self._buf = buf
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                self._buf = buf
                return {"returncode": -signal.SIGKILL, "lost": True}
            buf += chunk
        line, _, self._buf = buf.partition(b"\n")
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            msg = self._read_line(0)
            if msg is not None:
                self._done(msg)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            msg = self._read_line(timeout)
            if msg is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._done(msg)
        assert self.returncode is not None
        return self.returncode

    def _done(self, msg: dict) -> None:
        self.returncode = int(msg["returncode"])
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Only stdout/stderr to files or STDOUT are supported here (`run` captures to files)."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        self.wait(timeout)
        return None, None

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stdin is not None:
            self.stdin.close()
        self.wait()


def _fd(spec: Any, default: int) -> tuple[int, bool]:
    """A descriptor for a stream spec (None: ours; DEVNULL; a file object; an fd), and whether
    it was opened here."""
    if spec is None:
        return default, False
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(spec, int):
        return spec, False
    return spec.fileno(), False


def popen(
    args: list[Any],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    start_new_session: bool = False,
    text: bool = False,
) -> subprocess.Popen | Forked:
    """`subprocess.Popen(args, ...)`, from a zygote where it can (see the module doc). Streams:
    None, DEVNULL, a file object or descriptor, stdin PIPE (text or bytes), stderr STDOUT."""
    env = dict(os.environ if env is None else env)
    program = _program(list(args), env)
    if program is None or stdout == subprocess.PIPE or stderr == subprocess.PIPE:
        return subprocess.Popen(
            args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
            start_new_session=start_new_session, text=text,
        )  # fmt: skip
    opened: list[int] = []
    pipe_w = -1
    if stdin == subprocess.PIPE:
        in_fd, pipe_w = os.pipe()
        opened.append(in_fd)
    else:
        in_fd, mine = _fd(stdin, 0)
        opened += [in_fd] if mine else []
    out_fd, mine = _fd(stdout, 1)
    opened += [out_fd] if mine else []
    if stderr == subprocess.STDOUT:
        err_fd = out_fd
    else:
        err_fd, mine = _fd(stderr, 2)
        opened += [err_fd] if mine else []
    child: Forked | subprocess.Popen | None = None
    try:
        inherited = os.environ.get(ZYGOTE_ENV)
        for zygote in (_Zygote(None, inherited) if inherited else None, "local"):
            if zygote == "local":
                zygote = _zygote_for(env)
            if zygote is None:
                continue
            try:
                child = Forked(
                    zygote, program, env, str(cwd or os.getcwd()), (in_fd, out_fd, err_fd),
                    start_new_session,
                )  # fmt: skip
                break
            except _Refused:
                continue
        if child is None:
            streams = [in_fd, out_fd, subprocess.STDOUT if stderr == subprocess.STDOUT else err_fd]
            child = subprocess.Popen(
                args, env=env, cwd=cwd, stdin=streams[0], stdout=streams[1], stderr=streams[2],
                start_new_session=start_new_session, text=text,
            )  # fmt: skip
    finally:
        for fd in opened:
            os.close(fd)
    if pipe_w >= 0:
        child.stdin = os.fdopen(pipe_w, "w" if text else "wb")
    return child


def run(
    args: list[Any],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    capture_output: bool = False,
    text: bool = False,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """`subprocess.run(args, ...)` from a zygote where it can; output captured through files.
    On a timeout the child's session (it has its own) is killed, then TimeoutExpired."""
    if _program(list(args), dict(os.environ if env is None else env)) is None:
        return subprocess.run(
            args, env=env, cwd=cwd, timeout=timeout, capture_output=capture_output, text=text,
            check=check,
        )  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(
            args, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=out if capture_output else None, stderr=err if capture_output else None,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        outs = []
        for f in (out, err):
            f.seek(0)
            data = f.read() if capture_output else None
            outs.append(data.decode(errors="replace") if text and data is not None else data)
    done = subprocess.CompletedProcess(list(args), rc, outs[0], outs[1])
    if check:
        done.check_returncode()
    return done


# -- the zygote process -----------------------------------------------------------------------


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process, run its program, exit as Python
    would. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        program = request["program"]
        code = 0
        try:
            _run_program(program)
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would
            import traceback

            traceback.print_exc()
            code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads first
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    finally:
        os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _run_program(program: list[str]) -> None:
    import runpy
    import types

    if program[0] == "-c":
        sys.argv = ["-c", *program[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(program[1], "<string>", "exec"), main.__dict__)  # noqa: S102
        return
    script = os.path.abspath(program[0])
    sys.argv = [program[0], *program[1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def _serve(path: str) -> None:
    before = dict(os.environ)
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    # what the imports set in the environment (vLLM sets torch's and its own defaults), for
    # each child as its own imports would have
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    own = _key({**before, **set_by_imports})
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # a client connects only once the imports are done
    srv.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([srv, wake_r], [], [], 1.0)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        _reap(children)
        if srv not in ready:
            continue
        conn, _ = srv.accept()
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(msg)
        except (OSError, ValueError):
            conn.close()
            continue
        if _key({**request["env"], **set_by_imports}) != own:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(b'{"refused": "another environment"}\n')
            conn.close()
            continue
        request["env"].update(set_by_imports, **{ZYGOTE_ENV: path})
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for s in (srv, conn, *children.values()):
                s.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            _child(request, fds)
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"returncode": rc}).encode() + b"\n")
        conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
