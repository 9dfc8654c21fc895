/* rsocket-std.so: lets rsockets' preload (librspreload.so, rdma-core 44)
 * take the sockets of programs built on Rust's std, for the comparison in
 * tests/softroce/bench-verbs.sh. Preload it before librspreload.so.
 *
 * rdma-core 44's preload takes a stream socket only when socket()'s type is
 * exactly SOCK_STREAM, and a connection only from accept(): std asks for
 * SOCK_STREAM | SOCK_CLOEXEC and accepts with accept4(). So: socket() with
 * the flags taken off the type (O_NONBLOCK set afterwards if it was asked
 * for; close-on-exec is moot for an rsocket, which exec cannot carry), and
 * accept4() as accept() plus the flags. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/socket.h>

static void set_nonblocking(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

int socket(int domain, int type, int protocol)
{
	static int (*real_socket)(int, int, int);
	int flags = type & (SOCK_CLOEXEC | SOCK_NONBLOCK);
	int fd;

	if (!real_socket)
		real_socket = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
	fd = real_socket(domain, type & ~flags, protocol);
	if (fd >= 0 && (flags & SOCK_NONBLOCK))
		set_nonblocking(fd);
	return fd;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags)
{
	static int (*real_accept)(int, struct sockaddr *, socklen_t *);
	int conn;

	if (!real_accept)
		real_accept = (int (*)(int, struct sockaddr *, socklen_t *))dlsym(RTLD_NEXT, "accept");
	conn = real_accept(fd, addr, len);
	if (conn >= 0 && (flags & SOCK_NONBLOCK))
		set_nonblocking(conn);
	return conn;
}
