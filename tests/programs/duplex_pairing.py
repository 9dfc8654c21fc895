"""A reader thread and a writer thread on each new connection, from its
first byte: the pair completes at some call of one thread while the
other's call is on the TCP socket or about to be. Every byte must come
back in order, as on TCP.

server PORT: a thread per connection echoes what it reads.
client PORT CONNECTIONS SIZE: one connection after another; on each, a
    writer sends SIZE random bytes in 512-byte pieces while a reader
    takes the echo. Prints "ok N" with N connections checked, or what
    went wrong.
"""

import os
import socket
import sys
import threading


def server(port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(128)

    def echo(c):
        with c:
            while True:
                b = c.recv(65536)
                if not b:
                    return
                c.sendall(b)

    while True:
        c, _ = ls.accept()
        threading.Thread(target=echo, args=(c,), daemon=True).start()


def client(port, conns, size):
    for i in range(conns):
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(20)
        data = os.urandom(size)
        got = bytearray()
        failed = []

        def reader():
            try:
                while len(got) < size:
                    b = s.recv(65536)
                    if not b:
                        failed.append("eof after %d bytes" % len(got))
                        return
                    got.extend(b)
            except OSError as e:
                failed.append("recv: %s" % e)

        t = threading.Thread(target=reader)
        t.start()
        try:
            for k in range(0, size, 512):
                s.sendall(data[k:k + 512])
        except OSError as e:
            failed.append("send: %s" % e)
        t.join(30)
        if t.is_alive():
            failed.append("reader hung at %d of %d bytes" % (len(got), size))
        elif not failed and bytes(got) != data:
            failed.append("echo differs")
        if failed:
            print("connection %d: %s" % (i, "; ".join(failed)), file=sys.stderr, flush=True)
            sys.exit(1)
        s.close()
    print("ok %d" % conns, file=sys.stderr, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    else:
        client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
