"""Which rank am I: every way of starting processes maps to RANK / WORLD_SIZE / LOCAL_RANK."""

import pytest

from memoria_ds.train.distributed import discover_launcher_env


def test_launchers_that_set_the_variables_are_left_alone():
    assert discover_launcher_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == {}


def test_plain_python_is_a_group_of_one():
    env = discover_launcher_env({})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert int(env["MASTER_PORT"]) > 0


def test_open_mpi():
    env = discover_launcher_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16",
                                 "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "node7"})
    assert env == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        discover_launcher_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_slurm_tasks_become_ranks():
    env = discover_launcher_env({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
                                 "MASTER_ADDR": "gpu001", "MASTER_PORT": "1234"})
    assert env == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "MASTER_PORT": "1234"}
    # a single SLURM task (an interactive job running `python ...`) is a group of one
    assert discover_launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})["WORLD_SIZE"] == "1"
    with pytest.raises(RuntimeError, match="SLURM_JOB_NODELIST"):
        discover_launcher_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
