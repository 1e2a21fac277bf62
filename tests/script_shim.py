"""Stands in for `python` where a launcher starts one (torchrun's PYTHON_EXEC): hands its arguments,
working directory, environment and standard streams to tests/script_server.py, whose fork runs them,
forwards the signals a launcher sends, and exits as that run exited. Standard library only (it starts
in milliseconds, with -I -S)."""
import json
import os
import signal
import socket
import sys


def main() -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(os.environ["CDGRAB_SCRIPT_SERVER"])
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(1 << 16))["pid"]
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, lambda received, frame: os.kill(pid, received))
    reply = conn.recv(1 << 16)
    returncode = json.loads(reply)["returncode"] if reply else -signal.SIGKILL
    if returncode < 0:  # die of the same signal, so that the launcher reports it as the run's
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode)


if __name__ == "__main__":
    main()
