"""The launch command's flags (preflight.inputs.launchcmd) and each node's effective launch (preflight.job.view),
from recorded facts: the launchers' own parsing rules, and nodes that send nonsense."""
import pytest

from preflight import registry, runner
from preflight.inputs import launchcmd
from preflight.job import view as jobview
from preflight.plan import build_plan
from preflight.result import Status

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 2
machine_rank: {rank}
num_processes: 4
main_process_ip: 10.0.0.1
main_process_port: 29500
mixed_precision: bf16
"""


@pytest.mark.parametrize("argv, launcher, options, script, args", [
    (["accelerate", "launch", "--num-processes", "8", "--machine_rank=1", "--multi_gpu", "train.py", "--lr", "1"],
     "accelerate", {"num_processes": "8", "machine_rank": "1", "multi_gpu": True}, "train.py", ("--lr", "1")),
    (["/venv/bin/accelerate", "launch", "-m", "pkg.train", "--x"], "accelerate", {"module": True}, "pkg.train", ("--x",)),
    (["torchrun", "--nnodes", "2", "--nproc-per-node=4", "--node_rank", "1", "--standalone", "t.py"],
     "torchrun", {"nnodes": "2", "nproc_per_node": "4", "node_rank": "1", "standalone": True}, "t.py", ()),
    (["python3", "-u", "-m", "torch.distributed.run", "--master_addr", "h", "t.py"], "torchrun",
     {"master_addr": "h"}, "t.py", ()),
    (["env", "NCCL_DEBUG=INFO", "deepspeed", "-H", "hf", "--num_gpus", "8", "t.py", "--deepspeed", "ds.json"],
     "deepspeed", {"hostfile": "hf", "num_gpus": "8"}, "t.py", ("--deepspeed", "ds.json")),
    (["python", "train.py", "a"], "python", {}, "train.py", ("a",)),
    (["bash", "run.sh"], "other", {}, None, ()),
])
def test_each_launcher_is_read_as_its_parser_reads_it(argv, launcher, options, script, args):
    command = launchcmd.parse(argv)
    assert (command.launcher, dict(command.options), command.script, command.script_args) == \
        (launcher, options, script, args)
    assert command.problem is None


def test_the_files_a_command_names():
    command = launchcmd.parse(["accelerate", "launch", "--config_file", "c.yaml", "train.py", "--data", "d/x.json",
                               "--out=ckpt/", "--epochs", "3"])
    assert command.files == ["c.yaml", "train.py", "d/x.json", "ckpt/"]
    assert launchcmd.parse(["accelerate", "launch", "--num_processes"]).problem == "--num_processes needs a value"


def facts(config_text=None, argv=(), files=None, gpus=None):
    job = {"cwd": "/job", "argv": list(argv), "files": files or {}, "programs": {},
           "config": {"path": "/home/u/.cache/huggingface/accelerate/default_config.yaml", "default": True,
                      **({"text": config_text, "sha256": "x"} if config_text else {"error": "missing"})}}
    return {"facts": {"job": job, "host": {"interfaces": {"lo": ["127.0.0.1"]}}, "env": {},
                      "gpus": gpus or {"available": False}}, "error": None, "clock": None}


def context(node_facts, command=(), launching=False):
    plan = build_plan(nodes=tuple(node_facts), command=tuple(command), launching=launching)
    plan = plan.__class__(**{**plan.__dict__, "remote": True})
    return runner.CheckContext(plan, node_facts, {"job": jobview.launches(plan, node_facts, "10.0.0.1"),
                                                  "head": {"address": "10.0.0.1"}})


def run(check_id, ctx):
    spec = registry.load().get(check_id)
    return runner.run_check(spec, ctx)


def test_torchrun_without_master_addr_is_loopback_on_every_node():
    argv = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node_rank", "$R", "t.py"]
    nodes = {"a": facts(argv=[*argv[:6], "0", "t.py"]), "b": facts(argv=[*argv[:6], "1", "t.py"])}
    results = run("JOB003", context(nodes, argv))
    assert [r.status for r in results] == [Status.FAIL] and "127.0.0.1" in results[0].message
    assert [r.status for r in run("JOB002", context(nodes, argv))] == [Status.PASS]


def test_launch_gives_every_node_its_rank_so_the_files_ranks_do_not_matter():
    command = ["accelerate", "launch", "t.py"]
    nodes = {n: facts(CONFIG.format(rank=0), argv=command) for n in ("a", "b")}
    assert {r.status for r in run("JOB002", context(nodes, command))} == {Status.FAIL}
    assert [r.status for r in run("JOB002", context(nodes, command, launching=True))] == [Status.PASS]


def test_deepspeed_with_pdsh_on_several_machines_is_started_by_the_head():
    text = CONFIG.format(rank=0).replace("MULTI_GPU", "DEEPSPEED") + "deepspeed_config:\n  zero_stage: 2\n"
    nodes = {n: facts(text) for n in ("a", "b")}
    [result] = run("JOB002", context(nodes))
    assert result.status == Status.SKIP and "head's launcher starts every node" in result.message


def test_no_config_and_no_command_compares_nothing():
    nodes = {n: facts() for n in ("a", "b", "c")}
    for check_id in ("JOB001", "JOB002", "JOB004", "JOB005"):
        assert {r.status for r in run(check_id, context(nodes))} == {Status.SKIP}, check_id


def test_more_processes_than_gpus():
    gpus = {"available": True, "devices": [{"index": i, "uuid": f"GPU-{i}"} for i in range(2)]}
    nodes = {n: facts(CONFIG.format(rank=i), gpus=gpus) for i, n in enumerate(("a", "b"))}
    ctx = context(nodes)
    results = runner.run_check(registry.load().get("JOB008"), ctx)
    # 4 processes over 2 machines: 2 per node; one result for both nodes
    assert [(r.status, r.nodes) for r in results] == [(Status.PASS, ("a", "b"))]
    nodes = {n: facts(CONFIG.format(rank=i).replace("num_processes: 4", "num_processes: 8"), gpus=gpus)
             for i, n in enumerate(("a", "b"))}
    results = runner.run_check(registry.load().get("JOB008"), context(nodes))
    assert [(r.status, r.nodes) for r in results] == [(Status.FAIL, ("a",)), (Status.FAIL, ("b",))]
    assert "2 usable GPU(s)" in results[0].message


def test_gpu_ids_are_not_read_under_deepspeeds_runner():
    # the runner gives each node the GPUs of its hostfile slots (accelerate/utils/launch.py, deepspeed's launch.py)
    gpus = {"available": True, "devices": [{"index": i, "uuid": f"GPU-{i}"} for i in range(2)]}
    text = CONFIG.format(rank=0) + "gpu_ids: '7'\n"
    nodes = {"a": facts(text, gpus=gpus)}
    assert [r.status for r in run("JOB008", context(nodes))] == [Status.FAIL]  # MULTI_GPU: GPU 7 is not there
    text = text.replace("MULTI_GPU", "DEEPSPEED") + "deepspeed_config:\n  zero_stage: 2\n"
    assert [r.status for r in run("JOB008", context({"a": facts(text, gpus=gpus)}))] == [Status.PASS]


@pytest.mark.parametrize("job", [
    {"config": 5, "files": [], "argv": [1, 2]},
    {"config": {"path": "/x", "text": "[1, 2]"}, "files": {"t.py": "nonsense"}, "argv": "accelerate"},
    {"config": {"path": "/x.yaml", "text": "a: &a [*a]"}, "programs": [], "argv": None},
    {"config": {"path": "/x.yaml", "text": "num_machines: {deep: {deeper: 1}}"}, "files": None},
    {"config": {"path": "/x.yaml", "text": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: d.json\n"},
     "files": {}, "named": ["d.json"], "argv": ["accelerate", "launch", "t.py"]},  # the second answer, a list
])
def test_a_node_that_sends_nonsense_is_a_result_not_a_crash(job):
    nodes = {"a": facts(CONFIG.format(rank=0)),
             "b": {"facts": {"job": job, "host": "?", "env": ["?"], "packages": "?"}, "error": None, "clock": None}}
    ctx = context(nodes, ["accelerate", "launch", "t.py"])
    for spec in registry.load().checks:
        if spec.family == "JOB":
            for result in runner.run_check(spec, ctx):
                assert result.status != Status.ERROR, (spec.id, result.message)
    [bad] = [r for r in run("JOB001", ctx) if r.status == Status.FAIL]
    assert bad.nodes == ("b",)


def test_deepspeeds_runner_starts_the_hosts_of_its_hostfile_not_the_checked_nodes():
    argv = ["deepspeed", "-H", "hf", "t.py"]
    hostfile = {"hf": {"path": "/job/hf", "text": "a slots=8\nz slots=8\n", "sha256": "x"}}
    nodes = {n: facts(argv=argv, files=hostfile) for n in ("a", "b")}
    results = run("JOB004", context(nodes, argv))
    [wrong] = [r for r in results if r.status == Status.FAIL]
    assert wrong.nodes == ("a",) and "b is not in it" in wrong.message and "it lists z" in wrong.message
    hostfile["hf"]["text"] = "a slots=8\nb slots=8\n"
    assert {r.status for r in run("JOB004", context(nodes, argv))} == {Status.PASS}
    assert {r.status for r in run("JOB002", context(nodes, argv))} == {Status.SKIP}


# --- jobs that work must not be refused, and the launchers' own rules ---------------------------------------

def statuses(check_id, nodes, command=()):
    return {r.status for r in run(check_id, context(nodes, command))}


def test_a_quoted_machine_rank_is_a_number_to_accelerate():
    nodes = {n: facts(CONFIG.format(rank=f'"{i}"')) for i, n in enumerate(("a", "b"))}
    assert statuses("JOB002", nodes) == {Status.PASS} and statuses("JOB001", nodes) == {Status.PASS}


def test_a_quoted_num_processes_stops_accelerate():
    text = CONFIG.format(rank=0).replace("num_processes: 4", "num_processes: '4'")
    nodes = {"a": facts(text), "b": facts(CONFIG.format(rank=1).replace("num_processes: 4", "num_processes: '4'"))}
    failed = [r for r in run("JOB001", context(nodes)) if r.status == Status.FAIL]
    assert failed and "TypeError" in failed[0].message


def test_numbers_as_text_that_accelerate_passes_on_are_numbers():
    """On one machine torchrun gets num_processes as text and reads it; only the head tests its port, so a quoted
    port on a worker is never compared (accelerate/utils/launch.py, prepare_multi_gpu_env)."""
    one = CONFIG.format(rank=0).replace("num_machines: 2", "num_machines: 1").replace("num_processes: 4",
                                                                                       "num_processes: '4'")
    view = jobview.launch("a", facts(one)["facts"]["job"], None)
    assert view["problems"] == [] and view["world_size"] == 4 and view["processes"] == 4, view
    quoted_port = CONFIG.replace("main_process_port: 29500", "main_process_port: '29500'")
    worker = jobview.launch("b", facts(quoted_port.format(rank=1))["facts"]["job"], None)
    head = jobview.launch("a", facts(quoted_port.format(rank=0))["facts"]["job"], None)
    assert worker["problems"] == [] and worker["main_port"] == 29500, worker
    assert head["problems"] == ["main_process_port is the text '29500' (/home/u/.cache/huggingface/accelerate/"
                                "default_config.yaml:7): accelerate tests whether the port is free "
                                "(socket.connect_ex) and stops with a TypeError; write it as a number"], head


def test_rdzv_backend_in_the_file_is_not_what_accelerate_uses():
    """accelerate's --rdzv_backend defaults to "static", never None, so the file's value is not copied."""
    nodes = {"a": facts(CONFIG.format(rank=0) + "rdzv_backend: c10d\n"), "b": facts(CONFIG.format(rank=1))}
    assert statuses("JOB005", nodes) == {Status.PASS}


def test_torchrun_with_an_endpoint_and_an_elastic_node_count():
    argv = ["torchrun", "--nnodes", "2:4", "--nproc-per-node", "1", "--rdzv_endpoint", "10.0.0.1:29400", "t.py"]
    nodes = {n: facts(argv=argv[:-1] + ["--node_rank", str(i), "t.py"]) for i, n in enumerate(("a", "b", "c"))}
    assert statuses("JOB004", nodes, argv) == {Status.PASS}
    ctx = context(nodes, argv)
    assert {v["main_ip"] for v in ctx.probes["job"]["nodes"].values()} == {"10.0.0.1"}


def test_the_workers_own_configs_do_not_count_when_the_head_starts_them():
    head = CONFIG.format(rank=0).replace("MULTI_GPU", "DEEPSPEED") + "deepspeed_config:\n  zero_stage: 2\n"
    stale = CONFIG.format(rank=0).replace("num_processes: 4", "num_processes: 64")
    nodes = {"a": facts(head), "b": facts(stale), "c": facts("{not: [yaml")}
    assert statuses("JOB001", nodes) == {Status.PASS}
    assert Status.FAIL not in {r.status for r in runner.run_check(registry.load().get("JOB008"), context(nodes))}


def test_accelerate_with_deepspeed_and_no_hostfile_trains_on_the_head_alone():
    head = CONFIG.format(rank=0).replace("MULTI_GPU", "DEEPSPEED") + "deepspeed_config:\n  zero_stage: 2\n"
    nodes = {n: facts(head) for n in ("a", "b")}
    [wrong] = [r for r in run("JOB004", context(nodes)) if r.status == Status.FAIL]
    assert "--hostfile None" in wrong.message and "head alone" in wrong.message


@pytest.mark.parametrize("text, extra, status", [
    ("10.0.0.1 slots=8\n10.0.0.2 slots=8\n", [], Status.PASS),  # IP addresses of the nodes
    ("a slots=8 max_slots=8\nb slots=8\n", [], Status.PASS),  # more after slots=: DeepSpeed takes it
    ("a slots=8\nb slots=8\nc slots=8\nd slots=8\n", ["--num_nodes", "2"], Status.PASS),  # a filter chooses
    ("a slots = 8\nb slots=8\n", [], Status.FAIL),  # DeepSpeed stops on it
])
def test_deepspeeds_hostfile_as_its_runner_reads_it(text, extra, status):
    argv = ["deepspeed", "-H", "hf", *extra, "t.py"]
    hostfile = {"hf": {"path": "/job/hf", "text": text, "sha256": "x"}}
    nodes = {n: facts(argv=argv, files=hostfile) for n in ("a", "b")}
    for name, address in (("a", "10.0.0.1"), ("b", "10.0.0.2")):
        nodes[name]["facts"]["host"]["interfaces"]["eth0"] = [address]
    assert statuses("JOB004", nodes, argv) == {status}


def test_a_plain_python_launch_has_no_machine_count_to_judge():
    nodes = {n: facts(argv=["python", "t.py"]) for n in ("a", "b")}
    assert Status.FAIL not in statuses("JOB004", nodes, ["python", "t.py"])


def test_outputs_and_missing_names_on_the_command_are_not_the_scripts_failure():
    argv = ["accelerate", "launch", "t.py", "--out", "results.json", "--data", "https://u:s3cret@h/x.json"]
    files = lambda out: {"t.py": {"path": "/job/t.py", "sha256": "aa", "size": 3},  # noqa: E731
                         "results.json": out, "https://u:s3cret@h/x.json": {"path": "/x", "error": "missing"}}
    nodes = {"a": facts(CONFIG.format(rank=0), argv, files({"path": "/job/results.json", "sha256": "b1", "size": 9})),
             "b": facts(CONFIG.format(rank=1), argv, files({"path": "/job/results.json", "error": "missing"}))}
    results = run("JOB007", context(nodes, argv))
    assert {r.status for r in results} == {Status.WARN, Status.PASS}
    assert "s3cret" not in repr([r.message for r in results])


def test_a_variable_not_set_on_a_node_is_said_so():
    argv = ["accelerate", "launch", "--machine_rank", "$SLURM_NODEID", "t.py"]
    nodes = {n: facts(CONFIG.format(rank=0), argv) for n in ("a", "b")}
    failed = [r for r in run("JOB001", context(nodes, argv)) if r.status == Status.FAIL]
    assert failed and "$SLURM_NODEID" in failed[0].message and "not set" in failed[0].message
    assert Status.FAIL not in statuses("JOB002", nodes, argv)  # not a rank: nothing to compare


def test_an_integer_past_pythons_digit_limit_is_that_nodes_problem():
    nodes = {"a": facts(CONFIG.format(rank=0)),
             "b": facts(None)}
    nodes["b"]["facts"]["job"]["config"] = {"path": "/c.json", "text": '{"num_processes": ' + "9" * 5000 + "}"}
    [bad] = [r for r in run("JOB001", context(nodes)) if r.status == Status.FAIL]
    assert bad.nodes == ("b",) and "malformed JSON" in bad.message and "digits" in bad.message


def test_fields_of_the_wrong_type_from_a_node_are_not_an_error():
    argv = ["accelerate", "launch", "t.py"]
    nodes = {n: facts(CONFIG.format(rank=i), argv, {"t.py": {"path": "/t.py", "sha256": 5, "size": "x"}})
             for i, n in enumerate(("a", "b"))}
    for node in nodes.values():
        node["facts"]["job"]["programs"] = {"accelerate": {"path": ["x"], "interpreter": {"a": 1}}}
    for check_id in ("JOB007", "JOB010"):
        assert Status.ERROR not in statuses(check_id, nodes, argv), check_id


def test_check_and_launch_lint_the_values_the_command_gives(tmp_path):
    """The CFG checks of `check` and `launch` see the command's flags over the file, as `lint` does; `launch`
    over SSH sets the rank, head and machine count itself, so the command's own are not taken."""
    config = tmp_path / "accelerate.yaml"
    config.write_text(CONFIG.format(rank=0).replace("num_processes: 4", "num_processes: 7"))
    command = ("accelerate", "launch", "--config_file", str(config), "--num_processes", "16", "--num_machines", "9",
               "t.py")
    here = build_plan(config=str(config), nodes=(), command=command)
    assert (here.accelerate.data["num_processes"], here.accelerate.data["num_machines"]) == (16, 9)
    assert here.accelerate.doc.where("num_processes").startswith("flag --num_processes")
    launched = build_plan(config=str(config), nodes=("a", "b"), command=command, launching=True)
    assert (launched.accelerate.data["num_processes"], launched.accelerate.data["num_machines"]) == (16, 2)


def test_a_node_that_stopped_answering_half_way_is_not_judged_by_its_partial_facts():
    """Its facts came, its second answer did not (SSH001 fails it): JOB must not read the half it sent."""
    nodes = {n: facts(CONFIG.format(rank=i)) for i, n in enumerate(("a", "b"))}
    nodes["b"]["error"] = {"kind": "timeout", "message": "no answer within 3 s", "remediation": "..."}
    ctx = context(nodes)
    assert list(ctx.probes["job"]["nodes"]) == ["a"]
    assert {n for r in run("JOB001", ctx) for n in r.nodes} == {"a"}
    nodes["a"]["error"] = nodes["b"]["error"]
    for check_id in ("JOB008", "JOB009"):
        assert [r.status for r in run(check_id, context(nodes))] == [Status.SKIP], check_id


def deepspeed_nodes(head_interfaces, argv=("deepspeed", "--hostfile", "hf", "t.py")):
    """Three nodes running argv, a head with these interfaces (in `hostname -I` order) and two workers that
    reach it at 10.0.0.1."""
    nodes = {n: facts(argv=argv) for n in ("a", "b", "c")}
    nodes["a"]["facts"]["host"]["interfaces"] = head_interfaces
    for worker in ("b", "c"):
        nodes[worker]["facts"]["host"]["head_resolves_to"] = ["10.0.0.1"]
    return nodes


def test_deepspeed_without_master_addr_meets_at_the_heads_first_address():
    command = ["deepspeed", "--hostfile", "hf", "t.py"]
    docker_first = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["10.0.0.1"]}
    [result] = run("JOB011", context(deepspeed_nodes(docker_first), command))
    assert result.status == Status.WARN and result.nodes == ("a",), result
    assert "MASTER_ADDR=172.17.0.1" in result.message and "on docker0" in result.message
    assert result.remediation == "pass --master_addr 10.0.0.1 to deepspeed"
    training_first = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.1"], "docker0": ["172.17.0.1"]}
    [result] = run("JOB011", context(deepspeed_nodes(training_first), command))
    assert result.status == Status.PASS and result.evidence == {"address": "10.0.0.1"}, result
    given = ["deepspeed", "--hostfile", "hf", "--master_addr", "10.0.0.1", "t.py"]
    [result] = run("JOB011", context(deepspeed_nodes(docker_first, given), given))
    assert result.status == Status.PASS and "--master_addr 10.0.0.1 is given" in result.message, result


def test_job011_judges_only_deepspeeds_runner_over_several_nodes():
    accelerate = ["accelerate", "launch", "t.py"]
    nodes = deepspeed_nodes({"docker0": ["172.17.0.1"], "eth0": ["10.0.0.1"]}, accelerate)
    [result] = run("JOB011", context(nodes, accelerate))
    assert result.status == Status.SKIP and "not DeepSpeed's runner" in result.message
