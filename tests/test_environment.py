"""Notebooks run in zerolab's own interpreter whatever kernelspecs the machine has; no code path
needs one fixed free port.

The machine is made hostile on purpose: a `python3` kernelspec earlier on the Jupyter path whose
Python cannot import zerolab (the issue's example), and a port taken by another program.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from zerolab.course.nb import own_kernel

NOTEBOOK = ["import sys, zerolab\n", "print(zerolab.__file__)"]


@pytest.fixture
def hostile_jupyter(tmp_path):
    """A JUPYTER_PATH whose `python3` kernel cannot import zerolab (a shadow package raises
    ModuleNotFoundError first on its path), and a notebook that imports zerolab."""
    shadow = tmp_path / "shadow" / "zerolab"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'zerolab'\")\n")
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "another Python", "language": "python",
        "env": {"PYTHONPATH": str(tmp_path / "shadow")}}))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("".join(NOTEBOOK))])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    book = tmp_path / "uses_zerolab.ipynb"
    nbformat.write(nb, book)
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "jupyter")}
    return book, env


def _pytest(book, env, *flags):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", "--nbval-lax", *flags, str(book)],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_nbval_with_current_env_ignores_a_foreign_python3_kernelspec(hostile_jupyter):
    book, env = hostile_jupyter
    foreign = _pytest(book, env)                        # the control: the foreign kernel is used
    assert foreign.returncode != 0 and "No module named 'zerolab'" in foreign.stdout
    own = _pytest(book, env, "--nbval-current-env")     # the README's and CI's command
    assert own.returncode == 0, own.stdout + own.stderr


@pytest.mark.timeout(150)
def test_papermill_with_own_kernel_ignores_a_foreign_python3_kernelspec(hostile_jupyter, tmp_path):
    """What `zerolab labs` does for every lab."""
    book, env = hostile_jupyter
    name, own_env = own_kernel(tmp_path / "own")
    own_env["JUPYTER_PATH"] += os.pathsep + env["JUPYTER_PATH"]
    res = subprocess.run([sys.executable, "-m", "papermill", str(book), str(tmp_path / "out.ipynb"),
                          "-k", name, "--no-progress-bar"], env=own_env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for o in out.cells[0].outputs)
    assert printed.strip() == str(Path(__import__("zerolab").__file__))


def _train(env, tmp_path, name):
    return subprocess.run([sys.executable, "-m", "zerolab.run.train", "--preset", "nano", "--steps",
                           "1", "--batch-size", "2", "--no-allocator", "--out",
                           str(tmp_path / name)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(150)
def test_plain_train_picks_a_free_port_or_names_the_taken_one(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 29533))       # the port the plain run used to take for granted
        taken.listen()
        ok = _train(env, tmp_path, "free")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        bad = _train({**env, "MASTER_PORT": "29533"}, tmp_path, "taken")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "MASTER_PORT 29533 is taken" in lines[0], bad.stderr
