"""The README's transcripts of `launch` and `node` on the test cluster (tests/transcripts.py: a transcript is what
preflight prints today): a job folder at the same path on every node, a real `accelerate launch` of a gloo job,
node02 with a 64 MiB /dev/shm and node03's clock 5 s ahead, then both mended."""
import contextlib
import re
import shutil
from pathlib import Path

import pytest
import yaml

import transcripts
from cluster import cluster, cluster_up  # noqa: F401  (fixtures)

pytestmark = pytest.mark.cluster

SHOWN_PROJECT = "/tmp/pfdocs-proj"
TRAIN = """\
import os, socket, time
import torch.distributed as dist
from accelerate import Accelerator
accelerator = Accelerator()
hosts = [None] * dist.get_world_size()
dist.all_gather_object(hosts, socket.gethostname())
if dist.get_rank() == 0:
    print(f"{len(hosts)} ranks on {', '.join(hosts)}: training", flush=True)
    time.sleep(1)  # the other nodes' agents leave torchrun's exit barrier before this node's, which holds its store
os._exit(0)  # torch 2.13 may abort at exit after gloo ("terminate called without an active exception")
"""
ACCELERATE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "use_cpu": True,
              "num_machines": 3, "num_processes": 3, "machine_rank": 0, "main_process_ip": "node01",
              "main_process_port": 29571, "mixed_precision": "no", "rdzv_backend": "static"}


@pytest.fixture
def project(cluster):
    """The job's folder (the path the transcripts show: the launch plan's cells are cut at 40 characters), every node's
    sessions quiet for the job (OMP_NUM_THREADS: accelerate's note on CPU threads; c10d's warning that the test
    hosts' addresses have no reverse name)."""
    folder = Path(SHOWN_PROJECT)  # the path shown: cut at the same place each run
    shutil.rmtree(folder, ignore_errors=True)  # a run killed before its teardown
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    (folder / "accelerate.yaml").write_text(yaml.safe_dump(ACCELERATE, sort_keys=False))
    with contextlib.ExitStack() as quiet:
        for node in cluster.nodes:
            quiet.enter_context(cluster.env(node, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR"))
        yield folder
    shutil.rmtree(folder)


def shown(cluster, project):
    return {cluster.ssh_config: "/tmp/pfdocs/ssh_config", project: SHOWN_PROJECT, transcripts.VENV: "/venv"}


def test_launch_stops_at_a_node_with_a_small_dev_shm_and_one_whose_clock_is_ahead(cluster, project):
    with cluster.small_shm_fault("node02", "64m"), cluster.faked_time("node03", "+5s"):
        said, code = transcripts.run("launch-faults", project, shown(cluster, project), timeout=180)
    assert code == 1
    transcripts.held("launch-faults", said, varies=transcripts.SIZES)


def test_launch_starts_the_job_on_every_node_once_they_are_mended(cluster, project):
    said, code = transcripts.run("launch-ready", project, shown(cluster, project), timeout=180)
    assert code == 0
    transcripts.held("launch-ready", said, varies=transcripts.SIZES)


def test_node_on_a_node_of_the_cluster(cluster, project):
    said, code = transcripts.run("node-budget", project, shown(cluster, project),
                                 via=lambda line: cluster.ssh_argv("node01", line))
    assert code == 0
    transcripts.held("node-budget", said, varies=transcripts.SIZES)


def test_check_names_the_node_whose_launch_differs(cluster, project):
    """docs/job.md: each node's own accelerate config (its HF_HOME); node03 was given node02's rank, node02 fp16,
    node03 has an older train.py (its own folder at the same path), and node02's ~/.bashrc prints a banner."""
    homes = Path("/tmp/pfdocs-hf")  # beside the job's folder, which node03 has a copy of its own of
    shutil.rmtree(homes, ignore_errors=True)
    with contextlib.ExitStack() as faults:
        faults.callback(shutil.rmtree, homes, ignore_errors=True)
        for rank, node in enumerate(cluster.nodes):
            home = homes / f"hf-{node}"
            (home / "accelerate").mkdir(parents=True)
            config = dict(ACCELERATE, machine_rank={"node03": 1}.get(node, rank), main_process_port=29572,
                          mixed_precision={"node02": "fp16"}.get(node, "bf16"))
            (home / "accelerate" / "default_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            faults.enter_context(cluster.env(node, HF_HOME=str(home)))
        older = faults.enter_context(cluster.bound_dir("node03", project))
        (older / "train.py").write_text("print('training')\n")
        faults.enter_context(cluster.noisy_shell_fault("node02", "Welcome to node02! Quota: 80% used"))
        said, code = transcripts.run("job-differs", project, shown(cluster, project), timeout=180)
    assert code == 1
    transcripts.held("job-differs", said, varies=transcripts.SIZES)


def test_check_with_a_fault_on_each_node(cluster, project):
    """docs/reading-results.md: node01's /dev/shm is 64 MiB, node02's clock 5 s ahead, node03 has another
    accelerate."""
    with cluster.small_shm_fault("node01", "64m"), cluster.faked_time("node02", "+5s"), \
            cluster.shadowed_package("node03", "accelerate", "0.34.2"):
        said, code = transcripts.run("report-check", project, shown(cluster, project), timeout=180)
    assert code == 1
    transcripts.held("report-check", said, varies=transcripts.SIZES)


def test_the_all_reduce_names_a_node_behind_a_slow_link(cluster, project):
    """docs/collective.md: node03 behind a 100 Mbit/s link, below --min-busbw: the bisect names it (COL002 on
    node03 alone, COL001 passes: slow, but correct), within the all-reduce's --timeout (30 s) and 5 s."""
    with cluster.slowed_link("node03", "100mbit"):
        said, code = transcripts.run("collective-slow-link", project, shown(cluster, project), timeout=180)
    assert code == 1 and float(re.search(r" in (\d+\.\d+) s$", said.strip()).group(1)) < 30 + 5
    transcripts.held("collective-slow-link", said, varies=[(r"\d+x below", "Nx below")])  # of two measured rates


def test_the_pairwise_probes_name_a_node_whose_firewall_lets_in_ssh_and_the_main_port_only(cluster, project):
    """docs/collective.md: node03 takes SSH and the main port only; gloo's all-reduce passes (node03 dials), the
    pairwise links and the ephemeral ports do not."""
    with cluster.blocked_incoming("node03", 22, 29500):
        said, code = transcripts.run("collective-firewall", project, shown(cluster, project), timeout=180)
    assert code == 1
    # the ports the kernel picked this run
    transcripts.held("collective-firewall", said, varies=[(r"peer's port \d+", "peer's port P"),
                                                          (r"ephemeral port \(\d+,", "ephemeral port (P,")])
