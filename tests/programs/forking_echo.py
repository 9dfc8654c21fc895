"""python's ForkingTCPServer echoing each connection in a forked child, and
a client of N connections at once that each send SIZE random bytes, shut
down, and check the echo by sha256. Used by process_models.rs.
   forking_echo.py server PORT
   forking_echo.py client PORT N SIZE"""
import hashlib
import os
import socket
import socketserver
import sys
import threading


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while True:
            b = self.request.recv(1 << 16)
            if not b:
                break
            self.request.sendall(b)


def server(port):
    socketserver.ForkingTCPServer.allow_reuse_address = True
    # socketserver's listen backlog is 5: with 20 clients at once on a
    # loaded host, kernel TCP itself reset one (CI, 2026-11-29).
    socketserver.ForkingTCPServer.request_queue_size = 64
    with socketserver.ForkingTCPServer(("127.0.0.1", port), Echo) as s:
        s.serve_forever()


def client(port, n, size):
    bad = []

    def one(i):
        try:
            data = os.urandom(size)
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            w = threading.Thread(target=lambda: (s.sendall(data), s.shutdown(socket.SHUT_WR)))
            w.start()
            got = bytearray()
            while True:
                b = s.recv(1 << 16)
                if not b:
                    break
                got += b
            w.join()
            s.close()
            if hashlib.sha256(got).digest() != hashlib.sha256(data).digest():
                bad.append((i, len(got)))
        except Exception as e:
            bad.append((i, repr(e)))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(f"client: {n - len(bad)} of {n} echoes equal; wrong: {bad}", file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    else:
        client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
