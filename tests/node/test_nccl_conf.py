"""NCCL's configuration files as NCCL reads them (src/misc/param.cc of NVIDIA/nccl: initEnvFunc, setEnvFile;
src/include/param.h before 2.12.10): the node reads every candidate (preflight.node.ncclconf), the head merges them
into the variables every NCCL rule reads (preflight.job.nccl.nccl_env), and a finding that rests on a file's
value names its file and line."""
import os
import socket

import pytest

from preflight import registry, runner
from preflight.job.nccl import nccl_env
from preflight.node import ncclconf
from preflight.plan import build_plan
from preflight.result import Status

# Censuses of this machine's processes on fixed ports (29984-29993): one at a time (tests/workers.py).
pytestmark = pytest.mark.machine


def conf(tmp_path, text, name=".nccl.conf"):
    path = tmp_path / name
    path.write_bytes(text)
    return path


def entries(data):
    return [(e["line"], e["name"], e["value"]) for e in ncclconf.parse(data)[0]]


def test_a_line_is_split_at_its_first_equals_sign_with_nothing_trimmed_as_setenvfile_does():
    """`while (line[s] != '\\0' && line[s] != '=') s++; if (line[s] == '\\0') continue;`: the name is what comes
    before the first `=` and the value all after it, spaces and quotes kept; a line without `=` is skipped."""
    data = (b"NCCL_SOCKET_IFNAME=eth1\nNCCL_IB_HCA = mlx5_0\nNCCL_DEBUG=\"INFO\"\nNCCL_ALGO=Ring=x\n"
            b"NCCL_PROTO\n#NCCL_P2P_DISABLE=1\n# a comment\nexport NCCL_NET=IB\nOMP_NUM_THREADS=4\nNCCL_X=\n")
    assert entries(data) == [(1, "NCCL_SOCKET_IFNAME", "eth1"), (2, "NCCL_IB_HCA ", " mlx5_0"),
                             (3, "NCCL_DEBUG", '"INFO"'), (4, "NCCL_ALGO", "Ring=x"), (8, "export NCCL_NET", "IB"),
                             (10, "NCCL_X", "")]


def test_a_name_and_a_value_are_cut_at_1023_bytes_and_at_a_nul_byte_and_a_cr_is_kept_for_the_head():
    """envVar[1024], envValue[1024] with strncpy(..., 1023); strlen stops at NUL; the CR is cut since 2.30 only."""
    long = b"a" * 2000
    data = b"NCCL_TOPO_FILE=" + long + b"\nNCCL_SOCKET_IFNAME=eth1\0junk\nNCCL_A\0=b\nNCCL_B=c\r\n"
    assert entries(data) == [(1, "NCCL_TOPO_FILE", "a" * 1023), (2, "NCCL_SOCKET_IFNAME", "eth1"),
                             (4, "NCCL_B", "c\r")]


def test_a_line_over_4095_bytes_is_not_read_as_nccl_2_30s_fgets_reads_it_in_pieces():
    data = b"NCCL_A=" + b"x" * 5000 + b"NCCL_B=y\nNCCL_C=z\n"
    found, long_lines = ncclconf.parse(data)
    assert [e["name"] for e in found] == ["NCCL_C"] and long_lines == [1]


def test_secret_named_values_never_leave_the_node():
    assert entries(b"NCCL_AUTH_TOKEN=s3cret\n") == [(1, "NCCL_AUTH_TOKEN", "<redacted>")]


def test_the_candidates_in_nccls_order_each_path_once(tmp_path):
    conf(tmp_path, b"NCCL_SOCKET_IFNAME=eth1\n")
    found = ncclconf.facts({"HOME": str(tmp_path)})
    paths = list(found["files"])
    assert paths[0] == f"{tmp_path}/.nccl.conf" and paths[-1] == "/etc/nccl.conf"
    assert found["files"][paths[0]]["entries"] == [{"line": 1, "name": "NCCL_SOCKET_IFNAME", "value": "eth1"}]
    named = ncclconf.facts({"HOME": str(tmp_path), "NCCL_CONF_FILE": "my.conf"}, cwd=str(tmp_path))
    assert list(named["files"])[0] == "my.conf" and named["files"]["my.conf"]["error"] == "missing"


def test_hostile_files_are_refused_in_one_line_never_read_blocking_or_whole(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    huge = conf(tmp_path, b"NCCL_A=1\n" + b"#" * (200 << 10) + b"\nNCCL_B=2\n", "huge")
    binary = conf(tmp_path, bytes(range(256)) * 64 + b"\nNCCL_C=\xff\xfe\n", "binary")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    try:
        read = {name: ncclconf.read_conf(str(tmp_path / name)) for name in ("fifo", "loop", "huge", "binary", "sock")}
    finally:
        server.close()
    assert read["fifo"]["error"] == "not a regular file" and read["fifo"]["nothing"] is False
    assert read["sock"]["error"] == "No such device or address" and read["sock"]["nothing"] is True  # ENXIO
    assert "symbolic links" in read["loop"]["error"] and read["loop"]["nothing"] is True
    assert read["huge"]["cut_at"] == ncclconf.MAX_BYTES and [e["name"] for e in read["huge"]["entries"]] == ["NCCL_A"]
    assert read["binary"]["entries"] == [{"line": 66, "name": "NCCL_C", "value": "\ufffd\ufffd"}]  # 64 newlines before
    assert ncclconf.read_conf(str(tmp_path))["nothing"] is True  # a directory: fopen works, getline reads nothing
    assert os.path.getsize(huge) > ncclconf.MAX_BYTES and os.path.getsize(binary)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read as another user")
def test_a_file_unreadable_to_another_user_is_unknown_but_to_the_same_user_it_is_nothing_for_nccl(tmp_path):
    path = conf(tmp_path, b"NCCL_A=1\n")
    path.chmod(0)
    pid = os.fork()
    if pid == 0:  # as nobody: the file NCCL, run as nobody, cannot open either
        os.setuid(65534)
        os._exit(0 if ncclconf.read_conf(str(path), same_user=True)["nothing"]
                 and not ncclconf.read_conf(str(path), same_user=False)["nothing"] else 1)
    assert os.waitpid(pid, 0)[1] == 0


def facts(files, env=None, nccl="2.30.3", passwd_home="/home/u"):
    """A node's facts with NCCL's configuration files as the node sends them ({path: [lines...]} or {path: entry})."""
    sent = {}
    for path in ("/home/u/.nccl.conf", f"{passwd_home}/.nccl.conf", "/etc/nccl.conf"):  # the node reads these always
        files.setdefault(path, {"error": "missing", "nothing": True})
    for path, text in files.items():
        if isinstance(text, dict):
            sent[path] = dict(text, path=path)
        else:
            sent[path] = {"path": path, "entries": ncclconf.parse(text.encode())[0]}
    return {"env": {"HOME": "/home/u", **(env or {})}, "packages": {"versions": {"nccl": nccl}},
            "nccl_conf": {"conf_file": (env or {}).get("NCCL_CONF_FILE"), "home": "/home/u",
                          "passwd_home": passwd_home, "files": sent}}


def test_the_environment_wins_then_the_first_file_then_its_first_line():
    """setenv(name, value, 0) for each line: an existing variable (even empty) is kept."""
    found = nccl_env(facts({"/home/u/.nccl.conf": "NCCL_A=home\nNCCL_A=later\nNCCL_B=home\nNCCL_E=home\n",
                            "/etc/nccl.conf": "NCCL_A=etc\nNCCL_C=etc\nNCCL_B=etc\n"}, env={"NCCL_E": ""}))
    assert {k: found.values.get(k) for k in "NCCL_A NCCL_B NCCL_C NCCL_E".split()} == \
        {"NCCL_A": "home", "NCCL_B": "home", "NCCL_C": "etc", "NCCL_E": ""}
    assert found.sources == {"NCCL_A": "/home/u/.nccl.conf line 1", "NCCL_B": "/home/u/.nccl.conf line 3",
                             "NCCL_C": "/etc/nccl.conf line 2"}
    assert found.said("NCCL_C") == "NCCL_C=etc (from /etc/nccl.conf line 2)"
    # the job's own settings (its launch's VAR=v) are the environment too
    assert nccl_env(facts({"/etc/nccl.conf": "NCCL_C=etc\n"}), {"NCCL_C": "job"}).values["NCCL_C"] == "job"


def test_nccl_conf_file_replaces_the_home_file_since_2_23_and_is_ignored_before():
    files = {"/x.conf": "NCCL_A=x\n", "/home/u/.nccl.conf": "NCCL_A=home\n"}
    assert nccl_env(facts(files, {"NCCL_CONF_FILE": "/x.conf"}, "2.23.4")).values["NCCL_A"] == "x"
    assert nccl_env(facts(files, {"NCCL_CONF_FILE": "/x.conf"}, "2.22.3")).values["NCCL_A"] == "home"
    assert nccl_env(facts(files, {"NCCL_CONF_FILE": ""}, "2.23.4")).values["NCCL_A"] == "home"  # strlen > 0
    unread = nccl_env(facts({}, {"NCCL_CONF_FILE": "/y.conf"})).unread  # named by the job, not read on the node
    assert unread == ("/y.conf: not read on the node (the job's own environment names it)",)


def test_home_is_the_password_databases_before_2_30_and_home_since():
    files = {"/home/u/.nccl.conf": "NCCL_A=env-home\n", "/root/.nccl.conf": "NCCL_A=pw-home\n"}
    assert nccl_env(facts(files, nccl="2.29.7", passwd_home="/root")).values["NCCL_A"] == "pw-home"
    assert nccl_env(facts(files, nccl="2.30.3", passwd_home="/root")).values["NCCL_A"] == "env-home"


def test_a_windows_line_end_keeps_its_cr_in_the_value_before_nccl_2_30():
    files = {"/etc/nccl.conf": "NCCL_SOCKET_IFNAME=eth1\r\n"}
    assert nccl_env(facts(files, nccl="2.29.7")).values["NCCL_SOCKET_IFNAME"] == "eth1\r"
    assert nccl_env(facts(files, nccl="2.30.3")).values["NCCL_SOCKET_IFNAME"] == "eth1"


def test_a_file_nccl_reads_that_the_node_could_not_is_unknown_and_a_missing_one_is_nothing():
    found = nccl_env(facts({"/home/u/.nccl.conf": {"error": "not a regular file", "nothing": False},
                            "/etc/nccl.conf": {"error": "missing", "nothing": True}}))
    assert found.unread == ("/home/u/.nccl.conf: not a regular file",)
    assert nccl_env(facts({"/etc/nccl.conf": {"error": "missing", "nothing": True}})).unread == ()


def check(check_id, facts_by_node):
    plan = build_plan(nodes=tuple(facts_by_node))
    plan = plan.__class__(**{**plan.__dict__, "remote": True})
    ctx = runner.CheckContext(plan, {n: {"facts": f, "error": None} for n, f in facts_by_node.items()}, {})
    return runner.run_check(registry.load().get(check_id), ctx)


def gpu_node(files, env=None, nccl="2.30.3"):
    node = facts(files, env, nccl)
    node.update(gpus={"available": True}, host={
        "interfaces": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]},
        "links": {"eth0": {"up": True, "running": True, "ipv4": ["10.0.0.2/24"]}},
        "route_to_head": {"head": "10.0.0.1", "source": "10.0.0.2", "interface": "eth0"}})
    return node


def test_net005_names_the_file_and_line_of_an_ifname_that_selects_nothing():
    [result] = check("NET005", {"n1": gpu_node({"/home/u/.nccl.conf": "# ours\nNCCL_SOCKET_IFNAME=eth1\n"})})
    assert result.status is Status.FAIL, result
    assert result.message.startswith("NCCL_SOCKET_IFNAME=eth1 (from /home/u/.nccl.conf line 2) selects no interface")
    assert "comes from /home/u/.nccl.conf line 2: change it there" in result.remediation
    assert result.evidence["source"] == "/home/u/.nccl.conf line 2"
    [result] = check("NET005", {"n1": gpu_node({"/home/u/.nccl.conf": "NCCL_SOCKET_IFNAME=eth1\n"},
                                               {"NCCL_SOCKET_IFNAME": "eth0"})})
    assert result.status is Status.PASS and "(from" not in result.message  # the environment wins


def test_net005_does_not_judge_nccls_default_where_a_file_it_reads_is_not_known():
    [result] = check("NET005", {"n1": gpu_node({"/etc/nccl.conf": {"error": "not a regular file", "nothing": False}})})
    assert result.status is Status.SKIP and "/etc/nccl.conf: not a regular file" in result.message


def test_pkg004_names_the_file_that_makes_one_node_differ():
    nodes = {"n1": gpu_node({}), "n2": gpu_node({}), "n3": gpu_node({"/etc/nccl.conf": "NCCL_IB_DISABLE=1\n"})}
    [result] = [r for r in check("PKG004", nodes) if r.status is not Status.PASS]
    assert result.status is Status.FAIL and result.nodes == ("n3",)
    assert "NCCL_IB_DISABLE is 1 on n3 (from /etc/nccl.conf line 1), unset on the others" in result.message


def test_net005_says_where_a_windows_line_end_leaves_a_cr_in_the_interface_name():
    [result] = check("NET005", {"n1": gpu_node({"/etc/nccl.conf": "NCCL_SOCKET_IFNAME=eth0\r\n"}, nccl="2.29.7")})
    assert result.status is Status.FAIL and result.message.startswith(
        "NCCL_SOCKET_IFNAME=eth0\\r (from /etc/nccl.conf line 1) selects no interface"), result
    assert result.remediation.endswith("`dos2unix /etc/nccl.conf`")
    [result] = check("NET005", {"n1": gpu_node({"/etc/nccl.conf": "NCCL_SOCKET_IFNAME=eth0\r\n"}, nccl="2.30.3")})
    assert result.status is Status.PASS and "(from /etc/nccl.conf line 1)" in result.message


def test_pkg009_warns_of_each_line_nccl_misreads_naming_its_file_line_and_fix():
    """setEnvFile splits at the first `=` and trims or unquotes nothing; a CR stays before 2.30 only."""
    text = ('NCCL_SOCKET_IFNAME = eth0\nexport NCCL_IB_HCA=mlx5_0\nNCCL_DEBUG="INFO"\nNCCL_ALGO=Ring\r\n'
            "NCCL_PROTO=Simple\n#NCCL_X=1\n")
    results = check("PKG009", {"n1": facts({"/etc/nccl.conf": text}, nccl="2.29.7")})
    assert [(r.status, r.message) for r in results] == [
        (Status.WARN, "/etc/nccl.conf line 1: `NCCL_SOCKET_IFNAME = eth0`: NCCL sets `NCCL_SOCKET_IFNAME ` with its "
                      "spaces, not NCCL_SOCKET_IFNAME"),
        (Status.WARN, "/etc/nccl.conf line 2: `export NCCL_IB_HCA=mlx5_0`: NCCL sets a variable named `export "
                      "NCCL_IB_HCA`, not NCCL_IB_HCA (the file is no shell script)"),
        (Status.WARN, '/etc/nccl.conf line 3: `NCCL_DEBUG="INFO"`: NCCL keeps the quotes: NCCL_DEBUG is "INFO", '
                      "quotes included"),
        (Status.WARN, "/etc/nccl.conf line 4: `NCCL_ALGO=Ring\\r`: NCCL 2.29.7 keeps the CR of the file's Windows "
                      "line end in the value")]
    assert [r.remediation for r in results] == [
        "write `NCCL_SOCKET_IFNAME=eth0` with no space around `=` in /etc/nccl.conf line 1",
        "write `NCCL_IB_HCA=mlx5_0` without `export` in /etc/nccl.conf line 2",
        "write `NCCL_DEBUG=INFO` without quotes in /etc/nccl.conf line 3",
        "`dos2unix /etc/nccl.conf` in /etc/nccl.conf line 4"]
    assert all(r.nodes == ("n1",) for r in results)
    newer = check("PKG009", {"n1": facts({"/etc/nccl.conf": text}, nccl="2.30.3")})
    assert len(newer) == 3 and "line 4" not in newer[-1].message  # 2.30 cuts the CR
    # the node's NCCL not known: a CR not judged, and only the files every release reads
    home = {"/home/u/.nccl.conf": "export NCCL_A=1\n", "/root/.nccl.conf": "", "/etc/nccl.conf": "NCCL_B=1\r\n"}
    [result] = check("PKG009", {"n1": facts(dict(home), nccl=None, passwd_home="/root")})
    assert result.status is Status.PASS and "not judged: /etc/nccl.conf line 1: ends with a CR" in result.message
    [result] = check("PKG009", {"n1": facts(dict(home), nccl=None)})  # $HOME is the password database's home
    assert result.status is Status.WARN and "`export NCCL_A=1`" in result.message
    [result] = check("PKG009", {"n1": facts({})})
    assert result.status is Status.SKIP


MAPS_NCCL = "import mmap, sys, time; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); " \
    "print(1, flush=True); time.sleep(30)"


def libnccl(path, wheel=None):
    """A file named as a libnccl (not a real library: this machine has none; a process maps it as the loader would),
    with the nvidia-nccl wheel's metadata whose RECORD lists it `wheel` = (folder, version) where given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF" + bytes(4092))
    if wheel:
        folder, version = wheel
        info = folder / f"nvidia_nccl_cu12-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu12\nVersion: {version}\n\n")
        (info / "RECORD").write_text(f"nvidia/__init__.py,,\n{path.relative_to(folder)},sha256=x,4096\n")
    return path


def test_doctor_reads_the_files_a_running_rank_read_by_its_own_home_working_folder_and_nccl(tmp_path):
    """The rank's /proc/PID/environ holds what it was started with, not what NCCL's setenv added: the census
    reads the files its HOME and NCCL_CONF_FILE (from its working folder) name, and RAS is asked where they say,
    by the rules of the NCCL the rank maps (/proc/PID/maps: a wheel's dist-info, a system library's name); a rank
    whose NCCL's version its files do not prove gets what every release agrees on, and the rest named as unread."""
    import subprocess
    import sys

    from preflight.node import census

    (tmp_path / "job.conf").write_text("NCCL_RAS_ADDR=localhost:28999\nNCCL_SOCKET_IFNAME=eth9\nNCCL_DEBUG_SUBSYS=INIT\n")
    (tmp_path / ".nccl.conf").write_text("NCCL_SOCKET_IFNAME=eth7\n")  # not read: NCCL_CONF_FILE replaces it
    (tmp_path / "etc").mkdir()
    site = tmp_path / "site packages"
    libraries = {"wheel": libnccl(site / "nvidia/nccl/lib/libnccl.so.2", (site, "2.23.4")),  # NCCL_CONF_FILE read
                 "system": libnccl(tmp_path / "lib dir/libnccl.so.2.22.3"),  # before 2.23: ~/.nccl.conf of passwd
                 "replaced": libnccl(tmp_path / "old/libnccl.so.2.23.4")}  # deleted since: its version not proven
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29986", HOME=str(tmp_path),
               NCCL_CONF_FILE="job.conf", NCCL_DEBUG="WARN")
    procs = {kind: subprocess.Popen([sys.executable, "-c", MAPS_NCCL, str(path)], env=env, cwd=str(tmp_path),
                                    stdout=subprocess.PIPE) for kind, path in libraries.items()}
    try:
        for proc in procs.values():
            proc.stdout.readline()  # mapped
        libraries["replaced"].unlink()
        found = census.take_census({"port": 29986, "pids": [p.pid for p in procs.values()], "deadline_s": 4,
                                    "stacks": False, "interval_s": 0.1})
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    ranks = {kind: next(p for p in found["processes"] if p["pid"] == proc.pid) for kind, proc in procs.items()}
    wheel, system, replaced = ranks["wheel"], ranks["system"], ranks["replaced"]
    assert wheel["env"]["NCCL_SOCKET_IFNAME"] == "eth9" and wheel["env"]["NCCL_DEBUG"] == "WARN"
    assert wheel["nccl_from"] == {"NCCL_RAS_ADDR": "job.conf line 1", "NCCL_SOCKET_IFNAME": "job.conf line 2",
                                  "NCCL_DEBUG_SUBSYS": "job.conf line 3"}
    assert "nccl_unread" not in wheel
    assert "NCCL_SOCKET_IFNAME" not in system.get("nccl_from", {}) and "NCCL_RAS_ADDR" not in system["env"]
    assert "NCCL_SOCKET_IFNAME" not in replaced["env"] and "nccl_from" not in replaced
    assert any(u.startswith("NCCL_SOCKET_IFNAME: NCCL_SOCKET_IFNAME unset or NCCL_SOCKET_IFNAME=eth9 (job.conf "
                            "line 2)") for u in replaced["nccl_unread"]), replaced["nccl_unread"]
    assert replaced["nccl_unread"][-1] == f"NCCL's release: {libraries['replaced']} (deleted), whose version its " \
        "files do not tell"
    assert "localhost:28999" in [a["address"] for a in found["nccl_ras"]["answers"]]


def test_a_libnccls_version_is_only_what_its_files_prove(tmp_path):
    """Its name where it gives one, else the nvidia-nccl wheel whose RECORD lists that very file."""
    from preflight.node.packages import nccl_library_version

    site = tmp_path / "site"
    owned = libnccl(site / "nvidia/nccl/lib/libnccl.so.2", (site, "2.27.3"))
    assert nccl_library_version(str(owned)) == "2.27.3"
    assert nccl_library_version(str(libnccl(tmp_path / "usr/lib/libnccl.so.2.21.5"))) == "2.21.5"
    bundled = libnccl(site / "torch/lib/libnccl.so.2")  # torch's own copy: the nvidia-nccl wheel does not own it
    assert nccl_library_version(str(bundled)) is None
    assert nccl_library_version(f"{owned} (deleted)") is None
    assert nccl_library_version(str(owned).replace(str(tmp_path), "/"), str(tmp_path)) == "2.27.3"  # in a root


def test_a_rank_in_a_container_has_its_files_read_in_its_own_filesystem(tmp_path):
    """A rank in a mount namespace of its own (a container) reads the ~/.nccl.conf only it sees (a folder mounted
    there, empty here) and its NCCL_CONF_FILE from its own working folder: the census reads both through /proc/PID
    (root, cwd), not at the same paths on the node, and a rank on the node beside it keeps its own."""
    import subprocess
    import sys

    from preflight.node import census

    home = tmp_path / "home"
    home.mkdir()
    (home / ".nccl.conf").write_text("NCCL_SOCKET_IFNAME=eth_node\n")  # what the node has at that path
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / ".nccl.conf").write_text("NCCL_SOCKET_IFNAME=eth_container\nNCCL_IB_HCA=mlx5_9\n")
    lib = libnccl(tmp_path / "lib/libnccl.so.2.30.3")  # NCCL 2.30 reads $HOME/.nccl.conf
    script = (f"mount -t tmpfs none {home} && cp {inside / '.nccl.conf'} {home}/.nccl.conf && cd {home} && "
              f"exec {sys.executable} -c \"{MAPS_NCCL}\" {lib}")
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29994", HOME=str(home),
               NCCL_DEBUG="WARN")
    container = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env,
                                 stdout=subprocess.PIPE)
    node = subprocess.Popen([sys.executable, "-c", MAPS_NCCL, str(lib)],
                            env=dict(env, RANK="1"), stdout=subprocess.PIPE, cwd=str(home))
    try:
        assert container.stdout.readline().strip() == b"1" and node.stdout.readline().strip() == b"1"
        assert "eth_node" in (home / ".nccl.conf").read_text()  # here, the node's file
        found = census.take_census({"port": 29994, "deadline_s": 4, "stacks": False, "interval_s": 0.1})
    finally:
        for proc in (container, node):
            proc.kill()
            proc.wait()
    ranks = {p["env"].get("RANK"): p for p in found["processes"] if p.get("env", {}).get("MASTER_PORT") == "29994"}
    assert ranks["0"]["env"]["NCCL_SOCKET_IFNAME"] == "eth_container" and ranks["0"]["env"]["NCCL_IB_HCA"] == "mlx5_9"
    assert ranks["1"]["env"]["NCCL_SOCKET_IFNAME"] == "eth_node" and "NCCL_IB_HCA" not in ranks["1"]["env"]
