//! Self-tests of the host CUDA emulation (`kernels/emulation.hpp`), built with the
//! `emulation` feature: each test calls one `kvp_emu_selftest_*` entry point of
//! `kernels/host/emulation_selftest.cpp`, which launches the kernels of
//! `kernels/host/emulation_selftest_kernels.cuh` in emulation and compares them with host
//! computations. The tests run on several test threads at once, which the emulation
//! supports (all of its state is per OS thread).
#![cfg(feature = "emulation")]

use std::ffi::CStr;
use std::os::raw::{c_char, c_int};

// Links the crate, and with it the static library of the emulated kernels and self-tests.
use kvpage_cuda as _;

extern "C" {
    fn kvp_emu_selftest_message() -> *const c_char;
    fn kvp_emu_selftest_block_reduce() -> c_int;
    fn kvp_emu_selftest_warp_shuffles() -> c_int;
    fn kvp_emu_selftest_dynamic_shared_poison() -> c_int;
    fn kvp_emu_selftest_missing_sync() -> c_int;
    fn kvp_emu_selftest_deadlock() -> c_int;
    fn kvp_emu_selftest_invalid_launch() -> c_int;
    fn kvp_emu_selftest_grid_3d() -> c_int;
    fn kvp_emu_selftest_trap() -> c_int;
    fn kvp_emu_selftest_threads() -> c_int;
    fn kvp_emu_selftest_cta_vote() -> c_int;
    fn kvp_emu_selftest_stack_size() -> c_int;
    fn kvp_emu_selftest_switch_ns() -> f64;
}

/// Runs one self-test and fails with its message unless it returned 0.
fn check(name: &str, selftest: unsafe extern "C" fn() -> c_int) {
    // SAFETY: the self-tests take no arguments; the message is a NUL-terminated string owned
    // by this OS thread, read before the next self-test on it.
    let (rc, message) = unsafe {
        let rc = selftest();
        let message = CStr::from_ptr(kvp_emu_selftest_message())
            .to_string_lossy()
            .into_owned();
        (rc, message)
    };
    assert_eq!(rc, 0, "emulation self-test {name} failed: {message}");
}

#[test]
fn block_reduce_with_barriers_matches_host_sums() {
    check("block_reduce", kvp_emu_selftest_block_reduce);
}

#[test]
fn warp_shuffles_match_host_reductions() {
    check("warp_shuffles", kvp_emu_selftest_warp_shuffles);
}

#[test]
fn dynamic_shared_memory_is_poisoned_at_every_cta() {
    check(
        "dynamic_shared_poison",
        kvp_emu_selftest_dynamic_shared_poison,
    );
}

#[test]
fn missing_syncthreads_gives_a_wrong_result_for_some_seed() {
    check("missing_sync", kvp_emu_selftest_missing_sync);
}

#[test]
fn deadlocks_are_reported_not_hung() {
    check("deadlock", kvp_emu_selftest_deadlock);
}

#[test]
fn invalid_launch_configurations_are_rejected() {
    check("invalid_launch", kvp_emu_selftest_invalid_launch);
}

#[test]
fn grid_and_block_indices_in_three_dimensions() {
    check("grid_3d", kvp_emu_selftest_grid_3d);
}

#[test]
fn trap_stops_the_launch() {
    check("trap", kvp_emu_selftest_trap);
}

#[test]
fn concurrent_launches_from_several_os_threads() {
    check("threads", kvp_emu_selftest_threads);
}

#[test]
fn cta_votes_count_and_or() {
    check("cta_vote", kvp_emu_selftest_cta_vote);
}

#[test]
fn larger_fiber_stacks_hold_large_local_arrays() {
    check("stack_size", kvp_emu_selftest_stack_size);
}

#[test]
fn fiber_switch_cost() {
    // SAFETY: no arguments; returns a number.
    let ns = unsafe { kvp_emu_selftest_switch_ns() };
    assert!(ns > 0.0, "the barrier loop launch failed");
    println!("emulation: {ns:.1} ns per fiber switch (scheduling included)");
}
