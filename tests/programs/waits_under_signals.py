"""Waits on a non-blocking socket through a storm of SIGALRMs.

`python3 waits_under_signals.py server|client PORT select|poll|epoll`:
the client sends 32 MiB, waiting for room with the given call before each
send; the server waits for data the same way, then answers the SHA-256 of
what it got, which the client checks. A handler runs for SIGALRM every
3 ms all the while. Python retries a wait that a handled signal interrupts
(EINTR, PEP 475); any other error raises, and the exit status is 1.
"""

import hashlib
import select
import signal
import socket
import sys

mode, port, style = sys.argv[1], int(sys.argv[2]), sys.argv[3]
TOTAL = 32 << 20
ticks = 0


def on_alarm(_sig, _frame):
    global ticks
    ticks += 1


def wait(sock, for_room):
    if style == "select":
        if for_room:
            select.select([], [sock], [], 5)
        else:
            select.select([sock], [], [], 5)
    elif style == "poll":
        p = select.poll()
        p.register(sock, select.POLLOUT if for_room else select.POLLIN)
        p.poll(5000)
    else:
        e = select.epoll()
        e.register(sock.fileno(), select.EPOLLOUT if for_room else select.EPOLLIN)
        e.poll(5)
        e.close()


signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
digest = hashlib.sha256()
if mode == "server":
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    conn, _ = listener.accept()
    conn.setblocking(False)
    got = 0
    while got < TOTAL:
        wait(conn, False)
        try:
            b = conn.recv(1 << 20)
        except BlockingIOError:
            continue
        if not b:
            break
        digest.update(b)
        got += len(b)
    conn.setblocking(True)
    conn.sendall(digest.hexdigest().encode())
    ok = got == TOTAL
else:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setblocking(False)
    block = bytes((i * 7 + 3) & 255 for i in range(1 << 20))
    view = memoryview(block)
    sent = 0
    while sent < TOTAL:
        wait(conn, True)
        at = sent % len(block)
        try:
            n = conn.send(view[at:])
        except BlockingIOError:
            continue
        digest.update(view[at : at + n])
        sent += n
    conn.setblocking(True)
    answer = b""
    while len(answer) < 64:
        b = conn.recv(64 - len(answer))
        if not b:
            break
        answer += b
    ok = answer.decode() == digest.hexdigest()
signal.setitimer(signal.ITIMER_REAL, 0)
print(f"{mode} {style}: {'ok' if ok else 'MISMATCH'}, {ticks} signals", file=sys.stderr)
sys.exit(0 if ok else 1)
