"""Real DeepSpeed checkpoints for the CKPT tests, saved and loaded by DeepSpeed itself on the CPU (gloo, torchrun):
`save_all(folder)` writes checkpoints without ZeRO and with ZeRO-1 (fp32), ZeRO-2 and 3 (bf16) of a small model
saved by two ranks, in one run; `load_each(folder, cases, nproc)` runs DeepSpeed's own load_checkpoint for each
(checkpoint, config) on a world of its own and returns what it said."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

SAVE = textwrap.dedent("""
    import sys, torch, deepspeed
    out = sys.argv[1]
    for stage, bf16 in ((0, False), (1, False), (2, True), (3, True)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        x = torch.randn(2, 8, dtype=torch.bfloat16 if bf16 else torch.float32)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        engine.save_checkpoint(f"{out}/zero{stage}", tag="global_step1")
""")


def free_port():
    with socket.socket() as probe:  # the kernel's choice: runs beside each other (xdist, a second checkout) differ
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(folder, script, nproc, *args):
    """(exit code, output) of `script` run by torchrun on nproc CPU ranks."""
    (folder / "script.py").write_text(script)
    port = free_port()
    runner = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([runner, "--nproc_per_node", str(nproc), "--master_port", str(port), str(folder / "script.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    return proc.returncode, proc.stdout + proc.stderr


def save_all(folder):
    pytest.importorskip("deepspeed")
    code, out = torchrun(folder, SAVE, 2, folder)
    assert code == 0, out[-3000:]
    return folder


LOAD = textwrap.dedent("""
    import json, sys, torch, deepspeed
    for root, config in json.loads(sys.argv[1]):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        try:
            path, _ = engine.load_checkpoint(root)
            said = f"LOADED {path}"
        except Exception as exc:
            said = f"REFUSED {type(exc).__name__} {exc}".replace("\\n", " ")
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            print("CASE", said, flush=True)
""")


def load_each(folder, cases, nproc):
    """What DeepSpeed's load_checkpoint says for each (checkpoint, config) on `nproc` ranks, in one run: a list of
    ("LOADED", path) or ("REFUSED", its exception and message)."""
    import json

    code, out = torchrun(folder, LOAD, nproc, json.dumps([[str(root), config] for root, config in cases]))
    said = [line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("CASE ")]
    assert code == 0 and len(said) == len(cases), out[-3000:]
    return [tuple(words) for words in said]


def load(folder, root, config, nproc):
    return load_each(folder, [(root, config)], nproc)[0]
