# dsec fncall zygote: the fork server of one warm pool (docs/fncall.md).
#
# dsecd starts it as `python3 -I -c <this file>` as pid 1 of a fork server's sandbox (its own mount, pid, network,
# ipc, uts and cgroup namespaces over the image's read-only root), as root with CAP_SYS_ADMIN, CAP_SETUID and
# CAP_SETGID only, under a seccomp filter that still allows mount. fd 3 is its control socket to the agent.
#
# It imports the configured modules once (its /proc, mounted by the agent with hidepid=invisible, shows a process
# only its own user's processes), and then, for every ARM message, forks the child of one future call:
#
#   zygote (pid 1 of the server's sandbox: never runs a call's code, keeps nothing of any call; it reaps, and
#    |      reports each call's exit status to the agent)
#    `- call's process: joins the call's cgroup, takes its own mount, ipc and cgroup namespaces, and says READY.
#          When the call comes: a fresh tmpfs on /tmp (size-capped, the call's files and working directory) and on
#          /dev/shm, the call's GPUs, an unprivileged uid with no capabilities, rlimits, the strict seccomp
#          filter; then it runs the code (Python in-process in a fresh __main__, shell and C/C++ by exec).
#
# When the call's process has ended, the agent kills whatever is left in the call's cgroup before the server takes
# its next call; the call's mounts and ipc objects go with its namespaces. A server runs one call at a time, and a
# call's user sees no process of another user (hidepid), so nothing a call does reaches the zygote, the next call,
# or another call.
#
# Messages on every socket are frames: u32 header length, u32 blob length (little endian), a JSON header, the blob;
# file descriptors travel as SCM_RIGHTS with the frame's first bytes.

import array
import atexit
import base64
import builtins
import ctypes
import gc
import io
import json
import linecache
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback
import types

CTL_FD = 3
SCRATCH_FD = 4
HEAD = struct.Struct("<II")

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
BUILD_DIR = "/tmp/.dsec"

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]


def close_range(first, last):
    try:
        libc.close_range.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_int]
        if libc.close_range(first, last, 0) == 0:
            return
    except AttributeError:  # a C library older than glibc 2.34
        pass
    os.closerange(first, min(last, 65535) + 1)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Failure(Exception):
    """A step of a call's setup that failed: reported to the agent as {"type": "failed", "stage": ...}."""

    def __init__(self, stage, message):
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.message = message


def check(rc, stage, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise Failure(stage, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data, stage):
    check(libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                     flags, data.encode() if data else None), stage, f"mount {fstype or 'bind'} on {target}")


def send(sock, header, blob=b"", fds=()):
    head = json.dumps(header, separators=(",", ":")).encode()
    data = HEAD.pack(len(head), len(blob)) + head
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)
    if blob:
        sock.sendall(blob)


def recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the agent closed the socket mid-message")
        got += k
    return buf


def recv(sock, max_fds=0):
    """One frame: (header, blob, fds), or None at end of file. Received fds are close-on-exec."""
    fds = []
    head = b""
    while len(head) < HEAD.size:
        if max_fds:
            data, anc, _, _ = sock.recvmsg(HEAD.size - len(head), socket.CMSG_SPACE(max_fds * 4),
                                           socket.MSG_CMSG_CLOEXEC)
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        else:
            data = sock.recv(HEAD.size - len(head))
        if not data:
            if head:
                raise EOFError("the agent closed the socket mid-message")
            return None
        head += data
    head_len, blob_len = HEAD.unpack(head)
    header = json.loads(recv_exact(sock, head_len))
    blob = recv_exact(sock, blob_len) if blob_len else bytearray()
    return header, blob, fds


# --------------------------------------------------------------------------------------------------------------
# The zygote


def preload(modules):
    loaded, failed = [], {}
    for name in modules:
        try:
            __import__(name)
            loaded.append(name)
        except BaseException as e:  # a module that is not in the image, or fails to import
            failed[name] = f"{type(e).__name__}: {e}"
    return loaded, failed


def zygote():
    try:
        os.close(SCRATCH_FD)
    except OSError:
        pass
    ctl = socket.socket(fileno=CTL_FD)
    msg = recv(ctl)
    if msg is None:
        os._exit(0)
    config = msg[0]
    if sys.version_info < (3, 9):
        send(ctl, {"type": "fatal", "message": f"python {sys.version.split()[0]} is too old: fncall needs 3.9"})
        os._exit(1)
    config["filter"] = Seccomp(config["seccomp"])
    loaded, failed = preload(config.get("preload", []))
    # A child forks from here: what the zygote holds in stdio buffers would be written by every child.
    sys.stdout.flush()
    sys.stderr.flush()
    # The collector leaves what exists now alone, so children do not copy the zygote's pages just to scan them.
    gc.collect()
    gc.freeze()
    # Children that end wake the loop below (the zygote is their parent, and the init of every orphan).
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    send(ctl, {"type": "hello", "python": sys.version.split()[0], "preloaded": loaded, "failed": failed})
    calls = {}  # pid of an armed or running call's process -> its socket to the agent
    while True:
        ready, _, _ = select.select([ctl, wake_r], [], [])
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            reap(calls)
        if ctl not in ready:
            continue
        try:
            msg = recv(ctl, max_fds=16)
        except (OSError, EOFError, ValueError):
            msg = None
        if msg is None:
            os._exit(0)  # the agent is gone: so is this server (pid 1: everything in its sandbox dies with it)
        header, _, fds = msg
        if header.get("type") != "arm" or not fds:
            for fd in fds:
                os.close(fd)
            continue
        try:
            pid = os.fork()
        except OSError as e:
            report_failure(fds[0], Failure("fork", str(e)))
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                ctl.close()
                for sock in calls.values():
                    sock.close()
                call_process(fds[0], fds[1:], config)
            finally:
                os._exit(70)
        calls[pid] = socket.socket(fileno=fds[0])
        for fd in fds[1:]:
            os.close(fd)


def reap(calls):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = calls.pop(pid, None)
        if sock is not None:
            try:
                send(sock, {"type": "status", "status": status})
            except OSError:
                pass
            sock.close()


def report_failure(fd, failure):
    try:
        s = socket.socket(fileno=os.dup(fd))
        send(s, {"type": "failed", "stage": failure.stage, "message": failure.message})
        s.close()
    except OSError:
        pass


# --------------------------------------------------------------------------------------------------------------
# A call's process. Everything up to "drop privileges" runs as root.


def call_process(sock_fd, procs_fds, config):
    sock = socket.socket(fileno=sock_fd)
    try:
        for fd in procs_fds:
            if os.write(fd, b"0") != 1:
                raise Failure("cgroup", "short write to the call's cgroup.procs")
            os.close(fd)
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWCGROUP), "namespaces", "unshare")
        # The agent holds the mount namespace too: the call's end then does not wait for its mounts to go.
        pidfd = os.pidfd_open(os.getpid())
        mount_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        prepared = prepare_python() if config["language"] == "python" else None
        send(sock, {"type": "ready"}, fds=[pidfd, mount_ns])
        os.close(pidfd)
        os.close(mount_ns)
        msg = recv(sock, max_fds=2)
        if msg is None:
            os._exit(0)  # disarmed
        header, blob, fds = msg
        run_call(sock, header, blob, fds, config, prepared)
    except Failure as e:
        report(sock, e)
    except BaseException as e:
        report(sock, Failure("setup", f"{type(e).__name__}: {e}"))
    os._exit(72)


def report(sock, failure):
    if sock.fileno() >= 0:
        report_failure(sock.fileno(), failure)
    else:
        # The runner already let go of the agent's socket: the call's stderr is where this can go.
        try:
            os.write(2, f"dsec: the function call's runner failed at {failure.stage}: {failure.message}\n".encode())
        except OSError:
            pass


def run_call(sock, header, blob, fds, config, prepared):
    if len(fds) != 2:
        raise Failure("call", "the call did not carry its stdout and stderr")
    out_fd, err_fd = fds
    uid, gid = config["uid"], config["gid"]
    language = config["language"]

    tmp_bytes = int(header["tmp_bytes"])
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={tmp_bytes},nr_inodes={max(1024, tmp_bytes // 8192)},mode=0700,uid={uid},gid={gid}", "tmp")
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={int(header['shm_bytes'])},nr_inodes=4096,mode=1777", "tmp")
    for dev in header.get("devices", []):
        mount(f"/dev/.dsec-gpu/{dev}", f"/dev/{dev}", None, MS_BIND, None, "gpu")

    # Drop privileges: an unprivileged uid (its change from 0 clears every capability), no groups.
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        raise Failure("credentials", str(e))

    view = memoryview(blob)
    off = 0
    code = bytes(view[off:off + header["code_size"]])
    off += header["code_size"]
    stdin = view[off:off + header["stdin_size"]]
    off += header["stdin_size"]
    try:
        for path, size in header["files"]:
            full = "/tmp/" + path
            parent = os.path.dirname(full)
            if parent != "/tmp":
                os.makedirs(parent, exist_ok=True)
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            write_all(fd, view[off:off + size])
            os.close(fd)
            off += size
        os.chdir("/tmp")
        stdin_fd = os.memfd_create("stdin", 0)
        write_all(stdin_fd, stdin)
        os.lseek(stdin_fd, 0, os.SEEK_SET)
    except OSError as e:
        raise Failure("files", f"{e.filename or ''}: {e.strerror}" if e.strerror else str(e))
    del view, stdin, blob

    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (stdin_fd, out_fd, err_fd):
        if fd > 2:
            os.close(fd)
    keep = sock.fileno()
    # Everything else the zygote had open goes; the agent's socket stays (close-on-exec) until the code runs.
    if keep > 3:
        close_range(3, keep - 1)
    close_range(keep + 1, 0xFFFFFFFF)

    env = {str(k): str(v) for k, v in header["env"].items()}
    nofile = int(config.get("nofile", 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()
    config["filter"].load()

    args = [str(a) for a in header["args"]]
    cpu = float(header.get("cpu_seconds", 0))
    if language == "python":
        sock.close()
        set_cpu_limit(cpu)
        run_python(prepared, code, args, env)
    elif language == "shell":
        sock.close()
        set_cpu_limit(cpu)
        run_shell(code, args, env)
    else:
        compile_and_run(sock, language, code, args, env, cpu, config, header)


def write_all(fd, data):
    data = memoryview(data)
    while data:
        n = os.write(fd, data)
        data = data[n:]


class Seccomp:
    """The strict filter every call's child loads, decoded once in the zygote."""

    def __init__(self, program):
        bpf = base64.b64decode(program)
        self.buffer = ctypes.create_string_buffer(bpf, len(bpf))
        self.prog = SockFprog(len(bpf) // 8, ctypes.cast(self.buffer, ctypes.c_void_p))

    def load(self):
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0), "seccomp", "no_new_privs")
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.cast(ctypes.byref(self.prog), ctypes.c_void_p),
                         0, 0), "seccomp", "load the filter")


def set_cpu_limit(seconds):
    # A backstop for the agent's own watch of the call's CPU time: the process itself gets SIGXCPU, then SIGKILL.
    if seconds > 0:
        soft = int(seconds) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))


def reset_signals():
    # What an exec'd program should start with (the zygote's Python ignores SIGPIPE and SIGXFSZ).
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)


# --------------------------------------------------------------------------------------------------------------
# The languages


def prepare_python():
    """What a Python call needs that does not depend on the call, done while the child is armed, so that the pages
    it touches are copied before the call arrives rather than on its way. Every child is a new process, so this is
    still fresh for each call."""
    # A fresh process would draw new seeds; the zygote's were drawn once, so draw again here.
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        try:
            sys.modules["numpy.random"].seed()
        except Exception:
            pass
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    # The standard streams on fds 0-2 (/dev/null now; the call's pipes and stdin take those fds before the code).
    stdio = (io.open(0, "r", encoding="utf-8", errors="strict", closefd=False),
             io.open(1, "w", encoding="utf-8", errors="strict", closefd=False),
             io.open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False))
    # A dry run of what the call does: the code paths and objects it will touch are copied now.
    json.loads('{"type": "call", "args": ["a"], "env": {"K": "v"}, "files": [["f", 1]], "code_size": 1}')
    exec(compile("pass", "main.py", "exec"), {"__builtins__": builtins})
    return main, stdio


def run_python(prepared, code, args, env):
    main, stdio = prepared
    os.environ.clear()
    os.environ.update(env)
    sys.modules["__main__"] = main
    sys.argv = ["main.py"] + args
    sys.path.insert(0, "")  # the working directory, as for `python3 -c`
    sys.stdin, sys.stdout, sys.stderr = stdio
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = stdio
    source = code.decode("utf-8", errors="surrogateescape")
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    status = 0
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit as e:
        status = exit_status(e)
    except BaseException as e:
        # As Python prints it: without this runner's own frame.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        status = 1
    status = finish_python(status)
    os._exit(status)


def exit_status(e):
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def finish_python(status):
    # What the interpreter does on its way out: wait for threads, run atexit functions, flush stdio.
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
    except SystemExit as e:
        status = exit_status(e)
    except BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            if status == 0:
                status = 120
    return status


def run_shell(code, args, env):
    reset_signals()
    # An argument string is limited to 128 KiB: longer scripts are read from a descriptor instead.
    if len(code) < 100 * 1024:
        argv = ["sh", "-c", code, "sh"] + args
    else:
        fd = os.memfd_create("script", 0)
        write_all(fd, code)
        os.lseek(fd, 0, os.SEEK_SET)
        argv = ["sh", "-c", f'. /dev/fd/{fd}', "sh"] + args
    try:
        os.execve("/bin/sh", argv, env)
    except OSError as e:
        os.write(2, f"dsec: cannot run /bin/sh: {e.strerror}\n".encode())
        os._exit(127)


def compile_and_run(sock, language, code, args, env, cpu, config, header):
    import subprocess

    ext = "c" if language == "c" else "cpp"
    os.mkdir(BUILD_DIR, 0o755)
    # Compiled in BUILD_DIR by relative names, so the compiler's messages say "main.c:3:5".
    source = f"main.{ext}"
    binary = f"{BUILD_DIR}/main"
    fd = os.open(f"{BUILD_DIR}/{source}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    write_all(fd, code)
    os.close(fd)
    argv = [a.replace("{source}", source).replace("{binary}", "main") for a in config["compile"][language]]
    cap = int(header.get("compile_output_cap", 65536))
    started = time.monotonic()
    compile_env = {k: v for k, v in env.items() if k in ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR")}
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=compile_env, cwd=BUILD_DIR)
        rc, output = done.returncode, done.stdout
        if rc < 0:
            output += f"dsec: the compiler was killed by signal {-rc}\n".encode()
    except OSError as e:
        rc, output = 127, f"dsec: cannot run {argv[0]}: {e.strerror}\n".encode()
    seconds = time.monotonic() - started
    send(sock, {"type": "compiled", "exit_code": rc, "seconds": seconds, "truncated": len(output) > cap},
         bytes(output[:cap]))
    if rc != 0:
        os._exit(0)
    msg = recv(sock, max_fds=8)
    if msg is None or msg[0].get("type") != "go":
        os._exit(0)
    # The program's own cgroup (the agent opened its cgroup.procs: writing to it needs no privilege here), so that
    # what the compiler used is not counted as the program's.
    for fd in msg[2]:
        if os.write(fd, b"0") != 1:
            raise Failure("cgroup", "short write to the program's cgroup.procs")
        os.close(fd)
    reset_signals()
    set_cpu_limit(cpu)
    try:
        os.execve(binary, ["./main"] + args, env)
    except OSError as e:
        os.write(2, f"dsec: cannot run the program: {e.strerror}\n".encode())
        os._exit(127)


zygote()
