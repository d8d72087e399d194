"""The sbatch scripts' shell, on any machine: stand-ins for scontrol, srun and torchrun on PATH, so
that the failure modes of a real cluster (scontrol refusing node details, a node list longer than a
pipe's buffer) run in a fraction of a second, without SLURM (issue 32, item 1). The real thing,
a two-node SLURM cluster, is tests/test_multinode.py."""
import os
import re
import subprocess

import pytest

from conftest import REPO

SCONTROL = r"""#!/bin/bash
case "$1 $2" in
    "show hostnames")  # SLURM_JOB_NODELIST expanded, one name a line
        if [ -n "${FAKE_MANY_NODES:-}" ]; then seq -f "node%g" 1 200000; else printf 'node1\nnode2\n'; fi ;;
    "show node")
        if [ -n "${FAKE_PRIVATE_DATA:-}" ]; then  # PrivateData=nodes, as a user sees it
            echo "slurm_load_node error: Access/permission denied" >&2; exit 1
        fi
        printf 'NodeName=%s Arch=x86_64 CoresPerSocket=1\n   NodeAddr=10.0.0.%s NodeHostName=%s\n' \
            "$3" "${3#node}" "$3" ;;
    *) exit 2 ;;
esac
"""
SRUN = r"""#!/bin/bash
while [[ "$1" == -* ]]; do shift; done  # srun's own options; then the task, run on "this node"
SLURMD_NODENAME=${FAKE_NODE:-node1} exec "$@"
"""
TORCHRUN = """#!/bin/bash
printf 'torchrun %s\\n' "$*"
"""
SCRIPTS = ["05_torchrun_elastic/train.sbatch", "11_train_gpt/train.sbatch"]  # 11's: 05's, its flags


@pytest.fixture
def bin_dir(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("torchrun", TORCHRUN)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def run_job(script, bin_dir, tmp_path, **fake):
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-2]",
               SLURM_JOB_ID="7", SLURM_NNODES="2", SLURM_CPUS_PER_TASK="2", NPROC_PER_NODE="2",
               CHECKPOINTS=str(tmp_path / "ckpt"), OUT_DIR=str(tmp_path / "out"), **fake)
    return subprocess.run(["bash", script, "--epochs", "1"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def torchrun_args(done):
    line = [x for x in done.stdout.splitlines() if x.startswith("torchrun ")]
    assert done.returncode == 0 and len(line) == 1, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return line[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_head_nodes_address_comes_from_scontrol_and_each_node_passes_its_own(script, bin_dir, tmp_path):
    args = torchrun_args(run_job(script, bin_dir, tmp_path))
    assert re.search(r"--rdzv-endpoint=10\.0\.0\.1:\d+ ", args), args
    assert "--local-addr=10.0.0.1 --rdzv-conf=is_host=1 " in args, args
    args = torchrun_args(run_job(script, bin_dir, tmp_path, FAKE_NODE="node2"))  # srun's other node
    assert "--local-addr=10.0.0.2 --rdzv-conf=is_host=0 " in args, args


@pytest.mark.parametrize("script", SCRIPTS)
def test_scontrol_refusing_node_details_falls_back_to_the_names(script, bin_dir, tmp_path):
    """PrivateData=nodes: `scontrol show node` exits 1. Before the fix: exit 1 and no output."""
    args = torchrun_args(run_job(script, bin_dir, tmp_path, FAKE_PRIVATE_DATA="1"))
    assert re.search(r"--rdzv-endpoint=node1:\d+ ", args) and "--local-addr=node1 " in args, args


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_node_list_longer_than_a_pipes_buffer(script, bin_dir, tmp_path):
    """200,000 names (1.3 MB): `scontrol show hostnames | head -n 1` died of SIGPIPE, exit 141."""
    args = torchrun_args(run_job(script, bin_dir, tmp_path, FAKE_MANY_NODES="1"))
    assert "--local-addr=10.0.0.1 --rdzv-conf=is_host=1 " in args, args


@pytest.mark.parametrize("fake, status", [({"FAKE_MANY_NODES": "1"}, {141}), ({"FAKE_PRIVATE_DATA": "1"}, {1, 141})])
def test_the_stand_in_reproduces_both_failures(bin_dir, tmp_path, fake, status):
    """The old lines, under the stand-in: the script ends silently, as the issue found. (141 even on
    2 names, now and then: the stand-in writes a line at a time, and head may exit in between.)"""
    old = tmp_path / "old.sbatch"
    old.write_text('set -euo pipefail\nHEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
                   'HEAD_ADDR=$(scontrol show node "$HEAD_NODE" 2>/dev/null | sed -n "s/.*NodeAddr=//p")\n'
                   'echo "rendezvous at ${HEAD_ADDR:-$HEAD_NODE}"\n')
    done = run_job(str(old), bin_dir, tmp_path, **fake)
    assert done.returncode in status and not done.stdout, (done.returncode, done.stdout)
