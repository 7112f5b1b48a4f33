"""The job as its nodes run it: the effective launch of each node, its files merged with the launcher's flags
(view); a running job's launchers and ranks across nodes, for doctor (running); and the memory its ZeRO stage,
offload and precision need (memory). Facts in, plain values out: no I/O here."""
