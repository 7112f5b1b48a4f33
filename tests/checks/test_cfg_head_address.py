"""The fix CFG010 gives for a main_process_ip that is missing or no address names the head as the inputs know
it (the nodes checked, the hostfile's first host, which DeepSpeed's runner makes rank 0), or what is left of the
text once user@, scheme and :port are removed; never an address made up for the example."""
from __future__ import annotations

import pytest

from conftest import run_cli

CONFIG = "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 16\nmachine_rank: 0\nmain_process_port: 29500\n"
UNKNOWN_HEAD = ("set main_process_ip to the head node's (machine_rank 0) address as the workers resolve it: "
                "`hostname -I` on the head, or its host name")
HOSTFILE_HEAD = ("set main_process_ip to the head node's address as the workers resolve it: 'gpu-a17' (the first host "
                 "of hostfile), or its address on the training network (`hostname -I` there)")
BARE = "; no user@, scheme, path or :port"


@pytest.fixture(autouse=True)
def empty_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def address_fixes(capsys, tmp_path, ip, hostfile):
    (tmp_path / "accelerate.yaml").write_text(CONFIG + (f"main_process_ip: '{ip}'\n" if ip is not None else ""))
    args = ["--config", "accelerate.yaml"]
    if hostfile:
        (tmp_path / "hostfile").write_text("gpu-a17 slots=8\ngpu-a18 slots=8\n")
        args += ["--hostfile", "hostfile"]
    # with the launch command known (one that gives no --main_process_ip): the file's address is the job's
    code, doc, err = run_cli(capsys, "lint", *args, "--json", "--", "accelerate", "launch", "train.py")
    assert code in (0, 1), err
    return [r["remediation"] for r in doc["results"] if r["id"] == "CFG010" and r["status"] == "fail"]


@pytest.mark.parametrize("ip,hostfile,fix", [
    (None, False, UNKNOWN_HEAD),
    (None, True, HOSTFILE_HEAD),
    ("tcp://", False, UNKNOWN_HEAD + BARE),  # nothing left of the text: no address to offer
    ("root@", True, HOSTFILE_HEAD + BARE),
    ("1234", False, UNKNOWN_HEAD + BARE),
    ("<IP>", True, HOSTFILE_HEAD),  # a placeholder
    ("root@gpu-a17:29500", True, "set main_process_ip to 'gpu-a17' (no user@, scheme, path or :port)"),
])
def test_the_fix_names_the_head_as_the_inputs_know_it(capsys, tmp_path, ip, hostfile, fix):
    assert address_fixes(capsys, tmp_path, ip, hostfile) == [fix]
