/* tests/cuda_emu/cuda_emu.c — the emulated device's runtime (cuda_emu.h):
 * a block's threads as fibers, the barriers where they meet, shuffles and
 * the m16n8k16 MMA.
 *
 * A fiber is a worker on a stack of its own, made once (ucontext) and kept:
 * it runs one thread of a block after another, and every switch between it
 * and the scheduler is a setjmp/longjmp pair, the compiler's builtins (no
 * system call, unlike swapcontext, which sets the signal mask each time:
 * most of the time of an emulated elementwise kernel went there). */
#define _GNU_SOURCE
#include "cuda_emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#define EMU_MAX_THREADS 1024
#define EMU_STACK (128u << 10) /* per fiber: the kernels' registers and ASan's frames */

enum { RUNNABLE, AT_BLOCK, AT_WARP, DONE };

/* On x86-64, the compiler's own setjmp and longjmp: they keep the frame,
 * the stack pointer and the resume address, and the registers a callee
 * must preserve are saved and restored by the two functions that switch
 * (EMU_CLOBBER makes their prologue save them and their epilogue restore
 * them, whichever way they are left). glibc's _longjmp also unwinds the
 * thread's cancellation cleanups each time (_longjmp_unwind): with its
 * _setjmp, a sixth of an emulated training step. Elsewhere, glibc's. */
/* The registers a caller may keep across a call into them are the ABI's
 * too (EMU_SWITCH: without noipa, GCC sees what they clobber themselves and
 * keeps values in r8 or xmm registers across the call, which another fiber
 * then overwrites). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
typedef void *emu_jb[5];
#define EMU_SETJMP(b) __builtin_setjmp(b)
#define EMU_CLOBBER() __asm__ volatile("" ::: "rbx", "r12", "r13", "r14", "r15", "memory")
#define EMU_SWITCH __attribute__((noinline, noipa))
#else
#include <setjmp.h>
typedef jmp_buf emu_jb;
#define EMU_SETJMP(b) _setjmp(b)
#define EMU_CLOBBER() ((void)0)
#define EMU_SWITCH __attribute__((noinline))
#endif

static __attribute__((noinline, noreturn)) void emu_longjmp(emu_jb b)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_longjmp(b, 1);
#else
    _longjmp(b, 1);
#endif
}

typedef struct fiber {
    emu_thread_id id; /* first: emu_cur points here */
    emu_jb jb;        /* where it goes on when the scheduler switches to it */
    int started;      /* its stack runs fiber_main (else: first entry by ucontext) */
    void *stack;
    void *fake; /* ASan's fake stack while switched out */
    int state;
} fiber;

/* What the lanes of one warp leave for each other at a warp operation. */
typedef struct warp_slots {
    uint64_t word[32];
    uint32_t a[32][4], b[32][2];
    float c[32][4];
    int arrived, live, gen;
    int mma_gen; /* the generation whose MMA result is in c (computed once a warp) */
} warp_slots;

emu_dim3 emu_block_idx, emu_block_dim, emu_grid_dim;
emu_thread_id *emu_cur;

static fiber fibers[EMU_MAX_THREADS];
static void *dyn_shared; /* the launch's dynamic shared memory */
static size_t dyn_size;
static warp_slots warps[EMU_MAX_THREADS / 32];
static int nthreads, block_live, block_arrived;
static emu_jb sched; /* the scheduler, waiting for the fiber it switched to */
static void (*kernel_fn)(void *);
static void *kernel_arg;
#ifdef EMU_ASAN
static const void *sched_bottom; /* the scheduler's stack, for ASan's switches */
static size_t sched_size;
#endif

static fiber *cur_fiber(void)
{
    return (fiber *)emu_cur;
}

static int lane_of(const fiber *f)
{
    return (int)f->id.tid.x & 31;
}

static warp_slots *warp_of(const fiber *f)
{
    return &warps[f->id.tid.x >> 5];
}

/* From fiber f back to the scheduler; returns when the scheduler switches
 * to f again. */
static EMU_SWITCH void yield_from(fiber *f)
{
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(&f->fake, sched_bottom, sched_size);
#endif
    EMU_CLOBBER();
    if (!EMU_SETJMP(f->jb))
        emu_longjmp(sched);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake, &sched_bottom, &sched_size);
#endif
}

static void yield(void)
{
    yield_from(cur_fiber());
}

/* A fiber's life: the thread it was given (emu_cur), to its end, then the
 * next one. */
static void fiber_main(void)
{
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &sched_bottom, &sched_size);
#endif
    for (;;) {
        fiber *f = cur_fiber();
        kernel_fn(kernel_arg);
        f->state = DONE;
        /* a thread that ends no longer holds up its block's or its warp's barrier */
        block_live--;
        warp_of(f)->live--;
        yield_from(f);
    }
}

/* From the scheduler to fiber f (emu_cur set), until it yields. */
static EMU_SWITCH void switch_to(fiber *f)
{
#ifdef EMU_ASAN
    void *fake = NULL;
    __sanitizer_start_switch_fiber(&fake, f->stack, EMU_STACK);
#endif
    EMU_CLOBBER();
    if (!EMU_SETJMP(sched)) {
        if (f->started) {
            emu_longjmp(f->jb);
        } else { /* the first entry: onto its own stack, in fiber_main */
            ucontext_t from, to;
            getcontext(&to);
            to.uc_stack.ss_sp = f->stack;
            to.uc_stack.ss_size = EMU_STACK;
            to.uc_link = NULL; /* fiber_main never returns */
            makecontext(&to, fiber_main, 0);
            f->started = 1;
            swapcontext(&from, &to);
        }
    }
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, NULL, NULL);
#endif
}

/* Releases the threads waiting at a barrier that every live thread of its
 * scope has reached. */
static void release_block(void)
{
    block_arrived = 0;
    for (int i = 0; i < nthreads; i++)
        if (fibers[i].state == AT_BLOCK)
            fibers[i].state = RUNNABLE;
}

static void release_warp(int w)
{
    warps[w].arrived = 0;
    warps[w].gen++;
    for (int i = w * 32; i < w * 32 + 32 && i < nthreads; i++)
        if (fibers[i].state == AT_WARP)
            fibers[i].state = RUNNABLE;
}

void emu_syncthreads(void)
{
    fiber *f = cur_fiber();
    if (++block_arrived == block_live) {
        release_block();
        return;
    }
    f->state = AT_BLOCK;
    yield();
}

/* Every live lane of the warp meets here. */
static void warp_meet(void)
{
    fiber *f = cur_fiber();
    warp_slots *w = warp_of(f);
    if (++w->arrived == w->live) {
        release_warp((int)(f->id.tid.x >> 5));
        return;
    }
    f->state = AT_WARP;
    yield();
}

static void warp_whole(const char *op)
{
    fiber *f = cur_fiber();
    if (warp_of(f)->live != 32) {
        fprintf(stderr,
                "cuda_emu: %s in block (%u,%u) thread %u with %d of the warp's 32 lanes live "
                "(the others have returned)\n",
                op, emu_block_idx.x, emu_block_idx.y, f->id.tid.x, warp_of(f)->live);
        abort();
    }
}

uint64_t emu_shfl_xor(unsigned mask, uint64_t v, int lane_mask)
{
    fiber *f = cur_fiber();
    if (mask != 0xffffffffu) {
        fprintf(stderr, "cuda_emu: a shuffle with mask %#x (only full warps are emulated)\n",
                mask);
        abort();
    }
    warp_whole("a shuffle");
    warp_slots *w = warp_of(f);
    int lane = lane_of(f);
    w->word[lane] = v;
    warp_meet(); /* every lane's value is in */
    uint64_t r = w->word[(lane ^ lane_mask) & 31];
    warp_meet(); /* every lane has read: the slots may be reused */
    return r;
}

static float bf16_lo(uint32_t r)
{
    return __uint_as_float(r << 16);
}

static float bf16_hi(uint32_t r)
{
    return __uint_as_float(r & 0xffff0000u);
}

static float half_of(uint32_t r, int k)
{
    return k & 1 ? bf16_hi(r) : bf16_lo(r);
}

/* A[row][k] (16 x 16) from the lanes' a registers; B[k][n] (16 x 8) from
 * their b registers: the PTX ISA's m16n8k16 .bf16 layouts. */
static float a_at(const warp_slots *w, int row, int k)
{
    int lane = (row & 7) * 4 + (k & 7) / 2, reg = (row >= 8) + 2 * (k >= 8);
    return half_of(w->a[lane][reg], k);
}

static float b_at(const warp_slots *w, int k, int n)
{
    int lane = n * 4 + (k & 7) / 2;
    return half_of(w->b[lane][k >= 8], k);
}

/* D = A B + C over the warp's fragments, into the lanes' c slots: each
 * element k in order, in fp32. */
static void mma_warp(warp_slots *w)
{
    float A[16][16], B[16][8];
    for (int r = 0; r < 16; r++)
        for (int k = 0; k < 16; k++)
            A[r][k] = a_at(w, r, k);
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++)
            B[k][n] = b_at(w, k, n);
    for (int lane = 0; lane < 32; lane++)
        for (int e = 0; e < 4; e++) {
            int row = (lane >> 2) + 8 * (e >= 2), n = 2 * (lane & 3) + (e & 1);
            float acc = w->c[lane][e];
            for (int k = 0; k < 16; k++)
                acc += A[row][k] * B[k][n];
            w->c[lane][e] = acc;
        }
}

void emu_mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    fiber *f = cur_fiber();
    warp_whole("mma.sync");
    warp_slots *w = warp_of(f);
    int lane = lane_of(f);
    memcpy(w->a[lane], a, sizeof w->a[lane]);
    w->b[lane][0] = b0;
    w->b[lane][1] = b1;
    memcpy(w->c[lane], c, sizeof w->c[lane]);
    warp_meet(); /* every lane's fragments are in */
    if (w->mma_gen != w->gen) { /* the first lane on computes the warp's */
        mma_warp(w);
        w->mma_gen = w->gen;
    }
    memcpy(c, w->c[lane], sizeof w->c[lane]);
    warp_meet(); /* every lane has its result: the slots may be reused */
}

void emu_ldmatrix_x4(uint32_t r[4], const void *row, int trans)
{
    fiber *f = cur_fiber();
    warp_whole("ldmatrix");
    if ((uintptr_t)row & 15u) {
        fprintf(stderr, "cuda_emu: ldmatrix row address %p is not 16-byte aligned\n", row);
        abort();
    }
    warp_slots *w = warp_of(f);
    int lane = lane_of(f), g = lane >> 2, t = lane & 3;
    w->word[lane] = (uint64_t)(uintptr_t)row;
    warp_meet(); /* every lane's row address is in */
    for (int i = 0; i < 4; i++) {
        uint16_t lo, hi;
        if (!trans) {
            const uint16_t *p = (const uint16_t *)(uintptr_t)w->word[8 * i + g];
            lo = p[2 * t];
            hi = p[2 * t + 1];
        } else {
            lo = ((const uint16_t *)(uintptr_t)w->word[8 * i + 2 * t])[g];
            hi = ((const uint16_t *)(uintptr_t)w->word[8 * i + 2 * t + 1])[g];
        }
        r[i] = (uint32_t)lo | (uint32_t)hi << 16;
    }
    warp_meet(); /* every lane has read: the slots may be reused */
}

/* The shared window of the emulation: the launch's dynamic shared memory,
 * at address 0 (a descriptor holds an 18-bit address, not a pointer). */
uint32_t emu_smem_addr(const void *p)
{
    uintptr_t u = (uintptr_t)p, b = (uintptr_t)dyn_shared;
    if (!dyn_shared || u < b || u - b >= dyn_size || u - b >= (1u << 18)) {
        fprintf(stderr,
                "cuda_emu: %p is not in the launch's dynamic shared memory (%zu bytes), the "
                "only shared memory the emulation gives an address\n",
                p, dyn_size);
        abort();
    }
    return (uint32_t)(u - b);
}

/* B(n, k) of a wgmma from its descriptor (no swizzling): K-major (trans 0)
 * or MN-major (trans 1), the ISA's canonical layouts (cuda_wgmma.cuh). */
static float wg_b_at(uint64_t desc, int trans, int n, int k)
{
    size_t start = (size_t)(desc & 0x3FFFu) << 4, lbo = (size_t)((desc >> 16) & 0x3FFFu) << 4;
    size_t sbo = (size_t)((desc >> 32) & 0x3FFFu) << 4;
    size_t off = trans ? start + (size_t)(n % 8) * 2 + (size_t)(n / 8) * sbo +
                             (size_t)(k % 8) * 16 + (size_t)(k / 8) * lbo
                       : start + (size_t)(n % 8) * 16 + (size_t)(n / 8) * sbo +
                             (size_t)(k % 8) * 2 + (size_t)(k / 8) * lbo;
    if (off + 2 > dyn_size) {
        fprintf(stderr, "cuda_emu: wgmma reads B(%d, %d) at shared byte %zu, past the %zu bytes "
                        "of dynamic shared memory\n", n, k, off, dyn_size);
        abort();
    }
    uint16_t v;
    memcpy(&v, (const char *)dyn_shared + off, sizeof v);
    return __uint_as_float((uint32_t)v << 16);
}

/* The products a warp has issued and not yet completed (wgmma is
 * asynchronous): each lane's A fragment (copied at issue, as the hardware
 * reads it then at the latest) and accumulator array, the descriptor, and
 * the commit group. They run when a wait completes their group, in issue
 * order, reading B from shared memory then and writing the accumulators
 * then: a kernel that reads an accumulator before its wait, or writes the
 * shared memory a product reads before it, gets what the hardware may give
 * it at worst, and its results are wrong here. */
#define EMU_WG_PENDING 64
typedef struct wg_op {
    uint32_t a[32][4];
    float *d[32];
    uint64_t desc;
    int n, trans, scale_d, group;
} wg_op;

typedef struct wg_queue {
    wg_op ops[EMU_WG_PENDING];
    int nops, committed; /* ops issued and not completed; groups committed */
} wg_queue;

static wg_queue wg_queues[EMU_MAX_THREADS / 32];

static void wg_run(const wg_op *op)
{
    float A[16][16];
    for (int r = 0; r < 16; r++)
        for (int k = 0; k < 16; k++) {
            int ln = (r & 7) * 4 + (k & 7) / 2, reg = (r >= 8) + 2 * (k >= 8);
            A[r][k] = half_of(op->a[ln][reg], k);
        }
    for (int col = 0; col < op->n; col++) {
        float B[16];
        for (int k = 0; k < 16; k++)
            B[k] = wg_b_at(op->desc, op->trans, col, k);
        for (int row = 0; row < 16; row++) {
            int ln = (row & 7) * 4 + (col & 7) / 2, e = (col / 8) * 4 + (row >= 8) * 2 + (col & 1);
            float acc = op->scale_d ? op->d[ln][e] : 0.0f;
            for (int k = 0; k < 16; k++)
                acc += A[row][k] * B[k];
            op->d[ln][e] = acc;
        }
    }
}

void emu_wgmma_bf16(float *d, int n, const uint32_t a[4], uint64_t desc, int trans_b, int scale_d)
{
    fiber *f = cur_fiber();
    warp_whole("wgmma");
    if ((emu_block_dim.x & 127u) != 0 || n < 8 || n > 128 || n % 8) {
        fprintf(stderr, "cuda_emu: wgmma m64n%dk16 in a block of %u threads (warpgroups of 128)\n",
                n, emu_block_dim.x);
        abort();
    }
    if (desc >> 49) {
        fprintf(stderr, "cuda_emu: a wgmma descriptor with swizzling or a base offset (%#llx): "
                        "not emulated\n", (unsigned long long)desc);
        abort();
    }
    warp_slots *w = warp_of(f);
    wg_queue *q = &wg_queues[f->id.tid.x >> 5];
    if (q->nops == EMU_WG_PENDING) {
        fprintf(stderr, "cuda_emu: more than %d wgmma in flight in a warp\n", EMU_WG_PENDING);
        abort();
    }
    int lane = lane_of(f);
    memcpy(q->ops[q->nops].a[lane], a, sizeof q->ops[0].a[0]);
    q->ops[q->nops].d[lane] = d;
    warp_meet(); /* every lane's fragment and accumulators are named */
    if (w->mma_gen != w->gen) { /* once a warp: the product joins the open group */
        wg_op *op = &q->ops[q->nops++];
        op->desc = desc, op->n = n, op->trans = trans_b, op->scale_d = scale_d;
        op->group = q->committed;
        w->mma_gen = w->gen;
    }
    warp_meet(); /* the slot is taken before any lane issues the next */
}

void emu_wgmma_commit(void)
{
    fiber *f = cur_fiber();
    warp_whole("wgmma.commit_group");
    warp_slots *w = warp_of(f);
    warp_meet();
    if (w->mma_gen != w->gen) {
        wg_queues[f->id.tid.x >> 5].committed++;
        w->mma_gen = w->gen;
    }
    warp_meet();
}

void emu_wgmma_wait(int pending)
{
    fiber *f = cur_fiber();
    warp_whole("wgmma.wait_group");
    warp_slots *w = warp_of(f);
    wg_queue *q = &wg_queues[f->id.tid.x >> 5];
    warp_meet(); /* every lane is here: the products may write its accumulators */
    if (w->mma_gen != w->gen) {
        int done = 0;
        while (done < q->nops && q->ops[done].group < q->committed - pending)
            wg_run(&q->ops[done++]);
        memmove(q->ops, q->ops + done, sizeof q->ops[0] * (size_t)(q->nops - done));
        q->nops -= done;
        w->mma_gen = w->gen;
    }
    warp_meet();
}

/* Products left in flight when a block ends: the hardware would write
 * their accumulators after the threads have gone. */
static int wg_leftovers(void)
{
    int left = 0;
    for (int i = 0; i < EMU_MAX_THREADS / 32; i++) {
        left += wg_queues[i].nops;
        wg_queues[i].nops = wg_queues[i].committed = 0;
    }
    return left;
}

/* The copies a thread has issued by cp.async and not yet completed: the
 * 16 bytes (read from global memory at issue: nothing a kernel here reads
 * changes while it runs), where they go, and the commit group. On the
 * device the bytes land at some time between the issue and the wait that
 * completes their group; here the destination is poisoned at the issue
 * (0xff bytes: NaN in bf16 and fp32) and written at that wait
 * (emu_cp_async_wait). So a kernel that reads a tile before its wait, or
 * waits for one group too few, reads NaN, and so does a warp still
 * reading a buffer that another thread's copy already overwrites (a
 * missing barrier before the copy). */
#define EMU_CP_PENDING 64
typedef struct cp_op {
    void *dst;
    unsigned char bytes[16];
    int size, group;
} cp_op;

typedef struct cp_queue {
    cp_op ops[EMU_CP_PENDING];
    int nops, committed;
} cp_queue;

static cp_queue cp_queues[EMU_MAX_THREADS];

/* One cp.async of size bytes (16 or 4), each address a multiple of it. */
void emu_cp_async(void *dst, const void *src, int size, int valid)
{
    fiber *f = cur_fiber();
    cp_queue *q = &cp_queues[f - fibers];
    uintptr_t m = (uintptr_t)size - 1u;
    if (((uintptr_t)dst & m) || (valid && ((uintptr_t)src & m))) {
        fprintf(stderr, "cuda_emu: cp.async of %d bytes at a misaligned address (%p from %p)\n",
                size, dst, src);
        abort();
    }
    if (q->nops == EMU_CP_PENDING) {
        fprintf(stderr, "cuda_emu: more than %d cp.async in flight in a thread\n", EMU_CP_PENDING);
        abort();
    }
    cp_op *op = &q->ops[q->nops++];
    op->dst = dst;
    op->size = size;
    op->group = q->committed;
    if (valid)
        memcpy(op->bytes, src, (size_t)size);
    else
        memset(op->bytes, 0, (size_t)size);
    memset(dst, 0xff, (size_t)size);
}

void emu_cp_async_commit(void)
{
    cp_queues[cur_fiber() - fibers].committed++;
}

void emu_cp_async_wait(int pending)
{
    cp_queue *q = &cp_queues[cur_fiber() - fibers];
    int done = 0, kept = 0;
    /* the committed groups but the newest `pending` complete; copies not
     * yet committed stay in flight (cp.async.wait_group waits for groups) */
    for (int i = 0; i < q->nops; i++) {
        if (q->ops[i].group < q->committed - pending) {
            memcpy(q->ops[i].dst, q->ops[i].bytes, (size_t)q->ops[i].size);
            done++;
        } else {
            q->ops[kept++] = q->ops[i];
        }
    }
    (void)done;
    q->nops = kept;
}

/* Copies left in flight when a block ends: the hardware would write shared
 * memory after the threads have gone, or a thread never waited for a tile
 * it staged. */
static int cp_leftovers(void)
{
    int left = 0;
    for (int i = 0; i < EMU_MAX_THREADS; i++) {
        left += cp_queues[i].nops;
        cp_queues[i].nops = cp_queues[i].committed = 0;
    }
    return left;
}

void emu_trap(void)
{
    fiber *f = cur_fiber();
    fprintf(stderr, "cuda_emu: __trap() in block (%u,%u) thread %u\n", emu_block_idx.x,
            emu_block_idx.y, f ? f->id.tid.x : 0u);
    abort();
}

/* Runs every fiber of the block until each has ended; -1 on a deadlock. */
/* Warps run one at a time, each as far as it can go (to a barrier of the
 * block, or its end) before the next: the most one warp can get ahead of
 * another on the device, so that a warp that writes shared memory another
 * still reads (a missing barrier) spoils that read here. In ascending
 * warp order in blocks of even x + y, descending in the others. */
static int run_block(void)
{
    int nw = (nthreads + 31) / 32, down = (emu_block_idx.x + emu_block_idx.y) & 1;
    for (;;) {
        int ran = 0, left = 0;
        for (int k = 0; k < nw; k++) {
            int wi = down ? nw - 1 - k : k, progress;
            do {
                progress = 0;
                for (int i = wi * 32; i < nthreads && i < wi * 32 + 32; i++) {
                    fiber *f = &fibers[i];
                    if (f->state != RUNNABLE)
                        continue;
                    ran = progress = 1;
                    emu_cur = &f->id;
                    switch_to(f);
                    emu_cur = NULL;
                    /* the last thread of a barrier's scope may have ended
                     * meanwhile: f, of its block and of its warp (no other
                     * thread ran) */
                    if (block_arrived && block_arrived == block_live)
                        release_block();
                    warp_slots *w = warp_of(f);
                    if (w->arrived && w->arrived == w->live)
                        release_warp(i >> 5);
                }
            } while (progress);
        }
        for (int i = 0; i < nthreads; i++)
            left += fibers[i].state != DONE;
        if (!left) {
            int inflight = wg_leftovers(), copies = cp_leftovers();
            if (inflight) {
                fprintf(stderr, "cuda_emu: block (%u,%u) ended with %d wgmma never waited for\n",
                        emu_block_idx.x, emu_block_idx.y, inflight);
                abort();
            }
            if (copies) {
                fprintf(stderr,
                        "cuda_emu: block (%u,%u) ended with %d cp.async copies never waited for\n",
                        emu_block_idx.x, emu_block_idx.y, copies);
                abort();
            }
            return 0;
        }
        if (!ran) {
            int at_block = 0, at_warp = 0;
            for (int i = 0; i < nthreads; i++)
                at_block += fibers[i].state == AT_BLOCK, at_warp += fibers[i].state == AT_WARP;
            fprintf(stderr,
                    "cuda_emu: deadlock in block (%u,%u): %d thread(s) at __syncthreads, %d at "
                    "a warp operation, %d live\n",
                    emu_block_idx.x, emu_block_idx.y, at_block, at_warp, block_live);
            /* their frames are abandoned: the next launch starts them afresh */
            for (int i = 0; i < nthreads; i++)
                if (fibers[i].state != DONE)
                    fibers[i].started = 0;
            return -1;
        }
    }
}


void *emu_dynamic_shared(void)
{
    return dyn_shared;
}

int emu_launch(emu_dim3 grid, emu_dim3 block, void (*fn)(void *), void *arg)
{
    return emu_launch_smem(grid, block, 0, fn, arg);
}

static int run_grid(emu_dim3 grid);

int emu_launch_smem(emu_dim3 grid, emu_dim3 block, size_t smem, void (*fn)(void *), void *arg)
{
    /* nested launches (a kernel that launches) are not emulated */
    if (emu_cur) {
        fprintf(stderr, "cuda_emu: a launch from inside a kernel\n");
        return -1;
    }
    void *saved = dyn_shared;
    size_t saved_size = dyn_size;
    dyn_shared = NULL;
    dyn_size = (smem + 15) & ~(size_t)15;
    if (smem && !(dyn_shared = aligned_alloc(16, (smem + 15) & ~(size_t)15))) {
        dyn_shared = saved;
        dyn_size = saved_size;
        fprintf(stderr, "cuda_emu: no memory for %zu bytes of dynamic shared memory\n", smem);
        return -1;
    }
    int rc = 0;
    if (block.x == 0 || block.x > EMU_MAX_THREADS || (block.y ? block.y : 1) > 1 ||
        (block.z ? block.z : 1) > 1) {
        fprintf(stderr, "cuda_emu: unsupported block (%u,%u,%u)\n", block.x, block.y, block.z);
        free(dyn_shared);
        dyn_shared = saved;
        dyn_size = saved_size;
        return -1;
    }
    nthreads = (int)block.x;
    for (int i = 0; i < nthreads; i++)
        if (!fibers[i].stack) {
            fibers[i].stack = mmap(NULL, EMU_STACK, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (fibers[i].stack == MAP_FAILED) {
                fibers[i].stack = NULL;
                fprintf(stderr, "cuda_emu: no memory for a fiber's stack\n");
                rc = -1;
            }
        }
    kernel_fn = fn;
    kernel_arg = arg;
    emu_grid_dim = grid;
    emu_grid_dim.y = grid.y ? grid.y : 1;
    emu_grid_dim.z = grid.z ? grid.z : 1;
    emu_block_dim = block;
    emu_block_dim.y = emu_block_dim.z = 1;
    if (!rc)
        rc = run_grid(emu_grid_dim);
    free(dyn_shared);
    dyn_shared = saved;
    dyn_size = saved_size;
    return rc;
}

/* Fiber i takes thread i of the next block, from the kernel's start. */
static void fiber_init(fiber *f, int i)
{
    memset(&f->id, 0, sizeof f->id);
    f->id.tid.x = (unsigned)i;
    f->state = RUNNABLE;
}

static int run_grid(emu_dim3 grid)
{
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                emu_block_idx.x = x, emu_block_idx.y = y, emu_block_idx.z = z;
                block_live = nthreads;
                block_arrived = 0;
                for (int wi = 0; wi < (nthreads + 31) / 32; wi++) {
                    memset(&warps[wi], 0, sizeof warps[wi]);
                    warps[wi].live = nthreads - wi * 32 < 32 ? nthreads - wi * 32 : 32;
                }
                for (int i = 0; i < nthreads; i++)
                    fiber_init(&fibers[i], i);
                if (run_block())
                    return -1;
            }
    return 0;
}
