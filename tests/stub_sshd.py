"""A stub SSH server for tests: real SSH (paramiko's server side), key authentication against one public key,
then a fault that OpenSSH would never show by itself.

    python tests/stub_sshd.py --port 2222 --host-key KEY --authorized-key KEY.pub --stall exec

--stall exec: sessions open, but the exec request is never answered (a hung sshd or PAM session module);
--stall session: the session request itself is never answered; --close: every connection is closed as soon as
it is accepted, before the SSH banner (as sshd past MaxStartups, or a TCP wrapper refusing the host; no keys
needed then). It prints "ready" on stdout once it
listens, serves until killed, and keeps every connection open. Run it in a test host's network namespace
(cluster.netns_popen) to put it on the test network.
"""
import argparse
import socket
import sys
import threading

import paramiko


class Server(paramiko.ServerInterface):
    def __init__(self, authorized: paramiko.PKey, stall: str, forever: threading.Event):
        self.authorized, self.stall, self.forever = authorized, stall, forever

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL if key == self.authorized else paramiko.AUTH_FAILED

    def check_channel_request(self, kind, chanid):
        if self.stall == "session":
            self.forever.wait()  # the transport's thread waits here: no answer ever goes out
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel, command):
        self.forever.wait()
        return False


def serve(conn: socket.socket, host_key: paramiko.PKey, authorized: paramiko.PKey, stall: str,
          forever: threading.Event) -> None:
    transport = paramiko.Transport(conn)
    transport.add_server_key(host_key)
    try:
        transport.start_server(server=Server(authorized, stall, forever))
    except (paramiko.SSHException, EOFError, OSError):
        transport.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host-key")
    parser.add_argument("--authorized-key", help="a public key file (the one line of id_*.pub)")
    parser.add_argument("--stall", choices=("exec", "session"), default="exec")
    parser.add_argument("--close", action="store_true", help="close every connection before the banner")
    args = parser.parse_args(argv)
    if not args.close and not (args.host_key and args.authorized_key):
        parser.error("--host-key and --authorized-key are needed (but with --close)")
    if not args.close:
        host_key = paramiko.PKey.from_path(args.host_key)
        kind, blob = open(args.authorized_key).read().split()[:2]
        authorized = paramiko.PKey.from_type_string(kind, __import__("base64").b64decode(blob))
    forever = threading.Event()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", args.port))
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if args.close:
            conn.close()
            continue
        threading.Thread(target=serve, args=(conn, host_key, authorized, args.stall, forever), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
