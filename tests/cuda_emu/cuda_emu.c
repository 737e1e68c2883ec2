/* tests/cuda_emu/cuda_emu.c — the emulated device's runtime (cuda_emu.h):
 * a block's threads as fibers, the barriers where they meet, shuffles and
 * the m16n8k16 MMA. */
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

typedef struct fiber {
    emu_thread_id id; /* first: emu_cur points here */
    ucontext_t ctx;
    void *stack;
    void *fake; /* ASan's fake stack while switched out */
    int state;
} fiber;

/* What the lanes of one warp leave for each other at a warp operation. */
typedef struct warp_slots {
    uint64_t word[32];
    uint32_t a[32][4], b[32][2];
    int arrived, live, gen;
} warp_slots;

emu_dim3 emu_block_idx, emu_block_dim, emu_grid_dim;
emu_thread_id *emu_cur;

static fiber fibers[EMU_MAX_THREADS];
static warp_slots warps[EMU_MAX_THREADS / 32];
static int nthreads, block_live, block_arrived, block_gen;
static ucontext_t sched;
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

/* From a fiber back to the scheduler. */
static void yield(void)
{
    fiber *f = cur_fiber();
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(&f->fake, sched_bottom, sched_size);
#endif
    swapcontext(&f->ctx, &sched);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake, &sched_bottom, &sched_size);
#endif
}

static void fiber_main(void)
{
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &sched_bottom, &sched_size);
#endif
    fiber *f = cur_fiber();
    kernel_fn(kernel_arg);
    f->state = DONE;
    /* a thread that ends no longer holds up its block's or its warp's barrier */
    block_live--;
    warp_of(f)->live--;
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(NULL, sched_bottom, sched_size);
#endif
    /* returns to sched through uc_link */
}

/* Releases the threads waiting at a barrier that every live thread of its
 * scope has reached. */
static void release_block(void)
{
    block_arrived = 0;
    block_gen++;
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

void emu_mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    fiber *f = cur_fiber();
    warp_whole("mma.sync");
    warp_slots *w = warp_of(f);
    int lane = lane_of(f), g = lane >> 2, t = lane & 3;
    memcpy(w->a[lane], a, sizeof w->a[lane]);
    w->b[lane][0] = b0;
    w->b[lane][1] = b1;
    warp_meet();
    for (int e = 0; e < 4; e++) {
        int row = g + 8 * (e >= 2), n = 2 * t + (e & 1);
        float acc = c[e];
        for (int k = 0; k < 16; k++)
            acc += a_at(w, row, k) * b_at(w, k, n);
        c[e] = acc;
    }
    warp_meet();
}

void emu_trap(void)
{
    fiber *f = cur_fiber();
    fprintf(stderr, "cuda_emu: __trap() in block (%u,%u) thread %u\n", emu_block_idx.x,
            emu_block_idx.y, f ? f->id.tid.x : 0u);
    abort();
}

/* Runs every fiber of the block until each has ended; -1 on a deadlock. */
static int run_block(void)
{
    for (;;) {
        int ran = 0, left = 0;
        for (int i = 0; i < nthreads; i++) {
            fiber *f = &fibers[i];
            if (f->state == DONE)
                continue;
            left++;
            if (f->state != RUNNABLE)
                continue;
            ran = 1;
            emu_cur = &f->id;
#ifdef EMU_ASAN
            void *fake = NULL;
            __sanitizer_start_switch_fiber(&fake, f->stack, EMU_STACK);
#endif
            swapcontext(&sched, &f->ctx);
#ifdef EMU_ASAN
            __sanitizer_finish_switch_fiber(fake, NULL, NULL);
#endif
            emu_cur = NULL;
            /* the last thread of a barrier's scope may have ended meanwhile */
            if (block_arrived && block_arrived == block_live)
                release_block();
            for (int wi = 0; wi < (nthreads + 31) / 32; wi++)
                if (warps[wi].arrived && warps[wi].arrived == warps[wi].live)
                    release_warp(wi);
        }
        if (!left)
            return 0;
        if (!ran) {
            int at_block = 0, at_warp = 0;
            for (int i = 0; i < nthreads; i++)
                at_block += fibers[i].state == AT_BLOCK, at_warp += fibers[i].state == AT_WARP;
            fprintf(stderr,
                    "cuda_emu: deadlock in block (%u,%u): %d thread(s) at __syncthreads, %d at "
                    "a warp operation, %d live\n",
                    emu_block_idx.x, emu_block_idx.y, at_block, at_warp, block_live);
            return -1;
        }
    }
}

int emu_launch(emu_dim3 grid, emu_dim3 block, void (*fn)(void *), void *arg)
{
    if (block.x == 0 || block.x % 32 || block.x > EMU_MAX_THREADS || block.y > 1 ||
        block.z > 1) {
        fprintf(stderr, "cuda_emu: unsupported block (%u,%u,%u)\n", block.x, block.y, block.z);
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
                return -1;
            }
        }
    kernel_fn = fn;
    kernel_arg = arg;
    emu_grid_dim = grid;
    emu_block_dim = block;
    emu_block_dim.y = emu_block_dim.z = 1;
    for (unsigned z = 0; z < (grid.z ? grid.z : 1); z++)
        for (unsigned y = 0; y < (grid.y ? grid.y : 1); y++)
            for (unsigned x = 0; x < grid.x; x++) {
                emu_block_idx.x = x, emu_block_idx.y = y, emu_block_idx.z = z;
                block_live = nthreads;
                block_arrived = 0;
                for (int wi = 0; wi < nthreads / 32; wi++) {
                    memset(&warps[wi], 0, sizeof warps[wi]);
                    warps[wi].live = 32;
                }
                for (int i = 0; i < nthreads; i++) {
                    fiber *f = &fibers[i];
                    memset(&f->id, 0, sizeof f->id);
                    f->id.tid.x = (unsigned)i;
                    f->state = RUNNABLE;
                    f->fake = NULL;
                    getcontext(&f->ctx);
                    f->ctx.uc_stack.ss_sp = f->stack;
                    f->ctx.uc_stack.ss_size = EMU_STACK;
                    f->ctx.uc_link = &sched;
                    makecontext(&f->ctx, fiber_main, 0);
                }
                if (run_block())
                    return -1;
            }
    return 0;
}
