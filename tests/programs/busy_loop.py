#!/usr/bin/env python3
"""An event loop that never sleeps: both ends poll their epoll sets with a
zero timeout, as busy-polling servers do, over several connections.

  busy_loop.py server PORT CONNS
  busy_loop.py client PORT CONNS ROUNDS DIR

The client runs ROUNDS request/answer rounds on each of CONNS connections
(32-byte requests, checked answers), then writes DIR/done and holds the
connections open until DIR/close exists (so that their counters can be
read), then closes. The server echoes what it reads and exits when every
connection has closed.
"""
import os
import select
import socket
import sys
import time

MSG = 32
LIMIT = 120.0


def server(port, conns):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(conns)
    socks = []
    for _ in range(conns):
        c, _ = ls.accept()
        c.setblocking(False)
        socks.append(c)
    ep = select.epoll()
    by_fd = {}
    for c in socks:
        ep.register(c.fileno(), select.EPOLLIN)
        by_fd[c.fileno()] = c
    end = time.monotonic() + LIMIT
    while by_fd and time.monotonic() < end:
        for fd, _ in ep.poll(0):
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
    sys.exit(0 if not by_fd else 1)


def client(port, conns, rounds, folder):
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
    ep = select.epoll()
    state = {}
    for i, c in enumerate(socks):
        c.setblocking(False)
        ep.register(c.fileno(), select.EPOLLIN)
        state[c.fileno()] = [c, i, 0, b""]
    def request(i, n):
        return (b"%08d:%08d:" % (i, n)).ljust(MSG, b"x")
    for c, i, n, _ in state.values():
        c.sendall(request(i, 0))
    left = conns
    end = time.monotonic() + LIMIT
    while left and time.monotonic() < end:
        for fd, _ in ep.poll(0):
            st = state[fd]
            c, i, n, got = st
            try:
                data = c.recv(4096)
            except BlockingIOError:
                continue
            if not data:
                sys.exit("server closed early")
            got += data
            if len(got) < MSG:
                st[3] = got
                continue
            if got != request(i, n):
                sys.exit("connection %d round %d: answer %r" % (i, n, got))
            n += 1
            st[2], st[3] = n, b""
            if n == rounds:
                left -= 1
            else:
                c.setblocking(True)
                c.sendall(request(i, n))
                c.setblocking(False)
    if left:
        sys.exit("%d connections unfinished" % left)
    open(os.path.join(folder, "done"), "w").close()
    end = time.monotonic() + LIMIT
    while not os.path.exists(os.path.join(folder, "close")):
        if time.monotonic() > end:
            sys.exit("nobody said close")
        time.sleep(0.02)
    for c in socks:
        c.close()


if __name__ == "__main__":
    role, port, conns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if role == "server":
        server(port, conns)
    else:
        client(port, conns, int(sys.argv[4]), sys.argv[5])
