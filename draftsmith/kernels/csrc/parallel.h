/* The C kernels' split over the cores (parallel.c): what a kernel calls to hand out shares of its work. */
#ifndef DRAFTSMITH_PARALLEL_H
#define DRAFTSMITH_PARALLEL_H

/* One share of a call: part `part` of `parts`, the context the kernel passed. */
typedef void (*part_fn)(const void *ctx, int part, int parts);

/* fn(ctx, p, n) for every share p < n, on the calling thread and the helpers (parallel.c says how n is chosen). */
void native_parallel(part_fn fn, const void *ctx, int parts);

/* Shares worth handing out for `work` multiply-adds over `units` indivisible pieces. */
int native_shares(long work, long units);

int native_threads(void);

#endif
