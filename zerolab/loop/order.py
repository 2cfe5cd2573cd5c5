"""Collectives issued in a different order on the ranks: found within seconds, stopped on every rank.

A backend pairs the k-th collective of one rank with the k-th of every other rank of the group,
so every rank must issue the same collectives in the same order. When the order depends on each
rank's own data - a mixture of experts whose experts run in the order of their tokens on that
rank (DeepSpeed#4808, PR#6557), blocks called in a rank-dependent order, a guard's check on one
rank only - the collectives pair wrongly: silently when their sizes happen to agree, otherwise
each rank waits for a partner that never comes, and gloo and NCCL give up only at the group's
timeout (30 minutes by default). A hang, with no word of why.

`watched_wait` is how `zerolab.comm` waits on gloo: in slices of `CHECK_S` seconds. A healthy
collective ends within the first slice and nothing else happens (no message, no store access:
free). When a slice runs out, this rank posts its recent ledger - (op, what, unit, numel) of each
of its last `TAIL` records, by position - to the process group's key-value store (the one
torchrun's rendezvous made) and reads what the other ranks of the group posted. Two ranks whose
records differ at the same position prove the disagreement: `CollectiveOrderError` (one line,
naming the first differing collective on each rank, the blocks, and the fix) on every rank that
stalls, which is every rank within about two slices. Ranks that wait in the same collective (a
slow peer, a long step on another rank) agree and keep waiting: only a proven difference stops.

Ranks that run different numbers of micro-steps before an optimizer step (one skipped a batch
whose forward raised, one had an extra batch) are the same fault: `Comm.passes` counts each
rank's forward passes per optimizer step, the posts carry it, and the message then says how many
each rank ran and how to even them (a batch the rank has, with its loss times 0; or, where the
stage allows, `sync=False` and `strategy.sync_grads()`). `Strategy.step` confirms first, so a
rank that steps early never sends a step's collective into another rank's micro-step (gloo
would abort on the size, or land a smaller message silently).
`agree` is ZeRO-3's check before each backward (it gathers in every micro-step): one
all_reduce of the ranks' `sync` flags and a hash of the all_gathers each issued since the last
one, so a difference stops every rank with one line instead of pairing collectives wrongly.

The fix the message gives: make every rank issue the same sequence - call the blocks in one
order, or make a group of blocks whose order varies one unit, gathered and reduced together
(`zerolab.loop.leaves.set_leaf_modules`, DeepSpeed's `set_z3_leaf_modules`; with `fully_shard`,
shard the parent module only).

Every rank hears the line. The rank that proves a difference posts its line to the store
(the first rank to post wins, so every rank raises the same line) and waits, at most `HEAR_S`, until
every other rank of the group has read it; the others read it within a slice of their own wait
(or poll of `confirm`) and raise it too (`CollectiveOrderError.proved` tells the two apart). So
the line reaches every rank whether the proving rank then exits, retries, or sleeps. A group
found out of step stays so: a later wait on it raises the line at once. A store that stops
answering (its host left: rank 0 under `init_method=tcp://`) is read as a peer that left
(`PeerLeftError`, one line naming what this rank waited for).

A backend whose Work cannot wait with a timeout (torch's threaded process group, what torch's
FSDP2 tests run on) waits without one: the order check is off there, said once (a warning).

NCCL: `Work.wait()` does not block the host there (it orders the CUDA stream), so this check does
not run; NCCL's own watchdog reports a stuck collective at the group's timeout (the run's
--timeout). zerolab's launches set TORCH_NCCL_DESYNC_DEBUG=1 (the report names the ranks out of
step) and the flight recorder (each rank's last collectives, written on a timeout; read them
with `torchfrtrace`): zerolab.run.preflight.nccl_watch.
"""
from __future__ import annotations

import datetime
import json
import time
import warnings
import zlib

import torch
import torch.distributed as dist

CHECK_S = 2.0           # seconds a gloo wait runs before this rank compares its ledger
TAIL = 64               # records compared (the most recent ones)
HEAR_S = 2 * CHECK_S + 1    # seconds a proving rank waits for the others to read its line
LISTEN_S = 0.25         # seconds between two reads of the store's line by a rank in confirm()


class CollectiveOrderError(RuntimeError):
    """The ranks of a group issued different collectives at the same position of their ledgers.
    `proved`: True on the rank that found the difference, False on a rank that read its line."""

    def __init__(self, line: str, proved: bool = True):
        super().__init__(line)
        self.proved = proved


class PeerLeftError(RuntimeError):
    """A peer of the group left while this rank waited (the store or gloo lost its connection)."""


#: {groups (their global ranks) found out of step: their line}. A collective of theirs never
#: completes, so the process must not wait for it at exit (destroy_process_group joins gloo's
#: workers): `broken()`
BROKEN: dict = {}
NO_TIMEOUT: list = []   # said once: a backend whose Work.wait takes no timeout


POSTED: set = set()     # store keys this process has posted and not taken back


def broken() -> bool:
    """True once a CollectiveOrderError was raised in this process: skip destroy_process_group
    (it would wait for the unmatched collective until the group's timeout) and exit."""
    return bool(BROKEN)


def watched_wait(work, comm, record):
    """Wait for `work` (a gloo Work, or a wrapper whose wait() passes a timeout on). Every
    CHECK_S seconds without completion, read the line a peer posted (`heard`), then compare this
    rank's recent ledger with the other ranks' (`check`). Raises CollectiveOrderError on a
    proven disagreement (or a group already found out of step), PeerLeftError when a peer left
    (gloo's connection closed, or the store stopped answering); whatever else `work.wait`
    raises (the group's timeout) passes through. A Work that takes no timeout is waited for
    without one (the check is off: a warning, once)."""
    if comm.ranks in BROKEN:
        raise CollectiveOrderError(BROKEN[comm.ranks], proved=False)
    posted = False
    while True:
        try:
            done = work.wait(datetime.timedelta(seconds=CHECK_S))
            if posted:                      # (kept when raising: the others read it)
                _store_delete(comm)
            return done
        except RuntimeError as err:
            if "not implemented" in str(err) and "timeout" in str(err):
                _say_no_timeout(err)
                return work.wait()
            if "timed out" not in str(err):
                _check_after(err, comm, record)
                raise
        posted = True
        with _peer_left(comm, record):
            check(comm, record)


def _say_no_timeout(err):
    if not NO_TIMEOUT:
        NO_TIMEOUT.append(str(err))
        warnings.warn("this process group's Work.wait() takes no timeout (torch's threaded "
                      "process group): collectives are waited for without one, so ranks that "
                      "issue them in different orders are not found by zerolab.loop.order",
                      RuntimeWarning, stacklevel=3)


class _peer_left:
    """Store errors inside the block (its host is gone) -> PeerLeftError naming `record`."""

    def __init__(self, comm, record, cause=None):
        self.comm, self.record, self.cause = comm, record, cause

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is None or not isinstance(err, dist.DistError):
            return False
        raise PeerLeftError(left_line(self.comm, self.record, err)) from (self.cause or err)


def left_line(comm, record, err) -> str:
    """One line: a peer left while this rank waited for `record` (a Record, or a confirm label)."""
    what = record if isinstance(record, str) else (
        f"{record.op} {record.what} {record.unit or '-'} (position {record.seq} of the ledger)")
    why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"a peer of rank {comm.rank} left while it waited in {what}: the group's store, "
            f"hosted by rank {comm.ranks[0]} or torchrun, stopped answering ({why}); that "
            "peer's own output says why it left, and every rank must run to the end or stop")


def _check_after(err, comm, record):
    """A peer closed its connection while this rank waited: if it left because it found the
    ranks out of step (its line, or its post, is still in the store), say that here too;
    PeerLeftError when the store went with it."""
    if not any(w in str(err) for w in ("closed by peer", "Connection reset")):
        return
    with _peer_left(comm, record, cause=err):
        check(comm, record)
    raise PeerLeftError(left_line(comm, record, err)) from err


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _key(comm, rank) -> str:
    return f"zerolab/order/{_group(comm)}/{rank}"


def _entry(r) -> list:
    return [r.seq, r.op, r.what, r.unit, r.numel, r.phase]


def check(comm, record):
    """Read the line a peer posted (`heard`); post this rank's last TAIL records, read the other
    ranks' posts (their stalls, and their `confirm` announcements at this rank's positions);
    CollectiveOrderError when two ranks' records differ at one position (`record`: the
    collective this rank waits for)."""
    store = _store()
    if store is None:
        return
    heard(comm, store)
    tail = [_entry(r) for r in comm.records[-TAIL:]]
    _post(store, _key(comm, comm.rank),
          json.dumps({"waits": record.seq, "tail": tail, "passes": _passes(comm)}), POSTED)
    _compare(comm, store, {e[0]: e for e in tail}, range(record.seq, len(comm.records)))


def _compare(comm, store, mine: dict, positions):
    for peer in range(comm.world_size):
        if peer == comm.rank:
            continue
        theirs, passes = {}, {}
        if _posted(store, _key(comm, peer)):                # stalled in a collective
            post = json.loads(store.get(_key(comm, peer)))
            theirs, passes = {e[0]: e for e in post["tail"]}, post["passes"]
        if _posted(store, _confirm_key(comm, peer)):        # waiting in confirm()
            entry = json.loads(store.get(_confirm_key(comm, peer)))
            if entry[0] in positions and entry[0] not in theirs:
                theirs[entry[0]], passes = entry, entry[6]
        for seq in sorted(mine.keys() & theirs.keys()):
            if mine[seq][1:5] != theirs[seq][1:5]:
                prove(comm, store, message(comm.rank, mine[seq], peer, theirs[seq],
                                           _uneven(_passes(comm), passes), comm.root.parents))


def _verdict_key(comm) -> str:
    return f"zerolab/order/{_group(comm)}/line"


def prove(comm, store, line: str):
    """This rank proved the ranks out of step: post `line` (unless a peer posted its own first:
    then that one), wait until every other rank of the group read it (at most HEAR_S seconds),
    and raise it. Every rank then raises the same line, whatever this one does next."""
    key = _verdict_key(comm)
    said = store.compare_set(key, "", line)
    said = said.decode() if isinstance(said, bytes) else str(said)
    if said != line:                        # a peer proved it first: its line
        store.add(key + "/heard", 1)
        BROKEN[comm.ranks] = said
        raise CollectiveOrderError(said, proved=False)
    store.add(key + "/n", 1)
    BROKEN[comm.ranks] = line
    deadline = time.monotonic() + HEAR_S
    try:
        while store.add(key + "/heard", 0) < comm.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    except dist.DistError:                  # the store's host read it and left
        pass
    raise CollectiveOrderError(line, proved=True)


def heard(comm, store):
    """Raise the line a peer of the group posted (`prove`), after saying this rank read it."""
    key = _verdict_key(comm)
    if store.add(key + "/n", 0) <= 0:
        return
    line = store.get(key).decode()
    store.add(key + "/heard", 1)
    BROKEN[comm.ranks] = line
    raise CollectiveOrderError(line, proved=False)


def confirm(comm, label: str, unit: str = ""):
    """Before collectives that some ranks may issue and others not - a block called out of the
    usual order, `gathered()`, the optimizer step (after as many micro-steps on every rank) -
    wait until every rank of the group has announced `label` as often as this rank has. A rank
    found waiting in a different collective meanwhile (or announcing another label) proves the
    disagreement: CollectiveOrderError, before anything mismatched is sent (gloo aborts the
    process on a mismatch of sizes, or lets a smaller message land silently). The last rank to
    arrive pays one store round trip; the others poll, and post what they wait for (for a
    stalled peer to compare) only after POST_AFTER_S. Measured, 2 gloo ranks on one host: about
    as long as an all_reduce of a scalar."""
    store = _store()
    if store is None or comm.world_size == 1 or comm.backend == "fake":
        return
    if comm.ranks in BROKEN:
        raise CollectiveOrderError(BROKEN[comm.ranks], proved=False)
    with _peer_left(comm, f"{label} (waiting for every rank to get there)"):
        _confirm(comm, store, label, unit)


def _confirm(comm, store, label, unit):
    group = _group(comm)
    k = SERIAL[group, label] = SERIAL.get((group, label), 0) + 1  # the same on every rank
    count, target = f"zerolab/confirm/{group}/{label}", k * comm.world_size
    if store.add(count, 1) >= target:
        return
    pos, key = len(comm.records), _confirm_key(comm, comm.rank)
    entry = [pos, "confirm", label, unit, 0, comm.current_phase, _passes(comm)]
    delay, waited, posted, listened = 5e-5, 0.0, False, 0.0
    while store.add(count, 0) < target:
        time.sleep(delay)
        waited += delay
        listened += delay
        delay = min(2 * delay, 0.05)
        if not posted and waited >= POST_AFTER_S:
            _post(store, key, json.dumps(entry), POSTED)
            posted = True
        if listened >= LISTEN_S:            # a peer's line: raised here too
            listened = 0.0
            heard(comm, store)
        if waited >= CHECK_S:               # as long as a collective's slice: compare
            waited = POST_AFTER_S
            _compare(comm, store, {pos: entry}, [pos])  # (the post stays when it raises)
    if posted:                              # passed: no longer waiting there
        POSTED.discard(key)
        store.add(key + "/n", -1)


POST_AFTER_S = 0.005    # a confirm waiting longer than this posts its entry
SERIAL: dict = {}       # (group, label) -> confirms of that label so far in this process


def _passes(comm) -> dict:
    return {str(k): v for k, v in getattr(comm.root, "passes", {0: 0}).items()}


def _uneven(mine: dict, theirs: dict):
    """(k, my count, their count) for the first optimizer step k whose forward passes differ
    between two ranks (a step still running counts as far as it got); None when they agree."""
    for k in sorted(mine.keys() & theirs.keys(), key=int):
        if mine[k] != theirs[k]:
            return int(k), mine[k], theirs[k]
    return None


def _group(comm) -> str:
    return "-".join(map(str, comm.ranks))


def _confirm_key(comm, rank) -> str:
    return f"zerolab/confirm/{_group(comm)}/r{rank}"      # this rank's latest confirm()


def _posted(store, key) -> bool:
    """Whether `key` was posted: its counter (PrefixStore.check ignores the prefix, and a
    store.wait with a timeout logs a warning each time)."""
    return store.add(key + "/n", 0) > 0


def _post(store, key, value: str, mine: set):
    store.set(key, value)
    if key not in mine:                     # the counter says "posted" once per post
        mine.add(key)
        store.add(key + "/n", 1)


def message(rank, a, peer, b, uneven=None, parents=None) -> str:
    """One line: the first differing collective of two ranks, what that means, and the fix.
    uneven: (k, n_rank, n_peer) forward passes in optimizer step k (`_uneven`); parents: {unit:
    class of the layer holding its block} (leaves.holders), named in the leaf advice."""
    def say(e):
        if e[1] == "confirm":
            return f"{e[2]} ({e[5]})"
        return f"{e[1]} {e[2]} {e[3] or '-'} ({e[4]:,} elements, {e[5]})"
    head = (f"ranks issued different collectives at position {a[0]} of the ledger: rank {rank} "
            f"{say(a)}, rank {peer} {say(b)} - ")
    if any(e[1] == "confirm" and e[2] == "gathered()" for e in (a, b)):
        return head + ("strategy.gathered() was entered on some ranks only: it gathers on every "
                       "rank, so enter it on every rank and put the `if rank == 0:` inside it")
    if uneven:
        k, mine, theirs = uneven
        return head + (f"rank {rank} ran {mine} forward passes in optimizer step {k + 1}, rank "
                       f"{peer} {theirs}: every rank must run as many micro-steps as the others "
                       "(each issues collectives); where a rank has no batch left (its data ran "
                       "out, its forward raised), run a batch it has with the loss times 0 (it "
                       "adds nothing to the gradients), or on DDP / ZeRO-1 / ZeRO-2 use "
                       "backward(loss, sync=False) and call strategy.sync_grads() where the "
                       "others run their last backward")
    units = sorted({e[3] for e in (a, b) if e[3] and (e[1] == "confirm" or e[2] in ("params",
                                                                                     "grads"))})
    if not units:
        return head + ("a collective was issued on some ranks only (a rank-dependent branch "
                       "around a collective): every rank must issue the same sequence")
    layer = sorted({(parents or {}).get(u, "") for u in units} - {""})
    layer = layer[0] if len(layer) == 1 else "TheLayerHoldingThem"
    return head + (f"blocks {' / '.join(units)} run in an order or number that differs between "
                   "ranks (e.g. experts called in the order of each rank's tokens); every rank "
                   "must issue the same sequence: call them in one order on every rank, or make "
                   "the blocks whose order varies one unit, gathered and reduced together "
                   f"(zerolab.set_leaf_modules(model, [{layer}]) before the strategy is built, "
                   "with find_unused_parameters=True if one of them may get no tokens on a "
                   "rank; DeepSpeed's set_z3_leaf_modules; with fully_shard, shard their parent "
                   "only)")


def _store_delete(comm):
    """This rank no longer waits: its stall post is taken back."""
    store, key = _store(), _key(comm, comm.rank)
    if store is not None and key in POSTED:
        POSTED.discard(key)
        store.add(key + "/n", -1)


def agree(comm, sync: bool, since: int, device="cpu") -> int:
    """Before a ZeRO-3 backward: every rank passed the same `sync`, and issued the same
    all_gathers (op, unit, size of each "params" record of `comm`'s ledger after record `since`).
    One all_reduce (max) of 4 int64 (ledger: what "metric", unit "agree"). Returns the new
    `since`. device: where the backend reduces (CUDA for NCCL). RuntimeError (one line, on
    every rank) when they differ: uneven micro-steps, or blocks called in an order that differs
    between ranks (when the counts of gathers differ, the ranks cannot get here: their
    collectives already mismatched)."""
    records = comm.records
    if torch.device(device).type == "meta":     # zerolab.timing.whatif: no values to compare
        return len(records)
    seq = "|".join(f"{r.op}:{r.unit}:{r.numel}" for r in records[min(since, len(records)):]
                   if r.what == "params")
    h = zlib.crc32(seq.encode())
    flags = torch.tensor([int(sync), -int(sync), h, -h], dtype=torch.int64, device=device)
    with comm.phase("backward"):
        comm.all_reduce(flags, what="metric", unit="agree", op="max")
    if flags[0] != -flags[1]:
        raise RuntimeError(
            "ranks disagree on sync at this backward (some passed sync=True, some False): ZeRO-3 "
            "gathers the weights in every micro-step, so every rank must run the same number of "
            "micro-steps; give every rank as many, or use ZeRO-2 (sync=False accumulates locally)")
    if flags[2] != -flags[3]:
        raise RuntimeError(
            "ranks issued different all_gathers since the last backward (blocks called in an "
            "order or number that differs between ranks): ZeRO-3 needs every rank to call the "
            "blocks in the same sequence (FSDP2 too); skipping blocks is fine")
    return len(records)

