/* MPI_Allreduce timing sweep (float sum), printed like rdmacomm-perf: size, count, time (us,
 * slowest rank's mean), algbw and busbw (GB/s, nccl-tests definitions: busbw = algbw * 2(n-1)/n).
 * With a sixth argument, alltoall (size: the whole buffer, busbw = algbw * (n-1)/n) or reduce
 * (to rank 0, busbw = algbw) instead, or iallreduce (MPI_Iallreduce then MPI_Wait at once: the
 * cost of the non-blocking path beside allreduce).
 * Usage: mpi_allreduce MIN MAX FACTOR ITERS WARMUP [allreduce|iallreduce|alltoall|reduce] */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *coll = "allreduce";

static void run(float *a, float *b, long sz, int n) {
    int count = (int)(sz / 4);
    if (!strcmp(coll, "alltoall")) MPI_Alltoall(a, count / n, MPI_FLOAT, b, count / n, MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(coll, "reduce")) MPI_Reduce(a, b, count, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
    else if (!strcmp(coll, "iallreduce")) {
        MPI_Request req;
        MPI_Iallreduce(a, b, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
        MPI_Wait(&req, MPI_STATUS_IGNORE);
    } else MPI_Allreduce(a, b, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc < 6) {
        if (rank == 0) fprintf(stderr, "usage: mpi_allreduce MIN MAX FACTOR ITERS WARMUP\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    long min = atol(argv[1]), max = atol(argv[2]), factor = atol(argv[3]);
    int iters = atoi(argv[4]), warmup = atoi(argv[5]);
    if (argc > 6) coll = argv[6];
    int alltoall = !strcmp(coll, "alltoall");
    float *a = malloc(max), *b = malloc(max);
    for (long i = 0; i < max / 4; i++) a[i] = (float)((rank + i) % 8);
    if (rank == 0) printf("# mpi_allreduce: %d ranks, float sum\n#       size        count       time(us)   algbw   busbw\n", n);
    long unit = alltoall ? 4L * n : 4;
    for (long sz = min < unit ? unit : min / unit * unit; sz <= max; sz *= factor) {
        sz = sz / unit * unit;
        int count = (int)(sz / 4);
        for (int i = 0; i < warmup; i++) run(a, b, sz, n);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) run(a, b, sz, n);
        double us = (MPI_Wtime() - t0) * 1e6 / iters, worst;
        MPI_Reduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        /* check one element: sum over ranks of (r + 1) % 8 */
        double want = 0;
        for (int r = 0; r < n; r++) want += (r + 1) % 8;
        /* alltoall: element 1 of the block from rank 0 is rank 0's element rank * block + 1 */
        if (alltoall) want = (double)((rank * (count / n) + 1) % 8);
        int checked = alltoall ? count / n > 1 : count > 1 && (rank == 0 || strcmp(coll, "reduce"));
        if (checked && b[1] != (float)want) { fprintf(stderr, "rank %d: wrong result %f != %f\n", rank, b[1], want); MPI_Abort(MPI_COMM_WORLD, 1); }
        if (rank == 0) {
            double algbw = sz / worst / 1e3;
            double f = alltoall ? (double)(n - 1) / n : !strcmp(coll, "reduce") ? 1.0 : 2.0 * (n - 1) / n;
            printf("  %10ld %12d %14.3f %7.4f %7.4f\n", sz, count, worst, algbw, algbw * f);
        }
    }
    free(a); free(b);
    MPI_Finalize();
    return 0;
}
