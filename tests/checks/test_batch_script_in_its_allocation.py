"""A batch script read inside its own allocation (SLURM_JOB_ID set, as `check --sbatch "$0"` in the batch step):
$SLURM_NNODES and the other counts are the allocation's, which sbatch's command line may have changed from the
#SBATCH directives; outside an allocation they are the directives'. And a launch line is kept whole."""
from preflight.inputs import batchscript

SCRIPT = """#!/bin/bash
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
srun --ntasks=$SLURM_NNODES torchrun --nnodes=$SLURM_NNODES --nproc_per_node=$SLURM_NTASKS_PER_NODE \\
    --rdzv_backend c10d --rdzv_endpoint node01:29500 train.py {args}
"""
# `sbatch -N2 --ntasks-per-node=4 job.sh`: what SLURM sets in its batch step
ALLOCATION = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2",
              "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "8"}


def main(environ, args=""):
    return batchscript.parse("job.sh", SCRIPT.format(args=args), environ).main


def test_inside_the_allocation_the_counts_are_the_environments():
    step = main(ALLOCATION)
    assert step.command.get("nnodes") == "2" and step.command.get("nproc_per_node") == "4"
    assert step.srun["ntasks"] == "2"


def test_outside_an_allocation_the_counts_are_the_directives():
    step = main({"SLURM_NNODES": "2"})  # no SLURM_JOB_ID: not an allocation's batch step
    assert step.command.get("nnodes") == "3" and step.command.get("nproc_per_node") == "1"
    assert step.srun["ntasks"] == "3"


def test_a_count_the_allocation_does_not_set_is_not_taken_from_the_directives():
    step = main({k: v for k, v in ALLOCATION.items() if k != "SLURM_NTASKS_PER_NODE"})
    assert step.command.get("nnodes") == "2" and step.command.get("nproc_per_node") != "1"


def test_a_long_launch_line_is_kept_whole():
    args = " ".join(f"--option{k} value{k}" for k in range(40))
    step = main({}, args)
    assert step.text.endswith("train.py " + args) and len(step.text) > 400
