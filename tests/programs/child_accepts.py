"""A listener shared after a fork, whose child accepts: the parent accepts
and echoes the first connection, then forks a child that waits a moment
(so that the parent's shim takes the next client's offer in) and accepts
and echoes the second. Used by process_models.rs.
   child_accepts.py server PORT
   child_accepts.py client PORT"""
import os
import socket
import sys
import time


def echo_once(c):
    b = c.recv(64)
    c.sendall(b)
    c.close()


def server(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(8)
    c, _ = s.accept()
    echo_once(c)
    if os.fork() == 0:
        time.sleep(0.6)
        c, _ = s.accept()
        echo_once(c)
        os._exit(0)
    # The parent keeps the listener (and its shim) alive, as a server's
    # does: its exit would close what it holds anyway.
    time.sleep(3)
    os.wait()


def client(port):
    for i in range(2):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"ping %d" % i)
        assert c.recv(64) == b"ping %d" % i
        # The second connection comes while the parent counts as
        # accepting (within a second of its accept), before the child
        # accepts; it then waits long enough to hear that no answer comes.
        time.sleep(0.2 if i == 0 else 1.5)
        c.sendall(b"x")
        c.close()
    print("2 echoes")


if __name__ == "__main__":
    {"server": lambda: server(int(sys.argv[2])), "client": lambda: client(int(sys.argv[2]))}[
        sys.argv[1]
    ]()
