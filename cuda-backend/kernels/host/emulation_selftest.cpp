// emulation_selftest.cpp: self-tests of the host CUDA emulation (emulation.hpp).
//
// Each `kvp_emu_selftest_*` entry point launches kernels of emulation_selftest_kernels.cuh
// with `kvp_emu::launch`, compares with a host computation, and returns 0 on success or 1
// with a message that `kvp_emu_selftest_message()` returns (per OS thread, valid until the
// next self-test on that thread). They are called by cuda-backend/tests/emulation_runtime.rs
// (feature `emulation`), from several test threads at once.
#include "emulation_selftest_kernels.cuh"

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace {

thread_local std::string message;

int fail(const std::string& why) {
    message = why;
    return 1;
}

int pass() {
    message.clear();
    return 0;
}

std::string launch_failed(const char* what, int rc) {
    return std::string(what) + ": launch returned " + std::to_string(rc) + ": " +
           kvp_emu::last_error();
}

/// Small integers as floats, so sums are exact in any order.
float input(unsigned i) { return static_cast<float>((i * 2654435761u) % 17u) - 8.0f; }

const std::uint64_t kSeeds[] = {0, 1, 2, 3, 0xdeadbeefull};

int block_reduce_with(std::uint64_t seed, dim3 grid, dim3 block) {
    kvp_emu::set_seed(seed);
    const unsigned n = block.x * block.y * block.z, ctas = grid.x * grid.y * grid.z;
    std::vector<float> in(static_cast<std::size_t>(n) * ctas), out(ctas, -1.0f);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = input(static_cast<unsigned>(i));
    const KvpEmuReduceParams p{in.data(), out.data()};
    const int rc = kvp_emu::launch(kvp_emu_test_block_reduce, grid, block, 0, p);
    if (rc != 0) return fail(launch_failed("block_reduce", rc));
    for (unsigned c = 0; c < ctas; ++c) {
        float want = 0.0f;
        for (unsigned t = 0; t < n; ++t) want += in[static_cast<std::size_t>(c) * n + t];
        if (out[c] != want) {
            return fail("block_reduce seed " + std::to_string(seed) + " block " +
                        std::to_string(block.x) + "x" + std::to_string(block.y) + "x" +
                        std::to_string(block.z) + " CTA " + std::to_string(c) + ": got " +
                        std::to_string(out[c]) + ", want " + std::to_string(want));
        }
    }
    return 0;
}

int warp_with(std::uint64_t seed, unsigned threads, unsigned ctas, bool half_only) {
    kvp_emu::set_seed(seed);
    const unsigned total = threads * ctas;
    std::vector<float> f(total), xor_sum(total), half_sum(total);
    std::vector<int> iv(total), down_sum((total + 31) / 32), scan(total);
    std::vector<unsigned> bcast(total), ballot(total);
    for (unsigned t = 0; t < total; ++t) {
        f[t] = input(t);
        iv[t] = static_cast<int>((t * 40503u) % 101u) - 50;
    }
    const KvpEmuWarpParams p{f.data(),        iv.data(),    xor_sum.data(),
                             down_sum.data(), bcast.data(), ballot.data(),
                             half_sum.data(), scan.data(),  half_only ? 1 : 0};
    const int rc = kvp_emu::launch(kvp_emu_test_warp, dim3(ctas), dim3(threads), 0, p);
    if (rc != 0) return fail(launch_failed("warp", rc));
    const std::string where =
        "warp seed " + std::to_string(seed) + " threads " + std::to_string(threads) + ": ";
    for (unsigned t = 0; t < total; ++t) {
        const unsigned h0 = t / 16 * 16;
        float h = 0.0f;
        for (unsigned k = 0; k < 16; ++k) h += f[h0 + k];
        if (half_sum[t] != h)
            return fail(where + "width-16 xor sum of thread " + std::to_string(t));
    }
    if (half_only) return 0;
    for (unsigned t = 0; t < total; ++t) {
        const unsigned w0 = t / 32 * 32, lane = t % 32;
        float fs = 0.0f;
        int is = 0, prefix = 0;
        unsigned bits = 0;
        for (unsigned k = 0; k < 32; ++k) {
            fs += f[w0 + k];
            is += iv[w0 + k];
            if (k <= lane) prefix += iv[w0 + k];
            if (iv[w0 + k] % 3 == 0) bits |= 1u << k;
        }
        if (xor_sum[t] != fs) return fail(where + "xor sum of thread " + std::to_string(t));
        if (lane == 0 && down_sum[t / 32] != is)
            return fail(where + "shuffle-down sum of warp " + std::to_string(t / 32));
        if (bcast[t] != 7u * (w0 + 5) + 3u)
            return fail(where + "broadcast to thread " + std::to_string(t));
        if (ballot[t] != bits) return fail(where + "ballot of thread " + std::to_string(t));
        if (scan[t] != prefix)
            return fail(where + "shuffle-up scan of thread " + std::to_string(t));
    }
    return 0;
}

int shift_with(std::uint64_t seed, bool sync, unsigned threads, bool* wrong) {
    kvp_emu::set_seed(seed);
    const unsigned ctas = 3, total = threads * ctas;
    std::vector<float> in(total), out(total, -1.0f);
    for (unsigned t = 0; t < total; ++t) in[t] = static_cast<float>(t);
    const KvpEmuShiftParams p{in.data(), out.data(), sync ? 1 : 0};
    const int rc =
        kvp_emu::launch(kvp_emu_test_shift, dim3(ctas), dim3(threads), threads * sizeof(float), p);
    if (rc != 0) return fail(launch_failed("shift", rc));
    *wrong = false;
    for (unsigned c = 0; c < ctas; ++c)
        for (unsigned t = 0; t < threads; ++t)
            if (!(out[c * threads + t] == in[c * threads + (t + 1) % threads])) *wrong = true;
    return 0;
}

}  // namespace

extern "C" {

/// Message of the last failed self-test on this OS thread ("" after a pass).
const char* kvp_emu_selftest_message(void) { return message.c_str(); }

/// Shared-memory tree reduction with barriers: block sizes 1 to 1024 (31, 33, 100, 1000 not
/// multiples of 32), 1D and 3D blocks, several CTAs, every seed of kSeeds.
int kvp_emu_selftest_block_reduce(void) {
    const dim3 blocks[] = {dim3(1),    dim3(31),   dim3(32),      dim3(33),
                           dim3(100),  dim3(128),  dim3(8, 4, 3), dim3(5, 7, 3),
                           dim3(1000), dim3(1024), dim3(16, 8, 8)};
    for (std::uint64_t seed : kSeeds)
        for (const dim3& b : blocks)
            if (block_reduce_with(seed, dim3(3, 2), b) != 0) return 1;
    return pass();
}

/// Warp shuffles (xor, down, up, broadcast, ballot, width 16) against host sums, and width-16
/// sums in blocks whose last warp has 16 lanes.
int kvp_emu_selftest_warp_shuffles(void) {
    for (std::uint64_t seed : kSeeds) {
        if (warp_with(seed, 32, 2, false) != 0) return 1;
        if (warp_with(seed, 128, 3, false) != 0) return 1;
        if (warp_with(seed, 48, 2, true) != 0) return 1;
        if (warp_with(seed, 16, 1, true) != 0) return 1;
    }
    return pass();
}

/// Dynamic shared memory is 16-byte aligned and filled with 0xFF bytes (NaN) at the start of
/// every CTA: unwritten elements read back as NaN even after CTA 0 wrote all of them.
int kvp_emu_selftest_dynamic_shared_poison(void) {
    for (std::uint64_t seed : kSeeds) {
        kvp_emu::set_seed(seed);
        const unsigned n = 96, ctas = 4;
        std::vector<float> out(2 * n * ctas, 0.0f);
        std::vector<unsigned> aligned(ctas, 0);
        const KvpEmuPoisonParams p{out.data(), aligned.data()};
        const int rc =
            kvp_emu::launch(kvp_emu_test_poison, dim3(ctas), dim3(n), 2 * n * sizeof(float), p);
        if (rc != 0) return fail(launch_failed("poison", rc));
        for (unsigned c = 0; c < ctas; ++c) {
            if (aligned[c] != 1)
                return fail("dynamic shared memory of CTA " + std::to_string(c) +
                            " not 16-byte aligned");
            for (unsigned t = 0; t < 2 * n; ++t) {
                const float v = out[c * 2 * n + t];
                const bool written = t < n && (c == 0 || t % 2 == 0);
                if (written ? v != static_cast<float>(t) : __float_as_uint(v) != 0xffffffffu) {
                    return fail("seed " + std::to_string(seed) + " CTA " + std::to_string(c) +
                                " element " + std::to_string(t) + ": got bits " +
                                std::to_string(__float_as_uint(v)));
                }
            }
        }
    }
    return pass();
}

/// A kernel missing a `__syncthreads` between a shared write and another thread's read gives a
/// wrong result for at least one seed; the same kernel with the barrier is right for all.
int kvp_emu_selftest_missing_sync(void) {
    const unsigned sizes[] = {64, 100};
    for (unsigned threads : sizes) {
        unsigned wrong_seeds = 0;
        for (std::uint64_t seed : kSeeds) {
            bool wrong = false;
            if (shift_with(seed, true, threads, &wrong) != 0) return 1;
            if (wrong)
                return fail("shift with the barrier is wrong for seed " + std::to_string(seed));
            if (shift_with(seed, false, threads, &wrong) != 0) return 1;
            wrong_seeds += wrong ? 1 : 0;
        }
        if (wrong_seeds == 0) return fail("a missing __syncthreads went unnoticed for every seed");
    }
    return pass();
}

/// Every deadlock mode of kvp_emu_test_deadlock returns kDeadlock with a message, without
/// hanging; a correct launch on the same OS thread works afterwards.
int kvp_emu_selftest_deadlock(void) {
    const char* expect[] = {"1 of 64 threads returned", "lane 0 waits at __syncwarp",
                            "lanes at __shfl_xor_sync", "48 wait at __syncthreads",
                            "__syncthreads_count and thread"};
    for (int mode = 0; mode < 5; ++mode) {
        for (std::uint64_t seed : kSeeds) {
            kvp_emu::set_seed(seed);
            std::vector<unsigned> after(64, 0);
            const KvpEmuDeadlockParams p{mode, after.data()};
            const int rc = kvp_emu::launch(kvp_emu_test_deadlock, dim3(2), dim3(64), 0, p);
            const std::string err = kvp_emu::last_error();
            if (rc != kvp_emu::kDeadlock)
                return fail("deadlock mode " + std::to_string(mode) + " returned " +
                            std::to_string(rc));
            if (err.find("deadlock") == std::string::npos ||
                err.find(expect[mode]) == std::string::npos)
                return fail("deadlock mode " + std::to_string(mode) + " message: " + err);
        }
    }
    if (block_reduce_with(7, dim3(2), dim3(64)) != 0) return 1;
    if (std::string(kvp_emu::last_error()) != "")
        return fail("last_error not cleared by a successful launch");
    return pass();
}

/// Invalid configurations and a null kernel are rejected before any thread runs; the limits
/// themselves pass.
int kvp_emu_selftest_invalid_launch(void) {
    struct Case {
        dim3 grid, block;
        std::size_t shared;
        bool ok;
    };
    const Case cases[] = {
        {dim3(1), dim3(1025), 0, false},
        {dim3(1), dim3(32, 32, 2), 0, false},
        {dim3(1), dim3(1, 1, 65), 0, false},
        {dim3(1), dim3(0), 0, false},
        {dim3(1), dim3(4, 0), 0, false},
        {dim3(0), dim3(32), 0, false},
        {dim3(2, 1, 0), dim3(32), 0, false},
        {dim3(1, 65536), dim3(32), 0, false},
        {dim3(1), dim3(32), 227 * 1024 + 1, false},
        {dim3(1), dim3(1024), 227 * 1024, true},
        {dim3(1), dim3(1, 1, 64), 0, true},
        {dim3(1), dim3(32, 32, 1), 0, true},
    };
    for (const Case& c : cases) {
        const unsigned n = c.block.x * c.block.y * c.block.z;
        std::vector<unsigned> ran(n == 0 ? 1 : n, 0);
        const KvpEmuTrapParams p{ran.data()};
        const int rc = kvp_emu::launch(kvp_emu_test_trap, c.grid, c.block, c.shared, p);
        const std::string what = "block " + std::to_string(c.block.x) + "x" +
                                 std::to_string(c.block.y) + "x" + std::to_string(c.block.z) +
                                 " grid " + std::to_string(c.grid.x) + "x" +
                                 std::to_string(c.grid.y) + "x" + std::to_string(c.grid.z) +
                                 " shared " + std::to_string(c.shared);
        if (c.ok) {
            if (rc != 0) return fail(launch_failed(what.c_str(), rc));
            for (unsigned v : ran)
                if (v != 1) return fail(what + ": a thread did not run");
        } else {
            if (rc != kvp_emu::kInvalidLaunch)
                return fail(what + ": returned " + std::to_string(rc));
            if (std::string(kvp_emu::last_error()).find("invalid launch") != 0)
                return fail(what + ": message " + kvp_emu::last_error());
            for (unsigned v : ran)
                if (v != 0) return fail(what + ": a thread ran");
        }
    }
    void (*null_kernel)(KvpEmuTrapParams) = nullptr;
    std::vector<unsigned> unused(1, 0);
    if (kvp_emu::launch(null_kernel, dim3(1), dim3(1), 0, KvpEmuTrapParams{unused.data()}) !=
        kvp_emu::kInvalidLaunch)
        return fail("a null kernel was not rejected");
    return pass();
}

/// A 3D grid of 3D blocks: every thread sees its own threadIdx/blockIdx and the launch's
/// blockDim/gridDim; seed 0 runs CTAs and threads in index order, other seeds in a
/// permutation that differs from it for at least one seed.
int kvp_emu_selftest_grid_3d(void) {
    const dim3 grid(3, 2, 4), block(4, 2, 3);
    const unsigned ctas = 24, n = 24;
    bool cta_shuffled = false, thread_shuffled = false;
    for (std::uint64_t seed : kSeeds) {
        kvp_emu::set_seed(seed);
        std::vector<unsigned> out(12 * n * ctas, ~0u), cta_log(ctas, ~0u), thread_log(n, ~0u),
            cursor(2, 0);
        const KvpEmuIndexParams p{out.data(), cta_log.data(), thread_log.data(), cursor.data()};
        const int rc = kvp_emu::launch(kvp_emu_test_index, grid, block, 0, p);
        if (rc != 0) return fail(launch_failed("index", rc));
        if (cursor[0] != ctas || cursor[1] != n) return fail("wrong number of CTAs or threads ran");
        for (unsigned c = 0; c < ctas; ++c) {
            const unsigned bx = c % 3, by = c / 3 % 2, bz = c / 6;
            for (unsigned t = 0; t < n; ++t) {
                const unsigned want[12] = {t % 4, t / 4 % 2, t / 8, bx, by, bz, 4, 2, 3, 3, 2, 4};
                for (unsigned k = 0; k < 12; ++k)
                    if (out[12 * (c * n + t) + k] != want[k])
                        return fail("index " + std::to_string(k) + " of thread " +
                                    std::to_string(t) + " of CTA " + std::to_string(c) + " is " +
                                    std::to_string(out[12 * (c * n + t) + k]));
            }
        }
        std::vector<bool> seen_cta(ctas, false), seen_thread(n, false);
        for (unsigned i = 0; i < ctas; ++i) {
            if (cta_log[i] >= ctas || seen_cta[cta_log[i]])
                return fail("CTA order is not a permutation");
            seen_cta[cta_log[i]] = true;
            if (seed == 0 && cta_log[i] != i)
                return fail("seed 0 did not run CTAs in blockIdx order");
            cta_shuffled = cta_shuffled || cta_log[i] != i;
        }
        for (unsigned i = 0; i < n; ++i) {
            if (thread_log[i] >= n || seen_thread[thread_log[i]])
                return fail("thread order is not a permutation");
            seen_thread[thread_log[i]] = true;
            if (seed == 0 && thread_log[i] != i)
                return fail("seed 0 did not run threads in index order");
            thread_shuffled = thread_shuffled || thread_log[i] != i;
        }
    }
    if (!cta_shuffled || !thread_shuffled)
        return fail("no seed changed the CTA or the thread order");
    return pass();
}

/// CTA-wide votes over block sizes that are and are not multiples of 32.
int kvp_emu_selftest_cta_vote(void) {
    const unsigned sizes[] = {1, 33, 96, 1024};
    for (std::uint64_t seed : kSeeds) {
        kvp_emu::set_seed(seed);
        for (unsigned n : sizes) {
            const unsigned ctas = 2;
            std::vector<int> out(4 * n * ctas, -1);
            const KvpEmuVoteParams p{out.data()};
            const int rc = kvp_emu::launch(kvp_emu_test_cta_vote, dim3(ctas), dim3(n), 0, p);
            if (rc != 0) return fail(launch_failed("cta_vote", rc));
            const int want[4] = {static_cast<int>((n + 2) / 3), 1, 1, 0};
            for (unsigned i = 0; i < 4 * n * ctas; ++i)
                if (out[i] != want[i % 4])
                    return fail("cta_vote block " + std::to_string(n) + " value " +
                                std::to_string(i % 4) + " of thread " + std::to_string(i / 4) +
                                ": " + std::to_string(out[i]));
        }
    }
    return pass();
}

/// `kvp_emu::set_stack_bytes` gives kernels with 96 KiB of locals room; each fiber has its
/// own stack (the values written before a barrier survive it).
int kvp_emu_selftest_stack_size(void) {
    const std::size_t before = kvp_emu::stack_bytes();
    kvp_emu::set_stack_bytes(256 * 1024);
    kvp_emu::set_seed(3);
    const unsigned ctas = 2, n = 64;
    std::vector<float> out(ctas * n, -1.0f);
    const KvpEmuStackParams p{out.data()};
    const int rc = kvp_emu::launch(kvp_emu_test_stack, dim3(ctas), dim3(n), 0, p);
    kvp_emu::set_stack_bytes(before);
    if (rc != 0) return fail(launch_failed("stack", rc));
    for (unsigned t = 0; t < ctas * n; ++t) {
        float want = 0.0f;
        for (unsigned i = 0; i < KVP_EMU_TEST_STACK_FLOATS; ++i)
            want += static_cast<float>((t + i) % 4);
        if (out[t] != want)
            return fail("stack: thread " + std::to_string(t) + " summed " + std::to_string(out[t]));
    }
    if (block_reduce_with(1, dim3(2), dim3(64)) != 0) return 1;
    return pass();
}

/// `__trap()` stops the launch with kTrap and names the thread.
int kvp_emu_selftest_trap(void) {
    kvp_emu::set_seed(0);
    std::vector<unsigned> ran(4 * 32, 0);
    const KvpEmuTrapParams p{ran.data()};
    const int rc = kvp_emu::launch(kvp_emu_test_trap, dim3(4), dim3(32), 0, p);
    if (rc != kvp_emu::kTrap) return fail("trap returned " + std::to_string(rc));
    if (std::string(kvp_emu::last_error()).find("thread (3,0,0) of block (1,0,0)") ==
        std::string::npos)
        return fail(std::string("trap message: ") + kvp_emu::last_error());
    for (unsigned t = 0; t < 32; ++t)
        if (ran[t] != 1) return fail("CTA 0 did not run before the trap");
    for (unsigned t = 64; t < 128; ++t)
        if (ran[t] != 0) return fail("a CTA ran after the trap");
    return pass();
}

/// Four OS threads launch at once, each with its own seed; each gets its own right result.
int kvp_emu_selftest_threads(void) {
    int results[4] = {-1, -1, -1, -1};
    std::string messages[4];
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) {
        threads.emplace_back([i, &results, &messages] {
            int rc = 0;
            for (int k = 0; k < 20 && rc == 0; ++k)
                rc = block_reduce_with(static_cast<std::uint64_t>(i * 100 + k), dim3(4, 3),
                                       dim3(8, 4, 3));
            if (rc == 0) rc = warp_with(static_cast<std::uint64_t>(i + 1), 128, 2, false);
            results[i] = rc;
            messages[i] = message;
        });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < 4; ++i)
        if (results[i] != 0) return fail("OS thread " + std::to_string(i) + ": " + messages[i]);
    return pass();
}

/// Nanoseconds per fiber switch measured over 64 CTAs of 128 threads passing 100 barriers
/// (each barrier: a switch to the scheduler and one back per thread, scheduling included);
/// negative if the launch failed.
double kvp_emu_selftest_switch_ns(void) {
    kvp_emu::set_seed(1);
    const unsigned ctas = 64, n = 128;
    std::vector<unsigned> out(ctas * n, 0);
    const KvpEmuBarrierLoopParams p{100, out.data()};
    const std::uint64_t before = kvp_emu::switch_count();
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = kvp_emu::launch(kvp_emu_test_barrier_loop, dim3(ctas), dim3(n), 0, p);
    const auto t1 = std::chrono::steady_clock::now();
    if (rc != 0) return -1.0;
    for (unsigned v : out)
        if (v != 100) return -1.0;
    const double resumes = static_cast<double>(kvp_emu::switch_count() - before);
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / (2.0 * resumes);
}

}  // extern "C"
