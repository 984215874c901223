/* The C kernels' work split over the cores: helper threads run shares of a call (native_parallel), and small_gemm /
 * small_gemm_f16 hand each thread a contiguous share of the output panels (paged attention hands out its (sequence,
 * kv head) units the same way, paged_attention.c).
 *
 * Why: a decode step of a small model is a chain of small GEMMs, too short for torch's intra-op threads (a hand-off
 * per op cost more than it saved: the engine runs such steps on one thread) yet bound by what one core can do: at
 * one row by the bandwidth one core draws from memory, at 16 rows and more by its FMA units. On a 2-core AVX2 EPYC
 * the embedded target's 20 layers of projections took 3.56 ms at 1 row on one core against 2.27 on two, 7.48
 * against 4.02 at 17 rows, 12.7 against 6.7 at 32 (best of 30, a C loop over the packed weights).
 *
 * Exactness: a GEMM share is a range of whole panels, and each output is still the one FMA chain over k from zero,
 * then + bias (small_gemm.c); an attention unit is computed whole by one thread in the one-thread order. So the
 * results are bit for bit the one-thread results, whatever the thread count.
 *
 * The helpers start on the first call that splits; after a call each spins for SPIN_NS (a step's calls come every
 * few microseconds) and then sleeps on a condition variable until the next. A call made while another thread holds
 * the helpers, or too small for a hand-off to pay, runs on the calling thread. A forked child starts its own helpers
 * (pthread_atfork). native_set_threads(1), the default, never splits.
 *
 * Shares are claimed, not assigned: the caller and the helpers take the next unclaimed share from one atomic ticket,
 * so a share whose helper is late (descheduled on a busy machine, or still waking up) is run by the caller once its
 * own is done, instead of the caller spinning until the scheduler brings that helper back. With a CPU-bound process
 * beside it on the 2-core VM, a 1-row attention call took 57 us against 11.5 quiet when each share was a helper's.
 * Spinning threads also yield the core now and then, so a descheduled thread of ours can get it back.
 */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "parallel.h"

#define PANEL 16
#define MAX_THREADS 16
#define MIN_MACS_PER_THREAD (1L << 14)   /* below it, a share is shorter than the hand-off */
/* How long a helper spins for the next call before it sleeps: a step's GEMMs come every few microseconds, and
 * between a round's forwards (a draft's steps, the verify) lie 0.1-0.5 ms of Python; a sleeping helper's wake-up
 * costs tens of microseconds, more than a small share's work. With 0.1 ms (4096 pauses of 26 ns on a Zen 3 EPYC)
 * the standalone draft's rounds gained nothing from a second core. */
#define SPIN_NS 500000L
/* Pauses between sched_yield calls of a spinning thread (~25 us on Zen 3): a yield with nothing else runnable on the
 * core returns at once, so a quiet machine pays a syscall per 25 us of spinning. */
#define YIELD_EVERY 1024

void small_gemm_serial(const float *x, long m, long k, long ldx, const float *packed, long n, const float *bias,
                       float *y, long ldy);
void small_gemm_serial_f16(const float *x, long m, long k, long ldx, const uint16_t *packed, long n,
                           const float *bias, float *y, long ldy);

static struct {                      /* the call being split: written before `ticket`, read after a claim */
    part_fn fn;
    const void *ctx;
} job;
/* The posted call's shares: generation << 16 | parts << 8 | the next unclaimed share. The generation makes every
 * call's tickets distinct, so a claim against a stale value fails. */
static atomic_ulong ticket;
static atomic_int done_parts;        /* shares of the posted call finished */
static atomic_long generation;       /* the count of split calls posted (what sleeping helpers wait on) */
static atomic_int sleepers;          /* helpers waiting on `wake` */
static atomic_int busy;              /* a caller holds the helpers */
static atomic_int num_threads = 1;   /* asked for (native_set_threads; read by any caller) */
static int num_helpers;              /* started in this process */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* The next generation after `seen`, spinning up to SPIN_NS (the clock read every 64 pauses); `seen` if none came. */
static long spin_for_next(long seen) {
    long posted, deadline = now_ns() + SPIN_NS;
    for (unsigned round = 1; (posted = atomic_load(&generation)) == seen; round++) {
        _mm_pause();
        if (round % 64 == 0 && now_ns() > deadline) break;
        if (round % YIELD_EVERY == 0) sched_yield();
    }
    return posted;
}

/* Claim and run the posted call's unclaimed shares, one at a time. A successful claim means the call is not done
 * (its share is not), so `job` still holds it while the share runs. */
static void run_shares(void) {
    unsigned long t = atomic_load(&ticket);
    for (;;) {
        int parts = (int)((t >> 8) & 0xff), next = (int)(t & 0xff);
        if (next >= parts) return;
        if (!atomic_compare_exchange_weak(&ticket, &t, t + 1)) continue;   /* t now holds the current ticket */
        job.fn(job.ctx, next, parts);
        atomic_fetch_add(&done_parts, 1);
        t = atomic_load(&ticket);
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    long seen = atomic_load(&generation);
    for (;;) {
        long posted = spin_for_next(seen);
        if (posted == seen) {
            /* the caller reads `sleepers` after it moves `generation` (both sequentially consistent): either it sees
             * this helper counted and signals under the lock, or this helper sees the new generation below */
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleepers, 1);
            while ((posted = atomic_load(&generation)) == seen) pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&lock);
        }
        seen = posted;
        run_shares();
    }
    return 0;
}

static void after_fork_in_child(void) {   /* the helpers did not come along */
    num_helpers = 0;
    atomic_store(&busy, 0);
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&lock, 0);
    pthread_cond_init(&wake, 0);
}

static void register_atfork(void) { pthread_atfork(0, 0, after_fork_in_child); }

/* Start helpers up to num_threads - 1 (fewer if the system refuses); the caller holds the helpers. */
static void start_helpers(void) {
    pthread_once(&atfork_once, register_atfork);
    while (num_helpers < native_threads() - 1) {
        pthread_t thread;
        if (pthread_create(&thread, 0, helper_main, 0) != 0) break;
        pthread_detach(thread);
        num_helpers++;
    }
}

void native_set_threads(int threads) {
    atomic_store_explicit(&num_threads, threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads),
                          memory_order_relaxed);
}

int native_threads(void) { return atomic_load_explicit(&num_threads, memory_order_relaxed); }

/* Shares worth handing out for `work` multiply-adds over `units` indivisible pieces: 1 unless threads were asked
 * for and each share has work enough. */
int native_shares(long work, long units) {
    long threads = native_threads(), parts = threads < units ? threads : units;
    while (parts > 1 && work / parts < MIN_MACS_PER_THREAD) parts--;
    return parts < 1 ? 1 : (int)parts;
}

/* fn(ctx, p, n) for every share p < n, each claimed by the calling thread or a helper; n = parts, or fewer
 * helpers' worth. Where the helpers are held by another caller (or none could start): fn(ctx, 0, 1), the whole call
 * as one share on the calling thread. */
void native_parallel(part_fn fn, const void *ctx, int parts) {
    if (parts > 1 && atomic_exchange(&busy, 1) == 0) {
        start_helpers();
        if (parts > num_helpers + 1) parts = num_helpers + 1;
        if (parts > 1) {
            job.fn = fn, job.ctx = ctx;
            atomic_store(&done_parts, 0);
            /* the ticket before the generation: a helper that sees the new generation finds this call's shares
             * (only the caller holding `busy` moves the generation) */
            long posted = atomic_load(&generation) + 1;
            atomic_store(&ticket, ((unsigned long)posted << 16) | ((unsigned long)parts << 8));
            atomic_store(&generation, posted);
            if (atomic_load(&sleepers)) {
                pthread_mutex_lock(&lock);
                pthread_cond_broadcast(&wake);
                pthread_mutex_unlock(&lock);
            }
            run_shares();
            /* the shares still running are a helper's; `job` is rewritten by the next call */
            for (unsigned round = 1; atomic_load(&done_parts) != parts; round++) {
                _mm_pause();
                if (round % YIELD_EVERY == 0) sched_yield();
            }
            atomic_store(&busy, 0);
            return;
        }
        atomic_store(&busy, 0);
    }
    fn(ctx, 0, 1);
}

typedef struct {
    const float *x;
    long m, k, ldx;
    const void *packed;
    int f16;
    long n;
    const float *bias;
    float *y;
    long ldy;
} gemm_call;

/* Share `part` of `parts` of a GEMM: whole panels, as even as possible. */
static void gemm_part(const void *arg, int part, int parts) {
    const gemm_call *g = arg;
    long panels = (g->n + PANEL - 1) / PANEL;
    long first = panels * part / parts, last = panels * (part + 1) / parts;
    if (last <= first) return;
    long c0 = first * PANEL, c1 = last * PANEL < g->n ? last * PANEL : g->n;
    const float *bias = g->bias ? g->bias + c0 : 0;
    if (g->f16)
        small_gemm_serial_f16(g->x, g->m, g->k, g->ldx, (const uint16_t *)g->packed + first * g->k * PANEL, c1 - c0,
                              bias, g->y + c0, g->ldy);
    else
        small_gemm_serial(g->x, g->m, g->k, g->ldx, (const float *)g->packed + first * g->k * PANEL, c1 - c0, bias,
                          g->y + c0, g->ldy);
}

static void split_gemm(const gemm_call *g) {
    if (g->m <= 0 || g->n <= 0) return;
    native_parallel(gemm_part, g, native_shares(g->m * g->k * g->n, (g->n + PANEL - 1) / PANEL));
}

void small_gemm(const float *x, long m, long k, long ldx, const float *packed, long n, const float *bias, float *y,
                long ldy) {
    split_gemm(&(gemm_call){x, m, k, ldx, packed, 0, n, bias, y, ldy});
}

void small_gemm_f16(const float *x, long m, long k, long ldx, const uint16_t *packed, long n, const float *bias,
                    float *y, long ldy) {
    split_gemm(&(gemm_call){x, m, k, ldx, packed, 1, n, bias, y, ldy});
}
