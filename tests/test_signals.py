"""A signal to a command that starts processes stops every one of them (issue #23, item 3).

Each case starts a real `python -m zerolab COMMAND` in a session of its own, waits until its
ranks run, remembers every process descended from it (by pid and start time, so a recycled pid
is never mistaken for one of them), sends the command one SIGTERM (SIGINT for one `check`), and
checks that the command ends in bounded time, saying why in its last line where it can, and
that none of the processes it started is left. `labs` has its own cases in test_faults.py.
`zerolab check` is also checked for its listeners while its ranks run: loopback only, with
MASTER_ADDR=0.0.0.0 in its environment.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import sigint_default
from test_faults import _is_loopback, _listening, _socket_inodes


# --- the processes a command started ------------------------------------------------------------
def _table() -> dict[int, tuple[int, int, str, str]]:
    """{pid: (ppid, start time, state, command line)} from /proc."""
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        out[int(entry)] = (int(fields[1]), int(fields[19]), fields[0], cmd)
    return out


def descendants(root: int, known: dict | None = None) -> dict[int, int]:
    """{pid: start time} of `root` and every process below it, plus those already `known`."""
    known, table = dict(known or {}), _table()
    members = {p for p, start in known.items() if p in table and table[p][1] == start}
    members |= {root} if root in table else set()
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _, _, _) in table.items():
            if ppid in members and pid not in members:
                members.add(pid)
                grew = True
    known.update({p: table[p][1] for p in members if p not in known})
    return known


def alive(known: dict) -> dict[int, str]:
    """{pid: command line} of the `known` processes still running (not zombies)."""
    table = _table()
    return {p: table[p][3] for p, start in known.items()
            if p in table and table[p][1] == start and table[p][2] != "Z"}


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Command:
    """`python -m zerolab ARGS` in a session of its own, its process tree followed."""

    def __init__(self, args, env=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "zerolab", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, **(env or {})},
                                     preexec_fn=sigint_default)
        self.known: dict[int, int] = {}

    def wait_for(self, ready, within: float = 150):
        """Follow the tree until ready(alive processes) is true."""
        end = time.monotonic() + within
        while time.monotonic() < end:
            self.known = descendants(self.proc.pid, self.known)
            if ready(alive(self.known)):
                time.sleep(0.5)             # a last look: every rank started by now
                self.known = descendants(self.proc.pid, self.known)
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the command ended first:\n{self.proc.stdout.read()}")
            time.sleep(0.2)
        self.kill()
        pytest.fail("its ranks never appeared")

    def signal(self, sig, within: float) -> tuple[int, str, float]:
        """Send `sig`; (exit code, output, seconds until every process it started is gone)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the command did not end within {within} s of {sig.name}")
        while alive(self.known) and time.monotonic() < t0 + within:
            time.sleep(0.1)
        left = alive(self.known)
        kill_all(left)
        assert not left, f"left running after {sig.name}: {left}"
        return self.proc.returncode, out, time.monotonic() - t0

    def kill(self):
        kill_all(alive(self.known))
        self.proc.kill()
        self.proc.communicate()


# --- zerolab check ---------------------------------------------------------------------------------
HANGING = {   # exercise -> a learner's file that marks each process it runs in, then hangs there
    "ddp": textwrap.dedent("""
        import os, time
        from pathlib import Path
        def all_reduce_bucket(comm, unit, world_size):
            (Path({flags!r}) / str(os.getpid())).touch()     # a rank runs the learner's code
            time.sleep(1e6)
    """),
    "timing": textwrap.dedent("""
        import os
        from pathlib import Path
        def ring_time(op, size_bytes, n, link):
            (Path({flags!r}) / str(os.getpid())).touch()     # the judge runs the learner's code
            while True:
                pass
    """)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig, exercise, processes", [(signal.SIGTERM, "ddp", 2),
                                                      (signal.SIGINT, "timing", 1),
                                                      (signal.SIGKILL, "ddp", 2)],
                         ids=["SIGTERM-ranks", "SIGINT-judge", "SIGKILL-ranks"])
def test_signal_to_zerolab_check_stops_every_process(tmp_path, sig, exercise, processes):
    """The issue's example - SIGTERM to `zerolab check` while the learner's code hangs on its
    ranks - Ctrl-C while it hangs in the judge (the fork that grades without ranks), and SIGKILL,
    which the check cannot see: its ranks notice it is gone (their parent, multiprocessing's
    forkserver, would outlive it while they hold its pipe, and they would sleep on). While
    the ranks run, every listening socket of the check and of its ranks (the rendezvous store,
    gloo) is on loopback although the environment says MASTER_ADDR=0.0.0.0."""
    flags = tmp_path / "flags"
    flags.mkdir()
    impl = tmp_path / "mine.py"
    impl.write_text(HANGING[exercise].format(flags=str(flags)))
    cmd = Command(["check", exercise, "--impl", str(impl), "--nproc", "2", "--call-timeout",
                   "600"], env={"MASTER_ADDR": "0.0.0.0", "MASTER_PORT": "29500"})
    cmd.wait_for(lambda procs: len(list(flags.iterdir())) == processes)
    learners = [int(f.name) for f in flags.iterdir()]
    assert set(learners) <= set(alive(cmd.known)), "the learner's code ran outside the check"
    assert cmd.proc.pid not in learners, "the learner's code ran in the checking process"
    if exercise == "ddp":
        listening = _listening()
        sockets = {ino: listening[ino] for pid in [cmd.proc.pid, *learners]
                   for ino in _socket_inodes(pid) if ino in listening}
        assert len(sockets) >= 2, "found neither the rendezvous store nor gloo's listeners"
        assert all(_is_loopback(a) for a in sockets.values()), sockets
    code, out, seconds = cmd.signal(sig, within=30)
    assert seconds < 10, seconds
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        return
    how = "interrupted" if sig == signal.SIGINT else f"terminated ({sig.name})"
    assert code == 130, out
    assert out.strip().splitlines()[-1] == (f"zerolab check: {how}: every process of the check "
                                            f"was stopped"), out


# --- the commands that launch torchrun ----------------------------------------------------------
LAUNCHES = {   # argv after `zerolab`, a piece of a rank's command line
    "train": (["train", "--stage", "0", "--preset", "nano", "--steps", "100000", "--nproc", "2"],
              "-m zerolab.run.train"),
    "compare": (["compare", "--preset", "nano", "--steps", "100000", "--nproc", "2"],
                "-m zerolab.run.train"),
    "bench": (["bench", "--nproc", "2", "--preset", "nano", "--systems", "zerolab-ddp",
               "--rounds", "10000"], "-m zerolab.course.bench"),
    "doctor": (["doctor"], "-m zerolab.course.doctor --rank"),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("command", LAUNCHES)
def test_sigterm_to_a_launching_command_stops_every_process(tmp_path, command):
    """SIGTERM as soon as the ranks exist: the launcher stops torchrun and its ranks (doctor,
    whose rank check runs in a thread, dies of the signal; its children follow it)."""
    args, rank = LAUNCHES[command]
    out = ["--out", str(tmp_path / "o")] if command != "doctor" else []
    cmd = Command(args + out, env={"MASTER_ADDR": "0.0.0.0"})
    cmd.wait_for(lambda procs: sum(rank in c for c in procs.values()) >= 2)
    listening = _listening()                # torchrun's stores, gloo: on loopback only
    sockets = {ino: listening[ino] for pid in alive(cmd.known) for ino in _socket_inodes(pid)
               if ino in listening}
    assert all(_is_loopback(a) for a in sockets.values()), sockets
    code, text, seconds = cmd.signal(signal.SIGTERM, within=60)
    if command == "doctor":
        assert code in (130, -signal.SIGTERM), text
    else:
        assert code == 130 and f"zerolab {command}: terminated (SIGTERM)" in text, text
    assert seconds < 45, seconds            # launch.py gives torchrun 35 s to stop its ranks
