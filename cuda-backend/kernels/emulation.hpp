// emulation.hpp: the CUDA execution model emulated on the host (Linux, C++17, header-only).
//
// The kernels under cuda-backend/kernels/ are written once, in CUDA C++. nvcc compiles them
// for the GPU; for tests on machines without a GPU the same source is compiled by a host
// C++17 compiler with this header in front (through compat.cuh), and launched with
// `kvp_emu::launch`. Never include this header under nvcc: include compat.cuh.
//
// What is emulated
// - Qualifiers `__global__ __device__ __host__ __constant__ __forceinline__
//   __launch_bounds__(...) __align__(n)` (defined away, or to the host attribute).
//   `__restrict__` is already a keyword of g++ and clang++.
// - `dim3`, `uint3`, `threadIdx`, `blockIdx`, `blockDim`, `gridDim`, `warpSize`. The four
//   index variables are `thread_local` globals that the scheduler sets before it resumes a
//   fiber, so several OS threads may launch at once.
// - Barriers `__syncthreads()`, `__syncthreads_count/_and/_or(predicate)`,
//   `__syncwarp(mask)`; warp operations `__shfl_sync`, `__shfl_xor_sync`, `__shfl_down_sync`,
//   `__shfl_up_sync` (float, int, unsigned; optional `width`), `__ballot_sync`, `__any_sync`,
//   `__all_sync`.
// - Shared memory: `__shared__ T a[N];` becomes a function-local `static thread_local`
//   array: the fibers of a CTA share it, CTAs run one after another on the launching OS
//   thread. It is NOT cleared between CTAs or launches (it keeps the previous CTA's data),
//   so never initialise it in its declaration and never rely on its content. Dynamic shared
//   memory is declared with `KVP_DYNAMIC_SHARED(T, name);`: a per-launch 16-byte aligned
//   buffer of exactly the launch's byte count, filled with 0xFF bytes (a NaN in every f32,
//   f16 and bf16 lane) at the start of every CTA, so reading an unwritten element shows up.
//   Under AddressSanitizer the bytes past the end of it are poisoned.
// - Vector types `uint4 uint2 int4 int2 float4 float2` (16- and 8-byte aligned) and their
//   `make_` functions; math `expf __expf fmaxf fminf fabsf rsqrtf __fdividef sqrtf`,
//   `__float_as_uint __uint_as_float __float_as_int __int_as_float`, `__ldg`, `INFINITY`,
//   `min`/`max` for int, unsigned, long long, unsigned long long and float; `__trap()`.
//
// Execution and scheduling rule
// - `kvp_emu::launch(kernel, grid, block, dynamic_shared_bytes, params...)` runs the CTAs
//   one after another: in blockIdx order (x fastest) when the seed is 0, otherwise in an
//   order drawn from the seed (an affine permutation of the linear CTA index).
// - The threads of a CTA are fibers (their own stacks; x86-64: a hand-written switch of
//   the callee-saved registers, elsewhere or with -DKVP_EMU_UCONTEXT: ucontext), scheduled
//   cooperatively: a fiber runs until it reaches a barrier or warp operation, or returns.
//   When no fiber can run, barriers are released: a warp operation when every lane of the
//   warp (warp = linear thread index / 32, the last warp may be partial) waits at one with
//   the same kind, mask and width; a CTA barrier when every thread of the CTA waits at one
//   of the same kind (`__syncthreads` at two places in the code is one barrier, as on the
//   GPU). Released fibers run again in an order shuffled by the seed (seed 0: thread order),
//   so a missing `__syncthreads` lets a thread read shared data before it is written for
//   some seed (with dynamic shared memory it then reads the NaN poison).
// - Deadlock rule: when no fiber can run and no barrier can be released, the launch stops
//   and returns `kvp_emu::kDeadlock` with a message in `kvp_emu::last_error()` naming the
//   block and what its threads wait at; it does not hang and does not abort the process.
//   Cases: a thread returned while others wait at `__syncthreads`; lanes of a warp wait at
//   different warp operations (or masks, or widths), or some lanes returned; threads wait
//   at `__syncthreads` and `__syncthreads_count`; threads wait at `__syncthreads` while
//   lanes of their warp wait at a shuffle. The fibers are then abandoned: destructors of
//   their locals do not run (kernels hold plain data).
// - Invalid launches return `kInvalidLaunch` before running anything: a zero dimension,
//   block.x or block.y > 1024, block.z > 64, more than 1024 threads, grid.y or grid.z >
//   65535, grid.x > 2^31-1, dynamic shared memory > 227 KiB. `__trap()` stops the launch
//   with `kTrap`; an exception escaping a kernel with `kFailed`.
// - Shuffles read the value of a lane that does not exist (past the end of a partial warp)
//   as the caller's own value. A mask must name every existing lane of the warp.
//
// What is NOT emulated
// - No data races are detected and there is no memory model: fibers switch only at
//   barriers, so a race that the barriers do not order shows up only through the
//   shuffled order. No atomics, no `__threadfence`, no texture or constant caches (`__ldg`
//   is a plain load), no cooperative groups, no streams: a launch is synchronous.
// - No speed: the emulation is for correctness. `__expf`, `rsqrtf` and `__fdividef` are the
//   exact host functions, not the GPU's approximations, so compare with a tolerance.
// - Static `__shared__` memory is not counted against the 227 KiB limit; the MXCSR and x87
//   control words are not switched with a fiber (kernels never change them).
// - Fiber stacks are `kvp_emu::set_stack_bytes` (default 64 KiB) each, with a guard page
//   below: a kernel with large local arrays needs a larger value, an overflow faults.
//
// Threads: every piece of state (seed, stack size, error message, stacks, index variables)
// is per OS thread; a launch runs entirely on the calling OS thread. Calling a barrier,
// shuffle, `__trap` or `KVP_DYNAMIC_SHARED` outside a launch aborts with a message;
// calling `kvp_emu::launch` from inside a kernel returns kFailed.
#ifndef KVP_EMULATION_HPP
#define KVP_EMULATION_HPP

#if defined(__CUDACC__)
#error "emulation.hpp is the host emulation of CUDA: include compat.cuh under nvcc"
#endif

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#if !defined(__x86_64__) || defined(KVP_EMU_UCONTEXT)
#define KVP_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define KVP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVP_EMU_ASAN 1
#endif
#endif
#if defined(KVP_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

/// Set in host builds of kernel sources (never under nvcc).
#define KVP_EMULATION 1

// ---------------------------------------------------------------------------------------
// Qualifiers
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
/// Static shared memory: one array per OS thread, shared by the fibers of the running CTA.
#define __shared__ static thread_local

// ---------------------------------------------------------------------------------------
// Built-in types and variables

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};

inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

/// Index of the running thread in its CTA (set by the scheduler at every switch).
inline thread_local uint3 threadIdx{0, 0, 0};
/// Index of the running CTA in the grid.
inline thread_local uint3 blockIdx{0, 0, 0};
/// Threads per CTA of the running launch.
inline thread_local dim3 blockDim{1, 1, 1};
/// CTAs of the running launch.
inline thread_local dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

namespace kvp_emu {

/// Return codes of `launch`.
enum : int {
    kOk = 0,
    kInvalidLaunch = 1,  ///< rejected configuration; nothing ran
    kDeadlock = 2,       ///< no fiber can run and no barrier can be released
    kTrap = 3,           ///< a thread called `__trap()`
    kFailed = 4,         ///< no memory for stacks, a nested launch, an exception in a kernel
};

/// Largest dynamic shared memory of one CTA (sm_90's opt-in maximum, 227 KiB).
constexpr std::size_t kMaxDynamicSharedBytes = 227u * 1024u;
/// Largest number of threads of one CTA.
constexpr unsigned kMaxThreadsPerBlock = 1024;

namespace detail {

// ---------------------------------------------------------------------------------------
// Context switch

#if defined(KVP_EMU_USE_UCONTEXT)
struct Context {
    ucontext_t uc;
};

inline void init_context(Context& c, unsigned char* stack_lo, std::size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack_lo;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#else
struct Context {
    void* sp = nullptr;
};

/// Saves the callee-saved registers on the current stack, stores the stack pointer in
/// `*save`, loads `next` as the stack pointer, restores the registers saved there and
/// returns into the context that saved them (System V x86-64: rdi = save, rsi = next).
__attribute__((naked, noinline)) inline void raw_switch(void** /*save*/, void* /*next*/) {
    asm("pushq %rbp\n\t"
        "pushq %rbx\n\t"
        "pushq %r12\n\t"
        "pushq %r13\n\t"
        "pushq %r14\n\t"
        "pushq %r15\n\t"
        "movq %rsp, (%rdi)\n\t"
        "movq %rsi, %rsp\n\t"
        "popq %r15\n\t"
        "popq %r14\n\t"
        "popq %r13\n\t"
        "popq %r12\n\t"
        "popq %rbx\n\t"
        "popq %rbp\n\t"
        "ret\n\t");
}

/// Lays out a fresh stack so that switching to it "returns" into `entry` with the stack
/// aligned as at a normal function entry (rsp + 8 a multiple of 16).
inline void init_context(Context& c, unsigned char* stack_lo, std::size_t size, void (*entry)()) {
    std::uintptr_t top = (reinterpret_cast<std::uintptr_t>(stack_lo) + size) & ~std::uintptr_t{15};
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                              // return address of entry: never used
    *--sp = reinterpret_cast<void*>(entry);       // taken by raw_switch's ret
    for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
    c.sp = sp;
}

inline void switch_context(Context& from, Context& to) {
    // The compiler must assume that another fiber changed any memory (shared arrays, the
    // index variables) across the switch.
    asm volatile("" ::: "memory");
    raw_switch(&from.sp, to.sp);
    asm volatile("" ::: "memory");
}
#endif

// ---------------------------------------------------------------------------------------
// Fiber stacks: one mapping per OS thread, reused across launches, unmapped at thread exit.

class StackPool {
public:
    StackPool() = default;
    StackPool(const StackPool&) = delete;
    StackPool& operator=(const StackPool&) = delete;
    ~StackPool() { release(); }

    /// Makes `count` stacks of `bytes` (rounded up to pages) available; false if mmap fails.
    bool ensure(unsigned count, std::size_t bytes) {
        const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
        const std::size_t each = (bytes + page - 1) / page * page;
        if (base_ != nullptr && count <= count_ && each == each_) return true;
        release();
        const std::size_t stride = each + page;
        void* m = mmap(nullptr, stride * count, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (m == MAP_FAILED) return false;
        base_ = static_cast<unsigned char*>(m);
        map_bytes_ = stride * count;
        for (unsigned i = 0; i < count; ++i) {
            if (mprotect(base_ + i * stride, page, PROT_NONE) != 0) {
                release();
                return false;
            }
        }
        page_ = page;
        each_ = each;
        count_ = count;
        return true;
    }

    unsigned char* lo(unsigned i) const { return base_ + i * (each_ + page_) + page_; }
    std::size_t size() const { return each_; }

    void release() {
        if (base_ != nullptr) munmap(base_, map_bytes_);
        base_ = nullptr;
        map_bytes_ = each_ = page_ = 0;
        count_ = 0;
    }

private:
    unsigned char* base_ = nullptr;
    std::size_t map_bytes_ = 0, each_ = 0, page_ = 0;
    unsigned count_ = 0;
};

// ---------------------------------------------------------------------------------------
// Emulator state (one per OS thread)

enum class Op : unsigned char {
    SyncThreads,
    SyncWarp,
    ShflIdx,
    ShflXor,
    ShflDown,
    ShflUp,
    Ballot,
    Any,
    All
};
enum class Run : unsigned char { Ready, Waiting, Done };

inline const char* op_name(Op op) {
    switch (op) {
        case Op::SyncThreads: return "__syncthreads";
        case Op::SyncWarp: return "__syncwarp";
        case Op::ShflIdx: return "__shfl_sync";
        case Op::ShflXor: return "__shfl_xor_sync";
        case Op::ShflDown: return "__shfl_down_sync";
        case Op::ShflUp: return "__shfl_up_sync";
        case Op::Ballot: return "__ballot_sync";
        case Op::Any: return "__any_sync";
        case Op::All: return "__all_sync";
    }
    return "?";
}

struct Fiber {
    Context ctx;
    unsigned char* stack_lo = nullptr;
    uint3 tid{0, 0, 0};
    unsigned warp = 0, lane = 0;
    Run run = Run::Ready;
    Op op = Op::SyncThreads;
    unsigned mask = 0;
    int arg = 0, width = 32;
    std::uint32_t in = 0, out = 0;
};

using Invoke = void (*)(const void*);

struct Emu {
    // Settings.
    std::uint64_t seed = 0x9e3779b97f4a7c15ull;
    std::size_t stack_bytes = 64 * 1024;
    // Result of the last launch.
    std::string error;
    std::uint64_t switches = 0;
    // The running launch.
    bool active = false;
    int failure = kOk;
    Invoke invoke = nullptr;
    const void* kernel_args = nullptr;
    Context scheduler;
#if defined(KVP_EMU_ASAN)
    const void* scheduler_bottom = nullptr;
    std::size_t scheduler_size = 0;
#endif
    std::vector<Fiber> fibers;
    std::vector<unsigned> ready;
    std::vector<unsigned> warp_waiting;  // lanes of each warp waiting at a warp operation
    unsigned sync_waiting = 0, done = 0, warps = 0;
    std::vector<uint4> dynamic_shared;
    std::size_t dynamic_bytes = 0;
    StackPool stacks;
    std::uint64_t rng = 0;
};

inline Emu& emu() {
    static thread_local Emu e;
    return e;
}

/// The fiber running on this OS thread, or null outside a kernel.
inline thread_local Fiber* current_fiber = nullptr;

inline std::uint64_t next_random(std::uint64_t& s) {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

[[noreturn]] inline void outside_launch(const char* what) {
    fprintf(stderr, "kvp_emu: %s called outside kvp_emu::launch\n", what);
    abort();
}

// Switches from the running fiber back to the scheduler. `exiting`: the fiber never runs
// again (under ASan its fake stack is released).
inline void leave_fiber(Emu& e, Fiber& f, bool exiting) {
#if defined(KVP_EMU_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, e.scheduler_bottom, e.scheduler_size);
    switch_context(f.ctx, e.scheduler);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)exiting;
    switch_context(f.ctx, e.scheduler);
#endif
}

inline void enter_fiber(Emu& e, Fiber& f) {
    current_fiber = &f;
    threadIdx = f.tid;
    ++e.switches;
#if defined(KVP_EMU_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack_lo, e.stacks.size());
    switch_context(e.scheduler, f.ctx);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    switch_context(e.scheduler, f.ctx);
#endif
    current_fiber = nullptr;
}

[[noreturn]] inline void fiber_main() {
    Emu& e = emu();
#if defined(KVP_EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &e.scheduler_bottom, &e.scheduler_size);
#endif
    Fiber& f = *current_fiber;
#if defined(__cpp_exceptions)
    try {
        e.invoke(e.kernel_args);
    } catch (...) {
        if (e.failure == kOk) {
            e.failure = kFailed;
            e.error = "an exception escaped the kernel";
        }
    }
#else
    e.invoke(e.kernel_args);
#endif
    f.run = Run::Done;
    ++e.done;
    leave_fiber(e, f, true);
    fprintf(stderr, "kvp_emu: a finished fiber was resumed\n");
    abort();
}

/// Blocks the running fiber at a barrier or warp operation until the scheduler releases it.
inline std::uint32_t wait_at(const char* what, Op op, unsigned mask, std::uint32_t in, int arg,
                             int width) {
    Fiber* f = current_fiber;
    if (f == nullptr) outside_launch(what);
    Emu& e = emu();
    f->op = op;
    f->mask = mask;
    f->in = in;
    f->arg = arg;
    f->width = width;
    f->run = Run::Waiting;
    if (op == Op::SyncThreads) {
        ++e.sync_waiting;
    } else {
        ++e.warp_waiting[f->warp];
    }
    leave_fiber(e, *f, false);
    return f->out;
}

inline std::string block_text(const uint3& b) {
    return "(" + std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")";
}

inline std::string where_text(const Fiber& f) {
    return "thread " + block_text(f.tid) + " of block " + block_text(blockIdx);
}

/// Releases warp `w` if all its lanes wait at a warp operation. Returns 1 if released, 0 if
/// not, -1 (with e.error set) if the lanes wait at different operations.
inline int release_warp(Emu& e, unsigned w) {
    const unsigned n = static_cast<unsigned>(e.fibers.size());
    const unsigned first = w * 32, lanes = (n - first < 32) ? n - first : 32;
    if (e.warp_waiting[w] != lanes) return 0;
    Fiber* l = &e.fibers[first];
    const unsigned present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    for (unsigned i = 0; i < lanes; ++i) {
        if (l[i].op != l[0].op || l[i].mask != l[0].mask || l[i].width != l[0].width) {
            e.error = "deadlock: in warp " + std::to_string(w) + " of block " +
                      block_text(blockIdx) + ", lane 0 waits at " + op_name(l[0].op) + " (mask " +
                      std::to_string(l[0].mask) + ", width " + std::to_string(l[0].width) +
                      ") and lane " + std::to_string(i) + " at " + op_name(l[i].op) + " (mask " +
                      std::to_string(l[i].mask) + ", width " + std::to_string(l[i].width) + ")";
            return -1;
        }
    }
    const Op op = l[0].op;
    const unsigned width = static_cast<unsigned>(l[0].width);
    if ((l[0].mask & present) != present) {
        e.error = std::string("unsupported: ") + op_name(op) + " in warp " + std::to_string(w) +
                  " of block " + block_text(blockIdx) +
                  " with a mask that leaves out existing lanes";
        return -1;
    }
    if (width == 0 || width > 32 || (width & (width - 1)) != 0) {
        e.error = std::string(op_name(op)) + " with width " + std::to_string(l[0].width) +
                  " (must be a power of two up to 32) in block " + block_text(blockIdx);
        return -1;
    }
    std::uint32_t ballot = 0;
    for (unsigned i = 0; i < lanes; ++i) ballot |= (l[i].in != 0 ? 1u : 0u) << i;
    for (unsigned i = 0; i < lanes; ++i) {
        const unsigned seg = i & ~(width - 1), arg = static_cast<unsigned>(l[i].arg);
        unsigned src = i;
        switch (op) {
            case Op::ShflIdx: src = seg + (arg & (width - 1)); break;
            case Op::ShflXor: src = ((i ^ arg) & ~(width - 1)) == seg ? (i ^ arg) : i; break;
            case Op::ShflDown: src = std::uint64_t{i - seg} + arg < width ? i + arg : i; break;
            case Op::ShflUp: src = (i - seg) >= arg ? i - arg : i; break;
            default: break;
        }
        if (src >= lanes) src = i;
        switch (op) {
            case Op::Ballot: l[i].out = ballot; break;
            case Op::Any: l[i].out = ballot != 0; break;
            case Op::All: l[i].out = ballot == present; break;
            default: l[i].out = l[src].in; break;
        }
    }
    for (unsigned i = 0; i < lanes; ++i) l[i].run = Run::Ready;
    e.warp_waiting[w] = 0;
    return 1;
}

/// Kinds of CTA barrier, in `Fiber::arg` of a fiber waiting at Op::SyncThreads.
enum CtaBarrier : int { kPlain = 0, kCount = 1, kAnd = 2, kOr = 3 };

inline const char* cta_barrier_name(int kind) {
    switch (kind) {
        case kCount: return "__syncthreads_count";
        case kAnd: return "__syncthreads_and";
        case kOr: return "__syncthreads_or";
        default: return "__syncthreads";
    }
}

/// Releases a CTA whose threads all wait at a CTA barrier, giving each the barrier's result
/// (the number of threads with a non-zero predicate, their and, their or). False (with
/// e.error set) if the threads wait at different kinds of CTA barrier.
inline bool release_cta(Emu& e) {
    const int kind = e.fibers[0].arg;
    std::uint32_t count = 0;
    for (const Fiber& f : e.fibers) {
        if (f.arg != kind) {
            e.error = std::string("deadlock: in block ") + block_text(blockIdx) + ", thread " +
                      block_text(e.fibers[0].tid) + " waits at " + cta_barrier_name(kind) +
                      " and thread " + block_text(f.tid) + " at " + cta_barrier_name(f.arg);
            return false;
        }
        count += f.in != 0 ? 1u : 0u;
    }
    const std::uint32_t n = static_cast<std::uint32_t>(e.fibers.size());
    const std::uint32_t out = kind == kCount ? count
                              : kind == kAnd ? (count == n ? 1u : 0u)
                                             : (count != 0 ? 1u : 0u);
    for (Fiber& f : e.fibers) {
        f.out = out;
        f.run = Run::Ready;
    }
    e.sync_waiting = 0;
    return true;
}

inline std::string deadlock_text(const Emu& e) {
    const unsigned n = static_cast<unsigned>(e.fibers.size());
    std::string s = "deadlock in block " + block_text(blockIdx) + ": " + std::to_string(e.done) +
                    " of " + std::to_string(n) + " threads returned, " +
                    std::to_string(e.sync_waiting) + " wait at __syncthreads";
    unsigned at_warp = 0;
    for (unsigned w = 0; w < e.warps; ++w) at_warp += e.warp_waiting[w];
    if (at_warp != 0) {
        s += ", " + std::to_string(at_warp) + " wait at warp operations";
        for (unsigned w = 0; w < e.warps; ++w) {
            if (e.warp_waiting[w] == 0) continue;
            const unsigned first = w * 32, lanes = (n - first < 32) ? n - first : 32;
            for (unsigned i = 0; i < lanes; ++i) {
                const Fiber& f = e.fibers[first + i];
                if (f.run == Run::Waiting && f.op != Op::SyncThreads) {
                    s += " (warp " + std::to_string(w) + ": " + std::to_string(e.warp_waiting[w]) +
                         " of " + std::to_string(lanes) + " lanes at " + op_name(f.op) + ")";
                    break;
                }
            }
            break;
        }
    }
    return s;
}

/// Runs one CTA (blockIdx already set) to completion; returns kOk or an error code.
inline int run_block(Emu& e) {
    const unsigned n = static_cast<unsigned>(e.fibers.size());
    if (e.dynamic_bytes != 0) memset(e.dynamic_shared.data(), 0xFF, e.dynamic_bytes);
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = e.fibers[i];
#if defined(KVP_EMU_ASAN)
        // Frames of the previous CTA's fibers never returned: clear their redzones.
        __asan_unpoison_memory_region(f.stack_lo, e.stacks.size());
#endif
        init_context(f.ctx, f.stack_lo, e.stacks.size(), &fiber_main);
        f.run = Run::Ready;
    }
    for (unsigned w = 0; w < e.warps; ++w) e.warp_waiting[w] = 0;
    e.sync_waiting = 0;
    e.done = 0;
    for (;;) {
        e.ready.clear();
        for (unsigned i = 0; i < n; ++i)
            if (e.fibers[i].run == Run::Ready) e.ready.push_back(i);
        if (!e.ready.empty()) {
            if (e.seed != 0) {
                for (std::size_t i = e.ready.size() - 1; i > 0; --i) {
                    const std::size_t j = next_random(e.rng) % (i + 1);
                    const unsigned t = e.ready[i];
                    e.ready[i] = e.ready[j];
                    e.ready[j] = t;
                }
            }
            for (unsigned i : e.ready) {
                enter_fiber(e, e.fibers[i]);
                if (e.failure != kOk) return e.failure;
            }
            continue;
        }
        if (e.done == n) return kOk;
        bool released = false;
        for (unsigned w = 0; w < e.warps; ++w) {
            const int r = release_warp(e, w);
            if (r < 0) return kDeadlock;
            released = released || r > 0;
        }
        if (e.sync_waiting == n) {
            if (!release_cta(e)) return kDeadlock;
            released = true;
        }
        if (!released) {
            e.error = deadlock_text(e);
            return kDeadlock;
        }
    }
}

inline std::uint64_t gcd(std::uint64_t a, std::uint64_t b) {
    while (b != 0) {
        const std::uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

inline int invalid(Emu& e, const std::string& why) {
    e.error = "invalid launch: " + why;
    return kInvalidLaunch;
}

inline int check_config(Emu& e, dim3 grid, dim3 block, std::size_t dynamic_bytes) {
    if (grid.x == 0 || grid.y == 0 || grid.z == 0)
        return invalid(
            e, "grid " + block_text(uint3{grid.x, grid.y, grid.z}) + " has a zero dimension");
    if (block.x == 0 || block.y == 0 || block.z == 0)
        return invalid(
            e, "block " + block_text(uint3{block.x, block.y, block.z}) + " has a zero dimension");
    if (block.x > 1024 || block.y > 1024 || block.z > 64)
        return invalid(
            e, "block " + block_text(uint3{block.x, block.y, block.z}) + " exceeds (1024,1024,64)");
    const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
    if (threads > kMaxThreadsPerBlock)
        return invalid(e, std::to_string(threads) + " threads per block (at most 1024)");
    if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        return invalid(e, "grid " + block_text(uint3{grid.x, grid.y, grid.z}) +
                              " exceeds (2^31-1,65535,65535)");
    if (dynamic_bytes > kMaxDynamicSharedBytes)
        return invalid(
            e, std::to_string(dynamic_bytes) + " bytes of dynamic shared memory (at most 232448)");
    return kOk;
}

/// Type-erased launch: validates, prepares fibers and runs every CTA.
inline int run_launch(Invoke invoke, const void* args, dim3 grid, dim3 block,
                      std::size_t dynamic_bytes) {
    Emu& e = emu();
    if (e.active) {
        e.failure = kFailed;
        e.error = "kvp_emu::launch called from inside a kernel";
        return kFailed;
    }
    e.error.clear();
    if (const int rc = check_config(e, grid, block, dynamic_bytes)) return rc;
    const unsigned n = block.x * block.y * block.z;
    if (!e.stacks.ensure(n, e.stack_bytes)) {
        e.error = "cannot map " + std::to_string(n) + " fiber stacks of " +
                  std::to_string(e.stack_bytes) + " bytes";
        return kFailed;
    }
    e.fibers.assign(n, Fiber{});
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = e.fibers[i];
        f.stack_lo = e.stacks.lo(i);
        f.tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
        f.warp = i / 32;
        f.lane = i % 32;
    }
    e.warps = (n + 31) / 32;
    e.warp_waiting.assign(e.warps, 0);
    e.ready.reserve(n);
    e.dynamic_bytes = dynamic_bytes;
    e.dynamic_shared.resize((dynamic_bytes + 15) / 16 + 1);
#if defined(KVP_EMU_ASAN)
    {
        unsigned char* d = reinterpret_cast<unsigned char*>(e.dynamic_shared.data());
        const std::size_t cap = e.dynamic_shared.size() * sizeof(uint4);
        __asan_unpoison_memory_region(d, cap);
        __asan_poison_memory_region(d + dynamic_bytes, cap - dynamic_bytes);
    }
#endif
    e.invoke = invoke;
    e.kernel_args = args;
    e.failure = kOk;
    e.active = true;
    e.rng = e.seed;
    blockDim = block;
    gridDim = grid;

    // CTA i runs as linear CTA (a * i + b) mod ctas: with a coprime to ctas, a permutation.
    const std::uint64_t ctas = std::uint64_t{grid.x} * grid.y * grid.z;
    std::uint64_t a = 1, c = 0;
    if (e.seed != 0 && ctas > 1) {
        do {
            a = 1 + next_random(e.rng) % (ctas - 1);
        } while (gcd(a, ctas) != 1);
        c = next_random(e.rng) % ctas;
    }
    int rc = kOk;
    for (std::uint64_t i = 0; i < ctas && rc == kOk;
         ++i, c = c + a >= ctas ? c + a - ctas : c + a) {
        blockIdx =
            uint3{static_cast<unsigned>(c % grid.x), static_cast<unsigned>((c / grid.x) % grid.y),
                  static_cast<unsigned>(c / (std::uint64_t{grid.x} * grid.y))};
        rc = run_block(e);
    }
    e.active = false;
    e.invoke = nullptr;
    e.kernel_args = nullptr;
#if defined(KVP_EMU_ASAN)
    __asan_unpoison_memory_region(e.dynamic_shared.data(), e.dynamic_shared.size() * sizeof(uint4));
#endif
    threadIdx = uint3{0, 0, 0};
    blockIdx = uint3{0, 0, 0};
    blockDim = dim3{};
    gridDim = dim3{};
    return rc;
}

template <class... A>
struct Bound {
    void (*kernel)(A...);
    std::tuple<const A&...> args;
    static void invoke(const void* self) {
        const Bound* b = static_cast<const Bound*>(self);
        std::apply(b->kernel, b->args);
    }
};

template <class T>
struct Same {
    using type = T;
};

[[noreturn]] inline void trap() {
    Fiber* f = current_fiber;
    if (f == nullptr) outside_launch("__trap()");
    Emu& e = emu();
    if (e.failure == kOk) {
        e.failure = kTrap;
        e.error = "__trap() in " + where_text(*f);
    }
    f->run = Run::Done;
    leave_fiber(e, *f, true);
    abort();
}

inline void* dynamic_shared() {
    if (current_fiber == nullptr) outside_launch("KVP_DYNAMIC_SHARED");
    return emu().dynamic_shared.data();
}

}  // namespace detail

/// Runs `kernel(args...)` on a `grid` of CTAs of `block` threads with
/// `dynamic_shared_bytes` of dynamic shared memory, synchronously on the calling OS thread.
/// Returns kOk, kInvalidLaunch (nothing ran), kDeadlock, kTrap or kFailed; on failure
/// `last_error()` says why and the launch stopped at the failing CTA. Cost: every CTA
/// restarts one fiber per thread; each barrier costs two context switches per thread.
template <class... A>
int launch(void (*kernel)(A...), dim3 grid, dim3 block, std::size_t dynamic_shared_bytes,
           const typename detail::Same<A>::type&... args) {
    if (kernel == nullptr) {
        detail::emu().error = "invalid launch: null kernel";
        return kInvalidLaunch;
    }
    const detail::Bound<A...> bound{kernel, std::tuple<const A&...>(args...)};
    return detail::run_launch(&detail::Bound<A...>::invoke, &bound, grid, block,
                              dynamic_shared_bytes);
}

/// Seed of the run order on this OS thread: 0 runs CTAs in blockIdx order and threads in
/// index order; any other value shuffles both, deterministically for a given seed.
inline void set_seed(std::uint64_t seed) { detail::emu().seed = seed; }
inline std::uint64_t seed() { return detail::emu().seed; }

/// Stack bytes of each fiber on this OS thread (rounded up to pages, at least 16 KiB),
/// used from the next launch on. Default 64 KiB.
inline void set_stack_bytes(std::size_t bytes) {
    detail::emu().stack_bytes = bytes < 16384 ? 16384 : bytes;
}
inline std::size_t stack_bytes() { return detail::emu().stack_bytes; }

/// Message of the last failed launch on this OS thread ("" after a successful one).
inline const char* last_error() { return detail::emu().error.c_str(); }

/// Fiber switches (scheduler to fiber) performed on this OS thread since it started.
inline std::uint64_t switch_count() { return detail::emu().switches; }

/// Unmaps this OS thread's fiber stacks now (they are also unmapped when it exits).
inline void release_thread_resources() { detail::emu().stacks.release(); }

}  // namespace kvp_emu

// ---------------------------------------------------------------------------------------
// Barriers and warp operations

inline void __syncthreads() {
    kvp_emu::detail::wait_at("__syncthreads", kvp_emu::detail::Op::SyncThreads, 0xffffffffu, 0,
                             kvp_emu::detail::kPlain, 32);
}
/// Barrier returning the number of threads of the CTA whose `predicate` is non-zero.
inline int __syncthreads_count(int predicate) {
    return static_cast<int>(kvp_emu::detail::wait_at("__syncthreads_count",
                                                     kvp_emu::detail::Op::SyncThreads, 0xffffffffu,
                                                     predicate != 0, kvp_emu::detail::kCount, 32));
}
/// Barrier returning non-zero if `predicate` is non-zero for every thread of the CTA.
inline int __syncthreads_and(int predicate) {
    return static_cast<int>(kvp_emu::detail::wait_at("__syncthreads_and",
                                                     kvp_emu::detail::Op::SyncThreads, 0xffffffffu,
                                                     predicate != 0, kvp_emu::detail::kAnd, 32));
}
/// Barrier returning non-zero if `predicate` is non-zero for any thread of the CTA.
inline int __syncthreads_or(int predicate) {
    return static_cast<int>(kvp_emu::detail::wait_at("__syncthreads_or",
                                                     kvp_emu::detail::Op::SyncThreads, 0xffffffffu,
                                                     predicate != 0, kvp_emu::detail::kOr, 32));
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    kvp_emu::detail::wait_at("__syncwarp", kvp_emu::detail::Op::SyncWarp, mask, 0, 0, 32);
}

namespace kvp_emu {
namespace detail {
template <class T>
inline std::uint32_t to_bits(T v) {
    static_assert(sizeof(T) == 4, "32-bit values only");
    std::uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}
template <class T>
inline T from_bits(std::uint32_t u) {
    T v;
    memcpy(&v, &u, 4);
    return v;
}
template <class T>
inline T shuffle(const char* what, Op op, unsigned mask, T v, int arg, int width) {
    return from_bits<T>(wait_at(what, op, mask, to_bits(v), arg, width));
}
}  // namespace detail
}  // namespace kvp_emu

#define KVP_EMU_SHUFFLE(T)                                                                        \
    inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = warpSize) {                \
        return kvp_emu::detail::shuffle("__shfl_sync", kvp_emu::detail::Op::ShflIdx, mask, v,     \
                                        src_lane, width);                                         \
    }                                                                                             \
    inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {           \
        return kvp_emu::detail::shuffle("__shfl_xor_sync", kvp_emu::detail::Op::ShflXor, mask, v, \
                                        lane_mask, width);                                        \
    }                                                                                             \
    inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {         \
        return kvp_emu::detail::shuffle("__shfl_down_sync", kvp_emu::detail::Op::ShflDown, mask,  \
                                        v, static_cast<int>(delta), width);                       \
    }                                                                                             \
    inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {           \
        return kvp_emu::detail::shuffle("__shfl_up_sync", kvp_emu::detail::Op::ShflUp, mask, v,   \
                                        static_cast<int>(delta), width);                          \
    }
KVP_EMU_SHUFFLE(float)
KVP_EMU_SHUFFLE(int)
KVP_EMU_SHUFFLE(unsigned)
#undef KVP_EMU_SHUFFLE

inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return kvp_emu::detail::wait_at("__ballot_sync", kvp_emu::detail::Op::Ballot, mask,
                                    predicate != 0, 0, 32);
}
inline int __any_sync(unsigned mask, int predicate) {
    return static_cast<int>(kvp_emu::detail::wait_at("__any_sync", kvp_emu::detail::Op::Any, mask,
                                                     predicate != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int predicate) {
    return static_cast<int>(kvp_emu::detail::wait_at("__all_sync", kvp_emu::detail::Op::All, mask,
                                                     predicate != 0, 0, 32));
}

/// Dynamic shared memory of the running CTA as `T* name` (16-byte aligned, 0xFF-filled).
#define KVP_DYNAMIC_SHARED(T, name) \
    T* name = reinterpret_cast<T*>(::kvp_emu::detail::dynamic_shared())

// ---------------------------------------------------------------------------------------
// Math and bit casts (exact host functions; the GPU's fast intrinsics are approximations)

inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float f) { return kvp_emu::detail::to_bits(f); }
inline float __uint_as_float(unsigned u) { return kvp_emu::detail::from_bits<float>(u); }
inline int __float_as_int(float f) {
    return kvp_emu::detail::from_bits<int>(kvp_emu::detail::to_bits(f));
}
inline float __int_as_float(int i) {
    return kvp_emu::detail::from_bits<float>(kvp_emu::detail::to_bits(i));
}

/// Read-only cached load: a plain load on the host.
template <class T>
inline T __ldg(const T* p) {
    return *p;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

/// Stops the launch: `kvp_emu::launch` returns kTrap.
[[noreturn]] inline void __trap() { kvp_emu::detail::trap(); }

#endif  // KVP_EMULATION_HPP
