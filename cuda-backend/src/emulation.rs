//! The kernels run on the host (feature `emulation`): the same CUDA source as the GPU
//! fatbin, compiled as C++ against `kernels/emulation.hpp`, which runs every CTA's
//! threads as fibers with shuffled scheduling between barriers. For tests against the
//! CPU backend on machines without a GPU; no speed.
//!
//! The wrappers take host slices, plan the launch with [`crate::launch`] (exactly the
//! configuration a GPU launch gets) and validate every buffer before anything runs, so
//! they are safe: the kernels only touch what the validated plan covers. Emulation state
//! (the scheduling seed, the last error) is per OS thread.

use core::ffi::{c_char, c_int, c_void, CStr};
use core::fmt;

use kvpage_core::{BlockCopy, Geometry};

use crate::launch::{
    plan_attention, plan_copy, plan_f32_write, plan_write_stored, AttentionBuffers, AttentionCall,
    AttentionPlan, Buffer, LaunchConfig, LaunchError, Partitioning,
};
use crate::params::{KvpCopyParams, KvpGeometry, KvpWriteParams};

#[link(name = "kvpage_emu", kind = "static")]
extern "C" {
    fn kvpage_emu_launch(
        id: u32,
        gx: u32,
        gy: u32,
        gz: u32,
        bx: u32,
        by: u32,
        bz: u32,
        shared_bytes: u32,
        params: *const c_void,
    ) -> c_int;
    fn kvpage_emu_last_error() -> *const c_char;
    fn kvpage_emu_set_seed(seed: u64);
    fn kvpage_emu_tile_offset(g: *const KvpGeometry, layer: u32, kv: u32, head: u32) -> u64;
    fn kvpage_emu_block_offset(g: *const KvpGeometry, block: u32) -> u64;
    fn kvpage_emu_row_offset(
        g: *const KvpGeometry,
        block: u32,
        layer: u32,
        kv: u32,
        head: u32,
        row: u32,
    ) -> u64;
    fn kvpage_emu_scale_offset(
        g: *const KvpGeometry,
        block: u32,
        layer: u32,
        kv: u32,
        head: u32,
        row: u32,
    ) -> u64;
    fn kvpage_emu_slot_block(slot: u32, block_size: u32) -> u32;
    fn kvpage_emu_slot_offset(slot: u32, block_size: u32) -> u32;
    fn kvpage_emu_scratch_stat(q_row: u32, q_head: u32, part: u32, q_heads: u32, parts: u32)
        -> u64;
    fn kvpage_emu_query_offset(q_row: u32, q_head: u32, q_heads: u32, head_dim: u32) -> u64;
    fn kvpage_emu_f32_to_f16(x: f32) -> u16;
    fn kvpage_emu_f16_to_f32(h: u16) -> f32;
    fn kvpage_emu_f32_to_bf16(x: f32) -> u16;
    fn kvpage_emu_encode8(dtype: u32, x: f32, scale: f32) -> u8;
    fn kvpage_emu_scale_for(dtype: u32, absmax: f32) -> f32;
    fn kvpage_emu_decode8(dtype: u32, code: u8) -> f32;
    fn kvpage_emu_abi(out: *mut u64, cap: u32) -> u32;
}

/// Why an emulated launch did not run or did not finish.
#[derive(Debug, Clone, PartialEq)]
pub enum EmuError {
    /// The call failed validation; nothing ran.
    Launch(LaunchError),
    /// The arena is not 16-byte aligned (the kernels' vector loads need it), or a
    /// storage-dtype input is not whole elements aligned to their size; nothing ran.
    Misaligned,
    /// The emulator refused the launch or stopped it (a deadlock at a barrier, a trap):
    /// its code and message. Outputs may be partly written.
    Emulator {
        /// `kvp_emu` return code (or -1 for an unknown kernel id).
        code: i32,
        /// `kvp_emu::last_error()`.
        message: String,
    },
}

impl fmt::Display for EmuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Launch(e) => write!(f, "invalid launch: {e}"),
            Self::Misaligned => f.write_str("arena or input misaligned"),
            Self::Emulator { code, message } => write!(f, "emulator error {code}: {message}"),
        }
    }
}

impl std::error::Error for EmuError {}

impl From<LaunchError> for EmuError {
    fn from(e: LaunchError) -> Self {
        Self::Launch(e)
    }
}

/// Seed of the emulator's CTA and thread order on this OS thread (0: index order, the
/// default). O(1).
pub fn set_seed(seed: u64) {
    // SAFETY: plain value into thread-local emulator state.
    unsafe { kvpage_emu_set_seed(seed) }
}

/// Runs one launch of `cfg` with `params`.
///
/// # Safety
/// `P` is the params struct of `cfg.kernel`, and every address in it is valid for what
/// the kernel reads and writes under `cfg` (a validated plan over live buffers).
unsafe fn run<P>(cfg: &LaunchConfig, params: &P) -> Result<(), EmuError> {
    let [gx, gy, gz] = cfg.grid;
    let [bx, by, bz] = cfg.block;
    // SAFETY: the caller's contract; the params struct outlives the synchronous launch.
    let code = unsafe {
        kvpage_emu_launch(
            cfg.kernel.id(),
            gx,
            gy,
            gz,
            bx,
            by,
            bz,
            cfg.shared_bytes,
            (params as *const P).cast(),
        )
    };
    if code == 0 {
        return Ok(());
    }
    // SAFETY: the emulator returns a NUL-terminated thread-local string that lives until
    // the next launch on this thread; it is copied at once.
    let message = unsafe { CStr::from_ptr(kvpage_emu_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(EmuError::Emulator { code, message })
}

/// `Err` unless `arena` is `num_blocks` blocks long and 16-byte aligned.
fn check_arena(geometry: &Geometry, num_blocks: u32, arena: &[u8]) -> Result<(), EmuError> {
    let expected = geometry.bytes_per_block() * u64::from(num_blocks);
    if arena.len() as u64 != expected {
        return Err(LaunchError::BufferLength {
            buffer: Buffer::Arena,
            expected,
            actual: arena.len() as u64,
        }
        .into());
    }
    if !(arena.as_ptr() as usize).is_multiple_of(16) {
        return Err(EmuError::Misaligned);
    }
    Ok(())
}

/// The params of a write launch (`kvp_write_kv` or `kvp_write_kv_stored`, by `cfg`) over
/// host buffers: `k` and `v` point at f32 or storage-dtype elements. O(1); the pointers
/// are only read by the launch, which the caller has validated.
fn write_params<K>(
    geometry: &Geometry,
    num_blocks: u32,
    arena: &mut [u8],
    (k, v): (*const K, *const K),
    slots: &[u32],
    cfg: &LaunchConfig,
    layer: u32,
) -> KvpWriteParams {
    KvpWriteParams {
        geo: KvpGeometry::new(geometry, num_blocks),
        arena: arena.as_mut_ptr() as u64,
        k: k as u64,
        v: v as u64,
        slots: slots.as_ptr() as u64,
        tokens: cfg.grid[0],
        layer,
        k_scale: 0.0,
        v_scale: 0.0,
    }
}

/// `kvp_write_kv` in emulation: the K/V of `slots.len()` new tokens of `layer` into
/// `arena` (`num_blocks` blocks), as [`crate::launch::plan_write`] plans it. O(tokens × kv_heads ×
/// head_dim) emulated threads' work.
///
/// # Errors
/// [`crate::launch::plan_write`]'s errors, a wrong arena length,
/// [`EmuError::Misaligned`], or the emulator's.
pub fn write_kv(
    geometry: &Geometry,
    num_blocks: u32,
    arena: &mut [u8],
    layer: u32,
    slots: &[u32],
    k: &[f32],
    v: &[f32],
) -> Result<(), EmuError> {
    write_f32(geometry, num_blocks, arena, layer, slots, (k, v), None)
}

/// [`write_kv`] with the 8-bit rows at the fixed `scales` (`[k, v]`), as
/// [`crate::launch::plan_write_at_scales`] plans it. O(tokens × kv_heads × head_dim)
/// emulated threads' work.
///
/// # Errors
/// That planner's errors; otherwise as [`write_kv`].
pub fn write_kv_at_scales(
    geometry: &Geometry,
    num_blocks: u32,
    arena: &mut [u8],
    layer: u32,
    slots: &[u32],
    (k, v): (&[f32], &[f32]),
    scales: [f32; 2],
) -> Result<(), EmuError> {
    write_f32(
        geometry,
        num_blocks,
        arena,
        layer,
        slots,
        (k, v),
        Some(scales),
    )
}

/// [`write_kv`] or [`write_kv_at_scales`], by `scales`.
fn write_f32(
    geometry: &Geometry,
    num_blocks: u32,
    arena: &mut [u8],
    layer: u32,
    slots: &[u32],
    (k, v): (&[f32], &[f32]),
    scales: Option<[f32; 2]>,
) -> Result<(), EmuError> {
    let lens = (k.len(), v.len());
    let plan = plan_f32_write(geometry, num_blocks, layer, slots, lens, scales)?;
    check_arena(geometry, num_blocks, arena)?;
    let Some(cfg) = plan else { return Ok(()) };
    let mut p = write_params(
        geometry,
        num_blocks,
        arena,
        (k.as_ptr(), v.as_ptr()),
        slots,
        &cfg,
        layer,
    );
    [p.k_scale, p.v_scale] = scales.unwrap_or([0.0; 2]);
    // SAFETY: the plan validated slots, layer and the k / v lengths against the geometry,
    // and the arena length was checked: every access is inside the slices.
    unsafe { run(&cfg, &p) }
}

/// `kvp_write_kv_stored` in emulation: as [`write_kv`] with `k` and `v` the bytes of
/// storage-dtype elements (f32, f16 or bf16, native endian, aligned to the element size),
/// as [`plan_write_stored`] plans it.
///
/// # Errors
/// [`plan_write_stored`]'s errors (lengths counted in elements), a wrong arena length,
/// [`EmuError::Misaligned`] for an arena or input not aligned, or the emulator's.
pub fn write_kv_stored(
    geometry: &Geometry,
    num_blocks: u32,
    arena: &mut [u8],
    layer: u32,
    slots: &[u32],
    k: &[u8],
    v: &[u8],
) -> Result<(), EmuError> {
    let size = geometry.dtype().size_bytes() as usize;
    let plan = plan_write_stored(
        geometry,
        num_blocks,
        layer,
        slots,
        k.len() / size,
        v.len() / size,
    )?;
    check_arena(geometry, num_blocks, arena)?;
    for input in [k, v] {
        if input.len() % size != 0 || !(input.as_ptr() as usize).is_multiple_of(size) {
            return Err(EmuError::Misaligned);
        }
    }
    let Some(cfg) = plan else { return Ok(()) };
    let p = write_params(
        geometry,
        num_blocks,
        arena,
        (k.as_ptr(), v.as_ptr()),
        slots,
        &cfg,
        layer,
    );
    // SAFETY: as in `write_kv`; k and v hold whole, aligned storage elements.
    unsafe { run(&cfg, &p) }
}

/// `kvp_copy_blocks` in emulation: every copy in one launch, as [`plan_copy`] plans it.
/// O(copies × bytes_per_block).
///
/// # Errors
/// [`plan_copy`]'s errors, a wrong arena length, [`EmuError::Misaligned`], or the
/// emulator's.
pub fn copy_blocks(
    geometry: &Geometry,
    num_blocks: u32,
    arena: &mut [u8],
    copies: &[BlockCopy],
) -> Result<(), EmuError> {
    let plan = plan_copy(geometry, num_blocks, copies)?;
    check_arena(geometry, num_blocks, arena)?;
    let Some(cfg) = plan else { return Ok(()) };
    let p = KvpCopyParams {
        arena: arena.as_mut_ptr() as u64,
        pairs: copies.as_ptr() as u64,
        bytes_per_block: geometry.bytes_per_block(),
        num_pairs: cfg.grid[0],
        pad0: 0,
    };
    // SAFETY: block ids validated against num_blocks, the arena length checked;
    // `BlockCopy` is `#[repr(C)] { src: u32, dst: u32 }`, the kernel's pair layout.
    unsafe { run(&cfg, &p) }
}

/// Attention in emulation: `call` (its `q_len` / `out_len` must be `q.len()` /
/// `out.len()`) over `arena`, planned by [`plan_attention`] with `partitioning`; runs the
/// reduce when the plan has one (its scratch is allocated here). Returns the plan
/// (`None`: no query rows, nothing ran).
///
/// # Errors
/// [`plan_attention`]'s errors, a wrong arena, query or output length,
/// [`EmuError::Misaligned`], or the emulator's.
pub fn attention(
    call: &AttentionCall<'_>,
    partitioning: Partitioning,
    arena: &[u8],
    q: &[f32],
    out: &mut [f32],
) -> Result<Option<AttentionPlan>, EmuError> {
    let plan = plan_attention(call, partitioning)?;
    check_arena(&call.geometry, call.num_blocks, arena)?;
    for (buffer, expected, actual) in [
        (Buffer::Query, call.q_len, q.len()),
        (Buffer::Output, call.out_len, out.len()),
    ] {
        if expected != actual {
            return Err(LaunchError::BufferLength {
                buffer,
                expected: expected as u64,
                actual: actual as u64,
            }
            .into());
        }
    }
    let Some(plan) = plan else { return Ok(None) };
    let scratch_len =
        usize::try_from(plan.scratch_floats).map_err(|_| LaunchError::BufferLength {
            buffer: Buffer::Scratch,
            expected: plan.scratch_floats,
            actual: 0,
        })?;
    // NaN: an element the attention kernel should have written and did not poisons the
    // reduce's output.
    let mut scratch = vec![f32::NAN; scratch_len];
    let p = plan.params(AttentionBuffers {
        arena: arena.as_ptr() as u64,
        q: q.as_ptr() as u64,
        out: out.as_mut_ptr() as u64,
        block_table: call.table.as_ptr() as u64,
        seqs: call.seqs.as_ptr() as u64,
        scratch: scratch.as_mut_ptr() as u64,
    });
    // SAFETY: the plan validated rows, contexts, block ids and q / out lengths against
    // the table, the arena's blocks and the shapes; scratch has the planned size.
    unsafe { run(&plan.attention, &p)? };
    if let Some(reduce) = &plan.reduce {
        // SAFETY: as above; the reduce reads the scratch the attention launch wrote.
        unsafe { run(reduce, &p)? };
    }
    Ok(Some(plan))
}

/// The kernels' index functions (`kernels/layout.cuh`), called on the host.
pub mod index {
    use super::*;

    /// `kvp::tile_offset`. O(1).
    pub fn tile_offset(g: &KvpGeometry, layer: u32, kv: u32, head: u32) -> u64 {
        // SAFETY: reads the struct only.
        unsafe { kvpage_emu_tile_offset(g, layer, kv, head) }
    }
    /// `kvp::block_offset`. O(1).
    pub fn block_offset(g: &KvpGeometry, block: u32) -> u64 {
        // SAFETY: reads the struct only.
        unsafe { kvpage_emu_block_offset(g, block) }
    }
    /// `kvp::row_offset`. O(1).
    pub fn row_offset(
        g: &KvpGeometry,
        block: u32,
        layer: u32,
        kv: u32,
        head: u32,
        row: u32,
    ) -> u64 {
        // SAFETY: reads the struct only.
        unsafe { kvpage_emu_row_offset(g, block, layer, kv, head, row) }
    }
    /// `kvp::scale_offset`. O(1).
    pub fn scale_offset(
        g: &KvpGeometry,
        block: u32,
        layer: u32,
        kv: u32,
        head: u32,
        row: u32,
    ) -> u64 {
        // SAFETY: reads the struct only.
        unsafe { kvpage_emu_scale_offset(g, block, layer, kv, head, row) }
    }
    /// `kvp::slot_block` and `kvp::slot_offset`. O(1).
    pub fn slot(slot: u32, block_size: u32) -> (u32, u32) {
        // SAFETY: pure functions of plain values.
        unsafe {
            (
                kvpage_emu_slot_block(slot, block_size),
                kvpage_emu_slot_offset(slot, block_size),
            )
        }
    }
    /// `kvp::scratch_stat`. O(1).
    pub fn scratch_stat(q_row: u32, q_head: u32, part: u32, q_heads: u32, parts: u32) -> u64 {
        // SAFETY: pure function of plain values.
        unsafe { kvpage_emu_scratch_stat(q_row, q_head, part, q_heads, parts) }
    }
    /// `kvp::query_offset`. O(1).
    pub fn query_offset(q_row: u32, q_head: u32, q_heads: u32, head_dim: u32) -> u64 {
        // SAFETY: pure function of plain values.
        unsafe { kvpage_emu_query_offset(q_row, q_head, q_heads, head_dim) }
    }
}

/// The kernels' element conversions (`kernels/dtype.cuh`, host side), for bit-exact
/// comparison with the CPU backend's.
pub mod convert {
    use super::*;

    /// f32 → f16 bits, round to nearest even. O(1).
    pub fn f32_to_f16(x: f32) -> u16 {
        // SAFETY: pure function of a plain value.
        unsafe { kvpage_emu_f32_to_f16(x) }
    }
    /// f16 bits → f32. O(1).
    pub fn f16_to_f32(h: u16) -> f32 {
        // SAFETY: pure function of a plain value.
        unsafe { kvpage_emu_f16_to_f32(h) }
    }
    /// f32 → bf16 bits, round to nearest even. O(1).
    pub fn f32_to_bf16(x: f32) -> u16 {
        // SAFETY: pure function of a plain value.
        unsafe { kvpage_emu_f32_to_bf16(x) }
    }
    /// The 8-bit code of `x` in a row of scale `scale` (`dtype` 3: int8, 4: fp8). O(1).
    pub fn encode8(dtype: u32, x: f32, scale: f32) -> u8 {
        // SAFETY: pure function of plain values.
        unsafe { kvpage_emu_encode8(dtype, x, scale) }
    }
    /// The value of an 8-bit code before scaling (`dtype` 3: int8, 4: fp8). O(1).
    pub fn decode8(dtype: u32, code: u8) -> f32 {
        // SAFETY: pure function of plain values.
        unsafe { kvpage_emu_decode8(dtype, code) }
    }
    /// The scale of a row of largest magnitude `absmax`. O(1).
    pub fn scale_for(dtype: u32, absmax: f32) -> f32 {
        // SAFETY: pure function of plain values.
        unsafe { kvpage_emu_scale_for(dtype, absmax) }
    }
}

/// Sizes and field offsets of the ABI structs as the C++ compiler lays them out, in the
/// order of `kvpage_emu_abi` (`kernels/host/emulation_entry.cpp`). O(1).
pub fn abi_layout() -> Vec<u64> {
    let mut v = vec![0u64; 64];
    // SAFETY: writes at most `cap` = 64 values into the buffer.
    let n = unsafe { kvpage_emu_abi(v.as_mut_ptr(), 64) } as usize;
    v.truncate(n.min(64));
    v
}
