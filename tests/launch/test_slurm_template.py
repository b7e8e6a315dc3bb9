"""launch/slurm/repro.sbatch on a CPU machine: `scontrol` and `srun` are small stubs (srun runs
the command once per node of $SLURM_JOB_NODELIST, in parallel, with SLURM_NODEID set), so
the hostfile, the command each node runs and, in one test, a real two-node DeepSpeed
training run (`--no_ssh`, world size 2) are checked for real."""

from __future__ import annotations

import json
import shlex

import pytest

from repro_helpers import check, check_finished_run, free_port, run

SCONTROL = """#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] || exit 1
tr ',' '\\n' <<< "$3"
"""
SRUN = """#!/usr/bin/env bash
while [[ $1 == --* ]]; do shift; done
n=$(tr ',' '\\n' <<< "$SLURM_JOB_NODELIST" | wc -l)
pids=()
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
# records its arguments, one JSON file per call
DEEPSPEED = """#!/usr/bin/env python3
import json, os, sys
with open(os.path.join(os.environ["STUB_OUT"], f"ds.{os.environ.get('SLURM_NODEID', 'x')}.json"), "w") as f:
    json.dump(sys.argv[1:], f)
"""


@pytest.fixture
def slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def submit(*args: str, nodes: str = "node-a,node-b", gpus: str = "4", stub_deepspeed: bool = False, **env):
        path = bin_dir
        if stub_deepspeed:
            (path / "deepspeed").write_text(DEEPSPEED)
            (path / "deepspeed").chmod(0o755)
        extra = dict(SLURM_JOB_NODELIST=nodes, SLURM_JOB_ID="42", SLURM_GPUS_ON_NODE=gpus, STUB_OUT=str(tmp_path),
                     HOSTFILE=str(tmp_path / "hostfile"))
        extra.update(env)
        proc = run(["bash", "-c", f'PATH={shlex.quote(str(path))}:"$PATH" exec bash launch/slurm/repro.sbatch "$@"',
                    "_", *args], **extra)
        return proc

    return submit, tmp_path


def test_hostfile_from_the_allocation_and_deepspeed_on_every_node(slurm):
    submit, tmp = slurm
    proc = check(submit("deepspeed", "launch/finetune.py", "--config", "x.yaml", "optim.lr=1e-4",
                        gpus="gpu:4", stub_deepspeed=True))
    assert (tmp / "hostfile").read_text() == "node-a slots=4\nnode-b slots=4\n"
    assert "+ srun --ntasks-per-node=1 --kill-on-bad-exit=1 deepspeed --node_rank $SLURM_NODEID --hostfile" in proc.stdout
    for node in (0, 1):
        argv = json.loads((tmp / f"ds.{node}.json").read_text())
        assert argv == ["--node_rank", str(node), "--hostfile", str(tmp / "hostfile"), "--master_addr", "node-a",
                        "--no_ssh", "launch/finetune.py", "--config", "x.yaml", "optim.lr=1e-4"]


def test_pdsh_mode_runs_once_from_the_first_node(slurm):
    submit, tmp = slurm
    check(submit("deepspeed", "launch/finetune.py", stub_deepspeed=True, LAUNCH="pdsh"))
    assert json.loads((tmp / "ds.x.json").read_text()) == [
        "--hostfile", str(tmp / "hostfile"), "--master_addr", "node-a", "launch/finetune.py"]
    assert not (tmp / "ds.0.json").exists()


def test_table_script_dry_run_gets_the_hostfile(slurm):
    submit, tmp = slurm
    proc = check(submit("launch/repro/table5.sh", "--mode", "dry-run", "--sizes", "gpt2-xl", "--models", "memoria",
                        LAUNCH="pdsh"))
    assert "--topology multinode --hostfile" in proc.stdout
    command = next(line for line in proc.stdout.splitlines() if line.startswith("  command   "))
    argv = shlex.split(command.split("command   ", 1)[1])
    assert argv[1:5] == ["--hostfile", str(tmp / "hostfile"), "--master_addr", "node-a"]
    assert "batch     8 streams (memory rows) = 8 ranks x 1" in proc.stdout


def test_outside_an_allocation_it_says_so(slurm):
    submit, _ = slurm
    proc = submit("launch/repro/table5.sh", SLURM_JOB_NODELIST="")
    assert proc.returncode != 0 and "not inside a SLURM allocation" in proc.stderr


@pytest.mark.slow
def test_table2_smoke_on_two_simulated_nodes(slurm):
    """Table 2's smoke run through the template: two `deepspeed --no_ssh` launches make one world of 2."""
    submit, tmp = slurm
    root = tmp / "runs"
    check(submit("launch/repro/table2.sh", "--mode", "smoke", "--models", "memoria", "--run-root", str(root),
                 "--master-port", str(free_port()), nodes="localhost,127.0.0.1", gpus="1"))
    run_dir = root / "scratch" / "wikitext103-L50-memoria"
    check_finished_run(run_dir, ("paper", "full"))
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2 and ds["train_micro_batch_size_per_gpu"] == 1
    logs = {p.name: p.read_text() for p in run_dir.glob("launch.node*.log")}
    assert set(logs) == {"launch.node0.log", "launch.node1.log"}
    for node, log in enumerate(sorted(logs)):
        assert f"--no_ssh --node_rank {node} " in logs[log]  # each node echoed its own command
    assert "dist_world_size=2" in logs["launch.node0.log"]
