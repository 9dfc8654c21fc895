#!/usr/bin/env python3
"""Several event loops that sleep between requests, as memcached's workers
do: each server thread waits in its own epoll set (no timeout) over its
share of the connections.

  sleeping_loops.py server PORT CONNS LOOPS
  sleeping_loops.py client PORT CONNS ROUNDS DIR

The client runs ROUNDS request/answer rounds over its CONNS connections,
one connection after another (so that each request finds its loop
asleep), 32-byte requests with checked answers, then writes DIR/done and
holds the connections open until DIR/close exists (so that their counters
can be read), then closes. The server echoes what it reads; each loop
exits when its connections have closed.
"""
import os
import select
import socket
import sys
import threading
import time

MSG = 32
LIMIT = 120.0


def serve(socks):
    ep = select.epoll()
    by_fd = {}
    for c in socks:
        c.setblocking(False)
        ep.register(c.fileno(), select.EPOLLIN)
        by_fd[c.fileno()] = c
    end = time.monotonic() + LIMIT
    while by_fd and time.monotonic() < end:
        for fd, _ in ep.poll(5.0):
            c = by_fd[fd]
            try:
                data = c.recv(4096)
            except BlockingIOError:
                continue
            if not data:
                ep.unregister(fd)
                c.close()
                del by_fd[fd]
                continue
            c.setblocking(True)
            c.sendall(data)
            c.setblocking(False)
    ep.close()
    if by_fd:
        sys.exit("server: loop timed out")


def server(port, conns, loops):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(conns)
    shares = [[] for _ in range(loops)]
    for i in range(conns):
        c, _ = ls.accept()
        shares[i % loops].append(c)
    threads = [threading.Thread(target=serve, args=(s,)) for s in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def client(port, conns, rounds, d):
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
    for c in socks:
        c.settimeout(30)
    for r in range(rounds):
        for i, c in enumerate(socks):
            msg = (b"%08d:%08d:" % (r, i)).ljust(MSG, b"x")
            c.sendall(msg)
            got = b""
            while len(got) < MSG:
                part = c.recv(MSG - len(got))
                if not part:
                    sys.exit("client: connection %d ended in round %d" % (i, r))
                got += part
            if got != msg:
                sys.exit("client: round %d connection %d: %r != %r" % (r, i, got, msg))
    open(os.path.join(d, "done"), "w").close()
    end = time.monotonic() + LIMIT
    while not os.path.exists(os.path.join(d, "close")) and time.monotonic() < end:
        time.sleep(0.02)
    for c in socks:
        c.close()


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
