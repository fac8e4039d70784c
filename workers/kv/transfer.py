"""KV page transfer prefill -> decode over NIXL (UCX backend): DRAM on CPU, VRAM on GPU.

Decode registers its pool and hands prefill its agent metadata and each buffer's base address and page bytes;
prefill WRITEs whole pages straight into the decode pool with a notification, which is how decode learns the KV
landed. No fallback: without NIXL this module says so.
"""

from __future__ import annotations

import base64
import enum
import functools
import logging
import os
import threading
from array import array
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from .nixl_loader import load_nixl_api
from .pool import KVPool, PoolLayout

log = logging.getLogger(__name__)


class XferState(str, enum.Enum):
    """NIXL's state of a transfer (`check_xfer_state`), as SGLang's `KVPoll` names a room's."""

    PROC = "PROC"   # in flight
    DONE = "DONE"
    ERR = "ERR"


_STATES = {s.value: s for s in XferState}   # check_xfer_state's strings (a dict lookup, not Enum's call)
# NIXL's per-transfer telemetry (nixlXferTelemetry): start (us since its epoch), post and post-to-done durations
# (us), bytes and descriptors (after merging)
TELEMETRY = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")


class TransferError(RuntimeError):
    """NIXL is missing, a peer is unknown or incompatible, or a transfer failed."""


@dataclass(frozen=True)
class PeerInfo:
    """What one side tells the other so that pages can be written into its pool."""

    agent_name: str
    metadata_b64: str
    layout: dict
    buffers: list[tuple[int, int]]   # (base address, bytes per page) of each of KVPool.regions()
    mem_type: str
    device_id: int

    @property
    def num_pages(self) -> int:
        """The peer pool's page count: its descriptors and page indices (pools may differ in capacity only)."""
        return int(self.layout["num_pages"])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "PeerInfo":
        return cls(**{**d, "buffers": [tuple(b) for b in d["buffers"]]})


def _load_nixl():
    try:
        api = load_nixl_api()
    except ImportError as exc:
        raise TransferError(f"the nixl transfer backend needs NIXL ({exc}); no other transfer is "
                            "substituted silently") from exc
    bind = api.nixlBind
    errors = tuple(getattr(bind, n) for n in dir(bind) if n.startswith("nixl") and n.endswith("Error"))
    return api.nixl_agent, api.nixl_agent_config, errors


DESCRIPTOR_MODES = ("runs", "prepped")


class NixlTransfer:
    """One NIXL agent per worker process; thread-safe (HTTP handlers and the engine share it).

    How a WRITE's descriptors are made (`descriptors`, bench/kv_transfer.py measures both):
    - "runs": per request, one descriptor per region and run of pages consecutive on both sides (`page_runs`),
      handed to NIXL as a new list (`initialize_xfer`);
    - "prepped": once per peer, a strided descriptor list of every page of every region on each side
      (`prep_xfer_dlist`), and per request only the pages' indices (`make_prepped_xfer`, which merges
      consecutive descriptors into one), as SGLang's NIXL connector does since its prepared-dlist change.
    """

    def __init__(self, name: str, pool: KVPool, ucx_tls: str | None = None, descriptors: str = "prepped"):
        if descriptors not in DESCRIPTOR_MODES:
            raise ValueError(f"descriptors {descriptors!r}: choose one of {', '.join(DESCRIPTOR_MODES)}")
        self.descriptors = descriptors
        if ucx_tls:
            os.environ["UCX_TLS"] = ucx_tls   # UCX reads it when the agent's backend starts
        nixl_agent, nixl_agent_config, self._nixl_errors = _load_nixl()
        self.name = name
        self._pool = pool
        self._lock = threading.Lock()
        # No progress thread: UCX's spins a core even while idle. The engine loop's polls
        # (poll/notifications) drive progress while a transfer is pending (engine.py).
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        regions = pool.regions()
        self._agent.register_memory([t for t, _ in regions])
        dev = regions[0][0].device
        self._mem_type = "VRAM" if dev.type == "cuda" else "DRAM"
        self._device_id = dev.index or 0
        self._local = [(t.data_ptr(), per_page) for t, per_page in regions]
        self._num_pages = pool.layout.num_pages
        self._peers: dict[str, PeerInfo] = {}
        self._incarnations: dict[str, int] = {}
        self._prepped: dict[str, object] = {}     # peer -> its prepared descriptor list ("prepped" mode)
        self._local_prepped = None
        if descriptors == "prepped":
            self._local_prepped = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _strided(self._local, self._num_pages, self._device_id), self._mem_type)

    def local_info(self) -> PeerInfo:
        with self._lock:
            meta = self._agent.get_agent_metadata()
        return PeerInfo(self.name, base64.b64encode(meta).decode(), asdict(self._pool.layout),
                        list(self._local), self._mem_type, self._device_id)

    def add_peer(self, info: PeerInfo) -> int:
        """Load (or reload, when its metadata changed) a peer's agent; returns its incarnation."""
        mismatch = self._pool.layout.compatible(PoolLayout(**info.layout))
        if mismatch:
            mine = {k: getattr(self._pool.layout, k) for k in mismatch}
            theirs = {k: info.layout[k] for k in mismatch}
            raise TransferError(f"KV layout of {info.agent_name} disagrees with {self.name} on {mismatch}: "
                                f"{theirs} vs {mine}; give prefill and decode the same page_size and kv_cache_dtype")
        name = info.agent_name
        with self._lock:
            known = self._peers.get(name)
            if known is not None and known.metadata_b64 == info.metadata_b64:
                return self._incarnations[name]
            try:
                if known is not None:   # the peer restarted: same name, new memory
                    self._peers.pop(name)
                    if name in self._prepped:
                        self._agent.release_dlist_handle(self._prepped.pop(name))
                    self._agent.remove_remote_agent(name)
                self._agent.add_remote_agent(base64.b64decode(info.metadata_b64))
                if self.descriptors == "prepped":   # the peer's pool may hold more or fewer pages than this one
                    self._prepped[name] = self._agent.prep_xfer_dlist(
                        name, _strided(info.buffers, info.num_pages, info.device_id), info.mem_type)
            except self._nixl_errors as exc:
                raise TransferError(f"NIXL could not load the agent of {name}: {exc!r}") from exc
            self._peers[name] = info
            self._incarnations[name] = self._incarnations.get(name, 0) + 1
            return self._incarnations[name]

    def incarnation(self, agent_name: str) -> int | None:
        """How many times the peer registered new metadata (None: never registered)."""
        with self._lock:
            return self._incarnations.get(agent_name) if agent_name in self._peers else None

    def write_pages(self, peer: str, src_pages: list[int], dst_pages: list[int], notif: bytes,
                    incarnation: int | None = None):
        """Start WRITEs of local `src_pages` into the peer's `dst_pages`, reserved by the peer's
        `incarnation` (None: whichever is current); returns a handle for `poll`."""
        if len(src_pages) > len(dst_pages):
            raise TransferError(f"{len(src_pages)} pages to send but {peer} reserved only {len(dst_pages)}")
        dst_pages = dst_pages[: len(src_pages)]
        # the local side outside the lock: this pool and its prepared list never change
        src = _check_pages(src_pages, self._num_pages, self.name)
        prepped = self.descriptors == "prepped"
        src_idx = _indices(src, len(self._local), self._num_pages) if prepped else None
        with self._lock:
            info = self._peers.get(peer)
            if info is None:
                raise TransferError(f"unknown decode agent {peer!r}: it never registered with this prefill")
            dst = _check_pages(dst_pages, info.num_pages, peer)
            if incarnation is not None and incarnation != self._incarnations[peer]:
                raise TransferError(f"{peer} restarted after it reserved these pages; its new process "
                                    "does not expect this KV")
            handle = None
            try:
                if prepped:
                    handle = self._agent.make_prepped_xfer(
                        "WRITE", self._local_prepped, src_idx,
                        self._prepped[peer], _indices(dst, len(info.buffers), info.num_pages), notif)
                else:
                    runs = page_runs(src_pages, dst_pages)
                    local = _descs(self._local, [(s, n) for s, _, n in runs], self._device_id)
                    remote = _descs(info.buffers, [(d, n) for _, d, n in runs], info.device_id)
                    handle = self._agent.initialize_xfer(
                        "WRITE", self._agent.get_xfer_descs(local, self._mem_type),
                        self._agent.get_xfer_descs(remote, info.mem_type), peer, notif)
                state = self._agent.transfer(handle)
            except self._nixl_errors as exc:
                self._release(handle)
                raise TransferError(f"NIXL failed the WRITE of {len(src_pages)} pages to {peer}: {exc!r}") from exc
            if state == "ERR":
                self._release(handle)
                raise TransferError(f"NIXL refused the WRITE of {len(src_pages)} pages to {peer}")
        return handle

    def poll(self, handle, telemetry: Callable[[dict | None], object] | None = None) -> XferState:
        """Where a WRITE stands (a NIXL error counts as ERR); a finished handle is released. `telemetry`, if given,
        is called once the WRITE ended with NIXL's telemetry of it, read just before the release (`TELEMETRY`:
        microseconds, bytes, descriptors after NIXL's merging), or None where NIXL keeps none (its agents keep it
        when NIXL_TELEMETRY_ENABLE=y is in the environment)."""
        seen = None
        with self._lock:
            try:
                state = _STATES[self._agent.check_xfer_state(handle)]
            except self._nixl_errors:
                state = XferState.ERR
            if state is not XferState.PROC:
                if telemetry is not None:
                    seen = self._telemetry(handle)
                self._release(handle)
        if telemetry is not None and state is not XferState.PROC:
            telemetry(seen)
        return state

    def _telemetry(self, handle) -> dict | None:
        try:
            return xfer_telemetry(self._agent, handle)
        except self._nixl_errors as exc:   # the release that follows says more, if anything is wrong
            log.warning("NIXL gave no telemetry of a transfer: %r", exc)
            return None

    def abandon(self, handle) -> bool:
        """Give up a WRITE still in flight: True if NIXL cancelled it (nothing more will be written or read),
        False if NIXL refused, so the transfer may still move bytes (poll it until it ends)."""
        with self._lock:
            return self._release(handle)

    def _release(self, handle) -> bool:
        """Free a transfer handle (cancelling it if it is in flight); False when NIXL refused, which leaves it to
        NIXL (and to `poll` until it ends)."""
        if handle is None:
            return True
        try:
            self._agent.release_xfer_handle(handle)
        except self._nixl_errors as exc:
            log.warning("NIXL kept a transfer handle it could not release (or cancel): %r", exc)
            return False
        return True

    def notify(self, peer: str, message: bytes) -> None:
        """Send `message` to a registered peer as a NIXL notification (no data moves)."""
        with self._lock:
            if peer not in self._peers:
                raise TransferError(f"unknown agent {peer!r}: it never registered with {self.name}")
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:    # nixl raises its own error types, none exported
                raise TransferError(f"NIXL could not notify {peer}: {exc}") from exc

    def progress(self) -> None:
        """Drive the agent's progress (it has no progress thread): what a notification it sent needs to leave
        before any transfer connected the two agents. Only a decode receives notifications: a prefill calls this."""
        dropped = self.notifications()
        if dropped:
            log.warning("%s ignored %d notifications it does not expect", self.name, len(dropped))

    def notifications(self) -> list[bytes]:
        with self._lock:
            try:
                notifs = self._agent.get_new_notifs()
            except self._nixl_errors as exc:   # a peer went away mid-message: its requests time out
                log.warning("NIXL could not read notifications: %r", exc)
                return []
        return [msg for msgs in notifs.values() for msg in msgs]


def xfer_telemetry(agent, handle) -> dict | None:
    """NIXL's telemetry of a transfer (`TELEMETRY`; read before its handle is released), None where NIXL keeps none:
    its agents keep it only when NIXL_TELEMETRY_ENABLE=y was in the environment."""
    try:
        t = agent.get_xfer_telemetry(handle)
    except Exception as exc:            # the binding's error types are not exported: this one by name
        if type(exc).__name__ == "nixlNoTelemetryError":
            return None
        raise
    return {k: getattr(t, k) for k in TELEMETRY}


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, pages) of each stretch in which both sides' pages are
    consecutive: one such stretch is one contiguous byte range per buffer on either side."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def _check_pages(pages, num_pages: int, owner: str) -> np.ndarray:
    """The pages as an int32 array (what `_indices` hands NIXL); a page outside a pool would be a WRITE outside its
    registered memory (or NIXL's refusal): refuse it here. `array("I")` converts a list at a few ns a page and refuses
    a negative page, one past 2**32 or one that is no integer itself; one reduction checks the rest (np.asarray of a
    list, before, cost 28 us at 512 pages on an H100 host: bench/results/kv_write_host_h100.md)."""
    try:
        p = np.frombuffer(array("I", pages), dtype=np.uint32)
    except (OverflowError, TypeError):
        p = None
    if p is None or (p.size and int(p.max()) >= num_pages):
        bad = next(x for x in pages if not isinstance(x, (int, np.integer)) or not 0 <= x < num_pages)
        raise TransferError(f"page {bad} lies outside the pool of {owner}, which has {num_pages} pages")
    return p.view(np.int32)


def _descs(buffers: list[tuple[int, int]], runs: list[tuple[int, int]], device_id: int) -> np.ndarray:
    """Nx3 (address, length, device) rows: every region's slice of every run of (first page, pages),
    region-major. A run of consecutive pages is one row, not one per page, and an fp8 pool has one region for
    all its layers (KVPool.regions), so a request whose pages form one run on both sides is one row
    (bench/kv_transfer.py measures what each row costs against one raw WRITE)."""
    rows = [(base + p * size, n * size, device_id) for base, size in buffers for p, n in runs]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def _strided(buffers: list[tuple[int, int]], num_pages: int, device_id: int) -> np.ndarray:
    """Nx5 (address, length, device, stride, count) rows: every page of every region, as NIXL's compressed
    (strided) descriptor list; descriptor r * num_pages + p is page p of region r."""
    rows = [(base, size, device_id, size, num_pages) for base, size in buffers]
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


def _indices(pages, regions: int, num_pages: int) -> np.ndarray:
    """The prepared list's indices of `pages` (checked: inside the pool) in every region, region-major (so that
    consecutive pages are consecutive descriptors, which NIXL merges), as int32: what NIXL's binding takes fastest
    (bench/results/kv_write_host_cpu.md: a list of 512 costs 10 us, an int32 array 1)."""
    pages = np.asarray(pages, dtype=np.int32)
    return pages if regions == 1 else (_region_offsets(regions, num_pages) + pages).ravel()


@functools.lru_cache(maxsize=64)
def _region_offsets(regions: int, num_pages: int) -> np.ndarray:
    """(regions, 1) int32: region r's first descriptor in a prepared list of `num_pages` pages a region."""
    if regions * num_pages > np.iinfo(np.int32).max:
        raise TransferError(f"{regions} regions of {num_pages} pages: more descriptors than NIXL's int32 indices reach")
    off = (np.arange(regions, dtype=np.int64)[:, None] * num_pages).astype(np.int32)
    off.flags.writeable = False
    return off
