"""The multi-host control channel: process 0's TCP link to its workers, which carries every engine
call in order (length-prefixed pickles from process 0, heartbeat bytes back from the workers).

Group is process 0's side, Leader a worker's. Either side that hears nothing from a peer for the
peer timeout, or sees its connection end, runs its loss handlers once; it never waits on a lost peer.
What the calls mean and how they are replayed is engine/multihost.py's business, not this file's.
"""
from __future__ import annotations

import dataclasses
import hmac
import logging
import pickle
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable


log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0         # both ends write at least this often, so silence means a lost peer
TOKEN_BYTES = 32          # the group's secret: a worker proves it belongs with it
_HELLO = struct.Struct(f">{TOKEN_BYTES}sI")
_FRAME = struct.Struct(">Q")
_BEAT = ("beat",)
_STOP = ("stop",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Where the group meets and how long its members wait for each other."""

    coordinator_address: str          # host:port of process 0 (jax.distributed's coordinator)
    num_processes: int
    process_id: int
    control_port: int | None = None   # process 0's lockstep channel; None: the coordinator's port + 1
    peer_timeout_s: float = 10.0      # a peer silent this long is lost
    connect_timeout_s: float = 600.0  # how long the processes wait for each other at start-up

    def __post_init__(self) -> None:
        host, sep, port = self.coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"coordinator address must be host:port, got {self.coordinator_address!r}")
        if self.num_processes < 2:
            raise ValueError(f"num_processes must be >= 2 for multi-host serving, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.control_port is not None and not 0 < self.control_port < 65536:
            raise ValueError(f"control_port must be a TCP port, got {self.control_port}")
        if not self.peer_timeout_s > HEARTBEAT_S:
            raise ValueError(f"peer_timeout_s must exceed the {HEARTBEAT_S} s heartbeat, got {self.peer_timeout_s}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")

    @property
    def control_address(self) -> tuple[str, int]:
        host, _, port = self.coordinator_address.rpartition(":")
        return host.strip("[]"), self.control_port or int(port) + 1


class PeerLost(RuntimeError):
    """Another process of the group went away: the group cannot run a step any more."""


# ---- the wire: length-prefixed pickles from process 0, heartbeat bytes from the workers ----------

def encode(msg: tuple) -> bytes:
    """One call as a frame. A compiled grammar travels as its source: an insert becomes
    ("insert", slot, state without it, (text, constraint) or None)."""
    if msg[0] == "insert":
        _, slot, state = msg
        grammar = state.params.constraint
        if grammar is not None:
            state = dataclasses.replace(state, params=dataclasses.replace(state.params, constraint=None))
        msg = ("insert", slot, state, None if grammar is None else (grammar.text, grammar.constraint))
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME.pack(len(data)) + data


def decode(payload: bytes, grammar: Callable[[str, Any], Any]) -> tuple:
    """A frame's call, its grammar (if any) compiled here by `grammar(text, constraint)`."""
    msg = pickle.loads(payload)
    if msg[0] == "insert":
        _, slot, state, source = msg
        if source is not None:
            state = dataclasses.replace(state, params=dataclasses.replace(state.params, constraint=grammar(*source)))
        msg = ("insert", slot, state)
    return msg


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerLost("connection closed")
        buf += chunk
    return bytes(buf)


class _OnLost:
    """Runs the loss handlers once, whichever thread notices first."""

    def __init__(self, handlers: list[Callable[[str], None]]) -> None:
        self.handlers = handlers
        self.reason: str | None = None
        self._lock = threading.Lock()

    def __call__(self, reason: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        log.error("multi-host group lost: %s", reason)
        for handler in self.handlers:
            try:
                handler(reason)
            except Exception:  # noqa: BLE001 - the exit handler must run whatever an abort does
                log.exception("loss handler %r failed", handler)


# ---- process 0 ---------------------------------------------------------------------------------

class Group:
    """Process 0's side of the control channel: one authenticated connection per worker, a reader
    thread per worker watching for its heartbeats, and a heartbeat of its own when idle. Handlers in
    `on_lost` run once when any worker is lost (the CLI aborts the scheduler and exits)."""

    def __init__(self, cfg: DistributedConfig, token: bytes, *, on_lost: list[Callable[[str], None]]) -> None:
        self._cfg, self._token = cfg, token
        self._lost = _OnLost(on_lost)
        self._socks: dict[int, socket.socket] = {}
        self._gone: dict[int, threading.Event] = {}  # set when a worker's connection ends
        self._send_lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closing = False
        self._listener = socket.create_server(("", cfg.control_address[1]), reuse_port=False)

    @property
    def lost(self) -> str | None:
        return self._lost.reason

    def add_handler(self, handler: Callable[[str], None]) -> None:
        self._lost.handlers.append(handler)

    def accept_workers(self) -> None:
        """Wait until every worker has connected (after building its engine): until then the
        group cannot run a step, so process 0 is not ready."""
        want = set(range(1, self._cfg.num_processes))
        deadline = time.monotonic() + self._cfg.connect_timeout_s
        while want - self._socks.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"processes {sorted(want - self._socks.keys())} did not connect to the "
                                   f"control port {self._cfg.control_address[1]} within "
                                   f"{self._cfg.connect_timeout_s:.0f} s")
            self._listener.settimeout(left)
            try:
                sock, addr = self._listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(self._cfg.peer_timeout_s)
            try:
                token, pid = _HELLO.unpack(_read_exact(sock, _HELLO.size))
            except (OSError, PeerLost, struct.error):
                sock.close()
                continue
            if not hmac.compare_digest(token, self._token) or pid not in want or pid in self._socks:
                log.warning("control channel: refused a connection from %s (not a worker of this group)", addr)
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[pid] = sock
            log.info("process %d connected from %s", pid, addr[0])
        self._listener.close()
        for pid, sock in self._socks.items():
            self._gone[pid] = threading.Event()
            threading.Thread(target=self._watch, args=(pid, sock), name=f"slipstream-peer-{pid}",
                             daemon=True).start()
        threading.Thread(target=self._beat, name="slipstream-heartbeat", daemon=True).start()

    def send(self, msg: tuple) -> None:
        """To every worker, in order; PeerLost once the group is lost."""
        frame = encode(msg)
        with self._send_lock:
            if self._lost.reason is not None:
                raise PeerLost(self._lost.reason)
            for pid, sock in self._socks.items():
                try:
                    sock.sendall(frame)
                except OSError as exc:
                    reason = f"process {pid}: sending failed ({exc!r})"
                    self._lost(reason)
                    raise PeerLost(reason) from exc
            self._last_send = time.monotonic()

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to exit (0) and wait, up to timeout_s, for them to hang up."""
        self._closing = True
        try:
            self.send(_STOP)
        except PeerLost:
            return
        deadline = time.monotonic() + timeout_s
        for pid, sock in self._socks.items():
            if not self._gone[pid].wait(max(0.0, deadline - time.monotonic())):
                log.warning("process %d did not hang up within %.0f s of the stop", pid, timeout_s)
            sock.close()

    def _watch(self, pid: int, sock: socket.socket) -> None:
        try:
            while sock.recv(4096):
                pass
            reason = f"process {pid} closed its control connection (exited?)"
        except socket.timeout:
            reason = f"process {pid} sent nothing for {self._cfg.peer_timeout_s:.0f} s"
        except OSError as exc:
            reason = f"process {pid}: control connection failed ({exc!r})"
        self._gone[pid].set()
        if not self._closing:
            self._lost(reason)

    def _beat(self) -> None:
        while self._lost.reason is None and not self._closing:
            time.sleep(HEARTBEAT_S / 2)
            if time.monotonic() - self._last_send >= HEARTBEAT_S / 2:
                try:
                    self.send(_BEAT)
                except PeerLost:
                    return


# ---- workers -----------------------------------------------------------------------------------

def _no_grammar(text: str, constraint: Any) -> Any:
    raise PeerLost("a structured-output request reached a worker that cannot compile grammars")


class Leader:
    """A worker's link to process 0: a reader thread queues its calls and watches for its
    heartbeats; a heartbeat thread answers. Handlers in `on_lost` run once if process 0 is lost."""

    def __init__(self, cfg: DistributedConfig, token: bytes, *, on_lost: list[Callable[[str], None]],
                 grammar: Callable[[str, Any], Any] | None = None) -> None:
        self._cfg = cfg
        self._lost = _OnLost(on_lost)
        self._grammar = grammar or _no_grammar
        self._queue: queue.Queue = queue.Queue()
        self._stopped = False
        self._sock = self._connect(token)
        threading.Thread(target=self._read, name="slipstream-leader", daemon=True).start()
        threading.Thread(target=self._beat, name="slipstream-heartbeat", daemon=True).start()

    def _connect(self, token: bytes) -> socket.socket:
        address = self._cfg.control_address
        deadline = time.monotonic() + self._cfg.connect_timeout_s
        while True:  # process 0 opens the port once its engine is built
            try:
                sock = socket.create_connection(address, timeout=self._cfg.peer_timeout_s)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not reach process 0's control port at {address[0]}:{address[1]} "
                                       f"within {self._cfg.connect_timeout_s:.0f} s: {exc}") from exc
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_HELLO.pack(token, self._cfg.process_id))
        return sock

    def messages(self):
        """Process 0's calls, in order, until it says stop; PeerLost if it goes away first."""
        while True:
            msg = self._queue.get()
            if isinstance(msg, PeerLost):
                raise msg
            if msg == _STOP:
                return
            yield msg

    def _read(self) -> None:
        try:
            while True:
                (size,) = _FRAME.unpack(_read_exact(self._sock, _FRAME.size))
                msg = decode(_read_exact(self._sock, size), self._grammar)
                if msg != _BEAT:
                    self._queue.put(msg)
                if msg == _STOP:  # hang up: process 0 waits for that before it exits
                    self._stopped = True
                    self.close()
                    return
        except socket.timeout:
            reason = f"process 0 sent nothing for {self._cfg.peer_timeout_s:.0f} s"
        except (OSError, PeerLost) as exc:
            reason = f"process 0 closed the control connection ({exc})"
        except Exception as exc:  # noqa: BLE001 - a call this process cannot replay: out of step
            log.exception("could not read process 0's call")
            reason = f"could not read process 0's call: {exc!r}"
        self._queue.put(PeerLost(reason))
        self._lost(reason)

    def _beat(self) -> None:
        while self._lost.reason is None and not self._stopped:
            try:
                self._sock.sendall(b"\0")
            except OSError:
                return  # the reader sees the same broken connection
            time.sleep(HEARTBEAT_S / 2)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
