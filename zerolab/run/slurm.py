"""Launching under Slurm: torchrun's rendezvous from the environment srun gives each task.

Idea: the batch script `scripts/slurm/zerolab.sbatch` starts one task per node with `srun`; each
task runs `zerolab slurm train ARGS...`, which reads Slurm's variables here, adds `--nnodes`,
`--node-rank` and `--rdzv-endpoint` to ARGS and runs `zerolab train ARGS...` in the same process
(so Slurm's SIGTERM at the time limit or on `scancel` reaches the launcher, which stops its
ranks). `compare` does the same; any other command (`labs`, `doctor`, ...) runs on task 0 only,
the other tasks end at once. The rendezvous, as pure functions of the environment:

    rendezvous({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_ID": "4242",
                "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-08]"})
    -> {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "gpu07:29936"}

    nnodes         SLURM_NTASKS: one launcher per task (--ntasks-per-node=1: one per node)
    node_rank      SLURM_PROCID: node r holds global ranks r x nproc ... r x nproc + nproc - 1
    rdzv_endpoint  the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), where task 0
                   runs under srun's default (block or cyclic) distribution, and a port:
                   ZEROLAB_RDZV_PORT, else 20000 + (8 x SLURM_JOB_ID + SLURM_STEP_ID) mod 12000
                   (one job's steps differ; below Linux's ephemeral ports, 32768 and up)

A single task gets no rendezvous options: it runs as `zerolab train` does on one machine,
standalone, every listener on loopback only. Slurm's node names are taken as host names (what
`scontrol show hostnames` prints); they must resolve on every node.

`zerolab slurm --print-script COMMAND ...` prints a batch script for one command line
(`sbatch_script`): this Python, COMMAND baked in, and the imports kept to this zerolab
wherever the job starts (the submit folder may hold the checkout `zerolab/`, or a learner's
`torch.py`: `preflight.child_env`).
"""
from __future__ import annotations

import os
import re
import shlex
import sys

#: commands whose launchers form one world across the tasks; any other runs on task 0 only
WORLD_COMMANDS = ("train", "compare")
#: the options this module sets; given by hand they would contradict Slurm's allocation
SET_HERE = ("--nnodes", "--node-rank", "--rdzv-endpoint")
PORT_BASE, PORT_SPAN = 20000, 12000


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm host list as `scontrol show hostnames` does: "gpu[07-08],cpu1" ->
    ["gpu07", "gpu08", "cpu1"]; ranges keep their zero padding, several brackets multiply."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            if nodelist[start:i]:
                names += _expand(nodelist[start:i])
            start = i + 1
    if depth != 0 or not names:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    return names


def _expand(name: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", name)
    if not m:
        return [name]
    head, ranges, tail = m.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            raise ValueError(f"cannot read the range {part!r} of the Slurm node list {name!r}")
        out += [f"{head}{n:0{len(lo)}d}" for n in range(int(lo), int(hi or lo) + 1)]
    return [x + rest for x in out for rest in _expand(tail)]


def _int(env, name: str, minimum: int = 0) -> int:
    value = env.get(name)
    if value is None or not value.strip().isdigit() or int(value) < minimum:
        raise ValueError(f"{name}={value!r}: not inside a Slurm job step (run it under srun, as "
                         "scripts/slurm/zerolab.sbatch does)")
    return int(value)


def port(env) -> int:
    """The rendezvous port: ZEROLAB_RDZV_PORT, else one derived from the job and step ids."""
    if env.get("ZEROLAB_RDZV_PORT"):
        chosen = env["ZEROLAB_RDZV_PORT"]
        if not chosen.isdigit() or not 1024 <= int(chosen) <= 65535:
            raise ValueError(f"ZEROLAB_RDZV_PORT={chosen!r} must be a port 1024-65535")
        return int(chosen)
    job, step = _int(env, "SLURM_JOB_ID"), int(env.get("SLURM_STEP_ID", "0") or 0)
    return PORT_BASE + (8 * job + step) % PORT_SPAN


def rendezvous(env) -> dict:
    """{"nnodes", "node_rank", "rdzv_endpoint"} of this task from Slurm's environment `env`
    (a mapping like os.environ); {} for a single task. ValueError outside a job step."""
    ntasks = _int(env, "SLURM_NTASKS", minimum=1)
    procid = _int(env, "SLURM_PROCID")
    if procid >= ntasks:
        raise ValueError(f"SLURM_PROCID={procid} is not below SLURM_NTASKS={ntasks}")
    if ntasks == 1:
        return {}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError("neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set: not "
                         "inside a Slurm job step")
    return {"nnodes": ntasks, "node_rank": procid,
            "rdzv_endpoint": f"{hostnames(nodelist)[0]}:{port(env)}"}


def command(argv: list[str], env) -> list[str] | None:
    """The `zerolab` command line this task runs: `argv` plus the rendezvous for train and
    compare; argv itself on task 0 for any other command, None on the other tasks."""
    if not argv or argv[0].startswith("-") or argv[0] == "slurm":
        raise ValueError("give a zerolab command first: train, compare, labs, ... "
                         "(e.g. train --stage 3 --nproc 4)")
    given = [a.split("=")[0] for a in argv if a.split("=")[0] in SET_HERE]
    if given:
        raise ValueError(f"{', '.join(sorted(set(given)))}: set from Slurm's allocation here "
                         "(nodes x tasks); leave it out")
    rdzv = rendezvous(env)
    if argv[0] not in WORLD_COMMANDS:
        return list(argv) if int(env["SLURM_PROCID"]) == 0 else None
    extra = [] if not rdzv else ["--nnodes", str(rdzv["nnodes"]), "--node-rank",
                                 str(rdzv["node_rank"]), "--rdzv-endpoint", rdzv["rdzv_endpoint"]]
    return list(argv) + extra


def announce(argv: list[str], cmd: list[str] | None, env) -> str:
    """The line a task prints before it runs `cmd` (or ends: None)."""
    task = f"task {env.get('SLURM_PROCID')} of {env.get('SLURM_NTASKS')}"
    if cmd is None:
        return f"zerolab slurm: {task}: `zerolab {argv[0]}` runs on task 0 only"
    return f"zerolab slurm: {task} on {os.uname().nodename}: zerolab {' '.join(cmd)}"


def sbatch_script(argv: list[str], *, nodes: int = 2, cpus_per_task: int | None = None,
                  time_limit: str = "00:30:00", python: str | None = None) -> str:
    """A batch script (text) that runs `zerolab slurm ARGV` as one task per node on `nodes` nodes:
    the #SBATCH lines (`cpus_per_task`: default the larger of 8 and ARGV's --nproc), then srun
    with `python` (default: this interpreter, so the job needs no activated environment) and
    ARGV, plus any arguments given after the script's name to sbatch. The children import the
    zerolab this process imports, whatever folder the job starts in: PYTHONSAFEPATH=1 (Python
    3.11+; on 3.10 the current folder is dropped from sys.path by hand) and, for a checkout
    that is not in site-packages, its folder first on PYTHONPATH. ValueError (one line) for an
    ARGV `command` refuses, or nodes < 1."""
    from .preflight import SAFE_PATH, _site_dirs, package_root
    command(argv, {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"})   # the same refusals, one line
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"--nodes {nodes!r} must be an integer >= 1")
    nproc = next((int(v) for k, v in zip(argv, argv[1:]) if k == "--nproc" and v.isdigit()), 1)
    cpus = cpus_per_task or max(8, nproc)
    python = shlex.quote(python or sys.executable)
    root = package_root()
    lines = [
        "#!/bin/bash",
        f"# zerolab {' '.join(shlex.quote(a) for a in argv)} on a Slurm cluster, one launcher per "
        "node (written by `zerolab slurm --print-script`).",
        "# Submit: sbatch THIS_FILE [more zerolab options]; sbatch's own options override the "
        "#SBATCH lines (sbatch --nodes=4 THIS_FILE).",
        "# --nproc is ranks per node; --out must be on a file system every node sees.",
        f"#SBATCH --job-name=zerolab-{argv[0]}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={cpus}",
        f"#SBATCH --time={time_limit}",
        "#SBATCH --output=zerolab-%j.out",
        "##SBATCH --gpus-per-node=8      # a GPU cluster: delete one '#', give --nproc 8 (NCCL)",
        "set -euo pipefail",
    ]
    if root not in _site_dirs():
        lines.append(f"export PYTHONPATH={shlex.quote(str(root))}${{PYTHONPATH:+:$PYTHONPATH}}"
                     "   # the zerolab this script was written by")
    if SAFE_PATH:
        lines.append("export PYTHONSAFEPATH=1   # the submit folder is not first on sys.path (a "
                     "checkout's zerolab/ there would be imported instead)")
        start = f"{python} -m zerolab slurm"
    else:
        start = (f"{python} -c 'import sys; del sys.path[0]; from zerolab.cli import main; "
                 "sys.exit(main())' slurm")
    lines += [
        "# srun passes the job's --cpus-per-task on (Slurm 22.05 does not by itself); "
        "--kill-on-bad-exit: a launcher that fails stops the others",
        "exec srun --kill-on-bad-exit=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} \\",
        f"    {start} {' '.join(shlex.quote(a) for a in argv)} \"$@\"",
    ]
    return "\n".join(lines) + "\n"


HELP = """\
Run a zerolab command on a Slurm cluster, one launcher per node.

  zerolab slurm COMMAND ...                 inside a job step (srun, one task per node)
  zerolab slurm --print-script COMMAND ...  print a batch script for COMMAND; nothing runs

Inside a job step each task reads Slurm's environment and adds --nnodes (SLURM_NTASKS),
--node-rank (SLURM_PROCID) and --rdzv-endpoint (the first host of the node list, port 20000 + a
number from the job id, or ZEROLAB_RDZV_PORT) to COMMAND, then runs `zerolab COMMAND` in the same
process (Slurm's SIGTERM at the time limit or on scancel reaches it, and it stops its ranks).
Outside a job step it exits 2 with one line. A batch script starts it under srun: either
scripts/slurm/zerolab.sbatch from the checkout (COMMAND after the script's name), or the one
--print-script writes (COMMAND baked in, this Python, the imports kept to this zerolab
whatever folder the job starts in)."""


def help_epilog() -> str:
    """`zerolab slurm --help`'s examples, and the script `sbatch_script` writes for one."""
    example = ["train", "--preset", "gpt2", "--nproc", "8", "--out", "runs/slurm"]
    script = sbatch_script(example, python="/path/to/python")
    shown = [ln for ln in script.splitlines() if not ln.startswith("# ")]
    return ("examples:\n"
            "  zerolab slurm --print-script train --preset gpt2 --nproc 8 --out runs/slurm > job.sbatch\n"
            "  sbatch --nodes=4 job.sbatch             # 4 nodes x 8 ranks = a world of 32\n"
            "  sbatch scripts/slurm/zerolab.sbatch compare --preset tiny --nproc 4 --out runs/slurm-compare\n"
            "  srun --nodes=2 --ntasks-per-node=1 zerolab slurm train --nproc 8   # inside salloc\n\n"
            "the script --print-script writes for the first example (comments left out):\n" +
            "\n".join("  " + ln for ln in shown))
