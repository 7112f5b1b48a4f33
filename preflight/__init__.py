"""preflight: will this multi-node Accelerate + DeepSpeed job start and run on these nodes?"""

__version__ = "0.1.0"
