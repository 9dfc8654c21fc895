"""Keep-alive requests against an edge-triggered epoll server, as ab
against nginx: each new connection's second request comes on TCP while
the connection joins the fabric, and the server must hear of it.

server PORT: non-blocking sockets in one epoll set with EPOLLET; each
    117-byte request gets a 239-byte header and a 2768-byte body in one
    writev (as nginx's), the body a function of the request's number.
    A wait that names one descriptor twice (the kernel never does) is
    reported as "duplicate".
client PORT CONNECTIONS REQUESTS THREADS: blocking sockets, a new
    connection after each REQUESTS requests; every response checked.
    Prints "ok N" with N responses checked, or what went wrong.
"""

import os
import select
import socket
import sys
import threading

REQ_LEN, HDR_LEN, BODY_LEN = 117, 239, 2768


def response(req: bytes) -> bytes:
    n = int(req.split()[1])
    hdr = (b"OK %d " % n).ljust(HDR_LEN, b"h")
    body = (b"%08d" % n) * (BODY_LEN // 8)
    return hdr + body


def serve(port: int) -> None:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(512)
    ls.setblocking(False)
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    conns = {}  # fd -> [socket, bytes in, bytes out]
    print("ready", flush=True)
    while True:
        got = ep.poll()
        fds = [fd for fd, _ in got]
        if len(set(fds)) != len(fds):
            print("duplicate descriptor in one wait: %r" % got, file=sys.stderr, flush=True)
        for fd, _ in got:
            if fd == ls.fileno():
                while True:
                    try:
                        c, _ = ls.accept()
                    except BlockingIOError:
                        break
                    c.setblocking(False)
                    conns[c.fileno()] = [c, b"", b""]
                    ep.register(
                        c.fileno(),
                        select.EPOLLIN | select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET,
                    )
                continue
            st = conns.get(fd)
            if st is None:
                continue
            c, closed = st[0], False
            # Edge-triggered: drain until EAGAIN, then wait for the next edge.
            while True:
                try:
                    d = c.recv(65536)
                except BlockingIOError:
                    break
                except ConnectionError:
                    closed = True
                    break
                if not d:
                    closed = True
                    break
                st[1] += d
            while len(st[1]) >= REQ_LEN:
                st[2] += response(st[1][:REQ_LEN])
                st[1] = st[1][REQ_LEN:]
            while st[2] and not closed:
                out = st[2]
                try:
                    n = os.writev(fd, [out[:HDR_LEN], out[HDR_LEN:]])
                except BlockingIOError:
                    break
                except OSError:
                    closed = True
                    break
                st[2] = out[n:]
            if closed:
                ep.unregister(fd)
                c.close()
                del conns[fd]


def client(port: int, connections: int, requests: int, threads: int) -> None:
    checked, bad = [0], []
    lock = threading.Lock()

    def run(k: int) -> None:
        for i in range(k, connections, threads):
            s = socket.create_connection(("127.0.0.1", port))
            s.settimeout(20)
            try:
                for r in range(requests):
                    n = i * requests + r
                    s.sendall((b"GET %d " % n).ljust(REQ_LEN, b"r"))
                    want = response(b"GET %d" % n)
                    got = b""
                    while len(got) < len(want):
                        d = s.recv(len(want) - len(got))
                        if not d:
                            raise EOFError("the server closed")
                        got += d
                    if got != want:
                        raise ValueError("response %d differs" % n)
                    with lock:
                        checked[0] += 1
            except Exception as e:  # noqa: BLE001 (every failure is reported)
                with lock:
                    bad.append("connection %d, request %d: %r" % (i, r, e))
            finally:
                s.close()

    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if bad:
        print("%d failed, first: %s" % (len(bad), "; ".join(bad[:5])), file=sys.stderr, flush=True)
        sys.exit(1)
    print("ok %d" % checked[0], file=sys.stderr, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(int(sys.argv[2]))
    else:
        client(*(int(a) for a in sys.argv[2:6]))
