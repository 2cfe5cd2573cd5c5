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
"""
from __future__ import annotations

import os
import re

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
