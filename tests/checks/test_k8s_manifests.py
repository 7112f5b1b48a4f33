"""`lint --k8s MANIFEST`: a Kubernetes manifest read as the cluster will run it (preflight.inputs.manifests) and
judged by the CFG08x checks (checks/config/manifests.py); its main container's launch goes through the lint pipeline
as `-- COMMAND` does. Real manifests from public repositories and threads are in tests/fixtures/k8s (README there)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run_cli
from lint_results import lint as lint_args
from lint_results import assert_exit_2_in_one_line, assert_refused_in_one_line, statuses, unreadable_files
from preflight.inputs import manifests

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "k8s"
K8S_IDS = ("CFG080", "CFG081", "CFG082", "CFG083", "CFG084", "CFG085", "CFG086")


def lint(capsys, manifest, *extra):
    """`preflight lint --k8s MANIFEST --json`: (exit code, {id: [results]})."""
    return lint_args(capsys, "--k8s", manifest, *extra)


def write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def clean_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


JOBSET = """apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: train
spec:
  replicatedJobs:
  - name: workers
    template:
      spec:
        parallelism: 2
        completions: 2
        template:
          metadata:
            annotations:
              sidecar.istio.io/inject: "false"
          spec:
            containers:
            - name: trainer
              image: pytorch/pytorch
              env:
              - name: NODES
                value: "2"
              - name: RANK
                valueFrom:
                  fieldRef:
                    fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
              command:
              - bash
              - -c
              - |
                cd /workspace && torchrun --nnodes=$NODES --nproc_per_node=8 --node_rank=$RANK \\
                  --master_addr=train-workers-0-0.train --master_port=29500 train.py --lr 1e-4
              resources:
                limits:
                  nvidia.com/gpu: 8
              volumeMounts:
              - name: dshm
                mountPath: /dev/shm
            volumes:
            - name: dshm
              emptyDir:
                medium: Memory
                sizeLimit: 16Gi
"""


# ---- real manifests ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pytorchjob_simple.yaml", "pytorchjob_elastic_imagenet.yaml",
                                  "pytorchjob_deepspeed_demo.yaml", "jobset_pytorch_mnist.yaml", "lws_vllm_gpu.yaml",
                                  "volcano_pytorch_plugin.yaml", "trainjob_multi_node.yaml",
                                  "trainer_torch_distributed_runtime.yaml"])
def test_working_public_manifests_do_not_fail(capsys, name):
    code, found = lint(capsys, FIXTURES / name)
    assert code == 0, {k: v for k, v in found.items() if any(r["status"] == "fail" for r in v)}
    assert all(r["nodes"] == [] for rs in found.values() for r in rs)  # lint results name no node


def test_the_indexed_job_with_its_headless_service_passes(capsys):
    code, found = lint(capsys, FIXTURES / "indexed_job_torchrun_headless.yaml")
    assert code == 0, {k: v for k, v in found.items() if any(r["status"] == "fail" for r in v)}  # `--role ''` kept
    for check_id in ("CFG080", "CFG081", "CFG082", "CFG083", "CFG084"):
        assert statuses(found, check_id) == ["pass"], (check_id, found.get(check_id))
    assert "multinode-job-0.multinode-job-svc" in found["CFG084"][0]["message"]


def test_the_pytorchjob_operators_environment_counts_as_set(capsys):
    code, found = lint(capsys, FIXTURES / "pytorchjob_deepspeed_demo.yaml")
    # torchrun with no flags: PET_NNODES, PET_NPROC_PER_NODE (auto: the pod's 1 GPU), PET_NODE_RANK, PET_MASTER_ADDR
    assert "PET_NNODES (the operator's)" in found["CFG081"][0]["message"]
    assert statuses(found, "CFG082") == ["pass", "pass"]
    assert "pytorch-deepspeed-demo-master-0" in found["CFG084"][0]["message"]
    assert statuses(found, "CFG084") == ["pass"]


def test_an_elastic_pytorchjob_takes_its_replica_range(capsys):
    code, found = lint(capsys, FIXTURES / "pytorchjob_elastic_imagenet.yaml")
    assert "nnodes 1:3" in found["CFG081"][0]["message"] and statuses(found, "CFG081") == ["pass"]
    assert "elastic-example-imagenet-worker-0" in found["CFG084"][0]["message"]


def test_a_jobset_whose_torchrun_has_no_nnodes_trains_each_pod_alone(capsys):
    code, found = lint(capsys, FIXTURES / "jobset_pytorch_resnet.yaml")
    assert statuses(found, "CFG081") == ["fail"] and "every pod trains alone" in found["CFG081"][0]["message"]
    assert statuses(found, "CFG084") == ["fail"]  # no --node_rank with the static rendezvous
    assert code == 1


def test_an_unquoted_istio_annotation_is_refused(capsys):
    code, found = lint(capsys, FIXTURES / "katib_issue1112_unquoted_annotation.yaml")
    assert statuses(found, "CFG085") == ["fail", "fail"]
    assert "not a string" in found["CFG085"][0]["message"]


def test_a_pytorchjob_without_the_sidecar_annotation_is_said_once_as_not_judged(capsys):
    # whether namespace kubeflow injects is its label on the cluster: said once, not warned on every manifest
    code, found = lint(capsys, FIXTURES / "pytorchjob_simple.yaml")
    assert statuses(found, "CFG085") == ["skip"] and code == 0
    assert "(namespace kubeflow)" in found["CFG085"][0]["message"] and "not judged" in found["CFG085"][0]["message"]


def test_a_trainjob_takes_numnodes_over_its_runtime_in_the_same_file(capsys, tmp_path):
    both = (FIXTURES / "trainer_torch_distributed_runtime.yaml").read_text() + "---\n" + \
        (FIXTURES / "trainjob_multi_node.yaml").read_text()
    read = manifests.load(str(write(tmp_path, both)))
    (training,) = read.trainings  # the runtime is read with the TrainJob that names it
    assert training.kind == "TrainJob" and training.pods == 3
    assert training.injected["PET_NNODES"] == "3" and training.injected["PET_NPROC_PER_NODE"] == "auto"
    assert training.injected["PET_MASTER_ADDR"] == "multi-node-example-trainer-node-0-0.multi-node-example"
    (group,) = training.groups
    assert group.template_read and group.containers[0].name == "trainer"
    assert group.containers[0].argv[:2] == ("python3", "-c")  # the TrainJob's command on the runtime's container


# ---- the checks, one class each ---------------------------------------------------------------------------------

def test_a_healthy_jobset_is_clean(capsys, tmp_path):
    code, found = lint(capsys, write(tmp_path, JOBSET))
    assert code == 0, found
    for check_id in ("CFG080", "CFG081", "CFG082", "CFG083", "CFG084", "CFG085"):
        assert statuses(found, check_id) == ["pass"], (check_id, found.get(check_id))
    assert statuses(found, "CFG007") == ["pass"]  # the container's launch, judged as `-- COMMAND` is
    assert "nnodes 2" in found["CFG081"][0]["message"]  # $NODES is the container's env


def test_replicas_that_are_not_the_launchs_nodes_fail(capsys, tmp_path):
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("parallelism: 2", "parallelism: 4")))
    assert statuses(found, "CFG081") == ["fail"] and "starts 4 pods" in found["CFG081"][0]["message"]


def test_accelerates_num_machines_from_the_config_given_beside_it(capsys, tmp_path):
    config = write(tmp_path, "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 4\n"
                             "num_processes: 32\nmachine_rank: 0\nmain_process_ip: train-workers-0-0.train\n"
                             "main_process_port: 29500\n", "accelerate.yaml")
    launch = "accelerate launch --config_file /etc/accelerate/config.yaml --machine_rank $RANK train.py"
    text = JOBSET.replace("cd /workspace && torchrun --nnodes=$NODES --nproc_per_node=8 --node_rank=$RANK \\\n"
                          "                  --master_addr=train-workers-0-0.train --master_port=29500 train.py "
                          "--lr 1e-4", launch)
    code, found = lint(capsys, write(tmp_path, text), "--config", config)
    assert statuses(found, "CFG081") == ["fail"] and "num_machines is 4" in found["CFG081"][0]["message"]
    assert statuses(found, "CFG001") == ["pass"]  # the config itself linted by the existing checks
    ok = config.read_text().replace("num_machines: 4", "num_machines: 2").replace("num_processes: 32",
                                                                                  "num_processes: 16")
    config.write_text(ok)
    code, found = lint(capsys, write(tmp_path, text), "--config", config)
    assert statuses(found, "CFG081") == ["pass"] and statuses(found, "CFG082") == ["pass"]


def test_more_processes_than_the_pods_gpus_fail_and_fewer_warn(capsys, tmp_path):
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("nvidia.com/gpu: 8", "nvidia.com/gpu: 4")))
    assert statuses(found, "CFG082") == ["fail"] and "on the 4 GPU(s)" in found["CFG082"][0]["message"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("--nproc_per_node=8", "--nproc_per_node=2")))
    assert statuses(found, "CFG082") == ["warn"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("--nproc_per_node=8", "--nproc_per_node=gpu")
                                     .replace("nvidia.com/gpu: 8", "cpu: 4")))
    assert statuses(found, "CFG082") == ["fail"] and "Cuda is not available" in found["CFG082"][0]["message"]


def test_dev_shm_missing_or_small(capsys, tmp_path):
    without = JOBSET.replace("              volumeMounts:\n              - name: dshm\n                mountPath: "
                             "/dev/shm\n", "")
    code, found = lint(capsys, write(tmp_path, without))  # NCCL "may require" it: a warning for 8 GPUs a pod
    assert statuses(found, "CFG083") == ["warn"] and "64 MB for the 8 GPUs" in found["CFG083"][0]["message"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("sizeLimit: 16Gi", "sizeLimit: 64Mi")))
    assert statuses(found, "CFG083") == ["fail"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("sizeLimit: 16Gi", "sizeLimit: 768Mi")))
    assert statuses(found, "CFG083") == ["warn"]
    code, found = lint(capsys, write(tmp_path, without.replace("--nproc_per_node=8", "--nproc_per_node=1")
                                     .replace("nvidia.com/gpu: 8", "nvidia.com/gpu: 1")))
    assert statuses(found, "CFG083") == ["pass"]  # one GPU a pod: DataLoader workers only, which it does not tell
    assert "not judged" in found["CFG083"][0]["message"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("sizeLimit: 16Gi", "sizeLimit: 1.5.5Gi")))
    assert statuses(found, "CFG083") == ["fail"] and "is not a quantity" in found["CFG083"][0]["message"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("sizeLimit: 16Gi", "sizeLimit: .inf")))
    assert statuses(found, "CFG083") == ["fail"] and "JSON has no infinity" in found["CFG083"][0]["message"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("sizeLimit: 16Gi", "sizeLimit: 1e999")))
    assert statuses(found, "CFG083") == ["pass"]  # past an int64 a Quantity saturates: no limit


def test_a_head_address_that_names_each_pod_itself_fails(capsys, tmp_path):
    for address in ("localhost", "$(hostname)"):
        code, found = lint(capsys, write(tmp_path, JOBSET.replace("train-workers-0-0.train", address)))
        assert statuses(found, "CFG084") == ["fail"], (address, found["CFG084"])


def test_a_node_rank_the_same_on_every_pod_fails(capsys, tmp_path):
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("--node_rank=$RANK", "--node_rank=0")))
    assert statuses(found, "CFG084") == ["fail"] and "every pod claims one rank" in found["CFG084"][0]["message"]
    code, found = lint(capsys, write(tmp_path, JOBSET.replace("--node_rank=$RANK", "--rdzv_backend=c10d")))
    assert statuses(found, "CFG084") == ["pass"]


INDEXED_JOB = (FIXTURES / "indexed_job_torchrun_headless.yaml").read_text()


def test_an_indexed_jobs_service_must_be_headless_and_present(capsys, tmp_path):
    code, found = lint(capsys, write(tmp_path, INDEXED_JOB.replace("clusterIP: None", "clusterIP: 10.0.0.5")))
    assert statuses(found, "CFG084") == ["fail"] and "headless Service" in found["CFG084"][0]["message"]
    alone = INDEXED_JOB.split("---\n", 1)[1]
    code, found = lint(capsys, write(tmp_path, alone))
    assert statuses(found, "CFG084") == ["warn"] and "not in this file" in found["CFG084"][0]["message"]


def test_sidecar_injection(capsys, tmp_path):
    code, found = lint(capsys, write(tmp_path, JOBSET.replace('inject: "false"', 'inject: "true"')))
    assert statuses(found, "CFG085") == ["fail"]
    namespace = ("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: team\n  labels:\n    istio-injection: enabled\n"
                 "---\n")
    no_annotation = JOBSET.replace('              sidecar.istio.io/inject: "false"\n', "              a: b\n")
    code, found = lint(capsys, write(tmp_path, namespace + no_annotation.replace("  name: train\n",
                                                                                 "  name: train\n  namespace: team\n")))
    assert statuses(found, "CFG085") == ["fail"] and "namespace team injects" in found["CFG085"][0]["message"]
    code, found = lint(capsys, write(tmp_path, no_annotation))
    assert statuses(found, "CFG085") == ["skip"] and code == 0


def test_rdma(capsys, tmp_path):
    rdma = JOBSET.replace("nvidia.com/gpu: 8", "nvidia.com/gpu: 8\n                  rdma/rdma_shared_device_a: 1")
    code, found = lint(capsys, write(tmp_path, rdma))
    assert statuses(found, "CFG086") == ["fail"] and "IPC_LOCK" in found["CFG086"][0]["message"]
    locked = rdma.replace("              volumeMounts:", "              securityContext:\n                "
                          "capabilities:\n                  add: [IPC_LOCK]\n              volumeMounts:")
    code, found = lint(capsys, write(tmp_path, locked))
    assert statuses(found, "CFG086") == ["pass"]
    disabled = locked.replace("              - name: NODES", "              - name: NCCL_IB_DISABLE\n"
                              "                value: \"1\"\n              - name: NODES")
    code, found = lint(capsys, write(tmp_path, disabled))
    assert statuses(found, "CFG086") == ["fail"] and "NCCL_IB_DISABLE" in found["CFG086"][0]["message"]
    no_device = JOBSET.replace("              - name: NODES", "              - name: NCCL_IB_HCA\n"
                               "                value: mlx5\n              - name: NODES")
    code, found = lint(capsys, write(tmp_path, no_device))
    assert statuses(found, "CFG086") == ["fail"] and "/dev/infiniband" in found["CFG086"][0]["message"]
    assert statuses(lint(capsys, write(tmp_path, JOBSET))[1], "CFG086") == ["skip"]


def test_what_the_operator_refuses(capsys, tmp_path):
    text = (FIXTURES / "pytorchjob_simple.yaml").read_text()
    code, found = lint(capsys, write(tmp_path, text.replace("replicas: 1\n      restartPolicy: OnFailure\n      "
                                                            "template:\n        spec:\n          containers:\n"
                                                            "            - name: pytorch",
                                                            "replicas: 2\n      restartPolicy: OnFailure\n      "
                                                            "template:\n        spec:\n          containers:\n"
                                                            "            - name: main", 1)))
    messages = [r["message"] for r in found["CFG080"]]
    assert statuses(found, "CFG080") == ["fail", "fail"], messages
    assert any("Master replicas must be 1" in m for m in messages)
    assert any("no container named 'pytorch'" in m for m in messages)


# ---- templates and the shell ------------------------------------------------------------------------------------

def test_a_templated_manifest_is_read_where_literal(capsys, tmp_path):
    helm = JOBSET.replace("parallelism: 2", "parallelism: {{ .Values.nodes }}").replace(
        "  replicatedJobs:\n", "{{- if .Values.enabled }}\n  replicatedJobs:\n") + "{{- end }}\n"
    code, found = lint(capsys, write(tmp_path, helm))  # a templated field is said as not judged
    assert statuses(found, "CFG080") == ["pass"] and "templated, not judged" in found["CFG080"][0]["message"]
    assert "parallelism" in found["CFG080"][0]["message"]
    assert "not in the file" in found["CFG081"][0]["message"] and code == 0
    assert statuses(found, "CFG082") == ["pass"]  # what is literal is still judged
    env = JOBSET.replace("image: pytorch/pytorch", "image: ${IMAGE}")
    code, found = lint(capsys, write(tmp_path, env))
    assert statuses(found, "CFG080") == ["pass"] and "image" in found["CFG080"][0]["message"]


def test_a_shell_variable_in_the_command_is_not_a_template(tmp_path):
    read = manifests.load(str(write(tmp_path, JOBSET.replace("--master_port=29500", "--master_port=${PORT}"))))
    assert read.templated == ()
    (launch,) = [c.launch for _, _, c in read.launches]
    assert launch.in_shell and launch.command.get("master_port") == "$PORT"  # the shell's, at run time
    assert launch.command.get("nnodes") == "2" and launch.command.script == "train.py"


def test_the_kubelet_expands_dollar_paren_from_the_containers_env(tmp_path):
    text = JOBSET.replace("--nnodes=$NODES", "--nnodes=$(NODES)").replace("--lr 1e-4", "--lr 1e-4 --tag $$HOME")
    read = manifests.load(str(write(tmp_path, text)))
    (launch,) = [c.launch for _, _, c in read.launches]
    assert launch.command.get("nnodes") == "2" and launch.command.script_args[-1] == "$HOME"


def test_quantities():
    assert manifests.quantity_bytes("16Gi") == 16 * 2**30
    assert manifests.quantity_bytes("1G") == 10**9
    assert manifests.quantity_bytes("1e3") == 1000
    assert manifests.quantity_bytes("lots") is None


# ---- bad input --------------------------------------------------------------------------------------------------

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def test_bad_input_is_one_line_naming_the_file(tmp_path):
    cases = unreadable_files(tmp_path, ".yaml", manifests.MAX_BYTES, b"apiVersion: v1")
    cases[write(tmp_path, "compute_environment: LOCAL_MACHINE\nnum_machines: 2\n", "a.yaml")] = \
        "not a Kubernetes manifest"
    cases[write(tmp_path, "apiVersion: v1\nkind: ConfigMap\n" + BOMB, "bomb.yaml")] = "more than 100000 values"
    cases[write(tmp_path, "apiVersion: v1\nkind: [\n", "bad.yaml")] = "malformed YAML"
    cases[write(tmp_path, "apiVersion: v1\nkind: Job\nspec: {{ toYaml .Values.spec | indent 2 }} x: [\n",
                "chart.yaml")] = "render it first"
    assert_refused_in_one_line(manifests.load, cases)


@pytest.mark.parametrize("make,problem", [
    (lambda d: write(d, "just: yaml\n"), "not a Kubernetes manifest"),
    (lambda d: write(d, "apiVersion: v1\nkind: ConfigMap\n" + BOMB), "more than 100000 values"),
    (lambda d: (os.mkfifo(d / "p.yaml"), d / "p.yaml")[1], "not a regular file"),
    (lambda d: d / "missing.yaml", "cannot be read"),
])
def test_bad_input_is_exit_2_in_one_line(capsys, tmp_path, make, problem):
    assert_exit_2_in_one_line(capsys, "--k8s", make(tmp_path), problem)


def test_the_command_line_option(capsys):
    code, doc, err = run_cli(capsys, "lint", "--k8s", FIXTURES / "jobset_pytorch_resnet.yaml", "--json")
    assert code == 1 and [r["status"] for r in doc["results"] if r["id"] == "CFG081"] == ["fail"], err
    code, out, err = run_cli(capsys, "lint", "--k8s", "")
    assert code == 2 and "--k8s" in err


LWS = """apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: llm
spec:
  replicas: 3
  leaderWorkerTemplate:
    size: 2
    workerTemplate:
      metadata:
        annotations:
          sidecar.istio.io/inject: "false"
      spec:
        containers:
        - name: trainer
          image: pytorch/pytorch
          command:
          - sh
          - -c
          - >-
            torchrun --nnodes=$(LWS_GROUP_SIZE) --nproc_per_node=8 --node_rank=$(LWS_WORKER_INDEX)
            --master_addr=$(LWS_LEADER_ADDRESS) train.py
          resources:
            limits:
              nvidia.com/gpu: "8"
          volumeMounts:
          - {name: dshm, mountPath: /dev/shm}
        volumes:
        - {name: dshm, emptyDir: {medium: Memory, sizeLimit: 32Gi}}
"""


def test_a_leaderworkerset_group_is_one_job(capsys, tmp_path):
    code, found = lint(capsys, write(tmp_path, LWS))
    assert code == 0, found
    # LWS_GROUP_SIZE is set by the LWS controller; the job is one group of `size` pods, not all replicas x size
    assert statuses(found, "CFG081") == ["pass"] and "2 pods, torchrun's nnodes 2" in found["CFG081"][0]["message"]
    assert statuses(found, "CFG084") == ["pass"]
    code, found = lint(capsys, write(tmp_path, LWS.replace("--nnodes=$(LWS_GROUP_SIZE)", "--nnodes=6")))
    assert statuses(found, "CFG081") == ["fail"]


def test_a_volcano_pytorch_plugin_gives_the_head(capsys, tmp_path):
    text = (FIXTURES / "volcano_pytorch_plugin.yaml").read_text().replace(
        "              name: worker\n", "              name: worker\n              command: [torchrun, --nnodes=3, "
        "--node_rank=$(RANK), train.py]\n")
    code, found = lint(capsys, write(tmp_path, text))
    assert statuses(found, "CFG084") == ["pass"] and "pytorch-job-master-0.pytorch-job" in found["CFG084"][0]["message"]
    assert statuses(found, "CFG081") == ["pass"]


@pytest.mark.parametrize("old,new", [
    ("  replicatedJobs:\n  - name: workers", "  network: [a]\n  replicatedJobs: 5\n  x:\n  - name: workers"),
    ("parallelism: 2", "parallelism: {a: 1}"),
    ("            containers:\n            - name: trainer",
     "            containers: trainer\n            x:\n            - name: trainer"),
    ("              env:\n", "              env: {NODES: 2}\n              x:\n"),
    ("              resources:\n                limits:\n                  nvidia.com/gpu: 8",
     "              resources: [8]\n              x:\n                limits:\n                  nvidia.com/gpu: 8"),
    ("              emptyDir:\n", "              emptyDir: memory\n              x:\n"),
    ("  name: train\n", "  name: [train]\n  namespace: {a: b}\n"),
])
def test_a_resource_of_the_wrong_shape_is_read_without_an_error(capsys, tmp_path, old, new):
    assert JOBSET.count(old) == 1
    code, found = lint(capsys, write(tmp_path, JOBSET.replace(old, new)))
    assert code in (0, 1) and not [r for rs in found.values() for r in rs if r["status"] == "error"], found


MPIJOB = """apiVersion: kubeflow.org/v2beta1
kind: MPIJob
metadata:
  name: bert
spec:
  slotsPerWorker: 8
  mpiReplicaSpecs:
    Launcher:
      replicas: 1
      template:
        spec:
          containers:
          - name: launcher
            image: mpi-train:latest
            command: [mpirun, -np, "16", --allow-run-as-root, python, train.py]
    Worker:
      replicas: 2
      template:
        spec:
          containers:
          - name: worker
            image: mpi-train:latest
            resources:
              limits:
                nvidia.com/gpu: 8
                vpc.amazonaws.com/efa: 4
"""


def test_an_mpijob_is_read_like_the_others(capsys, tmp_path):
    # kubeflow/mpi-operator v2beta1: a Launcher runs mpirun, the Workers hold the GPUs (slotsPerWorker each)
    read = manifests.load(str(write(tmp_path, MPIJOB)))
    (training,) = read.trainings
    assert training.kind == "MPIJob" and [(g.role, g.pods) for g in training.groups] == [("Launcher", 1),
                                                                                        ("Worker", 2)]
    assert "8 slot(s) per worker" in training.notes
    code, found = lint(capsys, write(tmp_path, MPIJOB))
    assert "MPIJob bert: Launcher 1 + Worker 2 pods" in found["CFG080"][0]["message"]
    assert statuses(found, "CFG083") == ["warn"]  # the workers' 8 GPUs and the runtime's 64 MB /dev/shm
    # AWS's EFA is an RDMA device: judged, but its locked memory is its nodes' (no IPC_LOCK rule)
    assert statuses(found, "CFG086") == ["pass"] and "vpc.amazonaws.com/efa" in found["CFG086"][0]["message"]
