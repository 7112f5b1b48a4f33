#!/bin/sh
# SLURM HealthCheckProgram: `preflight node` every HealthCheckInterval seconds on every node, outside of
# jobs. A failing node is drained with the reason ("preflight: ..."), and a node that preflight drained
# earlier is returned to service once it passes again (--undrain touches only a node whose drain reason
# starts with "preflight:": a node an admin drained stays drained).
#
# slurm.conf:
#   HealthCheckProgram=/etc/slurm/preflight-healthcheck.sh
#   HealthCheckInterval=300
#   HealthCheckNodeState=ANY,CYCLE      # optional: spread the checks over the interval
#
# slurmd runs it as root when it starts (before it registers), then on every node at once each interval,
# with an environment of SLURMD_NODENAME only: PATH and SLURM_CONF (for scontrol) are set here.
# Its exit code drains nothing by itself: preflight's --drain calls scontrol. slurmd kills a health check
# that runs longer than 60 s: the budget (50 s) keeps it within that, scontrol included.
PATH=/usr/local/bin:/usr/bin:/bin
SLURM_CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}   # where your slurm.conf is, if not there
export PATH SLURM_CONF
PREFLIGHT=${PREFLIGHT:-/opt/preflight/bin/preflight}
LOG=${PREFLIGHT_LOG:-/var/log/preflight-healthcheck.log}

"$PREFLIGHT" node --budget 50 --drain --undrain ${PREFLIGHT_ARGS:-} >>"$LOG" 2>&1
