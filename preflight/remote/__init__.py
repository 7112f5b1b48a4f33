"""Reaching the nodes: shipping preflight.node's programs (shipping), the SSH and srun connections (ssh, srun),
the facts from every node and the coordinated probes (gather), and the shapes node answers are held to
(shapes). A node can answer anything, slowly, or never: each step has a deadline and every answer is checked."""
