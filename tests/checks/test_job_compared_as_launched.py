"""The JOB checks compare what each node's launcher will use, from recorded facts: a config file on the command line
by its settings (not its bytes), values as accelerate normalises them, and the head's name as each node resolves it.
Each healthy spelling that must pass has beside it the real difference that must still fail."""
import json
import socket
import time

import pytest

from preflight import registry, runner
from preflight.job import view as jobview
from preflight.node import launchfiles, paths
from preflight.plan import build_plan
from preflight.result import Status

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 2
machine_rank: {rank}
num_processes: 4
main_process_ip: {ip}
main_process_port: 29500
mixed_precision: {precision}
"""
HEAD, WORKER = "10.0.0.1", "10.0.0.2"
DS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}


def config(rank, ip=HEAD, precision="bf16", extra=""):
    return CONFIG.format(rank=rank, ip=ip, precision=precision) + extra


def node(config_text, argv=(), files=None, resolved=None, address=HEAD, path="/job/accelerate.yaml"):
    """A node's recorded facts: its config (named on the command line), the command's files, what it resolved."""
    job = {"cwd": "/job", "argv": list(argv), "files": files or {}, "programs": {}, "resolved": resolved or {},
           "config": {"path": path, "text": config_text, "sha256": "x"}}
    return {"facts": {"job": job, "host": {"interfaces": {"lo": ["127.0.0.1"], "eth0": [address]}}, "env": {},
                      "gpus": {"available": False}}, "error": None, "clock": None}


def context(nodes, command=(), deepspeed=None):
    plan = build_plan(nodes=tuple(nodes), command=tuple(command))
    plan = plan.__class__(**{**plan.__dict__, "remote": True, "deepspeed_path": deepspeed})
    return runner.CheckContext(plan, nodes, {"job": jobview.launches(plan, nodes, HEAD), "head": {"address": HEAD}})


def results(check_id, nodes, command=(), deepspeed=None):
    return runner.run_check(registry.load().get(check_id), context(nodes, command, deepspeed))


def statuses(check_id, nodes, command=(), deepspeed=None):
    return {r.status for r in results(check_id, nodes, command, deepspeed)}


def failed(check_id, nodes, command=(), deepspeed=None):
    return [r for r in results(check_id, nodes, command, deepspeed) if r.status in (Status.FAIL, Status.WARN)]


def file_entry(text, path="/job/accelerate.yaml"):
    import hashlib
    return {"path": path, "text": text, "sha256": hashlib.sha256(text.encode()).hexdigest(), "size": len(text)}


# --- 1. a config file on the command line is compared by its settings -------------------------------------

CONFIG_FILE = ["accelerate", "launch", "--config_file", "accelerate.yaml", "train.py"]
SCRIPT = {"path": "/job/train.py", "sha256": "ab" * 32, "size": 9}


def config_file_nodes(texts):
    return {name: node(text, CONFIG_FILE, {"accelerate.yaml": file_entry(text), "train.py": SCRIPT},
                       address=(HEAD if i == 0 else f"10.0.0.{i + 1}"))
            for i, (name, text) in enumerate(zip(("a", "b", "c"), texts))}


def test_per_node_config_files_that_differ_only_in_machine_rank_are_the_same_file():
    texts = [config(i).replace("num_machines: 2", "num_machines: 3").replace("num_processes: 4", "num_processes: 3")
             for i in range(3)]
    nodes = config_file_nodes(texts)
    assert statuses("JOB007", nodes, CONFIG_FILE) == {Status.PASS}
    assert statuses("JOB005", nodes, CONFIG_FILE) == {Status.PASS}


def test_a_config_file_that_differs_in_a_setting_is_still_a_failure():
    texts = [config(i).replace("num_machines: 2", "num_machines: 3").replace("num_processes: 4", "num_processes: 3")
             for i in range(3)]
    texts[2] = texts[2].replace("num_processes: 3", "num_processes: 6")
    [odd] = failed("JOB007", config_file_nodes(texts), CONFIG_FILE)
    assert odd.status == Status.FAIL and odd.nodes == ("c",), odd
    assert "accelerate.yaml differs on c" in odd.message and "as accelerate reads it" in odd.message


def test_a_deepspeed_config_flag_file_in_another_formatting_is_the_same_file():
    argv = ["accelerate", "launch", "--use_deepspeed", "--deepspeed_config_file", "ds.json", "train.py"]
    texts = {"a": json.dumps(DS, indent=2), "b": json.dumps(dict(reversed(list(DS.items())))),
             "c": json.dumps(DS, indent=2)}
    nodes = {n: node(config(i, extra="distributed_type: DEEPSPEED\n").replace("MULTI_GPU", "DEEPSPEED"), argv,
                     {"ds.json": file_entry(t, "/job/ds.json"), "train.py": SCRIPT})
             for i, (n, t) in enumerate(texts.items())}
    assert statuses("JOB007", nodes, argv) == {Status.PASS}
    nodes["c"]["facts"]["job"]["files"]["ds.json"] = file_entry(json.dumps(dict(DS, gradient_accumulation_steps=4)),
                                                                "/job/ds.json")
    [odd] = failed("JOB007", nodes, argv)
    assert odd.status == Status.FAIL and odd.nodes == ("c",) and "as DeepSpeed reads it" in odd.message


@pytest.mark.parametrize("argv", [
    ["accelerate", "launch", "train.py", "--deepspeed", "ds.json"],  # transformers' TrainingArguments.deepspeed
    ["deepspeed", "--hostfile", "hf", "train.py", "--deepspeed", "--deepspeed_config=ds.json"],  # deepspeed's own
])
def test_a_deepspeed_config_named_to_the_script_is_compared_by_its_settings(argv):
    formats = [json.dumps(DS), json.dumps(DS, indent=4, sort_keys=True)]
    nodes = {n: node(config(i), argv, {"ds.json": file_entry(t, "/job/ds.json"), "train.py": SCRIPT})
             for i, (n, t) in enumerate(zip(("a", "b"), formats))}
    assert statuses("JOB007", nodes, argv) == {Status.PASS}
    nodes["b"]["facts"]["job"]["files"]["ds.json"] = file_entry(json.dumps(dict(DS, zero_optimization={"stage": 3})),
                                                                "/job/ds.json")
    assert {r.status for r in failed("JOB007", nodes, argv)} == {Status.FAIL}  # the settings a launch reads: a failure


def test_other_files_are_still_compared_byte_for_byte():
    argv = ["accelerate", "launch", "train.py", "--data", "data.json"]
    data = [file_entry(json.dumps({"x": 1}), "/job/data.json"), file_entry(json.dumps({"x": 1}, indent=2), "/job/data.json")]
    nodes = {n: node(config(i), argv, {"data.json": d, "train.py": SCRIPT}) for i, (n, d) in enumerate(zip("ab", data))}
    [odd] = failed("JOB007", nodes, argv)
    assert odd.nodes == ("b",) and "sha256" in odd.message


def test_the_request_asks_for_the_text_of_a_deepspeed_config_named_to_the_script():
    plan = build_plan(nodes=("a", "b"), command=("accelerate", "launch", "train.py", "--deepspeed", "ds.json"))
    assert "ds.json" in jobview.request(plan)["text"]


# --- 2. values as the launcher normalises them ----------------------------------------------------------

@pytest.mark.parametrize("same, other", [
    ({"precision": "BF16"}, {"precision": "bf16"}),  # utils/launch.py: args.mixed_precision.lower()
    ({"extra": "dynamo_config:\n  dynamo_backend: inductor\n"}, {"extra": "dynamo_config:\n  dynamo_backend: INDUCTOR\n"}),
    ({"extra": "dynamo_backend: NO\n"}, {"extra": ""}),  # process_config: dynamo_backend NO is no dynamo
    ({"extra": "use_cpu: 'true'\n"}, {"extra": "use_cpu: True\n"}),
    ({"extra": "num_cpu_threads_per_process: '4'\n"}, {"extra": "num_cpu_threads_per_process: 4\n"}),
    ({"extra": "deepspeed_config:\n  zero3_init_flag: 'true'\n"}, {"extra": "deepspeed_config:\n  zero3_init_flag: true\n"}),
    ({"precision": "fp16"}, {"precision": "fp16\nfp16: true"}),
])
def test_spellings_the_launcher_reads_alike_are_the_same(same, other):
    nodes = {"a": node(config(0, **same)), "b": node(config(1, **other), address=WORKER)}
    assert statuses("JOB005", nodes) == {Status.PASS}, [r.message for r in failed("JOB005", nodes)]


def test_the_old_fp16_key_is_mixed_precision_fp16():
    text = config(0).replace("mixed_precision: bf16\n", "fp16: true\n")
    view = jobview.launch("a", node(text)["facts"]["job"], None)
    assert view["mixed_precision"] == "fp16"


@pytest.mark.parametrize("one, other, status", [
    ({"precision": "BF16"}, {"precision": "fp16"}, Status.FAIL),
    ({"extra": "dynamo_config:\n  dynamo_backend: inductor\n"}, {"extra": "dynamo_config:\n  dynamo_backend: eager\n"},
     Status.WARN),
    ({"extra": "num_cpu_threads_per_process: '4'\n"}, {"extra": "num_cpu_threads_per_process: 8\n"}, Status.WARN),
])
def test_values_that_differ_once_normalised_still_differ(one, other, status):
    nodes = {"a": node(config(0, **one)), "b": node(config(1, **other), address=WORKER)}
    assert status in {r.status for r in failed("JOB005", nodes)}


def test_the_heads_name_and_its_address_are_the_same_head():
    nodes = {"a": node(config(0, ip=HEAD)), "b": node(config(1, ip="n1"), resolved={"n1": [HEAD]}, address=WORKER)}
    assert statuses("JOB005", nodes) == {Status.PASS}, [r.message for r in failed("JOB005", nodes)]
    assert statuses("JOB003", nodes) == {Status.PASS}


def test_a_name_that_reaches_another_host_is_a_failure():
    nodes = {"a": node(config(0, ip=HEAD)), "b": node(config(1, ip="n2"), resolved={"n2": [WORKER]}, address=WORKER)}
    [odd] = failed("JOB005", nodes)
    assert odd.status == Status.FAIL and odd.nodes == ("b",)
    assert "main_process_ip differs: b has 'n2', which reaches b there" in odd.message and "reaches a" in odd.message


def test_a_name_a_node_cannot_resolve_is_said_so():
    nodes = {"a": node(config(0, ip=HEAD)),
             "b": node(config(1, ip="n1"), resolved={"n1": {"error": "[Errno -2] Name or service not known"}},
                       address=WORKER)}
    [odd] = failed("JOB005", nodes)
    assert odd.status == Status.FAIL and odd.nodes == ("b",)
    assert "main_process_ip 'n1' does not resolve on b" in odd.message and "Name or service not known" in odd.message


def test_a_loopback_name_is_never_the_head_of_another_node():
    nodes = {"a": node(config(0, ip=HEAD)),
             "b": node(config(1, ip="localhost"), resolved={"localhost": ["127.0.0.1"]}, address=WORKER)}
    [odd] = failed("JOB005", nodes)
    assert odd.nodes == ("b",) and "'localhost', which reaches 127.0.0.1 there" in odd.message


def test_a_name_no_node_resolved_is_compared_as_written():
    nodes = {"a": node(config(0, ip=HEAD)), "b": node(config(1, ip="n1"), address=WORKER)}
    assert {r.status for r in failed("JOB005", nodes)} == {Status.FAIL}


# --- the node resolves the head's names, bounded -------------------------------------------------------

def test_the_node_resolves_the_name_in_its_own_config_and_the_commands(tmp_path):
    (tmp_path / "accelerate.yaml").write_text(config(1, ip="localhost"))
    facts = launchfiles.facts({"cwd": str(tmp_path), "config": "accelerate.yaml", "argv": [], "files": [],
                               "resolve": ["$HEAD_NAME"], "expand": True, "deadline_s": 5})
    assert "127.0.0.1" in facts["resolved"]["localhost"]
    assert set(facts["resolved"]) == {"localhost", "$HEAD_NAME"} and "error" in facts["resolved"]["$HEAD_NAME"]


def test_a_json_config_names_its_head_too(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"main_process_ip": "localhost", "distributed_type": "MULTI_GPU"}))
    facts = launchfiles.facts({"cwd": str(tmp_path), "config": "c.json"})
    assert "127.0.0.1" in facts["resolved"]["localhost"]


def test_a_resolver_that_hangs_is_not_waited_for(monkeypatch):
    real = socket.getaddrinfo
    # the slow lookup answers nothing when it wakes (after the test): a resolver left behind stays harmless
    monkeypatch.setattr(paths.socket, "getaddrinfo",
                        lambda name, *a, **k: time.sleep(30) or [] if name == "slow" else real(name, *a, **k))
    started = time.monotonic()
    found = paths.resolve(["slow", "localhost"], seconds=0.5)
    assert time.monotonic() - started < 5
    assert found["slow"] == {"error": "no answer from the resolver within 0.5 s"} and "127.0.0.1" in found["localhost"]


def test_loopback_on_every_node_is_the_same_spelling_and_rank_zero_hosts_judge_it():
    argv = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node_rank", "$R", "t.py"]
    nodes = {n: node(config(0), [*argv[:6], str(i), "t.py"]) for i, n in enumerate(("a", "b"))}
    assert statuses("JOB005", nodes, argv) == {Status.PASS}
    assert statuses("JOB003", nodes, argv) == {Status.FAIL}  # each node would host its own rendezvous
