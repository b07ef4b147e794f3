"""Process starts for the suite from an interpreter that has already imported TensorFlow and Keras.

Every Python the suite starts used to import TensorFlow and Keras before its first line of work, and the suite
starts several hundred: those imports were a large share of its CPU (tests/site/sitecustomize.py's process log
says how much; docs/benchmarks.md has the figures). So each pytest worker keeps a *zygote*: a Python that has
imported both (TensorFlow imported, not started: no context, no server, none of its threads) and waits on a Unix
socket. A process the suite starts asks it first thing, from sitecustomize, before it has imported anything; the
zygote forks, and the fork takes the asker's argv, environment, working directory and standard streams, leads its
own process group and runs the program. The asker stays as the program's stand-in: it forwards every signal it
receives to the fork, the fork kills itself (and its group) if the stand-in dies, and the stand-in exits with the
fork's status. To its parent (a launcher, mpirun, a test) it is the program.

A process starts fresh, as before, unless everything that matters before a program's first line is the
zygote's: the interpreter, the environment variables Python, TensorFlow and Keras read while starting (PYTHONPATH
aside: the fork takes the asker's module path), the namespaces other than the network's (the fork enters the
asker's), cgroup, scheduling priority, resource limits and user, and no open file beyond the three standard
streams; the fork takes the asker's CPU affinity. It also starts fresh when it runs anything other than a
script file, `-c` code, `tfdist train` or a `-m benchmarks.`/`-m tests.` module, or when
TFDIST_TEST_FRESH_PROCESS=1: for tests that check what a fresh process imports, or that read a worker's own
state by its PID (CPU time, a SIGSTOP). TFDIST_TEST_ZYGOTE_LOG=FILE says why each fresh one was.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "TFDIST_TEST_ZYGOTE"
FRESH_ENV = "TFDIST_TEST_FRESH_PROCESS"

# Read while a Python starts, or while TensorFlow and Keras are imported: a process with other values starts fresh.
_START_ENV = ("PYTHONHOME", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONWARNINGS", "PYTHONOPTIMIZE",
              "PYTHONDEVMODE", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONMALLOC",
              "PYTHONDONTWRITEBYTECODE", "LD_PRELOAD", "LD_LIBRARY_PATH", "HOME", "KERAS_HOME", "KERAS_BACKEND",
              "TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE",
              "TF_USE_LEGACY_KERAS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "TFDIST_TEST_PROC_LOG")
_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_RSS", "RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_STACK", "RLIMIT_MEMLOCK",
           "RLIMIT_NPROC", "RLIMIT_CORE")


def _context() -> dict:
    """What a process inherits that a fork of the zygote would not: it must be the zygote's own."""
    import resource

    namespaces = {}
    for name in ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup"):
        try:
            namespaces[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            pass
    with open("/proc/self/cgroup") as f:
        cgroup = f.read()
    return {"executable": sys.executable, "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid()],
            "namespaces": namespaces, "cgroup": cgroup,
            "priority": os.getpriority(os.PRIO_PROCESS, 0),
            "limits": [list(resource.getrlimit(getattr(resource, r))) for r in _LIMITS],
            "env": {k: _library_path(os.environ.get(k)) if k == "LD_LIBRARY_PATH" else os.environ.get(k)
                    for k in _START_ENV}}


# Directories the dynamic loader searches anyway. OpenMPI's mpirun gives its ranks LD_LIBRARY_PATH=/usr/lib:/usr/lib
# (its prefix's lib directory, Debian's /usr): the same libraries load, so such a rank is still the zygote's kind.
_SYSTEM_LIBRARIES = {"/lib", "/lib64", "/usr/lib", "/usr/lib64", "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"}


def _library_path(value: str | None) -> str | None:
    """LD_LIBRARY_PATH without the system's own library directories (None when nothing else is left)."""
    if value is None:
        return None
    # an empty entry means the current directory to the loader: kept, so it still counts as a difference
    kept = [d for d in value.split(":") if not d or os.path.realpath(d) not in _SYSTEM_LIBRARIES and
            d not in _SYSTEM_LIBRARIES]
    return ":".join(dict.fromkeys(kept)) or None


def _program(argv: list[str]) -> dict | None:
    """The program of a command line the zygote can run (a script, or a benchmarks./tests. module), else None."""
    args = argv[1:]
    while args[:1] == ["-u"] and os.environ.get("PYTHONUNBUFFERED") or args[:1] == ["-B"]:
        args = args[1:]  # what PYTHONUNBUFFERED gives every process; -B: the fork writes no bytecode either
    if len(args) >= 2 and args[0] == "-m" and (args[1].startswith(("benchmarks.", "tests.")) or
                                               args[1:3] == ["tfdist", "train"]):
        return {"module": args[1], "args": args[2:]}
    if len(args) >= 2 and args[0] == "-c":
        return {"code": args[1], "args": args[2:]}
    script = args[0] if args else ""
    if (script.endswith(".py") or os.path.basename(script) == "tfdist" and args[1:2] == ["train"]) \
            and not script.startswith("-") and os.path.isfile(script):
        return {"path": script, "args": args[1:]}
    return None


def _std_streams() -> list[int] | None:
    """The standard streams this process has open, or None if it has any other file open (a pipe it was given
    on purpose, say), which a fork would not have."""
    names = os.listdir("/proc/self/fd")  # one of them is the listing's own descriptor
    others = [int(n) for n in names if int(n) > 2]
    if len(others) > 1 or (others and others[0] != 3):
        return None
    return [fd for fd in (0, 1, 2) if str(fd) in names]


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(conn, [struct.pack("!I", len(data)) + data], list(fds))


def _receive(conn: socket.socket, with_fds: bool = False):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 16)
    if len(data) < 4:
        return (None, fds) if with_fds else None
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return (None, fds) if with_fds else None
        data += chunk
    message = json.loads(data)
    return (message, fds) if with_fds else message


# --- the stand-in: every process the suite starts, from sitecustomize ------------------------------------------------
def _fresh(why: str) -> None:
    """TFDIST_TEST_ZYGOTE_LOG=FILE: one line per process that starts fresh, with the reason."""
    log = os.environ.get("TFDIST_TEST_ZYGOTE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"why": why, "argv": list(getattr(sys, "orig_argv", ()))[:4],
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")


def stand_in() -> None:
    """Runs this process's program in a fork of the zygote and exits with its status; returns at once (the
    process then starts as usual) when the zygote is absent or cannot run it faithfully."""
    path = os.environ.get(SOCKET_ENV)
    program = _program(list(getattr(sys, "orig_argv", ())))
    if not path:
        return None
    if os.environ.get(FRESH_ENV) == "1" or program is None:
        return _fresh("asked to start fresh" if program else "not a program for the zygote")
    streams = _std_streams()
    if streams is None:
        return _fresh("open files: " + " ".join(sorted(os.listdir("/proc/self/fd"))))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        _send(conn, {"program": program, "argv": sys.orig_argv, "streams": streams, "env": dict(os.environ),
                     "path": sys.path, "affinity": sorted(os.sched_getaffinity(0)),
                     "cwd": os.getcwd(), "stand_in": os.getpid(), "context": _context()}, streams)
        reply = _receive(conn)
    except OSError as err:
        reply, error = None, f" ({err})"
    else:
        error = "" if reply else " (it closed the connection)"
    if not reply or not reply.get("pid"):
        conn.close()  # the zygote is not up yet, or this process differs from it: start fresh
        return _fresh(f"differs from the zygote in: {reply['why']}" if reply else f"zygote not answering{error}")
    fork = reply["pid"]

    def forward(signum, frame):
        try:
            os.kill(fork, signum)
        except ProcessLookupError:
            pass

    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(signum, forward)
            except (OSError, ValueError):
                pass
    try:
        status = _receive(conn)
    except OSError:
        status = None
    if status is None:
        os.write(2, b"tests/site/tfdist_test_zygote.py: the zygote went away before the program ended\n")
        os._exit(70)
    code = status["status"]
    if os.WIFSIGNALED(code):
        signum = os.WTERMSIG(code)
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(code))


# --- the zygote ------------------------------------------------------------------------------------------------------
def _mismatch(request: dict, own: dict) -> str | None:
    theirs = request.get("context", {})
    for key, value in own.items():
        if key == "namespaces":  # a network namespace of its own (tfdist's launcher gives jobs one) is entered
            value = {k: v for k, v in value.items() if k != "net"}
            if {k: v for k, v in theirs.get(key, {}).items() if k != "net"} != value:
                return key
        elif key == "env" and theirs.get(key) != value:
            mine = theirs.get(key, {})
            return "env: " + " ".join(f"{k} ({str(mine.get(k))[:60]!r} here, {str(value[k])[:60]!r} in the zygote)"
                                      for k in value if mine.get(k) != value[k])
        elif theirs.get(key) != value:
            return key
    return None


def _enter_network_of(pid: int) -> None:
    """Moves this (single-threaded) process into the network namespace of `pid`, if it is not ours."""
    if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        return
    import ctypes

    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        os.write(2, f"tests/site/tfdist_test_zygote.py: cannot enter the network namespace of {pid}: "
                    f"{os.strerror(ctypes.get_errno())}\n".encode())
        os._exit(70)
    os.close(fd)


def _join_cgroups(listing: str) -> None:
    """Moves this process into the cgroups of a /proc/PID/cgroup listing (v1 hierarchies and v2)."""
    for line in listing.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers:  # a v1 hierarchy, mounted under its controllers' names
            mount = os.path.join("/sys/fs/cgroup", controllers.replace("name=", ""))
        else:  # v2: beside v1 hierarchies, or alone
            mount = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
        folder = os.path.join(mount, path.lstrip("/"))
        try:
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass


def _become(request: dict, fds: list[int]) -> None:
    """In the fork: take the stand-in's streams, environment, directory and argv, run its program and exit as
    the interpreter would have (raises SystemExit, which unwinds the zygote's loop in this process only)."""
    import random
    import runpy
    import tempfile
    import threading

    os.setsid()  # its own process group, as a launcher's start_new_session would give it
    _enter_network_of(request["stand_in"])  # before any thread: a namespace is entered per thread
    os.sched_setaffinity(0, request["affinity"])  # mpirun binds its ranks to cores
    sys.path[:] = [sys.path[0], *request["path"]]  # its PYTHONPATH (the first entry is replaced below)
    sys.dont_write_bytecode = sys.dont_write_bytecode or "-B" in request["argv"][1:3]
    for target in (0, 1, 2):
        if target in request["streams"]:
            os.dup2(fds[request["streams"].index(target)], target)
        else:
            os.close(target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    try:
        watch = os.pidfd_open(request["stand_in"])
    except ProcessLookupError:
        os._exit(1)

    stand_in_cgroup = f"/proc/{request['stand_in']}/cgroup"

    def die_with_the_stand_in():
        import select

        joined = request["context"]["cgroup"]
        # readable once the stand-in has exited (killed: it waits for us otherwise)
        while not select.select([watch], [], [], 0.2)[0]:
            try:
                with open(stand_in_cgroup) as f:
                    now = f.read()
            except OSError:
                continue
            if now != joined:  # moved by PID (a CPU-quota group of a benchmark): the program goes with it
                _join_cgroups(now)
                joined = now
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=die_with_the_stand_in, name="zygote-stand-in-watch", daemon=True).start()
    random.seed()
    tempfile._name_sequence = None  # the zygote's random name sequence would be every fork's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    site = sys.modules.get("sitecustomize")
    if getattr(site, "_clock", None) is not None:
        site._clock.cpu = {"tensorflow": 0.0, "keras": 0.0}  # imported before the fork: this process paid nothing
    sys.orig_argv = list(request["argv"])
    program = request["program"]
    try:
        if "path" in program:
            sys.argv = [program["path"], *program["args"]]
            sys.path[0] = os.path.dirname(os.path.realpath(program["path"]))
            runpy.run_path(program["path"], run_name="__main__")
        elif "module" in program:
            sys.argv = ["-m", *program["args"]]
            sys.path[0] = os.getcwd()
            runpy.run_module(program["module"], run_name="__main__", alter_sys=True)
        else:
            import types

            sys.argv = ["-c", *program["args"]]
            sys.path[0] = ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(program["code"], "<string>", "exec"), main.__dict__)
    except SystemExit:
        raise  # the interpreter ends the program as it would have: atexit handlers, then its usual finalization
    except BaseException as error:
        tb = error.__traceback__  # as a fresh interpreter shows it: without this file's and runpy's frames
        while tb is not None and tb.tb_frame.f_code.co_filename in (_become.__code__.co_filename, runpy.__file__):
            tb = tb.tb_next
        sys.excepthook(type(error), error, tb)
        if isinstance(error, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None
    raise SystemExit(0)


def serve(path: str, cpu_file: str) -> None:
    """Imports TensorFlow and Keras, then forks a program for every stand-in that connects to `path`; the CPU
    seconds of every fork it has reaped are kept in `cpu_file` (the suite's CPU log adds them)."""
    import gc
    import threading

    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    # The imported modules' objects go to the collector's permanent generation: a fork's collections never scan
    # them (nor copy their pages to update them), and its exit does not end with a last collection over them,
    # which made every fork, however short its program, take seconds to exit.
    gc.freeze()
    own = _context()
    lock, reaped = threading.Lock(), [0.0]
    parent = os.pidfd_open(os.getppid())

    def exit_with_the_pytest_worker():
        import select

        select.select([parent], [], [])
        os._exit(0)

    threading.Thread(target=exit_with_the_pytest_worker, daemon=True).start()

    def reap(conn: socket.socket, pid: int) -> None:
        _, status, usage = os.wait4(pid, 0)
        with lock:
            reaped[0] += usage.ru_utime + usage.ru_stime
            with open(cpu_file + ".tmp", "w") as f:
                f.write(f"{reaped[0]:.3f}")
            os.replace(cpu_file + ".tmp", cpu_file)
        try:
            _send(conn, {"status": status})
        except OSError:
            pass
        conn.close()

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".binding")
    server.listen(64)
    os.replace(path + ".binding", path)  # stand-ins connect only once the imports are done
    while True:
        conn, _ = server.accept()
        try:
            request, fds = _receive(conn, with_fds=True)
        except OSError:
            conn.close()
            continue
        why = _mismatch(request, own) if request else "no request"
        if why:
            for fd in fds:
                os.close(fd)
            try:
                _send(conn, {"pid": 0, "why": why})
            except OSError:
                pass
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            os.close(parent)  # the program gets no descriptor of the zygote's
            _become(request, fds)
        for fd in fds:
            os.close(fd)
        try:
            _send(conn, {"pid": pid})
        except OSError:
            pass
        threading.Thread(target=reap, args=(conn, pid), daemon=True).start()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
