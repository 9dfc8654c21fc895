#!/usr/bin/env python3
"""A thread-per-connection server whose threads block in recv() while
their clients stay quiet a while, as sshd's or PostgreSQL's backends wait
for the next request.

  blocked_receivers.py server PORT CONNS
  blocked_receivers.py client PORT CONNS IDLE_MS DIR

The server accepts CONNS connections, one thread each. A thread counts its
voluntary context switches across one blocking recv() of the 32-byte
request (/proc/thread-self/status), prints "wakes N" on stderr, echoes the
request and waits for the close. The client, one connection after another:
connect, stay quiet IDLE_MS, send 32 checked bytes, read and check the
echo. Then it writes DIR/done, and closes them all once DIR/close exists
(so that their counters can be read).
"""
import os
import socket
import sys
import threading
import time

MSG = 32


def switches():
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise RuntimeError("no voluntary_ctxt_switches")


def recv_exact(c, n):
    got = b""
    while len(got) < n:
        b = c.recv(n - len(got))
        if not b:
            raise RuntimeError("closed after %d bytes" % len(got))
        got += b
    return got


def handle(c):
    before = switches()
    first = c.recv(MSG)
    wakes = switches() - before
    data = first + recv_exact(c, MSG - len(first)) if len(first) < MSG else first
    print("wakes %d" % wakes, file=sys.stderr, flush=True)
    c.sendall(data)
    while c.recv(4096):
        pass
    c.close()


def server(port, conns):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(64)
    threads = []
    for _ in range(conns):
        c, _ = ls.accept()
        t = threading.Thread(target=handle, args=(c,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join(60)


def client(port, conns, idle_ms, d):
    held = []
    for i in range(conns):
        c = socket.create_connection(("127.0.0.1", port))
        time.sleep(idle_ms / 1000.0)
        msg = bytes((i * 7 + k) % 256 for k in range(MSG))
        c.sendall(msg)
        if recv_exact(c, MSG) != msg:
            raise RuntimeError("connection %d: the echo differs" % i)
        held.append(c)
    open(os.path.join(d, "done"), "w").close()
    end = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, "close")) and time.monotonic() < end:
        time.sleep(0.02)
    for c in held:
        c.close()


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]), int(sys.argv[3]))
    else:
        client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
