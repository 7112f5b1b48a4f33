"""Real DeepSpeed checkpoints for the CKPT tests, saved and loaded by DeepSpeed itself on the CPU (gloo, torchrun):
`save_all(folder)` writes checkpoints without ZeRO and with ZeRO-1 (fp32), ZeRO-2 and 3 (bf16) of a small model
saved by two ranks, one of ZeRO-1 with SGD (zero1-sgd/) and a two-stage pipeline's (pipe/), in one run; `load_each(folder, cases, nproc)` runs
DeepSpeed's own load_checkpoint for each (checkpoint, config) on a world of its own and returns what it said
(`load_pipeline` for the pipeline's); `save_states` and `load_states` do the same for accelerate's save_state
and DCP, `trainer_resumes` for the Trainer. Each save runs once per test run; later callers get a copy.
"""
import atexit
import fcntl
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

import workers

# A two-stage pipeline (PipelineModule, ZeRO-1, fp32) of the same layers, each stage on its own rank.
PIPELINE = textwrap.dedent("""
    def pipeline():
        import torch, deepspeed
        from deepspeed.pipe import PipelineModule
        deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule asks for the rank first
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=PIPE_CONFIG)
        return engine
""")
PIPE_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_optimization": {"stage": 1}}
SAVE = f"PIPE_CONFIG = {PIPE_CONFIG!r}\n" + PIPELINE + textwrap.dedent("""
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
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config.update(optimizer={"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}}, bf16={"enabled": False},
                  zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(f"{out}/zero1-sgd", tag="global_step1")
    engine = pipeline()
    engine.train_batch(data_iter=iter([(torch.randn(2, 8), torch.randn(2, 4))] * 2))
    engine.save_checkpoint(f"{out}/pipe", tag="global_step1")
""")


LOAD_PIPELINE = f"PIPE_CONFIG = {PIPE_CONFIG!r}\n" + PIPELINE + textwrap.dedent("""
    import os, sys
    engine = pipeline()
    try:
        path, _ = engine.load_checkpoint(sys.argv[1])
    except BaseException as exc:
        # the other stage waits in a collective for this one: torchrun ends it once this one exits
        said = f"CASE REFUSED {type(exc).__name__} {exc}".replace("\\n", " ")
        os.write(1, f"{said}\\n".encode())
        os._exit(1)
    import torch
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print("CASE LOADED", path, flush=True)
""")


def free_port():
    with socket.socket() as probe:  # the kernel's choice: runs beside each other (xdist, a second checkout) differ
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(folder, script, nproc, *args, env=None):
    """(exit code, output) of `script` run by torchrun on nproc CPU ranks, with `env` over this environment."""
    # torch 2.13's exit after gloo collectives aborts now and then ("terminate called without an active
    # exception", from a thread's destructor; one DCP run in three): once the script is through, leave without it
    (folder / "script.py").write_text(script + "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n"
                                      "_sys.stderr.flush()\n_os._exit(0)\n")
    port = free_port()
    runner = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([runner, "--nproc_per_node", str(nproc), "--master_port", str(port), str(folder / "script.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env or {})))
    return proc.returncode, proc.stdout + proc.stderr


def save_all(folder):
    pytest.importorskip("deepspeed")
    return _saved_once("save_all", folder, lambda: torchrun(folder, SAVE, 2, folder))


# What a save made in this test run, kept for the next module that asks: each gets a copy of its own in its
# folder (it may cut or remove files), and the libraries save once per run, not once per module (about 40 s each).
# Under xdist the first worker to ask saves into the run's folder and the others wait for it (tests/workers.py).
_SAVED = {}


def _saved_once(kind, folder, save):
    if kind in _SAVED:
        shutil.copytree(_SAVED[kind], folder, dirs_exist_ok=True, symlinks=True)
        return folder
    shared = workers.run_folder()
    if shared:
        kept = pathlib.Path(shared) / "saves" / kind
    else:
        kept = pathlib.Path(tempfile.mkdtemp(prefix=f"pf-{kind}-")) / kind
        atexit.register(shutil.rmtree, kept.parent, True)
    kept.parent.mkdir(exist_ok=True)
    with open(f"{kept}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while it saves: another worker waits, then copies
        if kept.exists():
            shutil.copytree(kept, folder, dirs_exist_ok=True, symlinks=True)
        else:
            code, out = save()
            assert code == 0, out[-3000:]
            shutil.copytree(folder, f"{kept}.part", symlinks=True)
            os.replace(f"{kept}.part", kept)
    _SAVED[kind] = kept
    return folder


LOAD = textwrap.dedent("""
    import json, sys, torch, deepspeed
    for root, config, *how in json.loads(sys.argv[1]):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        try:
            path, _ = engine.load_checkpoint(root, **(how[0] if how else {}))
            if sys.argv[2] == "step":  # and the first step after it
                x = torch.randn(2, 8, dtype=torch.bfloat16 if engine.bfloat16_enabled() else torch.float32)
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
            said = f"LOADED {path}"
        except Exception as exc:
            said = f"REFUSED {type(exc).__name__} {exc}".replace("\\n", " ")
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            print("CASE", said, flush=True)
""")


def load_each(folder, cases, nproc, step=False):
    """What DeepSpeed's load_checkpoint says for each (checkpoint, config[, its keyword arguments]) on `nproc` ranks,
    in one run: a list of ("LOADED", path) or ("REFUSED", its exception and message); step: and the first training
    step after it."""
    import json

    code, out = torchrun(folder, LOAD, nproc, json.dumps([[str(root), *rest] for root, *rest in cases]),
                         "step" if step else "load")
    said = [line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("CASE ")]
    assert code == 0 and len(said) == len(cases), out[-3000:]
    return [tuple(words) for words in said]


def load(folder, root, config, nproc):
    return load_each(folder, [(root, config)], nproc)[0]


def load_pipeline(folder, root):
    """What DeepSpeed's load_checkpoint says of `root` in the two-stage pipeline that saved it: ("LOADED", path)
    or ("REFUSED", the exception a stage raised)."""
    code, out = torchrun(folder, LOAD_PIPELINE, 2, root)
    said = [line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("CASE ")]
    refused = [words for words in said if words[0] == "REFUSED"]
    assert refused or (code == 0 and len(said) == 1), out[-3000:]
    return tuple((refused or said)[0])


# The other libraries' layouts, saved by two ranks (accelerate's save_state on the CPU, MULTI_CPU; a DCP folder)
# and by one Trainer process; the model is the one above, the Trainer's a one-layer GPT-2.
SAVE_STATES = textwrap.dedent("""
    import sys, torch
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    out = sys.argv[1]
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    for step in range(2):
        acc.backward(model(torch.randn(2, 8)).pow(2).mean())
        opt.step(); sched.step(); opt.zero_grad()
        acc.save_state(f"{out}/accelerate/checkpoints/checkpoint_{step}")
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{out}/dcp")
""")

TRAINER = textwrap.dedent("""
    import json, sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    out, resumes = sys.argv[1], json.loads(sys.argv[2])
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(8)]
    for resume in resumes or [None]:
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
        args = TrainingArguments(out if resume is None else out + "/again", max_steps=3, save_steps=1,
                                 per_device_train_batch_size=2, report_to=[], use_cpu=True, disable_tqdm=True)
        try:
            Trainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=resume)
            said = "LOADED"
        except Exception as exc:
            said = f"REFUSED {type(exc).__name__} {exc}".replace("\\n", " ")
        if resume is not None:
            print("CASE", said, flush=True)
""")


def save_states(folder):
    """accelerate's save_state (checkpoints/checkpoint_0 and _1) and a DCP folder, by two ranks; a Trainer's output
    folder (checkpoint-1 to 3), by one process."""
    pytest.importorskip("accelerate")

    def save():
        code, out = torchrun(folder, SAVE_STATES, 2, folder)
        if code != 0:
            return code, out
        proc = subprocess.run([sys.executable, "-c", TRAINER, str(folder / "trainer"), "[]"], capture_output=True,
                              text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        return proc.returncode, proc.stderr

    return _saved_once("save_states", folder, save)


LOAD_STATES = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    acc = Accelerator(cpu=sys.argv[3] != "deepspeed")
    if sys.argv[3] == "deepspeed":  # a DeepSpeed job's accelerate (ACCELERATE_USE_DEEPSPEED, ZeRO-2)
        acc.state.deepspeed_plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=2,
                                                           train_batch_size=2 * int(os.environ["WORLD_SIZE"]))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    try:
        if sys.argv[1] == "dcp":
            dcp.load({"model": model.state_dict()}, checkpoint_id=sys.argv[2])
        else:
            acc.load_state(sys.argv[2])
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        # The ranks that did not raise wait in a collective for this one: torchrun ends them once it exits.
        said = f"CASE REFUSED {type(exc).__name__} {exc}".replace("\\n", " ")
        os.write(1, f"{said}\\n".encode())  # one write: the ranks share torchrun's unbuffered pipe
        os._exit(1)
    torch.distributed.barrier()
    if acc.process_index == 0:
        print("CASE LOADED", flush=True)
""")


def load_states(folder, cases, nproc, deepspeed=False):
    """What accelerate's load_state ("accelerate") or DCP's load ("dcp") says of each (kind, path) on `nproc`
    ranks, one run each: REFUSED and the exception where a rank raised, LOADED where every rank loaded;
    deepspeed: accelerate of a DeepSpeed job (ZeRO-2)."""
    env = dict(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2") if deepspeed else {}
    said = []
    for kind, path in cases:
        code, out = torchrun(folder, LOAD_STATES, nproc, kind, path, "deepspeed" if deepspeed else "plain", env=env)
        lines = [line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("CASE ")]
        refused = [words for words in lines if words[0] == "REFUSED"]
        if refused:
            said.append(tuple(refused[0]))
        else:
            assert code == 0 and lines == [["LOADED"]], out[-9000:]
            said.append(("LOADED",))
    return said


def trainer_resumes(folder, paths):
    """What the Trainer's train(resume_from_checkpoint=PATH) says for each path, one process."""
    import json

    proc = subprocess.run([sys.executable, "-c", TRAINER, str(folder), json.dumps([str(p) for p in paths])],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    said = [line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    assert proc.returncode == 0 and len(said) == len(paths), proc.stdout[-2000:] + proc.stderr[-3000:]
    return [tuple(words) for words in said]


# The Trainer with DeepSpeed (ZeRO-2, its batch sizes and learning rate "auto", as the Trainer fills them), on
# CPU ranks: each checkpoint-N is a DeepSpeed root (global_stepN, latest) beside the Trainer's own files. The
# config names no train_batch_size: on the CPU the Trainer counts one process and would fill it wrong.
TRAINER_DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "zero_optimization": {"stage": 2},
                     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
TRAINER_DS = f"DS = {TRAINER_DS_CONFIG!r}\n" + textwrap.dedent("""
    import os, sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    out, resume = sys.argv[1], sys.argv[2] or None
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(16)]
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    args = TrainingArguments(out, max_steps=3 if resume is None else 4, save_steps=1, per_device_train_batch_size=2,
                             report_to=[], disable_tqdm=True, deepspeed=DS)
    try:
        Trainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=resume)
    except BaseException as exc:  # the other ranks wait for this one in a collective: torchrun ends them
        said = f"CASE REFUSED {type(exc).__name__} {exc}".replace("\\\\n", " ")
        os.write(1, f"{said}\\\\n".encode())
        os._exit(1)
    if int(os.environ["RANK"]) == 0:
        print("CASE LOADED", flush=True)
""")


def trainer_deepspeed(out, nproc, resume=None):
    """The Trainer with DeepSpeed on `nproc` CPU ranks: without `resume` it trains 3 steps and saves each into
    the output folder `out` (checkpoint-1 to 3); with it, what train(resume_from_checkpoint=resume) says (its
    saves go beside `out`): ("LOADED",) or ("REFUSED", the exception a rank raised)."""
    pytest.importorskip("transformers")
    code, said = torchrun(out.parent, TRAINER_DS, nproc, out.parent / "again" if resume else out, resume or "")
    lines = [line.split(" ", 2)[1:] for line in said.splitlines() if line.startswith("CASE ")]
    refused = [words for words in lines if words[0] == "REFUSED"]
    assert refused or (code == 0 and lines == [["LOADED"]]), said[-3000:]
    return tuple((refused or lines)[0])


# Model- and pipeline-parallel saves (CKPT003's degrees): a six-layer pipeline (PipelineModule, ZeRO-1 and without
# ZeRO), and a tensor-parallel pair of layers, each rank its slice, whose model-parallel unit (mpu) is built from real
# process groups as DeepSpeed's tests/unit/v1/moe/test_moe_tp.py builds its MPU. `build(kind, degree, stage)`:
# kind "pipe" (degree: its stages) or "tp" (degree: its tensor-parallel ranks); sequence parallel (DeepSpeed's Ulysses)
# of `degree` through the mpu accelerate and ALST hand DeepSpeed ("alst": parallel_state_sp, over whose data x
# sequence group ZeRO partitions) or through the config ("mesh": data_parallel_size and sequence_parallel_size, a
# mesh over whose data dimension ZeRO partitions); "autotp": a one-layer Llama of transformers' with
# tensor_parallel.autotp_size `degree`.
PARALLEL = textwrap.dedent("""
    import os, sys, json, torch, deepspeed
    import deepspeed.comm as dist

    class MPU:
        def __init__(self, tp):
            self.rank, self.world_size, self.tp = dist.get_rank(), dist.get_world_size(), tp
            for i in range(0, self.world_size, tp):
                ranks = list(range(i, i + tp))
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.tp_group = group
            for i in range(tp):
                ranks = list(range(i, self.world_size, tp))
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.dp_group = group
        def get_model_parallel_rank(self): return self.rank % self.tp
        def get_model_parallel_world_size(self): return self.tp
        def get_model_parallel_group(self): return self.tp_group
        def get_data_parallel_rank(self): return self.rank // self.tp
        def get_data_parallel_world_size(self): return self.world_size // self.tp
        def get_data_parallel_group(self): return self.dp_group

    def build(kind, degree, stage, universal=False):
        torch.manual_seed(0)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 if kind == "pipe" else 1,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": universal}}
        if kind == "pipe":
            from deepspeed.pipe import PipelineModule
            layers = [torch.nn.Linear(8, 16)] + [torch.nn.Linear(16, 16) for _ in range(4)] + [torch.nn.Linear(16, 4)]
            model = PipelineModule(layers=layers, num_stages=degree, loss_fn=lambda out, y: (out - y).pow(2).mean())
            return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        part, mpu = (16 // degree, MPU(degree) if degree > 1 else None) if kind == "tp" else (16, None)
        model = torch.nn.Sequential(torch.nn.Linear(8, part), torch.nn.ReLU(), torch.nn.Linear(part, 4))
        if kind == "alst":
            import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
            mpu.initialize_sequence_parallel(sequence_parallel_size=degree)
            config["sequence_parallel_size"] = degree
        elif kind == "mesh":
            config.update(data_parallel_size=dist.get_world_size() // degree, sequence_parallel_size=degree)
        elif kind == "autotp":
            from transformers import LlamaConfig, LlamaForCausalLM
            model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                                 max_position_embeddings=16))
            config["tensor_parallel"] = {"autotp_size": degree}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)[0]

    def step(engine):
        if hasattr(engine, "train_batch"):
            engine.train_batch(data_iter=iter([(torch.randn(2, 8), torch.randn(2, 4))] * 2))
        elif hasattr(engine.module, "config"):  # the Llama
            ids = torch.randint(0, 64, (2, 8))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        else:
            engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
            engine.step()

    deepspeed.init_distributed(dist_backend="gloo")
    if sys.argv[1] == "save":
        saves = json.loads(sys.argv[3]) if len(sys.argv) > 3 else (
            ("pp2", "pipe", 2, 1), ("pp2-zero0", "pipe", 2, 0), ("pp1", "pipe", 1, 1), ("tp2", "tp", 2, 1))
        for name, kind, degree, stage in saves:
            engine = build(kind, degree, stage)
            step(engine)
            engine.save_checkpoint(f"{sys.argv[2]}/{name}", tag="global_step1")
    else:
        for root, kind, degree, stage, universal, *how in json.loads(sys.argv[2]):
            engine = build(kind, degree, stage, universal)
            try:
                path, _ = engine.load_checkpoint(root, **(how[0] if how else {}))
                step(engine)
                said = f"LOADED {path}"
            except BaseException as exc:
                said = f"REFUSED {type(exc).__name__} {exc}".replace("\\n", " ")
                if dist.get_world_size() == 1:
                    print("CASE", said, flush=True)
                    continue
                # a rank that did not raise may wait in a collective for this one: torchrun ends it once this exits
                os.write(1, f"CASE {said}\\n".encode())
                os._exit(1)
            dist.barrier()
            if dist.get_rank() == 0:
                print("CASE", said, flush=True)
""")


def save_parallel(folder):
    """pp2/ (a six-layer pipeline of 2 stages, ZeRO-1), pp2-zero0/ (the same without ZeRO), pp1/ (one stage, data
    parallel 2, ZeRO-1) and tp2/ (tensor parallel 2 through an mpu, ZeRO-1), each saved by two ranks."""
    pytest.importorskip("deepspeed")
    return _saved_once("save_parallel", folder, lambda: torchrun(folder, PARALLEL, 2, "save", folder))


def load_parallel(folder, cases, nproc):
    """What DeepSpeed's load_checkpoint, then a training step, says of each (root, kind, degree, stage, universal[,
    load_checkpoint's keyword arguments]) on
    `nproc` ranks: ("LOADED", path) or ("REFUSED", the exception a rank raised); on several ranks the run ends at
    the first refusal (a rank that loaded may wait for the other in a collective), so only the last case may refuse."""
    import json

    code, out = torchrun(folder, PARALLEL, nproc, "load", json.dumps([[str(c[0]), *c[1:]] for c in cases]))
    said = [tuple(line.split(" ", 2)[1:]) for line in out.splitlines() if line.startswith("CASE ")]
    if nproc > 1:  # one line a rank: the first refusal stands for the case
        refused = [words for words in said if words[0] == "REFUSED"]
        said = [words for words in said if words[0] == "LOADED"] + refused[:1]
    assert len(said) == len(cases) and (code == 0 or said[-1][0] == "REFUSED"), out[-3000:]
    return said



def save_sequence(folder):
    """mesh/ (sequence parallel 2 through the config's mesh, data parallel 1) and autotp2/ (AutoTP 2), PARALLEL's
    kinds, each saved by two ranks in a run of its own (DeepSpeed keeps its parallel groups in globals)."""
    pytest.importorskip("transformers")
    import json

    def save():
        for name, kind in (("mesh", "mesh"), ("autotp2", "autotp")):
            code, out = torchrun(folder, PARALLEL, 2, "save", folder, json.dumps([[name, kind, 2, 1]]))
            if code != 0:
                return code, out
        return 0, ""

    return _saved_once("save_sequence", folder, save)
