#!/bin/sh
# SLURM Epilog (optional): after a job, a quick re-check of what jobs tend to leave broken (/dev/shm full of
# stale segments, disks filled, leftover environment): the next job does not land on a spoiled node.
#
# slurm.conf:
#   Epilog=/etc/slurm/preflight-epilog.sh
#
# Runs as root with a small environment. The epilog's exit code is not used to fail anything here: preflight
# drains the node itself (--drain) when it fails, and the script always exits 0 (a non-zero epilog would
# drain the node with "Epilog error" whatever preflight found).
PATH=/usr/local/bin:/usr/bin:/bin
export PATH
PREFLIGHT=${PREFLIGHT:-/opt/preflight/bin/preflight}
LOG=${PREFLIGHT_LOG:-/var/log/preflight-epilog.log}

"$PREFLIGHT" node --budget 15 --drain --only FS,SYS ${PREFLIGHT_ARGS:-} >>"$LOG" 2>&1
exit 0
