"""preflight as the gate in front of a job: `preflight launch` starting accelerate on every node (launcher),
and the SLURM node state for prologs and health checks (slurm)."""
