"""The all-reduce smoke test across the nodes and the bisection to the node that breaks it (allreduce), its
command-line options (options), and what NCCL says it chose (nccllog). The worker that runs on each node is
preflight.node.allreduce."""
