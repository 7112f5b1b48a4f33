#!/bin/sh
# SLURM Prolog: `preflight node` on every node of a job before any of its tasks start; a broken node is
# drained with the reason ("preflight: FS001 dev-shm: ...") and the job does not start on it.
#
# slurm.conf:
#   Prolog=/etc/slurm/preflight-prolog.sh
#   PrologFlags=Alloc          # run at allocation time, on every node, before any task
#
# slurmd runs it as root (SlurmdUser) with a small environment of SLURM_* variables: PATH is set here.
# Exit codes: 0 lets the job start; non-zero makes SLURM requeue the job (hold it, if it cannot) and drain
# the node; preflight has drained it first with its own reason, which `sinfo -R` shows.
# Only a verdict of fail (exit 1) stops the job: a bad invocation (2) or an internal error (3) of
# preflight itself is logged and lets the job start, so that a preflight defect cannot drain a cluster.
# The budget (20 s) bounds the whole run, scontrol included; keep it under PrologEpilogTimeout.
# The job's launch against its allocation (CFG075: launchers per node, GPUs per node, rank 0's node) is judged
# in the batch script, by `preflight check --slurm --sbatch "$0"` before the training step, not here: a failed
# prolog drains the node and requeues the job, and a wrong launch line is no fault of the node.
PATH=/usr/local/bin:/usr/bin:/bin
export PATH
PREFLIGHT=${PREFLIGHT:-/opt/preflight/bin/preflight}    # the preflight of the training environment
LOG=${PREFLIGHT_LOG:-/var/log/preflight-prolog.log}       # the full report, for the admin

"$PREFLIGHT" node --budget 20 --drain ${PREFLIGHT_ARGS:-} >>"$LOG" 2>&1
status=$?
if [ "$status" -eq 1 ]; then
    exit 1
fi
if [ "$status" -ne 0 ]; then
    echo "preflight-prolog: preflight exited $status (not a verdict): the job starts" >>"$LOG"
fi
exit 0
