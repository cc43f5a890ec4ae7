"""Unix-domain socket files for `serve --uds` and `--grpc-uds`: the path checked before the model loads, a
dead server's stale socket replaced, the file created with the asked mode and removed on shutdown.
No TCP or UDP socket is made here (the lent TPU machine forbids them)."""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import stat
from typing import Callable, TypeVar

# sockaddr_un.sun_path is 108 bytes on Linux, the last one its NUL
SUN_PATH_MAX = 107
DEFAULT_MODE = 0o600
T = TypeVar("T")


def parse_mode(text: str) -> int:
    """argparse type of --uds-mode: an octal permission such as 0600 or 660."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"not an octal file mode: {text!r} (use e.g. 0600 or 0660)")
    if mode & 0o600 != 0o600:
        raise argparse.ArgumentTypeError(f"mode {text}: the owner needs read and write (0600) to connect")
    return mode


def strip_scheme(address: str) -> str:
    """'unix:PATH' or 'unix:///abs/path' (gRPC's spellings) -> PATH; a plain path is returned as it is."""
    if address.startswith("unix:"):
        address = address[len("unix:"):]
        if address.startswith("///"):
            address = address[2:]
    return address


def check_path(path: str, flag: str) -> str:
    """The path a new listener can take, or a ValueError of one line naming `flag` and what to change.
    A socket file nobody answers on (a dead server's) is fine: it is replaced when bound."""
    if not path:
        raise ValueError(f"{flag}: the socket path is empty")
    size = len(os.fsencode(path))
    if size > SUN_PATH_MAX:
        raise ValueError(f"{flag} {path}: the path is {size} bytes, a unix socket path takes at most "
                         f"{SUN_PATH_MAX}; choose a shorter one (e.g. under /tmp or $XDG_RUNTIME_DIR)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: no permission to create a file in {parent}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"{flag} {path}: the path exists and is not a socket; refusing to replace it")
    if _answers(path, flag):
        raise ValueError(f"{flag} {path}: a live server already listens on it; stop it or choose another path")
    return path


def _answers(path: str, flag: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False  # nobody listens: a stale file
        except PermissionError as exc:
            raise ValueError(f"{flag} {path}: a socket file that this user cannot probe ({exc.strerror}); "
                             "remove it or choose another path") from exc
        except OSError:
            return True  # a timeout or a full backlog: someone is there
    return True


def create_with_mode(path: str, mode: int, flag: str, bind: Callable[[], T]) -> tuple[T, int]:
    """Run `bind` (which creates the socket file at `path`) so the file never has wider permissions than
    `mode`; replaces a stale socket first. Returns bind's result and the file's inode, for `remove`."""
    check_path(path, flag)  # again: the model loaded meanwhile, and another server may have started
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # check_path saw a stale socket or nothing
    # bind(2) creates the file with 0777 & ~umask: set the umask so it is `mode` from its first moment
    # (a chmod afterwards would leave a window where others may connect)
    old = os.umask(0o777 & ~mode)
    try:
        result = bind()
    finally:
        os.umask(old)
    os.chmod(path, mode)
    return result, os.lstat(path).st_ino


def bind_stream(path: str, mode: int, flag: str) -> tuple[socket.socket, int]:
    """A listening unix stream socket at `path` (for uvicorn's `sockets=`) and the file's inode."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def bind() -> socket.socket:
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            raise OSError(f"{flag} {path}: cannot listen there ({exc.strerror or exc})") from exc
        return sock

    sock, inode = create_with_mode(path, mode, flag, bind)
    sock.listen(2048)  # uvicorn's default backlog
    sock.setblocking(False)
    return sock, inode


def remove(path: str, inode: int) -> None:
    """Remove the socket file on shutdown, unless it is no longer ours (a successor bound the path)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if st.st_ino == inode and stat.S_ISSOCK(st.st_mode):
            os.unlink(path)
