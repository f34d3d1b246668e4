"""The guards the sandbox's child process raises around agent code, from the strongest to the weakest.

1. Landlock (Linux >= 5.13, kernel-enforced, inherited by every thread and child, cannot be lifted): writes,
   deletions, renames and file creation only beneath the run directory; reads only beneath the run directory,
   Python's installation and environment, the specpilot package and system libraries (the harness has already
   imported torch and loaded the weights), so no home directory, no other run, no /proc/<pid>/environ of the
   orchestrator (its API key); with ABI >= 4 every TCP bind/connect is denied; with ABI >= 6 signals to
   processes outside the sandbox are denied.
2. An audit hook (PEP 578) that turns network, process, ctypes, gc-introspection and out-of-directory write
   events into PermissionError and records each attempt on stderr, so a blocked attempt is visible to the
   parent even when the code swallows the exception. It lives in the same interpreter as the agent code:
   it is a tripwire with clear messages, not a boundary (code running C without audit events bypasses it,
   which is what layer 1 and the network namespace are for).
3. socket.socket / create_connection / getaddrinfo replaced by versions raising PermissionError.

Only the harness (trusted code) calls `lock_down`, after its own imports and before loading agent code.
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable, NoReturn

VIOLATION_MARK = "SPECPILOT-SANDBOX-BLOCKED "  # prefix of the stderr line the hook writes per blocked event

# Landlock constants (linux/landlock.h); the syscall numbers are the same on every architecture.
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR, _FS_REMOVE_DIR, _FS_REMOVE_FILE = 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5
_FS_MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_SIGNAL = 1 << 1

_PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "os.startfile")
_INTROSPECTION_EVENTS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile")
_PATH_EVENTS = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown",
                "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree", "shutil.copyfile", "shutil.move")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


@dataclass(frozen=True)
class GuardReport:
    """Which layers are active in this process (reported back to the parent)."""

    landlock_abi: int  # 0: unavailable
    landlock_fs: bool  # writes
    landlock_read: bool
    landlock_net: bool
    landlock_signals: bool
    audit_hook: bool

    def layers(self) -> tuple[str, ...]:
        named = (("landlock-fs", self.landlock_fs), ("landlock-read", self.landlock_read),
                 ("landlock-net", self.landlock_net),
                 ("landlock-signals", self.landlock_signals), ("audit-hook", self.audit_hook))
        return tuple(name for name, on in named if on)


def readable_roots(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What agent code may read besides its run directory: what imports and the engine need, nothing personal."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../specpilot
    paths = (sys.prefix, sys.base_prefix, sys.exec_prefix, package, "/usr", "/lib", "/lib64", "/etc/ld.so.cache",
             "/etc/localtime", "/dev/null", "/dev/urandom", "/proc/self", "/sys/devices/system/cpu") + extra
    return tuple(dict.fromkeys(p for p in paths if os.path.exists(p)))


def _landlock(root: str, extra_writable: tuple[str, ...],
              readable: tuple[str, ...]) -> tuple[int, bool, bool, bool, bool]:
    """Restrict this process (and its future children) to writing beneath `root` and reading beneath `root`
    and `readable`; returns (abi, writes, reads, net, signals) restricted."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi < 1:
        return 0, False, False, False, False
    read = _FS_READ_FILE | _FS_READ_DIR
    write = _FS_WRITE_FILE | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE
    write |= (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_SIGNAL if abi >= 6 else 0
    # struct landlock_ruleset_attr grew with the ABI: pass only the fields this kernel knows.
    fields = [write | read] + ([net] if abi >= 4 else []) + ([scoped] if abi >= 6 else [])
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        rules = [(root, write | read)] + [(p, _FS_WRITE_FILE | _FS_READ_FILE) for p in extra_writable]
        rules += [(p, read if os.path.isdir(p) else _FS_READ_FILE) for p in readable]  # files take no dir rights
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = PathBeneath(access, fd)
                if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}): {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return abi, True, True, bool(net), bool(scoped)


def _inside(path: object, root: str) -> bool:
    if isinstance(path, int):  # an already open descriptor: opening it was checked then
        return True
    try:
        resolved = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return resolved == root or resolved.startswith(root + os.sep)


def _writes(args: tuple) -> bool:
    """The `open` event's (path, mode, flags): does it open for writing?"""
    mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
    if isinstance(flags, int) and flags & _WRITE_FLAGS:
        return True
    return isinstance(mode, str) and any(c in mode for c in "wax+")


def _reporter() -> Callable[[str, str], None]:
    def report(event: str, detail: str) -> None:
        line = VIOLATION_MARK + json.dumps({"event": event, "detail": detail[:300]}) + "\n"
        os.write(2, line.encode("utf-8", "replace"))
    return report


def _install_audit_hook(root: str, report: Callable[[str, str], None]) -> None:
    # The hook closes over `root` and `report` only; nothing else references it, so agent code cannot reach
    # its state without gc introspection, which the hook itself blocks.
    def hook(event: str, args: tuple) -> None:
        blocked = None
        if event.startswith("socket.") or event in ("urllib.Request", "http.client.connect"):
            blocked = f"network access is disabled ({event} {args[:2]!r})"
        elif event in _PROCESS_EVENTS:
            blocked = f"starting or signalling processes is disabled ({event})"
        elif event.startswith("ctypes.") or event in _INTROSPECTION_EVENTS:
            blocked = f"{event} is disabled"
        elif event == "open" and _writes(args) and not _inside(args[0], root):
            blocked = f"writing outside {root} is disabled (open {args[0]!r})"
        elif event in ("os.symlink", "os.link"):
            blocked = f"links are disabled ({event} {args[:2]!r})"
        elif event in _PATH_EVENTS and not all(_inside(a, root) for a in args[:2] if isinstance(a, (str, bytes))):
            blocked = f"changing files outside {root} is disabled ({event} {args[:2]!r})"
        elif event == "sqlite3.connect" and not _inside(args[0], root):
            blocked = f"databases outside {root} are disabled"
        if blocked is not None:
            report(event, blocked)
            raise PermissionError(f"sandbox: {blocked}")

    sys.addaudithook(hook)


def _block_socket_module(report: Callable[[str, str], None]) -> None:
    """socket.socket stays a class (modules subclass it at import, e.g. ssl) that refuses to make a socket."""
    def deny(what: str) -> NoReturn:
        report(f"socket.{what}", "network access is disabled")
        raise PermissionError(f"sandbox: network access is disabled (socket.{what})")

    class NoSocket(socket.socket):
        def __init__(self, *_args: object, **_kwargs: object) -> None:
            deny("socket")

    socket.socket = NoSocket
    socket.create_connection = lambda *a, **k: deny("create_connection")
    socket.getaddrinfo = lambda *a, **k: deny("getaddrinfo")


def lock_down(root: str, extra_writable: tuple[str, ...] = (), extra_readable: tuple[str, ...] = ()) -> GuardReport:
    """Apply every guard for agent code whose only writable directory is `root`."""
    root = os.path.realpath(root)
    try:
        abi, fs, reads, net, signals = _landlock(root, extra_writable, readable_roots(extra_readable))
    except OSError as e:  # a kernel without Landlock, or one that refuses it: say so, keep the other layers
        os.write(2, f"sandbox: landlock unavailable: {e}\n".encode())
        abi, fs, reads, net, signals = 0, False, False, False, False
    report = _reporter()
    _block_socket_module(report)
    _install_audit_hook(root, report)
    return GuardReport(abi, fs, reads, net, signals, True)
