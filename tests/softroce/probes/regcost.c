// What one pinned registration costs on this device: ibv_reg_mr +
// ibv_dereg_mr of a touched, page-aligned buffer, per size (the cost each
// AZ-SDP advertisement and each zero-copy receive pays once over verbs,
// docs/benchmarks.md "Between hosts"). Also memcpy of the same size, the
// cost a copying stack (rsockets) pays instead.
//   regcost [DEVICE] [ROUNDS]
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv)
{
	const char *want = argc > 1 ? argv[1] : NULL;
	int rounds = argc > 2 ? atoi(argv[2]) : 50;
	int n;
	struct ibv_device **devs = ibv_get_device_list(&n);
	struct ibv_device *dev = NULL;
	for (int i = 0; devs && i < n; i++)
		if (!want || !strcmp(ibv_get_device_name(devs[i]), want))
			dev = devs[i];
	if (!dev) {
		fprintf(stderr, "regcost: no device\n");
		return 1;
	}
	struct ibv_context *ctx = ibv_open_device(dev);
	struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	if (!pd) {
		fprintf(stderr, "regcost: cannot open %s\n", ibv_get_device_name(dev));
		return 1;
	}
	size_t sizes[] = {64 << 10, 1 << 20};
	for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
		size_t len = sizes[s];
		char *a = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		char *b = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (a == MAP_FAILED || b == MAP_FAILED)
			return 1;
		memset(a, 1, len);
		memset(b, 2, len);
		double reg = 0, dereg = 0, copy = 0;
		for (int r = 0; r < rounds; r++) {
			double t0 = now_us();
			struct ibv_mr *mr = ibv_reg_mr(pd, a, len,
						       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
			double t1 = now_us();
			if (!mr) {
				perror("regcost: ibv_reg_mr");
				return 1;
			}
			ibv_dereg_mr(mr);
			double t2 = now_us();
			memcpy(b, a, len);
			double t3 = now_us();
			reg += t1 - t0;
			dereg += t2 - t1;
			copy += t3 - t2;
		}
		printf("registration %zu KiB: reg %.0f us, dereg %.0f us, memcpy %.0f us (mean of %d)\n",
		       len >> 10, reg / rounds, dereg / rounds, copy / rounds, rounds);
		munmap(a, len);
		munmap(b, len);
	}
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(devs);
	return 0;
}
