"""Injected faults end every run in bounded time, with every rank gone and no temp files left.

Each case starts a real launch (preset nano, gloo on CPU, loopback only), injects one fault into
a process of its tree (torchrun's agent, a rank, the launcher, `zerolab labs`), and checks: the
launch ends within the case's timeout and says why in its first line; no process of the run is
left (ranks live in sessions of their own, so this is checked by command line); the launch's
private temp folder, which holds torchrun's `torchelastic_*` folders and the kernels' connection
files, is gone. Every case has a pytest timeout.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import sigint_default

LAUNCHER = textwrap.dedent("""
    import sys
    from zerolab.run.launch import LaunchError, run_torchrun
    try:
        run_torchrun(["--stages", "0", "--preset", "nano", "--steps", "100000", "--no-allocator",
                      "--out", sys.argv[1]], 2, timeout=float(sys.argv[2]))
    except LaunchError as err:
        print("LAUNCH ERROR:", str(err).splitlines()[0], flush=True)
        raise SystemExit(3)
""")


def pids_with(*needles: str) -> list[int]:
    """Live (not zombie) processes whose command line holds every needle."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and all(n in cmd for n in needles) and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def private_dirs(launcher_pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"zerolab-run-{launcher_pid}-*"))


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Launch:
    """A launcher subprocess training until a fault is injected; `.marker` tags its ranks."""

    def __init__(self, tmp_path, timeout=150):
        self.out = str(tmp_path / "run")
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, self.out, str(timeout)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.seen = []
        for line in self.proc.stdout:              # wait until both ranks are training
            self.seen.append(line)
            if "step 2/" in line:
                break
        assert self.ranks(), "no rank was running:\n" + "".join(self.seen)

    def ranks(self):
        agent = set(self.agent())
        return [pid for pid in pids_with("-m zerolab.run.train", self.out) if pid not in agent]

    def agent(self):
        return pids_with("-m zerolab.run.launch", self.out)

    def finish(self, within: float) -> tuple[int, str]:
        t0 = time.monotonic()
        try:
            rest, _ = self.proc.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest, _ = self.proc.communicate()
            kill_all(self.ranks() + self.agent())
            pytest.fail(f"the launch did not end within {within} s:\n{''.join(self.seen)}{rest}")
        self.seconds = time.monotonic() - t0
        return self.proc.returncode, rest

    def assert_clean(self):
        deadline = time.monotonic() + 5
        while (self.ranks() or self.agent()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = self.ranks() + self.agent()
        kill_all(left)
        assert not left, f"processes left running: {left}"
        assert private_dirs(self.proc.pid) == [], "the launch's temp folder was left behind"


# --- security: a single-node run listens on loopback only --------------------------------------
def _listening() -> dict[str, str]:
    """{socket inode: local address} of every listening TCP socket (/proc/net/tcp, tcp6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":                    # TCP_LISTEN
                found[f[9]] = f[1]
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    return inodes


def _is_loopback(hex_addr: str) -> bool:
    ip = hex_addr.split(":")[0]
    if len(ip) == 8:                            # IPv4, little-endian: 0100007F = 127.0.0.1
        return ip[-2:] == "7F"
    return ip == "00000000000000000000000001000000"   # ::1


@pytest.mark.timeout(150)
def test_loopback_only_listeners_then_agent_sigkill_stops_every_rank(tmp_path):
    """Also checks, while the run trains, that every listening socket of torchrun's agent (its
    rendezvous stores) and of the ranks (gloo) is on loopback, in the kernel's socket table."""
    run = Launch(tmp_path)
    (agent,) = run.agent()
    listening = _listening()
    sockets = {ino: listening[ino] for pid in [agent, *run.ranks()] for ino in _socket_inodes(pid)
               if ino in listening}
    assert len(sockets) >= 2, "found neither the rendezvous store nor gloo's listeners"
    assert all(_is_loopback(a) for a in sockets.values()), \
        f"listening beyond loopback: {sorted(a for a in sockets.values() if not _is_loopback(a))}"
    assert list(Path(tempfile.gettempdir()).glob(f"zerolab-run-{run.proc.pid}-*/torchelastic_*")), \
        "torchrun's torchelastic_* folder is not inside the launch's private temp folder"
    os.kill(agent, signal.SIGKILL)
    code, rest = run.finish(within=40)
    assert code == 3 and "torchrun was killed by SIGKILL" in rest, rest
    run.assert_clean()
    assert run.seconds < 30, "the launch went on long after its agent died (its timeout: 150 s)"


@pytest.mark.timeout(150)
def test_rank_sigkilled_with_its_agent_gone_too(tmp_path):
    """A member of the same kind built here: the agent is SIGSTOPped (it can supervise nothing)
    and a rank is SIGKILLed; the launch still ends at its timeout and nothing is left."""
    run = Launch(tmp_path, timeout=25)
    (agent,) = run.agent()
    os.kill(agent, signal.SIGSTOP)
    os.kill(run.ranks()[0], signal.SIGKILL)
    code, rest = run.finish(within=90)
    assert code == 3 and "timed out after 25 s" in rest, rest
    run.assert_clean()


@pytest.mark.timeout(150)
def test_sigstopped_rank_at_timeout_is_stopped_after_torchrun_shuts_down(tmp_path):
    run = Launch(tmp_path, timeout=20)
    stopped = run.ranks()[1]
    os.kill(stopped, signal.SIGSTOP)
    code, rest = run.finish(within=90)
    assert code == 3 and "timed out after 20 s" in rest, rest
    run.assert_clean()


# --- the rendezvous port -------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bind_host, endpoint_host", [("127.0.0.1", "127.0.0.1"),
                                                      ("0.0.0.0", "localhost")])
def test_rendezvous_port_held_by_another_program_is_one_line(tmp_path, bind_host, endpoint_host):
    with socket.socket() as other:
        other.bind((bind_host, 0))
        other.listen()
        port = other.getsockname()[1]
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "zerolab", "train", "--preset", "nano",
                              "--steps", "2", "--rdzv-endpoint", f"{endpoint_host}:{port}",
                              "--out", str(tmp_path / "o"), "--timeout", "600"],
                             capture_output=True, text=True, timeout=110)
        seconds = time.monotonic() - t0
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert f"port {port} is already held by another program" in lines[0]
    assert seconds < 100                    # not the --timeout of 600 s
    assert not (tmp_path / "o").exists()


# --- zerolab labs interrupted ----------------------------------------------------------------------
SLOW_LAB = {"cells": [{"cell_type": "code", "id": "params", "metadata": {"tags": ["parameters"]}, "outputs": [],
                       "execution_count": None, "source": ["out = None\n"]},
                      {"cell_type": "code", "id": "slow", "metadata": {}, "outputs": [],
                       "execution_count": None,
                       "source": ["import time\n", "print('LAB STARTED', flush=True)\n",
                                  "time.sleep(120)\n"]}],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                        "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}

LABS_DRIVER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from zerolab import cli
    from zerolab.course import labs
    labs.LAB_DIR = Path(sys.argv[1])
    sys.exit(cli.main(["labs", "--out", sys.argv[2], "--timeout", "100"]))
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_zerolab_labs_stops_the_whole_run(tmp_path, sig):
    books = tmp_path / "labs"
    books.mkdir()
    for name in ("lab1_slow.ipynb", "lab2_next.ipynb"):
        (books / name).write_text(json.dumps(SLOW_LAB))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", LABS_DRIVER, str(books), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=sigint_default)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "LAB STARTED" in line:
            break
    kernel = [pid for pid in pids_with("ipykernel", f"zerolab-run-{proc.pid}-")]
    files = [Path(f) for pid in kernel for f in re.findall(
        r"-f (\S+\.json)", Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())]
    assert files and all(f.exists() for f in files), \
        "the kernel's connection file is not in the launch's private folder"
    proc.send_signal(sig)
    try:
        rest, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("zerolab labs did not stop within 60 s:\n" + "".join(seen))
    assert proc.returncode == 130, "".join(seen) + rest
    assert "lab2_next" not in rest, "".join(seen) + rest     # the next lab never started
    report = (out / "report.md").read_text()
    assert "interrupted" in report.lower() and "1 of 2 labs" in report
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert not (out / "lab2_next.ipynb").exists()
    assert not any(f.exists() for f in files), "the kernel's connection file was left behind"
    assert private_dirs(proc.pid) == []
    deadline = time.monotonic() + 5
    while pids_with(f"zerolab-run-{proc.pid}-") and time.monotonic() < deadline:
        time.sleep(0.2)
    left = pids_with(f"zerolab-run-{proc.pid}-")   # the kernel: its connection file is in there
    kill_all(left)
    assert not left, "the lab's kernel is still running"


@pytest.mark.timeout(150)
def test_ranks_die_with_their_agent_even_without_zerolabs_launcher(tmp_path):
    """Plain torchrun (no zerolab launcher watching): SIGKILL its agent and every rank still
    ends within seconds, by the parent-death signal each rank asks Linux for."""
    out = str(tmp_path / "bare")
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", "2", "-m", "zerolab.run.train", "--preset", "nano",
                              "--steps", "100000", "--no-allocator", "--out", out],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    seen = []
    for line in agent.stdout:
        seen.append(line)
        if "step 2/" in line:
            break
    ranks = [p for p in pids_with("-m zerolab.run.train", out) if p != agent.pid]
    assert len(ranks) == 2, "".join(seen)
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 15
    while any(p in pids_with("-m zerolab.run.train", out) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in ranks if p in pids_with("-m zerolab.run.train", out)]
    kill_all(left)
    agent.stdout.close()
    assert not left, f"ranks outlived their SIGKILLed agent: {left}"
