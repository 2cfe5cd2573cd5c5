"""Clusters through Slurm: `scripts/slurm/zerolab.sbatch` under a real Slurm, and the rendezvous
that `zerolab.run.slurm` reads from Slurm's environment.

The pure functions are checked on sample environments (host lists, node rank, port, refusals).
The real test starts a one-node cluster on this machine: munged with a key and socket of its own,
slurmctld and slurmd (Debian's slurm-wlm 22.05) in the foreground, the node named `localhost`,
no cgroups (proctrack/linuxproc, task/none), ports, state and logs in a temp folder; the daemons
are installed with apt when missing (as root, or with sudo that needs no password; .ci/run
installs them beforehand). It submits the batch script with `sbatch --wait` as two tasks on the
node (two launchers of one rank each, node ranks 0 and 1, the rendezvous at the first host of
the node list and a port from the job id) while a plain `zerolab train --nproc 2` of the same
world runs, and checks that every rank's JSON is identical but for the run id and the clocks,
and that params.pt holds the same bytes (torch's zip prefixes each member with the temp file's
name, so the members are compared). OMP_NUM_THREADS=1 as torchrun sets it for --nproc 2: a
launcher of one rank leaves torch's threads alone, and two threads round a matmul differently.
Every daemon is stopped afterwards, job or not. Measured on 2 cores that other jobs kept busy
(load average 7-10): the cluster is up in about 1 s, the sbatch test took 75-99 s, about 50 s of
it CPU (ten Python processes that import torch: two launchers, two agents and two ranks under
Slurm, one launcher, one agent and two ranks plain); installing slurm-wlm and munge took 24 s.

What a one-node cluster cannot show: traffic between two machines (the rendezvous store and gloo
listening on a real interface, host names resolving on every node, a firewall), srun placing one
task on each of several nodes (node ranks from SLURM_PROCID on different hosts), GPUs given per
node (--gpus-per-node, NCCL), and a file system shared by the nodes. Several nodes are covered by
tests/test_checkpoint.py::test_two_launchers_form_one_world_of_four (two launchers of two ranks,
static rendezvous, the same losses and bytes as --nproc 4) and its sibling
test_when_one_launcher_dies_the_other_exits_with_a_clear_line; both run on loopback.

The batch script `zerolab slurm --print-script` writes is run twice from a submit folder that
would shadow a module (a learner's torch.py, the checkout `zerolab/`): by bash with a stand-in
for srun (always), and submitted to the one-node cluster with sbatch (12 s measured).

Skipped when Slurm or munge is missing and cannot be installed, unless ZEROLAB_REQUIRE_SLURM=1
(set by .ci/run): then it fails instead.
"""
from __future__ import annotations

import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from zerolab import cli
from zerolab.course.testing import free_port
from zerolab.run import slurm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "slurm" / "zerolab.sbatch"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue",
         "scancel")
TRAIN = ["train", "--preset", "nano", "--stage", "3", "--precision", "fp32", "--steps", "3",
         "--save-params", "--timeout", "150"]


# --- the rendezvous from a sample environment ---------------------------------------------------
def env(**kw):
    base = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08],login1"}
    return {k: v for k, v in {**base, **kw}.items() if v is not None}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu[07-08],cpu1", ["gpu07", "gpu08", "cpu1"]),
    ("n[001-003]", ["n001", "n002", "n003"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,b[1,3-4]", ["a", "b1", "b3", "b4"]),
])
def test_host_lists_expand_as_scontrol_does(nodelist, hosts):
    assert slurm.hostnames(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "n[1-2", "n[2-1]", "n[a-b]"])
def test_a_host_list_that_cannot_be_read_is_refused(nodelist):
    with pytest.raises(ValueError, match="Slurm node list"):
        slurm.hostnames(nodelist)


def test_each_task_gets_its_node_rank_and_the_first_hosts_endpoint():
    assert slurm.rendezvous(env()) == {"nnodes": 2, "node_rank": 1,
                                       "rdzv_endpoint": "gpu07:29936"}  # 20000 + 8·4242 % 12000
    assert slurm.rendezvous(env(SLURM_PROCID="0"))["node_rank"] == 0
    assert slurm.rendezvous(env(SLURM_STEP_NODELIST=None))["rdzv_endpoint"] == "gpu07:29936"
    ports = {slurm.port(env(SLURM_JOB_ID=str(j), SLURM_STEP_ID=str(s)))
             for j in range(100, 110) for s in range(2)}
    assert len(ports) == 20 and all(20000 <= p < 32000 for p in ports)  # below ephemeral ports
    assert slurm.rendezvous(env(ZEROLAB_RDZV_PORT="23456"))["rdzv_endpoint"] == "gpu07:23456"


def test_one_task_runs_standalone_and_labs_run_on_task_0_only():
    one = env(SLURM_NTASKS="1", SLURM_PROCID="0")
    assert slurm.rendezvous(one) == {}
    assert slurm.command(["train", "--nproc", "4"], one) == ["train", "--nproc", "4"]
    assert slurm.command(["compare", "--nproc", "2"], env()) == [
        "compare", "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-endpoint", "gpu07:29936"]
    labs = ["labs", "-p", "nproc=2"]
    assert slurm.command(labs, env(SLURM_PROCID="0")) == labs
    assert slurm.command(labs, env()) is None


@pytest.mark.parametrize("argv, environ, says", [
    (["train", "--nnodes", "3"], env(), "--nnodes: set from Slurm"),
    (["train", "--rdzv-endpoint=h:1"], env(), "--rdzv-endpoint: set from Slurm"),
    (["--stage", "3"], env(), "give a zerolab command first"),
    (["train"], {}, "not inside a Slurm job step"),
    (["train"], env(SLURM_PROCID="2"), "not below SLURM_NTASKS"),
    (["train"], env(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None), "NODELIST"),
    (["train"], env(ZEROLAB_RDZV_PORT="80"), "ZEROLAB_RDZV_PORT"),
])
def test_what_slurm_sets_cannot_be_given_and_outside_a_job_it_says_so(argv, environ, says):
    with pytest.raises(ValueError, match=says):
        slurm.command(argv, environ)


def test_outside_a_job_step_zerolab_slurm_exits_with_one_line(monkeypatch, capsys):
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr("zerolab.run.launch.run", lambda *a, **k: pytest.fail("a launch started"))
    assert cli.main(["slurm", "train", "--stage", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zerolab slurm: error: SLURM_NTASKS=None: not "
                                               "inside a Slurm job step"), err


def test_readme_and_workshop_show_the_script():
    assert os.access(SCRIPT, os.X_OK)
    for doc in (ROOT / "README.md", ROOT / "docs" / "workshop.md"):
        assert "sbatch scripts/slurm/zerolab.sbatch train" in doc.read_text(), doc


def test_slurm_help_gives_usage_the_script_and_an_example(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["slurm", "--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0
    assert "zerolab slurm --print-script COMMAND" in text and "zerolab slurm COMMAND" in text
    assert "sbatch --nodes=4 job.sbatch" in text                       # an example
    script = slurm.sbatch_script(["train", "--preset", "gpt2", "--nproc", "8", "--out",
                                  "runs/slurm"], python="/path/to/python")
    for line in script.splitlines():                                   # the script, shown
        if not line.startswith("# "):
            assert "  " + line in text, line


def test_print_script_refuses_what_a_task_would_refuse(capsys):
    assert cli.main(["slurm", "--print-script", "train", "--nnodes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nnodes" in err[0] and "leave it out" in err[0], err
    with pytest.raises(SystemExit) as stop:     # argparse refuses the value (its range)
        cli.main(["slurm", "--print-script", "--nodes", "0", "train"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "--nodes" in err[0] and "'0'" in err[0], err


FAKE_SRUN = """#!/bin/bash
# srun for one task on this machine: drop srun's options, set what Slurm sets, run the rest
while [[ "$1" == --* ]]; do shift; done
export SLURM_NTASKS=1 SLURM_PROCID=0 SLURM_JOB_ID=7 SLURM_STEP_ID=0 SLURM_STEP_NODELIST=localhost
exec "$@"
"""


@pytest.mark.timeout(200)
def test_the_printed_script_trains_from_a_folder_holding_a_learners_torch_py(tmp_path, capsys):
    """The batch script `--print-script` writes, run as a job starts it (bash, in the submit
    folder, srun on PATH: a stand-in for one task) from a folder that holds a learner's torch.py
    - which Python started there imports (checked first) - trains: the launcher and its ranks
    import the installed torch and this zerolab."""
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / "torch.py").write_text("raise ImportError('the torch.py of the submit folder')\n")
    premise = subprocess.run([sys.executable, "-c", "import torch"], cwd=submit, text=True,
                             capture_output=True, env={k: v for k, v in os.environ.items()
                                                       if k != "PYTHONSAFEPATH"})
    assert "the torch.py of the submit folder" in premise.stderr
    assert cli.main(["slurm", "--print-script", "train", "--preset", "nano", "--steps", "1",
                     "--nproc", "2"]) == 0
    script = tmp_path / "job.sbatch"
    script.write_text(capsys.readouterr().out)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(FAKE_SRUN)
    (tmp_path / "bin" / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONSAFEPATH", None)
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["bash", str(script), "--out", str(tmp_path / "out")], cwd=submit,
                         env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "zerolab slurm: task 0 of 1" in res.stdout
    ranks = [json.loads((tmp_path / "out" / "stage0" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]


# --- a one-node cluster on this machine -------------------------------------------------------
def _tool(name):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def _without(reason):
    if os.environ.get("ZEROLAB_REQUIRE_SLURM") == "1":
        pytest.fail(f"{reason} (ZEROLAB_REQUIRE_SLURM=1)")
    pytest.skip(reason)


def _install():
    """apt-get install slurm-wlm munge when a tool is missing: as root, or with sudo -n."""
    missing = [t for t in TOOLS if not _tool(t)]
    if not missing:
        return
    if os.geteuid() == 0:
        sudo = []
    elif shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"],
                                                 capture_output=True).returncode == 0:
        sudo = ["sudo", "-n"]
    else:
        _without(f"{', '.join(missing)} missing, and no root or sudo to install slurm-wlm munge")
    if not shutil.which("apt-get"):
        _without(f"{', '.join(missing)} missing, and no apt-get to install slurm-wlm munge")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        res = subprocess.run([*sudo, "env", "DEBIAN_FRONTEND=noninteractive", *cmd],
                             capture_output=True, text=True, timeout=900)
        if res.returncode:
            _without(f"{' '.join(cmd)} failed: {(res.stdout + res.stderr)[-1500:]}")
    missing = [t for t in TOOLS if not _tool(t)]
    if missing:
        _without(f"{', '.join(missing)} still missing after installing slurm-wlm munge")


CONF = """\
ClusterName=zerolab
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
FirstJobId={first_job}
# sbatch --wait polls every 2 s while 2 s < MinJobAge / 2, else 4x longer each time
MinJobAge=5
NodeName=localhost CPUs=2 RealMemory=100 State=UNKNOWN
PartitionName=zerolab Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """A one-node Slurm on loopback: `env` points Slurm's commands at it (SLURM_CONF)."""

    def __init__(self, root: Path):
        self.root, self.procs = root, []
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, name, *argv):
        log = open(self.root / f"{name}.out", "w")
        self.procs.append(subprocess.Popen([_tool(argv[0]), *argv[1:]], stdout=log,
                                           stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))
        log.close()

    def run(self, *argv, timeout=30, **kw):
        return subprocess.run([_tool(argv[0]), *argv[1:]], env=kw.pop("env", self.env),
                              capture_output=True, text=True, timeout=timeout, **kw)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")))

    def wait_idle(self, seconds=45):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            res = self.run("sinfo", "-h", "-N", "-o", "%T")
            if res.returncode == 0 and res.stdout.strip() == "idle":
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.3)
        pytest.fail(f"the one-node cluster did not come up:\n{self.logs()}")

    def stop(self):
        """Cancel every job, then SIGTERM / SIGKILL each daemon's process group, then any process
        left that carries this cluster's SLURM_CONF (a step's ranks, by their environment)."""
        with _quiet():
            self.run("scancel", "--full", "--partition=zerolab", timeout=10)
            end = time.monotonic() + 10
            while time.monotonic() < end and self.run("squeue", "-h", timeout=10).stdout.strip():
                time.sleep(0.3)
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            for p in self.procs:
                with _quiet():
                    os.killpg(p.pid, sig)
            for p in self.procs:
                with _quiet():
                    p.wait(wait)
        mark = f"SLURM_CONF={self.conf}\0".encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with _quiet():
                if int(pid) != os.getpid() and mark in Path(f"/proc/{pid}/environ").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)


class _quiet:
    """Ignore what a clean-up step raises (a process already gone, a daemon not answering)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (OSError, subprocess.SubprocessError))


@pytest.fixture(scope="module")
def cluster():
    _install()
    root = Path(tempfile.mkdtemp(prefix="zerolab-slurm-"))  # short: slurmd's sockets live in it
    c = Cluster(root)
    try:
        root.chmod(0o755)
        for sub in ("munge", "state", "spool"):
            (root / sub).mkdir(mode=0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        c.start("munged", "munged", "--foreground", "--force", f"--socket={root}/munge/socket",
                f"--key-file={key}", f"--pid-file={root}/munge/pid",
                f"--seed-file={root}/munge/seed", f"--log-file={root}/munged.log")
        c.conf.write_text(CONF.format(root=root, user=pwd.getpwuid(os.geteuid()).pw_name,
                                      ctld_port=free_port(), d_port=free_port(),
                                      first_job=random.randint(1, 900_000)))
        end = time.monotonic() + 15
        while not (root / "munge" / "socket").exists() and time.monotonic() < end:
            time.sleep(0.1)
        c.start("slurmctld", "slurmctld", "-D", "-i")
        c.start("slurmd", "slurmd", "-D", "-N", "localhost")
        c.wait_idle()
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _stable(path: Path) -> dict:
    """A rank's JSON less what differs between any two runs: the run id, the clocks, and the
    hash of params.pt (see _members)."""
    d = json.loads(path.read_text())
    for key in ("run_id", "step_times_s", "params_sha256"):
        d.pop(key)
    for rec in d["comm"]["records"]:
        for key in ("time_s", "issue_to_done_s", "algbw", "busbw"):
            rec.pop(key, None)
    return d


def _members(path: Path) -> dict:
    """params.pt's zip members by name, without the folder torch names after the file it writes
    (a temp file's random name here)."""
    with zipfile.ZipFile(path) as z:
        return {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}


@pytest.mark.timeout(900)           # the first test on the cluster: it may apt-get install Slurm
def test_scontrol_expands_host_lists_as_we_do(cluster):
    for nodelist in ("gpu[07-08],cpu1", "n[001-003]", "n[9-11]", "rack[1-2]-n[01-02]"):
        res = cluster.run("scontrol", "show", "hostnames", nodelist)
        assert res.stdout.split() == slurm.hostnames(nodelist), res.stderr


@pytest.mark.timeout(400)
def test_sbatch_run_equals_a_plain_run_byte_for_byte(cluster, tmp_path):
    env = {**cluster.env, "ZEROLAB_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    plain = subprocess.Popen([sys.executable, "-m", "zerolab", *TRAIN, "--nproc", "2", "--out",
                              str(tmp_path / "plain")], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                             start_new_session=True)
    try:
        job_out = tmp_path / "job.out"
        res = cluster.run("sbatch", "--wait", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                          "--cpus-per-task=1", "--overcommit", "--time=5", f"--output={job_out}",
                          f"--chdir={tmp_path}", str(SCRIPT), *TRAIN, "--nproc", "1", "--out",
                          str(tmp_path / "slurm"), env=env, timeout=300)
        log = job_out.read_text() if job_out.exists() else "(no job output)"
        assert res.returncode == 0, f"{res.stdout}{res.stderr}\n{log}\n{cluster.logs()}"
        plain_log = plain.communicate(timeout=200)[0]
    finally:
        if plain.poll() is None:
            os.killpg(plain.pid, signal.SIGKILL)
    assert plain.returncode == 0, plain_log
    job = {"SLURM_JOB_ID": res.stdout.split()[-1], "SLURM_STEP_ID": "0"}
    for task in (0, 1):                # two launchers: node ranks, the endpoint from the job id
        assert (f"zerolab slurm: task {task} of 2 on " in log and f"--node-rank {task} "
                f"--rdzv-endpoint localhost:{slurm.port(job)}" in log), log
    manifest = json.loads((tmp_path / "slurm" / "run.json").read_text())
    assert manifest["status"] == "ok" and manifest["world_size"] == 2, manifest
    assert manifest["args"]["nnodes"] == 2 and manifest["args"]["nproc"] == 1
    for rank in (0, 1):
        a = _stable(tmp_path / "plain" / "stage3" / f"rank{rank}.json")
        b = _stable(tmp_path / "slurm" / "stage3" / f"rank{rank}.json")
        assert b["world_size"] == 2 and b["rank"] == rank
        assert b["losses"] == a["losses"] and b["grad_norms"] == a["grad_norms"]
        assert b == a
    a, b = (_members(tmp_path / d / "stage3" / "params.pt") for d in ("plain", "slurm"))
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


@pytest.mark.timeout(400)
def test_the_printed_script_runs_under_sbatch_from_the_clones_parent(cluster, tmp_path):
    """`zerolab slurm --print-script` for one node, submitted with sbatch (its #SBATCH lines read
    by Slurm; CPUs and output overridden on sbatch's command line, as the script's comment says)
    from a folder that holds the checkout `zerolab/` and a learner's torch.py, with no
    PYTHONPATH or PYTHONSAFEPATH in the submitting shell: the job trains with this zerolab."""
    submit = tmp_path / "submit"
    (submit / "zerolab" / "zerolab").mkdir(parents=True)
    (submit / "torch.py").write_text("raise ImportError('the torch.py of the submit folder')\n")
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.sbatch_script(["train", "--preset", "nano", "--steps", "2",
                                           "--nproc", "2", "--timeout", "150"], nodes=1))
    env = {k: v for k, v in cluster.env.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    job_out = tmp_path / "job.out"
    res = cluster.run("sbatch", "--wait", "--cpus-per-task=2", "--time=5", f"--output={job_out}",
                      f"--chdir={submit}", str(script), "--out", str(tmp_path / "out"),
                      env=env, timeout=300)
    log = job_out.read_text() if job_out.exists() else "(no job output)"
    assert res.returncode == 0, f"{res.stdout}{res.stderr}\n{log}\n{cluster.logs()}"
    assert "zerolab slurm: task 0 of 1" in log, log
    ranks = [json.loads((tmp_path / "out" / "stage0" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(len(r["losses"]) == 2 for r in ranks)
