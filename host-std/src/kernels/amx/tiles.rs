//! The AMX tile registers: whether this process may use them (the CPU has AMX-TILE and
//! AMX-BF16, and Linux granted the permission), the one tile configuration the bf16
//! kernels use, and the tile instructions as inline assembly (Rust has no stable AMX
//! intrinsics). The compiler never allocates the tile registers, so their contents
//! persist from one `asm!` block to the next on the same thread.

use core::arch::asm;

/// Tile register numbers of the configuration [`configure`] loads: two of 16 rows × 32
/// bytes, six of 16 rows × 64 bytes. A tile register is not renamed, so loading the
/// next operands into a register that a product still reads waits for it, and storing
/// sums waits for the product into them: the kernels alternate registers where they
/// can. The scores take one query register (what they load for a group of
/// dimensions waits on the previous group's product into the same scores tile
/// anyway), so that the chained accumulation has four sums tiles.
pub(super) mod tmm {
    /// Scores: 16 tokens × 8 columns of f32 (four rows' high and low query parts).
    pub(in crate::kernels::amx) const SCORES: u8 = 0;
    /// Scores: 16 dimension pairs × 8 columns of the query parts.
    pub(in crate::kernels::amx) const QUERIES: u8 = 1;
    /// Scores and accumulation a tile at a time: 16 keys or values × 32 bf16
    /// dimensions, for alternate groups of dimensions.
    pub(in crate::kernels::amx) const STORED: [u8; 2] = [2, 3];
    /// Accumulation a tile at a time: 16 rows (4 query rows × 2 weight parts × even /
    /// odd dimensions) × 16 f32, for alternate groups.
    pub(in crate::kernels::amx) const SUMS: [u8; 2] = [4, 5];
    /// Accumulation: 16 rows × 16 tokens of the weights, each in one half of a pair.
    pub(in crate::kernels::amx) const WEIGHTS: u8 = 6;
    /// Chained accumulation: the sums of four groups of dimensions, kept across the
    /// tiles of a chunk (the registers of [`STORED`] and [`SUMS`], which a chained
    /// accumulation does not use).
    pub(in crate::kernels::amx) const GROUP_SUMS: [u8; 4] = [2, 3, 4, 5];
    /// Chained accumulation: 16 values × 32 bf16 dimensions.
    pub(in crate::kernels::amx) const VALUES: u8 = 7;
    /// Int8 accumulation ([`super::super::int8`]): the sums of the weights' high and
    /// low bytes (16 rows × 16 words), a group of dimensions at a time.
    pub(in crate::kernels::amx) const PART_SUMS: [u8; 2] = [2, 3];
    /// Int8 accumulation: the weights' high and low bytes (16 rows × 64).
    pub(in crate::kernels::amx) const PART_WEIGHTS: [u8; 2] = [4, 5];
    /// Int8 accumulation: 16 values × 64 codes, for alternate tiles of tokens.
    pub(in crate::kernels::amx) const PART_VALUES: [u8; 2] = [6, 7];
}

/// `[rows, bytes per row]` of each tile register of the configuration.
const SHAPES: [[u8; 2]; 8] = [
    [16, 32],
    [16, 32],
    [16, 64],
    [16, 64],
    [16, 64],
    [16, 64],
    [16, 64],
    [16, 64],
];

/// The 64-byte operand of `ldtilecfg` (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile register.
    colsb: [u16; 16],
    /// Rows of each tile register.
    rows: [u8; 16],
}

/// Whether this process may use the AMX tiles for bf16: the CPU has AMX-TILE and
/// AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22) and the kernel granted the tile data
/// state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, Linux 5.16 and later;
/// the request is per process and made once). False elsewhere, under Miri, and when
/// the request fails (an older kernel, or a thread's signal stack too small for the
/// state). Once granted, Linux refuses any thread of the process an alternate signal
/// stack too small for the tile state: the caller asks only where
/// [`crate::kernels::CPU_PATH_ENV`] allows the tiles. O(1) after the first call.
pub(super) fn permitted() -> bool {
    static PERMITTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PERMITTED.get_or_init(|| !cfg!(miri) && cpu_has_amx_bf16() && request_tile_data())
}

/// CPUID leaf 7's EDX, where the AMX flags are (0 on a CPU without leaf 7). O(1).
fn leaf7_edx() -> u32 {
    use core::arch::x86_64::{__cpuid, __cpuid_count};
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only where leaf 0 says
    // it exists (`__cpuid` is unsafe in Rust 1.89, the minimum supported).
    #[allow(unused_unsafe)]
    unsafe {
        if __cpuid(0).eax < 7 {
            return 0;
        }
        __cpuid_count(7, 0).edx
    }
}

/// CPUID's AMX-TILE and AMX-BF16 flags. O(1).
fn cpu_has_amx_bf16() -> bool {
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    leaf7_edx() & (AMX_BF16 | AMX_TILE) == AMX_BF16 | AMX_TILE
}

/// Whether the CPU has AMX-INT8 (CPUID leaf 7, EDX bit 25): [`dot_u8i8`] and
/// [`dot_i8i8`]. Read once; O(1) after the first call.
pub(super) fn has_int8() -> bool {
    static INT8: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    const AMX_INT8: u32 = 1 << 25;
    *INT8.get_or_init(|| leaf7_edx() & AMX_INT8 != 0)
}

/// Asks Linux for the AMX tile data state; true when granted. O(1).
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the `arch_prctl` system call with a request that only changes which
    // state components this process may use; it reads and writes no memory of ours.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// No other system is asked: the tiles are Linux-only here.
#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// Loads the tile configuration of [`tmm`] on this thread (and zeroes the tiles).
/// O(1).
///
/// # Safety
/// [`permitted`] is true.
#[inline]
pub(super) unsafe fn configure() {
    let mut config = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    for (t, [rows, bytes]) in SHAPES.into_iter().enumerate() {
        config.rows[t] = rows;
        config.colsb[t] = u16::from(bytes);
    }
    // SAFETY: the tiles are permitted (caller); `config` is a valid palette-1
    // configuration, 64 bytes, read only.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly)) };
}

/// Returns the tiles to their initial state on this thread, so that a context switch
/// saves none of their 8 KiB. O(1).
///
/// # Safety
/// [`permitted`] is true.
#[inline]
pub(super) unsafe fn release() {
    // SAFETY: the tiles are permitted (caller).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Zeroes tile `T`. O(1).
///
/// # Safety
/// [`configure`] ran on this thread.
#[inline(always)]
pub(super) unsafe fn zero<const T: u8>() {
    // SAFETY: configured (caller); no memory is touched.
    unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) };
}

/// Loads tile `T` from rows `stride` bytes apart starting at `base`. O(its bytes).
///
/// # Safety
/// [`configure`] ran on this thread; every row of the tile (its configured bytes at
/// `base + i * stride`) is readable.
#[inline(always)]
pub(super) unsafe fn load<const T: u8>(base: *const u8, stride: usize) {
    // SAFETY: the rows are readable (caller).
    unsafe {
        asm!(
            "tileloadd tmm{t}, [{base} + {stride}*1]",
            t = const T,
            base = in(reg) base,
            stride = in(reg) stride,
            options(nostack, readonly),
        )
    };
}

/// Stores tile `T` to rows `stride` bytes apart starting at `base`. O(its bytes).
///
/// # Safety
/// [`configure`] ran on this thread; every row of the tile is writable at `base + i *
/// stride`.
#[inline(always)]
pub(super) unsafe fn store<const T: u8>(base: *mut u8, stride: usize) {
    // SAFETY: the rows are writable (caller).
    unsafe {
        asm!(
            "tilestored [{base} + {stride}*1], tmm{t}",
            t = const T,
            base = in(reg) base,
            stride = in(reg) stride,
            options(nostack),
        )
    };
}

/// `C += A · B` in bf16 pairs with f32 sums (`tdpbf16ps`): `C[m][n] += A[m][2k] ·
/// B[k][2n] + A[m][2k + 1] · B[k][2n + 1]` over the pairs `k` (A's row of pairs, B's
/// rows). Each product is exact; the sums round to nearest even, and subnormal inputs
/// and results are flushed to zero. O(rows × pairs × columns).
///
/// # Safety
/// [`configure`] ran on this thread, and the three shapes agree.
#[inline(always)]
pub(super) unsafe fn dot_bf16<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: configured (caller); registers only.
    unsafe {
        asm!(
            "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
            c = const C,
            a = const A,
            b = const B,
            options(nostack, nomem),
        )
    };
}

/// `C += A · B` in bytes with 32-bit integer sums, A unsigned and B signed
/// (`tdpbusd`): `C[m][n] += Σ_{i<4} A[m][4k + i] · B[k][4n + i]` over `k` (A's rows of
/// four bytes, B's rows). Exact while the sums stay within 32 bits (they wrap).
/// O(rows × quads × columns).
///
/// # Safety
/// [`configure`] ran on this thread, the CPU has AMX-INT8, and the three shapes agree.
#[inline(always)]
pub(super) unsafe fn dot_u8i8<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: configured, AMX-INT8 (caller); registers only.
    unsafe {
        asm!(
            "tdpbusd tmm{c}, tmm{a}, tmm{b}",
            c = const C,
            a = const A,
            b = const B,
            options(nostack, nomem),
        )
    };
}

/// [`dot_u8i8`] with both operands signed (`tdpbssd`). O(rows × quads × columns).
///
/// # Safety
/// As [`dot_u8i8`].
#[inline(always)]
pub(super) unsafe fn dot_i8i8<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: configured, AMX-INT8 (caller); registers only.
    unsafe {
        asm!(
            "tdpbssd tmm{c}, tmm{a}, tmm{b}",
            c = const C,
            a = const A,
            b = const B,
            options(nostack, nomem),
        )
    };
}

/// Stores at `c` (16 rows of 32 bytes, 64 bytes apart) the scores tile of 16 stored
/// keys against four query rows, `Σ_g K_g · Q_g` over `groups` groups of dimensions:
/// `K_g` 16 rows of 64 bytes at `keys + 64 g`, `stride` apart; `Q_g` the query tile of
/// 16 rows of 32 bytes at `queries + 512 g`. The products are [`dot_i8i8`] (`INT8`) or
/// [`dot_bf16`]. Even groups' keys go to the first stored register, odd groups' to
/// the second. O(groups).
///
/// # Safety
/// [`configure`] ran on this thread; the CPU has AMX-INT8 if `INT8`; the rows named
/// are readable, and `c`'s writable.
#[inline(always)]
pub(super) unsafe fn scores_tile<const INT8: bool>(
    keys: *const u8,
    stride: usize,
    queries: *const u8,
    groups: usize,
    c: *mut u8,
) {
    /// One group's product, its keys through register `K`.
    #[inline(always)]
    unsafe fn group<const INT8: bool, const K: u8>(k: *const u8, stride: usize, q: *const u8) {
        // SAFETY: the caller's.
        unsafe {
            load::<K>(k, stride);
            load::<{ tmm::QUERIES }>(q, 32);
            if INT8 {
                dot_i8i8::<{ tmm::SCORES }, K, { tmm::QUERIES }>();
            } else {
                dot_bf16::<{ tmm::SCORES }, K, { tmm::QUERIES }>();
            }
        }
    }
    // SAFETY: the caller's.
    unsafe {
        zero::<{ tmm::SCORES }>();
        for g in 0..groups {
            let (k, q) = (keys.add(64 * g), queries.add(512 * g));
            if g.is_multiple_of(2) {
                group::<INT8, { tmm::STORED[0] }>(k, stride, q);
            } else {
                group::<INT8, { tmm::STORED[1] }>(k, stride, q);
            }
        }
        store::<{ tmm::SCORES }>(c, 64);
    }
}
