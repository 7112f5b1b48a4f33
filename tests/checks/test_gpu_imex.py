"""GPU010 imex-channels: the multi-node NVLink domains of the job's nodes (NVML's fabric cluster UUID, recorded as
NVML's nvmlGpuFabricInfo_v2_t documents it: tests/fixtures/nvml/gb200x4*.json) and, on the nodes of a domain, the
IMEX channel devices (real character devices made with mknod under a folder the collector reads as "/"),
/proc/devices and the nvidia-imex daemon's process; NCCL's environment rules for multi-node NVLink."""
import copy
import json
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile

import pytest

from fabric_nodes import SPECS, node
from node_facts import TAKEN, changed, leaves
from preflight import runner
from preflight.job.nccl import mnnvl_off, nccl_param, strtoll
from preflight.node import fabric
from preflight.plan import build_plan
from preflight.remote import gather, shapes
from preflight.result import Status
from sysfs_tree import lay_out

RACK = "9b7c3e1a-4f2d-4c8e-9a61-2b5d7e0f1c3a"  # gb200x4.json's cluster UUID
MAJOR = 234  # the major NVIDIA's IMEX guide shows as its example
PROC_DEVICES = ("Character devices:\n  1 mem\n  4 tty\n195 nvidia\n{imex}\nBlock devices:\n  8 sd\n259 blkext\n")
NCCL_NO_CHANNEL = ("MNNVL (cliqueSize N) is available but not working on this system. Check the IMEX channel "
                   "configuration (/dev/nvidia-caps-imex-channels). Set NCCL_MNNVL_ENABLE=0 to ignore this issue.")
NCCL_NO_IMEX = ("MNNVL (cliqueSize N) is available but not working on this system. Check the IMEX configuration "
                "(nvidia-imex-ctl -N). Set NCCL_MNNVL_ENABLE=0 to ignore this issue.")

needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="making a character device (mknod) needs root")


def imex_tree(root, channel="device", running=True, registered=True, mode=0o666, major=MAJOR, hidden=False):
    """A node's /dev/nvidia-caps-imex-channels, /proc/devices and processes under `root`. channel: "device" (mknod,
    as the IMEX guide makes it), "file" (a regular file where the device should be), "empty" (the folder alone), None
    (no folder)."""
    root = pathlib.Path(root)
    folder = root / "dev" / "nvidia-caps-imex-channels"
    if channel is not None:
        folder.mkdir(parents=True, exist_ok=True)
    if channel == "device":
        os.mknod(folder / "channel0", stat.S_IFCHR | mode, os.makedev(major, 0))
        os.chmod(folder / "channel0", mode)  # (mknod's mode is cut by the umask)
    elif channel == "file":
        (folder / "channel0").write_text("")
    proc = root / "proc"
    for pid, comm in (("1", "systemd"), ("812", "nvidia-imex-ctl"), ("5120", "nvidia-imex" if running else "sshd")):
        if not (hidden and pid != "5120"):  # hidepid: only this user's own processes are there
            (proc / pid).mkdir(parents=True, exist_ok=True)
            (proc / pid / "comm").write_text(comm + "\n")
    (proc / "devices").write_text(PROC_DEVICES.format(
        imex=f"{MAJOR} nvidia-caps-imex-channels" if registered else "236 nvidia-caps"))
    return root


def gb200(tmp_path, name, nvml="gb200x4.json", env=None, container=None, versions=None, **tree):
    """A GB200 NVL72 tray: recorded NVML answers, an InfiniBand fabric, its IMEX channels as `tree` says."""
    imex_tree(tmp_path / name, **tree)
    state = node(tmp_path, name, "ib-node", nvml=nvml, env=env, versions=versions)
    state["facts"]["host"]["container"] = container
    return state


def gpu010(states, command=()):
    plan = build_plan(nodes=tuple(states), command=command)
    return runner.run_check(SPECS["GPU010"], runner.CheckContext(plan, states, {}))


def by_nodes(results):
    return {r.nodes: r for r in results}


# --- the facts ----------------------------------------------------------------------------------

@needs_mknod
def test_the_collector_reads_channel_devices_proc_devices_and_the_daemon(tmp_path):
    root = lay_out(imex_tree(tmp_path), "ib-node")
    folder = root / "dev" / "nvidia-caps-imex-channels"
    os.mknod(folder / "channel1", stat.S_IFCHR | 0o666, os.makedev(MAJOR + 1, 1))  # a node left from another driver
    (folder / "notes").write_text("a regular file")
    os.symlink("gone", folder / "channel9")
    facts = fabric.facts(str(root))["imex"]
    assert facts == {"directory": True, "registered": True, "major": MAJOR, "running": True, "channels": [
        {"name": "channel0", "char": True, "major": MAJOR, "minor": 0, "usable": True},
        {"name": "channel1", "char": True, "major": MAJOR + 1, "minor": 1, "usable": True},
        {"name": "channel9", "char": False, "major": None, "minor": None, "usable": False},
        {"name": "notes", "char": False, "major": None, "minor": None, "usable": True}]}
    assert shapes.problem(json.loads(json.dumps(fabric.facts(str(root)))), shapes.SECTIONS["fabric"], "fabric") is None


def test_nvidia_imex_ctl_is_not_the_daemon_and_a_hidden_proc_is_not_known(tmp_path):
    assert fabric.imex(str(imex_tree(tmp_path / "a", channel=None, running=False)))["running"] is False
    assert fabric.imex(str(imex_tree(tmp_path / "b", channel=None, hidden=True)))["running"] is None
    bare = fabric.imex(str(tmp_path / "c"))  # no /proc/devices readable, no folder
    assert bare == {"directory": False, "channels": [], "registered": None, "major": None, "running": None}
    assert "imex" not in fabric.facts(str(lay_out(tmp_path / "d", "no-rdma")))  # no NVIDIA driver: not read


@needs_mknod
def test_whether_another_user_may_open_a_channel_is_access2s_answer():
    """As root every channel is open; the collector runs as the job's user, and asks access(2) as that user
    (never opening the device): a channel of mode 0600 is not that user's."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")  # (not a shim under root's home)
    if not python:
        pytest.skip("no system python3 to run as another user")
    root = pathlib.Path(tempfile.mkdtemp(prefix="pf-imex-"))
    try:
        os.chmod(root, 0o755)
        imex_tree(root)
        os.mknod(root / "dev" / "nvidia-caps-imex-channels" / "channel1", stat.S_IFCHR | 0o600, os.makedev(MAJOR, 1))
        os.chmod(root / "dev" / "nvidia-caps-imex-channels" / "channel1", 0o600)
        code = ("import json, sys; from preflight.node import fabric; "
                "print(json.dumps(fabric.imex(sys.argv[1])['channels']))")
        here = pathlib.Path(__file__).resolve().parents[2]
        done = subprocess.run([python, "-c", code, str(root)], user="nobody", capture_output=True, text=True,
                              env={"PYTHONPATH": str(here), "PATH": os.environ.get("PATH", "")}, timeout=30)
        assert done.returncode == 0, done.stderr
        assert {c["name"]: c["usable"] for c in json.loads(done.stdout)} == {"channel0": True, "channel1": False}
    finally:
        shutil.rmtree(root)


def test_the_cluster_uuid_of_every_gpu_comes_with_its_fabric(tmp_path):
    facts = node(tmp_path, "n01", "ib-node", nvml="gb200x4.json")["facts"]["gpus"]
    assert [g["fabric"] for g in facts["devices"]] == [
        {"state": "completed", "status": 0, "clique": 32766, "health": [], "cluster_uuid": RACK}] * 4
    hgx = node(tmp_path, "n02", "ib-node")["facts"]["gpus"]["devices"][0]["fabric"]
    assert hgx["cluster_uuid"] == "00000000-0000-0000-0000-000000000000"  # kept as NVML gives it


# --- NCCL's environment, as NCCL reads it ---------------------------------------------------------

@pytest.mark.parametrize("text,value", [("0", 0), ("1", 1), (" 2", 2), ("0x10", 16), ("010", 8), ("-2", -2),
                                        ("1abc", 1), ("abc", 0), ("99999999999999999999", None)])
def test_nccl_reads_its_integers_with_strtoll(text, value):
    assert strtoll(text) == value


def test_an_empty_or_out_of_range_parameter_is_its_default():
    assert nccl_param({"NCCL_MNNVL_ENABLE": ""}, "NCCL_MNNVL_ENABLE", 2) == 2
    assert nccl_param({"NCCL_MNNVL_ENABLE": "9" * 30}, "NCCL_MNNVL_ENABLE", 2) == 2
    assert nccl_param({"NCCL_MNNVL_ENABLE": "no"}, "NCCL_MNNVL_ENABLE", 2) == 0  # strtoll: no digits is 0


@pytest.mark.parametrize("env,nccl,off", [
    ({}, None, None),
    ({"NCCL_MNNVL_ENABLE": "0"}, None, "NCCL_MNNVL_ENABLE=0 turns multi-node NVLink off"),
    ({"NCCL_MNNVL_ENABLE": "false"}, None, "NCCL_MNNVL_ENABLE=false turns multi-node NVLink off"),
    ({"NCCL_CUMEM_ENABLE": "0"}, None, "NCCL_CUMEM_ENABLE=0 turns cuMem off, and multi-node NVLink with it"),
    ({"NCCL_CUMEM_ENABLE": "-1"}, None, "NCCL_CUMEM_ENABLE=-1 turns cuMem off, and multi-node NVLink with it"),
    ({"NCCL_CUMEM_ENABLE": "1"}, None, None),
    ({"NCCL_P2P_DISABLE": "1"}, None, "NCCL_P2P_DISABLE=1 turns multi-node NVLink off (NCCL_MNNVL_ENABLE is not 1)"),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_MNNVL_ENABLE": "1"}, None, None),
    ({"NCCL_P2P_DISABLE": "1"}, (2, 26, 2), None),  # the P2P level counts since NCCL 2.27
    ({"NCCL_P2P_LEVEL": "LOC"}, (2, 27, 3), "NCCL_P2P_LEVEL=LOC turns multi-node NVLink off (NCCL_MNNVL_ENABLE is not 1)"),
    ({"NCCL_P2P_LEVEL": "0"}, None, "NCCL_P2P_LEVEL=0 turns multi-node NVLink off (NCCL_MNNVL_ENABLE is not 1)"),
    ({"NCCL_P2P_LEVEL": "NVL"}, None, None),
    ({"NCCL_P2P_DISABLE": "2"}, None, None),  # ncclGetLevel: only 1 disables
])
def test_the_environment_that_turns_multi_node_nvlink_off(env, nccl, off):
    assert mnnvl_off(env, nccl) == off


# --- the check ------------------------------------------------------------------------------------

@needs_mknod
def test_a_gb200_domain_of_two_nodes_with_channels_and_imex_running_passes(tmp_path):
    [result] = gpu010({n: gb200(tmp_path, n) for n in ("n01", "n02")})
    assert result.status is Status.PASS and result.nodes == ("n01", "n02"), result
    assert result.message == f"NVLink domain {RACK} of n[01-02]: IMEX channel0 open to this user, nvidia-imex running"


@needs_mknod
@pytest.mark.parametrize("tree,said", [
    (dict(channel=None), "/dev/nvidia-caps-imex-channels does not exist (channels are not made by default, nor kept "
                         "across a reboot)"),
    (dict(channel="empty"), "/dev/nvidia-caps-imex-channels holds no channel"),
    (dict(channel="file"), "channel0 is not a character device"),
    (dict(major=MAJOR + 2), f"channel0 is device {MAJOR + 2}:0, not of the driver's nvidia-caps-imex-channels major "
                            f"{MAJOR}"),
    (dict(registered=False), "/proc/devices lists no nvidia-caps-imex-channels device (a driver without IMEX "
                             "channels)"),
])
def test_a_missing_channel_fails_naming_the_node_nccls_words_and_the_fix(tmp_path, tree, said):
    results = by_nodes(gpu010({"n01": gb200(tmp_path, "n01"), "n02": gb200(tmp_path, "n02", **tree)}))
    assert results[("n01",)].status is Status.PASS
    bad = results[("n02",)]
    assert bad.status is Status.FAIL, bad
    assert bad.message == (f"NVLink domain {RACK} of n[01-02], but no IMEX channel this user may open: {said}: NCCL "
                           f"stops every rank with '{NCCL_NO_CHANNEL}'")
    assert bad.remediation.startswith("on n02, as root and again after every reboot (NVIDIA's IMEX guide): mkdir -p "
                                      "/dev/nvidia-caps-imex-channels && mknod -m 666 "
                                      "/dev/nvidia-caps-imex-channels/channel0 c ")
    assert "NVIDIA_IMEX_CHANNELS=0" in bad.remediation and bad.remediation.endswith(
        "or set NCCL_MNNVL_ENABLE=0 in the job's environment to run without multi-node NVLink")
    assert f"channel0 c {MAJOR} 0" in bad.remediation or "$(awk" in bad.remediation


@needs_mknod
def test_nccl_mnnvl_enable_0_in_the_job_passes_with_the_reason(tmp_path):
    states = {n: gb200(tmp_path, n, channel=None) for n in ("n01", "n02")}
    [result] = gpu010(states, command=("NCCL_MNNVL_ENABLE=0", "accelerate", "launch", "train.py"))
    assert result.status is Status.PASS and result.nodes == ("n01", "n02")
    assert result.message == (f"NVLink domain {RACK} of n[01-02]; NCCL_MNNVL_ENABLE=0 turns multi-node NVLink off: no "
                              "IMEX channel needed")
    states["n02"]["facts"]["env"]["NCCL_CUMEM_ENABLE"] = "0"  # the node's own environment: that node alone
    results = by_nodes(gpu010(states))
    assert results[("n02",)].status is Status.PASS and "NCCL_CUMEM_ENABLE=0 turns cuMem off" in \
        results[("n02",)].message
    assert results[("n01",)].status is Status.FAIL


@needs_mknod
def test_a_stopped_nvidia_imex_fails_and_one_not_seen_is_said_not_known(tmp_path):
    results = by_nodes(gpu010({"n01": gb200(tmp_path, "n01"), "n02": gb200(tmp_path, "n02", running=False)}))
    stopped = results[("n02",)]
    assert stopped.status is Status.FAIL
    assert stopped.message == (f"NVLink domain {RACK} of n[01-02], but nvidia-imex is not running: FABRIC handles are "
                               f"exported and imported through it, and NCCL stops every rank with '{NCCL_NO_IMEX}'")
    assert stopped.remediation.startswith("start nvidia-imex on n02 and on every node of its NVLink domain "
                                          "(systemctl enable --now nvidia-imex") and "nvidia-imex-ctl -N" in \
        stopped.remediation
    hidden = {"n01": gb200(tmp_path / "h", "n01", hidden=True), "n02": gb200(tmp_path / "c", "n02", running=False,
                                                                             container="docker")}
    for result in gpu010(hidden):
        assert result.status is Status.PASS, result
        assert "IMEX channel0 open to this user, whether nvidia-imex runs is not known here (" in result.message


@needs_mknod
def test_nccl_before_2_27_runs_without_multi_node_nvlink_when_no_channel(tmp_path):
    """NCCL 2.25 and 2.26 give up on MNNVL when the FABRIC allocation fails (src/mnnvl.cc of those releases), and
    stop with their own words when the export fails; before 2.25 their rules are others, not judged."""
    states = {"n01": gb200(tmp_path, "n01", versions={"nccl": "2.26.2"}),
              "n02": gb200(tmp_path, "n02", channel=None, running=False, versions={"nccl": "2.26.2"})}
    results = {r.status: r for r in gpu010(states) if r.nodes == ("n02",)}
    assert "NCCL 2.26.2 then runs without multi-node NVLink, over the network" in results[Status.WARN].message
    assert results[Status.FAIL].message.endswith("'MNNVL (cliqueSize N) is available but not supported on this "
                                                 "system. Check the IMEX configuration.'")
    for state in states.values():
        state["facts"]["packages"]["versions"]["nccl"] = "2.21.5"
    assert {r.status for r in gpu010(states)} == {Status.SKIP}


@needs_mknod
def test_single_nvswitch_nodes_and_domains_of_one_node_give_no_warning(tmp_path):
    """HGX H100 nodes (cluster UUID zero) are in no domain; two GB200 trays of two racks are a domain each: NCCL
    reaches the other over the network, and no IMEX channel is asked for on the strength of one node."""
    [hgx] = gpu010({n: gb200(tmp_path / "h", n, nvml="h100x8.json", channel=None) for n in ("n01", "n02")})
    assert hgx.status is Status.SKIP and hgx.message == (
        "no two of the job's nodes share a multi-node NVLink domain (n[01-02]: GPUs 0-7 are in no multi-node NVLink "
        "domain (cluster UUID zero)): NCCL needs no IMEX channel"), hgx
    racks = {"n01": gb200(tmp_path / "r", "n01", channel=None),
             "n02": gb200(tmp_path / "r", "n02", nvml="gb200x4-other-rack.json", channel=None)}
    results = gpu010(racks)
    assert [r.status for r in results] == [Status.SKIP]  # (a domain of one node each: nothing shared)
    for nvml in ("a100x8.json", "v100.json"):  # no NVSwitch fabric NVML tells of
        [result] = gpu010({n: gb200(tmp_path / nvml, n, nvml=nvml, channel=None) for n in ("n01", "n02")})
        assert result.status is Status.SKIP and "have no NVSwitch fabric (NVML)" in result.message


@needs_mknod
def test_a_domain_of_part_of_the_jobs_nodes_says_where_nccl_uses_it(tmp_path):
    """n01, n02 of one rack, n03 of another: NCCL uses MNNVL between n01 and n02 (src/mnnvl.cc counts the ranks of
    each cluster UUID) and the network to n03; an HGX node beside them turns it off for the whole job."""
    states = {n: gb200(tmp_path, n) for n in ("n01", "n02")}
    states["n03"] = gb200(tmp_path, "n03", nvml="gb200x4-other-rack.json", channel=None)
    results = by_nodes(gpu010(states))
    assert results[("n01", "n02")].status is Status.PASS
    assert results[("n01", "n02")].message.startswith(
        f"NVLink domain {RACK} of n[01-02] (NCCL uses it among them, and the network to n03): IMEX channel0")
    assert results[("n03",)].status is Status.PASS and results[("n03",)].message.startswith(
        "NVLink domain 27e4d0b9-8a13-4f6c-b5d2-c90a1e6f4b78 of no other node of the job: NCCL reaches the others over "
        "the network")
    states["n03"] = gb200(tmp_path / "hgx", "n03", nvml="h100x8.json", channel=None)
    for name in ("n01", "n02"):
        states[name] = gb200(tmp_path / "none", name, channel=None)  # no channel: not needed either
    [result] = gpu010(states)
    assert result.status is Status.PASS and result.nodes == ("n01", "n02")
    assert result.message == ("NCCL runs without multi-node NVLink, over the network: it uses it only where every "
                              "rank's GPU is in a domain (src/mnnvl.cc), and on n03: GPUs 0-7 are in no multi-node "
                              "NVLink domain (cluster UUID zero); no IMEX channel needed")


@needs_mknod
def test_nodes_without_gpus_or_unknown_fabric_are_not_judged(tmp_path):
    states = {n: gb200(tmp_path, n, channel=None) for n in ("n01", "n02")}
    states["n03"] = gb200(tmp_path, "n03", nvml=None)
    [result] = gpu010(states)
    assert result.status is Status.SKIP and result.nodes == ("n01", "n02")
    assert result.message.startswith("not judged: NCCL uses multi-node NVLink only where every rank's GPU is in a "
                                     "domain (src/mnnvl.cc), and that is not known for n03: no GPU facts")
    [result] = gpu010({n: gb200(tmp_path / "cpu", n, nvml=None) for n in ("n01", "n02")})
    assert result.status is Status.SKIP and result.message.startswith(
        "no GPU facts: no node's GPUs are known, so no multi-node NVLink domain is (n[01-02]: no GPU facts on this "
        "node: no NVIDIA driver)"), result
    [result] = gpu010({"n01": gb200(tmp_path / "one", "n01", channel=None)})
    assert result.status is Status.SKIP and result.message.startswith("the job runs on one node")
    plan = build_plan(nodes=())  # `preflight node`: this machine alone
    [result] = runner.run_check(SPECS["GPU010"], runner.CheckContext(plan, {"local": states["n01"]}, {}))
    assert result.status is Status.SKIP and result.message.startswith("this machine alone: ")
    older = {n: gb200(tmp_path / "old", n) for n in ("n01", "n02")}
    del older["n02"]["facts"]["fabric"]["imex"]  # a node running an older preflight
    assert by_nodes(gpu010(older))[("n02",)].status is Status.SKIP
    overridden = copy.deepcopy(states)
    del overridden["n03"]
    overridden["n01"]["facts"]["env"]["NCCL_MNNVL_UUID"] = "7"
    [result] = gpu010(overridden)
    assert result.status is Status.SKIP and "NCCL_MNNVL_UUID on n01 replaces NVML's cluster UUID" in result.message


# --- facts of another shape -------------------------------------------------------------------------

@needs_mknod
def test_hostile_fabric_and_imex_facts_are_the_nodes_failed_section_never_a_traceback(tmp_path):
    states = {n: gb200(tmp_path, n) for n in ("n01", "n02")}
    good = states["n02"]["facts"]
    paths = list(leaves(good["fabric"]["imex"], ("fabric", "imex"))) + list(
        leaves(good["gpus"]["devices"][0]["fabric"], ("gpus", "devices", 0, "fabric")))
    refused = 0
    for path in paths:
        for value in ("text", "00000000-0000-0000-0000-00000000000g", 7, True, None, [], {"x": 1}, [{}] * 65, TAKEN):
            facts = gather.checked_facts(json.loads(json.dumps(changed(good, path, value))))
            refused += bool(runner.failed_sections(facts))
            results = gpu010(dict(states, n02=dict(states["n02"], facts=facts)))
            for r in results:
                assert "raised" not in r.message and not (r.remediation or "").startswith("this is a defect"), \
                    (path, value, r)
                assert r.status in (Status.PASS, Status.FAIL, Status.SKIP, Status.ERROR), r
                if r.status is Status.ERROR:
                    assert r.nodes == ("n02",) and r.message.startswith("not evaluated on n02"), (path, value, r)
    assert refused


@pytest.mark.parametrize("section,value,expected", [
    ("gpus", {"devices": [{"index": 0, "fabric": {"state": "completed", "status": 0, "cluster_uuid": "9B7C"}}]},
     "gpus.devices[0].fabric.cluster_uuid is a string, not a UUID's text or null"),
    ("fabric", {"imex": {"channels": [{"name": "channel0", "char": "yes", "usable": True}]}},
     "fabric.imex.channels[0].char is a string"),
    ("fabric", {"imex": {"channels": [{"char": True, "usable": True}]}}, "fabric.imex.channels[0] has no 'name'"),
    ("fabric", {"imex": {"channels": [{"name": "c", "char": True, "usable": True}] * 65}},
     "fabric.imex.channels has 65 items, more than the 64 the collector sends"),
    ("fabric", {"imex": {"running": "yes"}}, "fabric.imex.running is a string"),
])
def test_what_is_wrong_in_the_new_facts_is_said_with_its_path(section, value, expected):
    assert shapes.problem(value, shapes.SECTIONS[section], section) == expected
