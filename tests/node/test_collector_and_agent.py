"""The facts collector and the request agent (preflight.node), run on this machine and shipped as a node runs
them: secrets redacted, torch never imported, the agent answering requests read from stdin."""
import json
import os
import subprocess
import sys

from node_facts import BASE
from preflight.node import agent, collector
from preflight.remote import shipping


def test_collector_redacts_secrets_and_never_imports_torch():
    env = dict(os.environ, HF_TOKEN="hf_secret_value", NCCL_DEBUG="INFO", WANDB_API_KEY="k")
    code = ("import json, sys; from preflight.node import collector; f = collector.collect({});"
            "print(json.dumps({'env': f['env'], 'torch_imported': 'torch' in sys.modules,"
            "'versions': f['packages']['versions']}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["env"]["HF_TOKEN"] == "<redacted>" and out["env"]["NCCL_DEBUG"] == "INFO"
    assert "hf_secret_value" not in json.dumps(out)
    assert out["torch_imported"] is False
    assert out["versions"]["torch"] == BASE["packages"]["versions"]["torch"]


def test_the_shipped_agent_runs_from_stdin_and_answers_requests():
    stdin = shipping.shipped_input(shipping.AGENT, {"head": "127.0.0.1", "port": 29500}) + "{\"op\": \"time\"}\n{\"op\": \"time\"}\n{\"op\": \"nope\"}\ndone\n"
    command = shipping.shipped_command(sys.executable)
    proc = subprocess.run(["sh", "-c", command], input=stdin, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    facts_doc = json.loads(lines[0])
    assert facts_doc["python"]["executable"] == sys.executable
    answers = [json.loads(line) for line in lines[1:]]
    assert len(answers) == 3 and all(abs(a["time"] - facts_doc["collected_at"]) < 60 for a in answers[:2])
    assert "unknown request" in answers[2]["error"]


def test_the_collector_reports_links_without_changing_interfaces():
    host = collector.collect({"head": "127.0.0.1", "port": 29500})["host"]
    assert all(isinstance(a, str) for addrs in host["interfaces"].values() for a in addrs)
    assert set(host["interfaces"]) <= set(host["links"])
    lo = host["links"]["lo"]
    assert lo["up"] is True and lo["running"] is True and "127.0.0.1/8" in lo["ipv4"]
    for name, addrs in host["interfaces"].items():
        ipv4 = [a for a in addrs if ":" not in a]
        assert [a.split("/")[0] for a in host["links"][name]["ipv4"] or []] == ipv4


def test_holders_gives_argv_parent_children_and_only_the_job_variables():
    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
            "print(s.getsockname()[1], flush=True); time.sleep(60)")
    child_env = dict(os.environ, RANK="2", MASTER_PORT="29511", HF_TOKEN="hf_never_read")
    proc = subprocess.Popen([sys.executable, "-c", code, "--token", "x" * 300], stdout=subprocess.PIPE, text=True,
                            env=child_env)
    try:
        port = int(proc.stdout.readline())
        [found] = agent.holders(port)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert found["pid"] == proc.pid and found["ppid"] == os.getpid() and found["children"] == 0
    assert found["argv"][:2] == [sys.executable, "-c"] and found["argv"][3] == "--token"
    assert found["argv"][4] == "x" * 200  # each argument capped
    mine = [a.decode()[:200] for a in open("/proc/self/cmdline", "rb").read().split(b"\0")[:-1]][:64]
    assert found["parent_argv"] == mine
    assert found["env"] == {"RANK": "2", "MASTER_PORT": "29511"}
    assert found["command"].startswith(sys.executable + " -c") and len(found["command"]) <= 200


def test_the_sockets_listening_here_are_those_of_the_whole_table_in_that_state():
    """host.listening reads only the LISTEN lines of /proc/net/tcp*: a real listener and a real connection to it."""
    import socket as sockets

    from preflight.node import host, procfs

    server = sockets.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = sockets.create_connection(server.getsockname())
    try:
        port = server.getsockname()[1]
        every = procfs.tcp_sockets()
        assert procfs.tcp_sockets("LISTEN") == {k: v for k, v in every.items() if v["state"] == "LISTEN"}
        assert any(s["state"] == "ESTABLISHED" and s["remote_port"] == port for s in every.values())
        assert ["127.0.0.1", port] in host.listening()
    finally:
        client.close()
        server.close()
