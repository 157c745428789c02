/* MPI_Allreduce timing sweep (float sum), printed like rdmacomm-perf: size, count, time (us,
 * slowest rank's mean), algbw and busbw (GB/s, nccl-tests definitions: busbw = algbw * 2(n-1)/n).
 * Usage: mpi_allreduce MIN MAX FACTOR ITERS WARMUP */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

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
    float *a = malloc(max), *b = malloc(max);
    for (long i = 0; i < max / 4; i++) a[i] = (float)((rank + i) % 8);
    if (rank == 0) printf("# mpi_allreduce: %d ranks, float sum\n#       size        count       time(us)   algbw   busbw\n", n);
    for (long sz = min < 4 ? 4 : min; sz <= max; sz *= factor) {
        int count = (int)(sz / 4);
        for (int i = 0; i < warmup; i++) MPI_Allreduce(a, b, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) MPI_Allreduce(a, b, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double us = (MPI_Wtime() - t0) * 1e6 / iters, worst;
        MPI_Reduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        /* check one element: sum over ranks of (r + 1) % 8 */
        double want = 0;
        for (int r = 0; r < n; r++) want += (r + 1) % 8;
        if (count > 1 && b[1] != (float)want) { fprintf(stderr, "rank %d: wrong result %f != %f\n", rank, b[1], want); MPI_Abort(MPI_COMM_WORLD, 1); }
        if (rank == 0) {
            double algbw = sz / worst / 1e3;
            printf("  %10ld %12d %14.1f %7.4f %7.4f\n", sz, count, worst, algbw, algbw * 2.0 * (n - 1) / n);
        }
    }
    free(a); free(b);
    MPI_Finalize();
    return 0;
}
