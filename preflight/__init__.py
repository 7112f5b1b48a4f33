"""preflight: will this multi-node Accelerate + DeepSpeed job start and run on these nodes?"""

# The one source of the version: the distribution's (pyproject.toml reads it), `preflight --version`, the
# JSON report and every node's facts (the head ships it with the node modules).
__version__ = "0.1.0"
DISTRIBUTION = "preflight-multinode"
