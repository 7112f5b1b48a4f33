"""--ssh-config is held to what OpenSSH itself takes (`ssh -G -F FILE HOST`) before any node is reached: a file that
is not there or that ssh refuses is exit 2 in one line with ssh's own words, not 'unreachable' on every node."""
import shutil

import pytest

from conftest import run_cli
from preflight.remote.openssh import refused_config

needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client here")


@pytest.mark.parametrize("command", ["check", "launch", "doctor"])
def test_an_ssh_config_that_is_not_there_is_one_line(capsys, tmp_path, command):
    extra = ["--", "true"] if command == "launch" else []
    code, _, err = run_cli(capsys, command, "--hosts", "n1,n2", "--ssh-config", tmp_path / "nope", *extra)
    assert code == 2 and err.count("\n") == 1 and f"{tmp_path / 'nope'}: SSH config (--ssh-config) not found" in err


@needs_ssh
@pytest.mark.parametrize("text,words", [
    ("Host *\n  Port abc\n", "line 2: Bad port 'abc'"),
    ("Host n1\n  Hostname 10.0.0.1\nHost n2\n  NoSuchOption yes\n", "line 4: Bad configuration option: nosuchoption"),
    ("Include /nonexistent-preflight/*.conf\nHost *\n  ConnectTimeout soon\n", "line 3"),
])
def test_an_ssh_config_openssh_refuses_is_exit_2_with_its_words(capsys, tmp_path, text, words):
    path = tmp_path / "ssh_config"
    path.write_text(text)
    code, _, err = run_cli(capsys, "check", "--hosts", "n1,n2", "--ssh-config", path)
    assert code == 2 and err.count("\n") == 1 and "OpenSSH refuses this SSH config" in err and words in err, err


@needs_ssh
def test_a_config_openssh_takes_is_let_through(tmp_path):
    path = tmp_path / "ssh_config"
    path.write_text("Host n*\n  User trainer\n  Port 2222\n  ProxyJump bastion\nMatch host n1\n  IdentityFile ~/x\n")
    assert refused_config(str(path), "n1") is None


@needs_ssh
def test_a_match_exec_that_hangs_is_not_waited_on_past_the_timeout(tmp_path):
    import time

    path = tmp_path / "ssh_config"
    path.write_text("Match exec \"sleep 30\"\n  Port 2222\n")
    started = time.monotonic()
    assert refused_config(str(path), "n1", timeout=1) is None  # not judged: the run's own --timeout says the rest
    assert time.monotonic() - started < 5  # the hanging command ended with ssh, not left holding its pipe
