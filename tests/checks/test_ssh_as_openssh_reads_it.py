"""If `ssh NODE true` works, preflight reaches NODE: what real sites put in ssh_config, each scenario proven
first with the real OpenSSH client and then with `preflight check` (its default client is that same ssh):
an Include tree, a ProxyCommand through a bastion, host certificates (@cert-authority) and user certificates
(TrustedUserCAKeys) signed with ssh-keygen -s, a ProxyCommand that hangs, IdentityAgent and KnownHostsCommand,
the system's /etc/ssh/ssh_config with ssh_config.d, CanonicalizeHostname and hostbased authentication, GSSAPI with
a Kerberos ticket from a real KDC, a key on a PKCS#11 token, a FIDO key through OpenSSH's test middleware, the
user's own ControlPersist master. paramiko (--ssh paramiko) says in one line what of the
config it does not honour. Nothing is left behind: no control folder, no ssh process."""
import os
import pwd
import re
import subprocess
import sys
import time

import pytest

from cluster import cluster, cluster_up, testcluster  # noqa: F401  (fixtures)
from test_ssh import Over, new_key, openssh, private_mounts, ssh001, ssh_agent, ssh_only_from, ssh_processes_on, sshd_with


def host_block(cluster, node, **changes):
    """The cluster's ssh_config entry of `node`, its lines changed (`Port="2205"`) or dropped (`None`)."""
    lines = cluster.ssh_config.read_text().split(f"Host {node}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    kept = []
    for line in lines:
        key = line.split()[0]
        if key in changes:
            if changes[key] is not None:
                kept.append(f"    {key} {changes.pop(key)}")
            else:
                changes.pop(key)
        else:
            kept.append(line)
    kept += [f"    {key} {value}" for key, value in changes.items() if value is not None]
    return "\n".join(kept) + "\n"


def control_folders():
    import tempfile

    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("preflight-ssh-")}


@pytest.mark.cluster
def test_an_include_tree_is_read_as_ssh_reads_it_and_paramiko_says_it_cannot(cluster, tmp_path):
    """ssh_config with `Include hosts.d/*.conf` (relative to ~/.ssh for a user config, here an absolute glob):
    each node in its own file, as sites generate them."""
    folder = tmp_path / "hosts.d"
    folder.mkdir()
    for node in cluster.nodes:
        (folder / f"{node}.conf").write_text(f"Host {node}\n{host_block(cluster, node)}")
    config = tmp_path / "ssh_config"
    config.write_text(f"Include {folder}/*.conf\n")
    hosts = ",".join(cluster.nodes)
    for node in cluster.nodes:
        assert openssh(config, node)[:2] == (0, node)
    before = control_folders()
    doc = ssh001(cluster, config, hosts)
    assert {n: r["status"] for n, r in doc.items()} == {n: "pass" for n in cluster.nodes}, doc
    assert control_folders() <= before and not ssh_processes_on(config)  # nothing left behind
    proc = subprocess.run([sys.executable, "-m", "preflight", "check", "--hosts", "node01", "--ssh-config", str(config),
                           "--python", sys.executable, "--json", "--only", "SSH001", "--ssh", "paramiko"],
                          capture_output=True, text=True, timeout=120)
    said = [line for line in proc.stderr.splitlines() if "does not honour" in line]
    assert said == [f"preflight: --ssh paramiko does not honour {config} line 1: Include; OpenSSH's client "
                    "(--ssh openssh) does"], proc.stderr


@pytest.mark.cluster
def test_a_proxycommand_through_a_bastion(cluster, tmp_path):
    """node03 lets in only node01: `ProxyCommand ssh -W %h:%p node01` is the way, as ssh goes."""
    config = tmp_path / "ssh_config"
    base = cluster.ssh_config.read_text()
    config.write_text(base.replace("Host node03\n", f"Host node03\n    ProxyCommand ssh -F {config} -W %h:%p node01\n"))
    with ssh_only_from(cluster, "node03", cluster.ip("node01")):
        assert openssh(cluster.ssh_config, "node03", "-o", "ConnectTimeout=3")[0] != 0  # no direct way in
        assert openssh(config, "node03")[:2] == (0, "node03")
        doc = ssh001(cluster, config, "node03")
        assert doc["node03"]["status"] == "pass", doc
    # the bastion refuses: ssh fails, and so does SSH001, naming the proxy and ssh's own words
    with ssh_only_from(cluster, "node03", cluster.ip("node01")), ssh_only_from(cluster, "node01", "10.255.255.254"):
        assert openssh(config, "node03")[0] != 0
        ssh = ssh001(cluster, config, "node03")["node03"]
    assert ssh["status"] == "fail" and "through ProxyCommand `ssh -F" in ssh["message"], ssh


@pytest.mark.cluster
def test_a_proxycommand_that_hangs_costs_the_timeout_and_leaves_nothing(cluster, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(cluster.ssh_config.read_text().replace("Host node02\n", "Host node02\n    ProxyCommand sleep 600\n"))
    doc = ssh001(cluster, config, "node01,node02", "--timeout", "2")
    assert doc["node01"]["status"] == "pass", doc
    assert doc["node02"]["status"] == "fail" and "no SSH banner through ProxyCommand `sleep 600` within 2 s" in \
        doc["node02"]["message"], doc["node02"]
    leftover = subprocess.run(["pgrep", "-f", "^sleep 600$"], capture_output=True, text=True).stdout.split()
    assert not leftover and not ssh_processes_on(config), leftover


def test_a_proxycommand_that_ignores_sighup_is_ended_after_ssh_itself_gave_up(tmp_path):
    """ssh that times out by itself (ConnectTimeout, the banner never came) ends its ProxyCommand with SIGHUP
    alone; under nohup the command ignores it. The session's end still ends ssh's group, and only it."""
    import signal

    from preflight.remote import openssh as client

    config = tmp_path / "ssh_config"
    config.write_text("Host hung\n    ProxyCommand sh -c 'trap \"\" HUP; exec sleep 577'\n")
    said = tmp_path / "said"
    with open(said, "wb") as err:  # a file: the ProxyCommand holds ssh's stderr open as long as it lives
        proc = subprocess.Popen(["ssh", "-F", str(config), "-o", "ConnectTimeout=1", "-o", "BatchMode=yes", "hung",
                                 "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    try:
        proc.wait(timeout=30)  # ssh gave up, and was reaped
        assert "timed out" in said.read_text(), said.read_text()
        assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout  # its ProxyCommand lives
        client._signal_group(proc, signal.SIGTERM)
        for _ in range(50):
            if not subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout:
                break
            time.sleep(0.1)
        assert not subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout
        assert not client._orphaned_group(proc.pid)  # the group is gone: nothing more is signalled
        assert not client._orphaned_group(os.getpid())  # a process of that pid (not a reaped child's): never
    finally:
        subprocess.run(["pkill", "-KILL", "-g", str(proc.pid)], capture_output=True)


def host_ca(tmp_path, cluster, node, principals):
    """A host CA, and node's host key certified by it for `principals` (ssh-keygen -s -h)."""
    ca = new_key(tmp_path, "host_ca")
    key = tmp_path / f"{node}_hostkey"
    key.write_bytes((cluster.node_dir(node) / "ssh_host_ed25519_key").read_bytes())
    key.chmod(0o600)
    key.with_suffix(".pub").write_text((cluster.node_dir(node) / "ssh_host_ed25519_key.pub").read_text())
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", f"{node}-host", "-h", "-n", principals, str(key) + ".pub"],
                   check=True, capture_output=True, timeout=30)
    return ca, tmp_path / f"{node}_hostkey-cert.pub"


@pytest.mark.cluster
def test_host_certificates_verified_by_cert_authority_in_known_hosts(cluster, tmp_path):
    """sshd presents a certificate (HostCertificate) signed by the site's host CA; known_hosts holds only
    `@cert-authority * CA` (no key of the node). A certificate for another name is refused, by ssh and by SSH001."""
    ip = cluster.ip("node02")
    ca, cert = host_ca(tmp_path, cluster, "node02", f"{ip},node02")
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority * {' '.join(ca.with_suffix('.pub').read_text().split()[:2])}\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host node02\n{host_block(cluster, 'node02', Port='2205', UserKnownHostsFile=str(known))}")
    with sshd_with(cluster, "node02", 2205, f"HostCertificate {cert}"):
        assert openssh(config, "node02")[:2] == (0, "node02")
        assert ssh001(cluster, config, "node02")["node02"]["status"] == "pass"
    other = tmp_path / "other"  # another CA's certificate, for a name that is not this node's
    other.mkdir()
    _, wrong = host_ca(other, cluster, "node02", "somewhere-else")
    with sshd_with(cluster, "node02", 2205, f"HostCertificate {wrong}"):
        code, _, err = openssh(config, "node02")
        assert code != 0 and "Host key verification failed" in err, err
        ssh = ssh001(cluster, config, "node02")["node02"]
    assert ssh["status"] == "fail" and ssh["evidence"]["reason"].startswith("host-key"), ssh


@pytest.mark.cluster
def test_user_certificates_signed_by_the_sites_user_ca(cluster, tmp_path):
    """sshd trusts the user CA (TrustedUserCAKeys) and no authorized_keys; the user's key is certified for root."""
    ca = new_key(tmp_path, "user_ca")
    key = new_key(tmp_path, "user")
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "alice", "-n", "root", str(key) + ".pub"], check=True,
                   capture_output=True, timeout=30)
    ip = cluster.ip("node02")
    hostkey = (cluster.node_dir("node02") / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[{ip}]:2206 {' '.join(hostkey)}\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host node02\n{host_block(cluster, 'node02', Port='2206', IdentityFile=str(key))}"
                      f"    UserKnownHostsFile {known}\n    CertificateFile {key}-cert.pub\n".replace(
                          f"UserKnownHostsFile {cluster.known_hosts}\n", ""))
    with sshd_with(cluster, "node02", 2206, f"TrustedUserCAKeys {ca}.pub", "AuthorizedKeysFile none"):
        assert openssh(config, "node02")[:2] == (0, "node02")
        assert ssh001(cluster, config, "node02")["node02"]["status"] == "pass"
        # without the certificate (ssh also looks for KEY-cert.pub by itself), the key alone is refused: by ssh
        # and by SSH001 alike
        config.write_text(re.sub(r"\n    CertificateFile .*\n", "\n", config.read_text()))
        (tmp_path / "user-cert.pub").rename(tmp_path / "elsewhere")
        assert openssh(config, "node02")[0] != 0
        ssh = ssh001(cluster, config, "node02")["node02"]
    assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "auth", ssh
    assert "Permission denied" in ssh["message"]


@pytest.mark.cluster
def test_identity_agent_and_known_hosts_command(cluster, tmp_path):
    """The key only in an agent named by IdentityAgent (no SSH_AUTH_SOCK), the host keys only from
    KnownHostsCommand (no known_hosts file): what sites with a managed agent and a host-key service write."""
    with ssh_agent(tmp_path, cluster.identity) as env:
        socket_path = env.pop("SSH_AUTH_SOCK")
        known = tmp_path / "served_known_hosts"
        known.write_text(cluster.known_hosts.read_text())
        config = tmp_path / "ssh_config"
        config.write_text(f"Host node02\n{host_block(cluster, 'node02', IdentityFile=None, IdentitiesOnly=None)}"
                          f"    IdentityAgent {socket_path}\n    UserKnownHostsFile /dev/null\n"
                          f"    KnownHostsCommand /bin/cat {known}\n".replace(
                              f"    UserKnownHostsFile {cluster.known_hosts}\n", ""))
        assert openssh(config, "node02", env=env)[:2] == (0, "node02")
        assert ssh001(cluster, config, "node02", env=env)["node02"]["status"] == "pass"
        known.write_text("")  # the service knows no key of the node: refused by both
        assert openssh(config, "node02", env=env)[0] != 0
        ssh = ssh001(cluster, config, "node02", env=env)["node02"]
    assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "host-key-unknown", ssh


def with_names(tmp_path, names):
    """This machine's /etc/hosts with more names ({name: address}), as a site's DNS would answer them."""
    hosts = tmp_path / "hosts"
    with open("/etc/hosts", encoding="utf-8") as system:
        hosts.write_text(system.read() + "".join(f"{address} {name}\n" for name, address in names.items()))
    return hosts


def host_key(cluster, node):
    return " ".join((cluster.node_dir(node) / "ssh_host_ed25519_key.pub").read_text().split()[:2])


@pytest.mark.cluster
def test_the_systems_own_config_canonical_names_and_hostbased_authentication(cluster, tmp_path):
    """What a site's image carries, and no user key at all: /etc/ssh/ssh_config includes ssh_config.d/*.conf,
    short names are canonicalized into the cluster's domain (CanonicalizeHostname), and nodes trust each other's
    host keys (hostbased authentication: ssh-keysign signs with the client's host key; the server finds it in
    known_hosts and the client in .shosts). preflight is given no --ssh-config, as ssh is given no -F."""
    node, port, login = "node02", 2207, cluster.login_ip
    etc = tmp_path / "etc_ssh"
    (etc / "ssh_config.d").mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc / "ssh_host_ed25519_key")],
                   check=True, capture_output=True, timeout=30)
    (etc / "ssh_known_hosts").write_text(f"[{node}.cluster.test]:{port} {host_key(cluster, node)}\n")
    (etc / "ssh_config").write_text("Include /etc/ssh/ssh_config.d/*.conf\nHost *\n    EnableSSHKeysign yes\n")
    (etc / "ssh_config.d" / "cluster.conf").write_text(
        "CanonicalizeHostname yes\nCanonicalDomains cluster.test\n"
        f"Host *.cluster.test\n    Port {port}\n    User root\n    HostbasedAuthentication yes\n"
        "    PubkeyAuthentication no\n    StrictHostKeyChecking yes\n")
    home = pwd.getpwuid(os.getuid()).pw_dir  # ssh's home (~/.ssh), whatever $HOME says
    # ssh asks the resolver for the absolute name (a final dot): a DNS server takes both, /etc/hosts the one listed
    names = {f"{node}.cluster.test {node}.cluster.test.": cluster.ip(node)}
    site = {"/etc/ssh": etc, "/etc/hosts": with_names(tmp_path, names),
            home: Over(tmp_path / "client_home").hide(".ssh")}  # no user config, no user key
    server_home = Over(tmp_path / "server_home")
    (server_home.upper / ".ssh").mkdir()
    login_key = " ".join((etc / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    (server_home.upper / ".ssh" / "known_hosts").write_text(f"login,{login} {login_key}\n")
    shosts = server_home.upper / ".shosts"
    shosts.write_text(f"login root\n{login} root\n")
    with sshd_with(cluster, node, port, "HostbasedAuthentication yes", "IgnoreRhosts no", "PubkeyAuthentication no",
                   binds={home: server_home}):
        assert openssh(None, node, binds=site)[:2] == (0, node)
        assert ssh001(cluster, None, node, binds=site)[node]["status"] == "pass"
        paramiko = subprocess.run(private_mounts(site, [
            sys.executable, "-m", "preflight", "check", "--hosts", node, "--python", sys.executable, "--only", "SSH001",
            "--ssh", "paramiko", "--timeout", "5"]), capture_output=True, text=True, timeout=120)
        assert ("--ssh paramiko does not honour /etc/ssh/ssh_config line 1: Include; /etc/ssh/ssh_config line 3: "
                "EnableSSHKeysign; OpenSSH's client (--ssh openssh) does") in paramiko.stderr, paramiko.stderr
        shosts.write_text("")  # the server no longer trusts the login host: refused by both
        assert "Permission denied (hostbased)" in openssh(None, node, binds=site)[2]
        ssh = ssh001(cluster, None, node, binds=site)[node]
    assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "auth", ssh
    assert not ssh_processes_on(etc / "ssh_config")


@pytest.mark.cluster
def test_gssapi_authentication_with_a_kerberos_ticket(cluster, tmp_path):
    """A realm whose KDC runs on node01; node02's sshd accepts GSSAPI alone (its host/node02 key in a keytab);
    the user holds a ticket (kinit) and no key. Without a ticket both ssh and SSH001 are refused."""
    node, port = "node02", 2208
    realm = cluster.start_kdc("node01")
    try:
        env = dict(os.environ, KRB5_CONFIG=realm["krb5.conf"], KRB5CCNAME=f"FILE:{tmp_path / 'ccache'}")
        subprocess.run(["kinit", "-k", "-t", realm["root.keytab"], f"root@{testcluster.KERBEROS_REALM}"], env=env,
                       check=True, capture_output=True, timeout=30)
        known = tmp_path / "known_hosts"
        known.write_text(f"[{node}]:{port} {host_key(cluster, node)}\n")
        config = tmp_path / "ssh_config"
        config.write_text(f"Host {node}\n    Port {port}\n    User root\n    GSSAPIAuthentication yes\n"
                          f"    PubkeyAuthentication no\n    UserKnownHostsFile {known}\n    StrictHostKeyChecking yes\n")
        site = {"/etc/hosts": with_names(tmp_path, {node: cluster.ip(node)})}
        with sshd_with(cluster, node, port, "GSSAPIAuthentication yes", "PubkeyAuthentication no",
                       env={"KRB5_CONFIG": realm["krb5.conf"], "KRB5_KTNAME": f"FILE:{realm['hosts.keytab']}"}):
            assert openssh(config, node, env=env, binds=site)[:2] == (0, node)
            assert ssh001(cluster, config, node, env=env, binds=site)[node]["status"] == "pass"
            subprocess.run(["kdestroy"], env=env, check=True, capture_output=True, timeout=30)
            assert "Permission denied (gssapi" in openssh(config, node, env=env, binds=site)[2]
            ssh = ssh001(cluster, config, node, env=env, binds=site)[node]
        assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "auth", ssh
    finally:
        cluster.stop_kdc("node01")


SOFTHSM = "/usr/lib/softhsm/libsofthsm2.so"


@pytest.mark.cluster
@pytest.mark.skipif(not os.path.exists(SOFTHSM), reason=f"{SOFTHSM} not installed (apt-get install softhsm2 opensc)")
def test_a_key_that_never_leaves_its_pkcs11_token(cluster, tmp_path, monkeypatch):
    """The user's key is made on a PKCS#11 token and never leaves it (SoftHSM here; a smart card or an HSM at
    sites): `ssh-add -s PROVIDER` hands it to the agent once (the PIN is asked then), and the config names the
    provider (PKCS11Provider) with IdentitiesOnly. `ssh NODE hostname` then needs no prompt, while ssh in batch
    mode lists no key of a token that needs a PIN ("pin required") and refuses the agent's copy: preflight
    reaches the node as `ssh NODE` does. Taken out of the agent (`ssh-add -e`), it is refused by both."""
    node, port = "node02", 2209
    monkeypatch.setenv("SOFTHSM2_CONF", str(tmp_path / "softhsm2.conf"))
    (tmp_path / "tokens").mkdir()
    (tmp_path / "softhsm2.conf").write_text(f"directories.tokendir = {tmp_path / 'tokens'}\nobjectstore.backend = file\n")
    for argv in (["softhsm2-util", "--init-token", "--free", "--label", "site", "--pin", "1234", "--so-pin", "5678"],
                 ["pkcs11-tool", "--module", SOFTHSM, "--token-label", "site", "--login", "--pin", "1234",
                  "--keypairgen", "--key-type", "EC:prime256v1", "--label", "user", "--id", "01"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=30)
    public = subprocess.run(["ssh-keygen", "-D", SOFTHSM], check=True, capture_output=True, text=True,
                            timeout=30).stdout
    (tmp_path / "authorized_keys").write_text(public)
    pin = tmp_path / "pin"
    pin.write_text("#!/bin/sh\necho 1234\n")
    pin.chmod(0o700)
    known = tmp_path / "known_hosts"
    known.write_text(f"[{cluster.ip(node)}]:{port} {host_key(cluster, node)}\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host {node}\n{host_block(cluster, node, Port=str(port), IdentityFile=None)}"
                      f"    PKCS11Provider {SOFTHSM}\n".replace(str(cluster.known_hosts), str(known)))
    assert "IdentitiesOnly yes" in config.read_text()
    with sshd_with(cluster, node, port, f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}"), \
            ssh_agent(tmp_path) as env:
        subprocess.run(["ssh-add", "-s", SOFTHSM], env=dict(env, SSH_ASKPASS=str(pin), SSH_ASKPASS_REQUIRE="force"),
                       check=True, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        assert openssh(config, node, env=env, batch=False)[:2] == (0, node)
        assert "pin required" in openssh(config, node, env=env)[2]  # why not BatchMode
        assert ssh001(cluster, config, node, env=env)[node]["status"] == "pass"
        subprocess.run(["ssh-add", "-e", SOFTHSM], env=env, check=True, capture_output=True, timeout=30)
        assert openssh(config, node, env=env, batch=False)[0] != 0
        ssh = ssh001(cluster, config, node, env=env)[node]
    assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "auth", ssh


SK_DUMMY = "/usr/lib/openssh/regress/misc/sk-dummy/sk-dummy.so"


@pytest.mark.cluster
@pytest.mark.skipif(not os.path.exists(SK_DUMMY), reason=f"{SK_DUMMY} not installed (apt-get install openssh-tests)")
def test_a_fido_key_through_its_security_key_middleware(cluster, tmp_path):
    """An ed25519-sk key (FIDO/U2F), made and used through a security key middleware (SecurityKeyProvider):
    OpenSSH's own test authenticator stands for the token this machine lacks, and answers as a key made with
    `-O no-touch-required` does (no touch: `ssh NODE true` asks nothing). sshd checks the signature as for a real
    token. Without the middleware, the key cannot sign: refused by ssh and by SSH001 alike."""
    node, port = "node02", 2212
    key = tmp_path / "id_ed25519_sk"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519-sk", "-w", SK_DUMMY, "-O", "no-touch-required", "-N", "",
                    "-f", str(key)], check=True, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    (tmp_path / "authorized_keys").write_text("no-touch-required " + key.with_suffix(".pub").read_text())
    known = tmp_path / "known_hosts"
    known.write_text(f"[{cluster.ip(node)}]:{port} {host_key(cluster, node)}\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host {node}\n{host_block(cluster, node, Port=str(port), IdentityFile=str(key))}"
                      f"    SecurityKeyProvider {SK_DUMMY}\n".replace(str(cluster.known_hosts), str(known)))
    with sshd_with(cluster, node, port, f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}"):
        assert openssh(config, node, batch=False)[:2] == (0, node)
        assert ssh001(cluster, config, node)[node]["status"] == "pass"
        config.write_text(config.read_text().replace(f"    SecurityKeyProvider {SK_DUMMY}\n", ""))
        assert openssh(config, node, batch=False)[0] != 0  # the default middleware (libfido2) finds no token
        ssh = ssh001(cluster, config, node)[node]
    assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "auth", ssh


@pytest.mark.cluster
def test_the_users_own_master_connection_serves_preflight_as_it_serves_ssh(cluster, tmp_path):
    """Sites where the login is made once (a one-time password, a touch) and kept by the user's own master
    (ControlMaster auto, ControlPath, ControlPersist): here it was authenticated once with a key the config does
    not name. `ssh NODE hostname` then needs no key, and neither does preflight, whose programs run as sessions of
    that master; the master is left running, the user's. Once it has gone, both are refused."""
    import shutil
    import tempfile

    node, port = "node02", 2211
    once, stranger = new_key(tmp_path, "once"), new_key(tmp_path, "stranger")
    (tmp_path / "authorized_keys").write_text(once.with_suffix(".pub").read_text())
    known = tmp_path / "known_hosts"
    known.write_text(f"[{cluster.ip(node)}]:{port} {host_key(cluster, node)}\n")
    sockets = tempfile.mkdtemp(prefix="pf-cm-", dir="/tmp")  # short: a socket path has 108 bytes
    config = tmp_path / "ssh_config"
    config.write_text(f"Host {node}\n    HostName {cluster.ip(node)}\n    Port {port}\n    User root\n"
                      f"    IdentityFile {stranger}\n    IdentitiesOnly yes\n    UserKnownHostsFile {known}\n"
                      f"    ControlMaster auto\n    ControlPath {sockets}/%C\n    ControlPersist 120\n")
    check_master = ["ssh", "-F", str(config), "-O", "check", node]
    try:
        with sshd_with(cluster, node, port, f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}"):
            subprocess.run(["ssh", "-F", str(config), "-i", str(once), "-o", "BatchMode=yes", node, "true"], check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
            assert openssh(config, node, batch=False)[:2] == (0, node)  # no key, over the master
            before = control_folders()
            assert ssh001(cluster, config, node)[node]["status"] == "pass"
            assert subprocess.run(check_master, capture_output=True, timeout=30).returncode == 0  # still the user's
            assert control_folders() <= before and not ssh_processes_on(config)
            subprocess.run(["ssh", "-F", str(config), "-O", "exit", node], capture_output=True, timeout=30)
            assert openssh(config, node, batch=False)[0] != 0
            ssh = ssh001(cluster, config, node)[node]
        assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "auth", ssh
    finally:
        subprocess.run(["ssh", "-F", str(config), "-O", "exit", node], capture_output=True, timeout=30)
        shutil.rmtree(sockets, ignore_errors=True)


def test_hosts_with_a_user_or_a_port_get_the_ssh_config_lines_to_write():
    for given, lines in (("alice@node01", "Host node01; User alice"), ("node01:2222", "Host node01; Port 2222"),
                         ("ssh://bob@n1:2200", "Host n1; User bob; Port 2200")):
        proc = subprocess.run([sys.executable, "-m", "preflight", "check", "--hosts", given, "--only", "SSH001"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"list the node as {lines.split(';')[0][5:]}" in proc.stderr and lines in proc.stderr, proc.stderr


def test_paramiko_names_each_line_of_the_config_it_does_not_honour(tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("@cert-authority *.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA\n")
    config = tmp_path / "ssh_config"
    config.write_text("Include conf.d/*\n# ProxyCommand in a comment\nHost gpu*\n  HostName %h.example.org\n"
                      "  ProxyCommand ssh -W %h:%p bastion\n  GSSAPIAuthentication no\n  ServerAliveInterval 30\n"
                      f"  CertificateFile ~/.ssh/id-cert.pub\n  UserKnownHostsFile {known}\n")
    from preflight.remote.ssh import unhonoured

    assert unhonoured(str(config)) == [f"{config} line 1: Include", f"{config} line 5: ProxyCommand",
                                       f"{config} line 8: CertificateFile",
                                       f"{known}: @cert-authority (host certificates)"]
    assert unhonoured(str(tmp_path / "absent")) == []
    # the system's config (ssh reads it where no -F is given; paramiko never does): what it sets is lost too,
    # but for an Include that names no file (Debian's ssh_config.d, empty)
    system = tmp_path / "etc_ssh" / "ssh_config"
    (system.parent / "ssh_config.d").mkdir(parents=True)
    system.write_text(f"Include {tmp_path}/absent.d/*.conf\nInclude ssh_config.d/*.conf\nHost *\n"
                      "    SendEnv LANG LC_*\n    HashKnownHosts yes\n    GSSAPIAuthentication yes\n"
                      "Host gpu*\n    User svc\n")
    assert unhonoured(str(system), read=False) == [f"{system} line 6: GSSAPIAuthentication", f"{system} line 8: User"]
    (system.parent / "ssh_config.d" / "site.conf").write_text("Host *\n")
    assert unhonoured(str(system), read=False)[0] == f"{system} line 2: Include"


def test_the_faster_key_exchange_is_preferred_only_where_the_config_says_nothing_of_it(tmp_path):
    from preflight.remote.openssh import FAST_KEX, base_argv

    plain = tmp_path / "plain"
    plain.write_text("Host *\n    User root\n")
    included = tmp_path / "site.d"
    included.mkdir()
    (included / "crypto.conf").write_text("Host *\n    KexAlgorithms=sntrup761x25519-sha512@openssh.com\n")
    site = tmp_path / "site"
    site.write_text(f"Include {included}/*.conf\n")
    assert FAST_KEX in base_argv(str(plain), False, 30)
    assert FAST_KEX not in base_argv(str(site), False, 30)  # the site's own list, through its Include
    # ssh takes it: curve25519 first, then ssh's own list
    proc = subprocess.run(["ssh", "-F", str(plain), "-o", FAST_KEX, "-G", "node"], capture_output=True, text=True,
                          timeout=30)
    kex = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("kexalgorithms "))
    assert kex.startswith("curve25519-sha256,") and "sntrup761x25519-sha512" in kex, kex


def test_a_control_folder_left_by_a_killed_run_is_removed_by_the_next(monkeypatch):
    """SIGKILL leaves no chance to clean up: the next run removes the folders of this user's runs that are gone,
    and leaves a live one's alone."""
    import shutil
    import tempfile
    from pathlib import Path

    from preflight.remote import openssh

    tmp_path = Path(tempfile.mkdtemp(prefix="pf-sweep-", dir="/tmp"))  # short: a socket path has 108 bytes
    monkeypatch.setattr(openssh.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(openssh, "_SWEPT", [])
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = tmp_path / f"preflight-ssh-{gone.pid}-x1"
    live = tmp_path / f"preflight-ssh-{os.getpid()}-x2"
    for folder in (left, live):
        folder.mkdir(mode=0o700)
    try:
        folder = openssh._control_folder()
        assert os.path.dirname(folder) == str(tmp_path)
        assert not left.exists() and live.exists() and os.path.isdir(folder)
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    finally:
        shutil.rmtree(tmp_path)
