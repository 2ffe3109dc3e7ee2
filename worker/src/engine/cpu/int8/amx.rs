//! The AMX copy of the integer recipe ([`super::dot_scalar`]) for batches of 16 rows or more:
//! one tile instruction computes a block's exact integer sums for 16 input rows × 16 weight rows
//! (`tdpbssd` for signed Q8_0 weights, `tdpbsud` for Q4_1's unsigned nibbles, the input signed),
//! and the block's float steps then run per row of the tile in AVX-512, in the recipe's order.
//!
//! # Tiles
//! One configuration for every kernel, loaded once per thread that runs one ([`ensure_config`]):
//! `tmm0..3` are the sums (16 rows × 16 `i32`), `tmm4..5` input rows (16 rows × one block, 32
//! bytes, read in place from [`QuantizedRows`], whose rows start on cache lines), `tmm6..7` a
//! group's weights for one block (8 rows of 64 bytes: row `t` holds elements `4t..4t+4` of the 16
//! weight rows, the [`Interleaved`] Q8_0 layout; Q4_1's nibbles are unpacked into it). A task lays
//! each of its groups out once, on cache lines, for all its row tiles ([`tile_layout`]): a tile
//! row that straddles two lines makes a tile load about three times slower.
//!
//! # Blocking
//! A pass ([`pass`]) is one tile of 16 input rows times one group of 16 weight rows over every
//! block: the 16×16 float accumulators stay in `zmm` registers from the first block to the last,
//! and each block's sums go through a 4 KiB, 64-byte aligned scratch in L1. Block `b`'s tile
//! product, block `b − 2`'s store of its sums and block `b − 3`'s float steps share an
//! iteration, so a store never waits on the product just issued; the tile slots rotate over
//! `tmm0..3` (sums) and `tmm4..7` (operands) so that consecutive blocks never wait on each
//! other's tile registers.
//!
//! # The OS
//! Linux hands out the tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`), once per process ([`available`]); where the CPU lacks the tiles or the
//! request is refused, the kernels stay at AVX-512 VNNI and a log line says why.
//!
//! The instructions are written in `asm!`: the AMX intrinsics are not stable Rust.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::{Cell, RefCell};
use std::sync::OnceLock;

use super::super::weights::{BlockKind, GROUP, Interleaved};
use super::{Lines, QuantizedRows};

/// Rows of a tile (input rows per tile, and weight rows per group).
pub const TILE_ROWS: usize = 16;

const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Whether this process may run the tile kernels: the CPU has AMX-TILE and AMX-INT8 and the
/// OS granted the tile state. Asked once per process; a refusal is logged.
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !cpu_has_amx_int8() {
            return false;
        }
        match request_tile_state() {
            Ok(()) => true,
            Err(why) => {
                tracing::warn!(
                    "AMX tiles unavailable ({why}); the integer kernels use AVX-512 VNNI"
                );
                false
            }
        }
    })
}

/// CPUID leaf 7: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8; XCR0 bits 17–18 the OS's support of
/// the tile state in XSAVE.
fn cpu_has_amx_int8() -> bool {
    // CPUID exists on every x86-64 CPU; leaf 7 is read only when leaf 0 reports it.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let cpu = (__cpuid_count(7, 0).edx >> 24) & 3 == 3;
    // SAFETY: XGETBV is available when CPUID.1:ECX.OSXSAVE (bit 27) is set, checked first.
    let os = (__cpuid(1).ecx >> 27) & 1 == 1 && unsafe { (_xgetbv(0) >> 17) & 3 == 3 };
    cpu && os
}

/// Asks Linux for the tile data state of this process and checks it was granted.
fn request_tile_state() -> Result<(), String> {
    if !cfg!(target_os = "linux") {
        return Err("tile state is requested only on Linux".into());
    }
    // SAFETY: arch_prctl with these codes reads and writes no user memory except `bits`, a
    // local the kernel fills (GET_XCOMP_PERM takes a pointer to a u64).
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return Err(format!(
                "arch_prctl(ARCH_REQ_XCOMP_PERM) refused: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut bits = 0u64;
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut bits as *mut u64,
        ) != 0
            || (bits >> XFEATURE_XTILEDATA) & 1 == 0
        {
            return Err("the tile data state was not granted".into());
        }
    }
    Ok(())
}

/// The 64-byte tile configuration (palette 1): `colsb` bytes per row and `rows` per tile.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> TileConfig {
        let mut c = TileConfig([0; 64]);
        c.0[0] = 1;
        let mut set = |t: usize, rows: u8, colsb: u16| {
            c.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c.0[48 + t] = rows;
        };
        for t in 0..4 {
            set(t, 16, 64);
        }
        set(4, 16, 32);
        set(5, 16, 32);
        set(6, 8, 64);
        set(7, 8, 64);
        c
    }
}

thread_local! {
    static CONFIGURED: Cell<bool> = const { Cell::new(false) };
}

/// Loads the tile configuration on this thread unless it already was.
///
/// # Safety
/// [`available`] returned true.
unsafe fn ensure_config() {
    CONFIGURED.with(|done| {
        if !done.get() {
            let cfg = TileConfig::new();
            // SAFETY: the caller's contract (the OS granted the tile state); `cfg` is 64 bytes.
            unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
            done.set(true);
        }
    });
}

/// See [`super::dots`]: rows `0..m − m % 16` of groups `g0..g0+ng` by tiles; the caller runs
/// the remaining rows with VNNI.
///
/// # Safety
/// [`available`] returned true; the CPU has AVX-512BW; `out.len() >= ng·a.rows·16`,
/// `g0 + ng <= w.groups`, `w.cols == a.k`.
pub unsafe fn dots(a: &QuantizedRows, w: &Interleaved, g0: usize, ng: usize, out: &mut [f32]) {
    let (m, nb) = (a.rows, w.nb);
    // SAFETY: the caller's contract.
    unsafe { ensure_config() };
    let mut sums = Sums([[0; 256]; SLOTS]);
    TILE_WEIGHTS.with_borrow_mut(|tile_w| {
        tile_w.resize(nb * 512);
        for g in 0..ng {
            let o = &mut out[g * m * GROUP..(g + 1) * m * GROUP];
            // SAFETY: the caller's contract; `tile_w` holds nb blocks of 512 bytes.
            unsafe { group(a, w, g0 + g, tile_w, &mut sums, o) };
        }
    });
}

thread_local! {
    /// A group's weights in the tile layout, on cache lines (see [`tile_layout`]).
    static TILE_WEIGHTS: RefCell<Lines<u8>> = RefCell::new(Lines::default());
}

/// Rows `0..m − m % 16` of group `gg` into `out` (16 floats a row).
///
/// # Safety
/// As [`dots`]; `tile_w` holds `nb` blocks of 512 bytes.
unsafe fn group(
    a: &QuantizedRows,
    w: &Interleaved,
    gg: usize,
    tile_w: &mut [u8],
    sums: &mut Sums,
    out: &mut [f32],
) {
    let (m, nb) = (a.rows, w.nb);
    let q4 = w.kind == BlockKind::Q4_1;
    // SAFETY: group gg exists (the caller's contract).
    unsafe { tile_layout(w, gg, tile_w) };
    let weights = tile_w.as_ptr();
    let mins = if q4 { &w.m } else { &w.d };
    for t in 0..m / TILE_ROWS {
        let p = Pass {
            x: a.q[t * TILE_ROWS * a.k..].as_ptr(),
            k: a.k,
            w: weights,
            dw: w.d[gg * nb * GROUP..].as_ptr(),
            mw: mins[gg * nb * GROUP..].as_ptr(),
            dx: a.d_tiles[t * nb * TILE_ROWS..].as_ptr(),
            sx: a.s_tiles[t * nb * TILE_ROWS..].as_ptr(),
            nb,
        };
        let o = &mut out[t * TILE_ROWS * GROUP..][..TILE_ROWS * GROUP];
        // SAFETY: `p` points at what `pass` reads (16 rows of k bytes, nb blocks of weights
        // and of 16 scales, mins, input scales and sums); `o` holds 16 rows of 16 floats;
        // the tiles are configured on this thread.
        unsafe {
            if q4 {
                pass::<true>(&p, o, sums)
            } else {
                pass::<false>(&p, o, sums)
            }
        }
    }
}

/// Group `g` in the tile layout, on cache lines: per block, 8 rows of 64 bytes, row `t` holding
/// elements `4t..4t+4` of each of the 16 weight rows. For Q8_0 that is the interleaved layout
/// (copied); for Q4_1 row `t < 4` is the low nibbles of interleaved vector `t` (elements
/// `4t..4t+4`), row `t ≥ 4` the high nibbles of vector `t − 4` (elements `16 + 4(t−4)..`).
///
/// # Safety
/// AVX-512BW; group `g` exists; `dst.len() >= nb·512`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn tile_layout(w: &Interleaved, g: usize, dst: &mut [u8]) {
    if w.kind == BlockKind::Q8_0 {
        dst[..w.nb * 512].copy_from_slice(&w.qs[g * w.nb * 512..(g + 1) * w.nb * 512]);
        return;
    }
    let low = _mm512_set1_epi8(0x0f);
    for b in 0..w.nb {
        // SAFETY: block g·nb + b holds 4 vectors of 64 bytes; dst block b holds 512 bytes.
        unsafe {
            let src = w.qs.as_ptr().add((g * w.nb + b) * 256);
            let d = dst.as_mut_ptr().add(b * 512);
            for t in 0..4 {
                let v = _mm512_loadu_si512(src.add(t * 64).cast());
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                _mm512_storeu_si512(d.add(t * 64).cast(), _mm512_and_si512(v, low));
                _mm512_storeu_si512(d.add((t + 4) * 64).cast(), hi);
            }
        }
    }
}

/// One tile of 16 input rows times one group of 16 weight rows, over all blocks.
struct Pass {
    /// The first input row's quantized bytes (rows `k` bytes apart).
    x: *const i8,
    k: usize,
    /// The group's blocks in the tile layout, 512 bytes each.
    w: *const u8,
    /// Per block, the 16 weight rows' scales and (Q4_1) mins.
    dw: *const f32,
    mw: *const f32,
    /// Per block, the 16 input rows' scales `d` and `s = d·Σq` side by side.
    dx: *const f32,
    sx: *const f32,
    nb: usize,
}

/// Blocks whose tile products are issued before a block's sums are stored from their tile:
/// the store waits for its product, and a product just issued kept it (and with it every
/// vector instruction behind it) waiting.
const STORE_LAG: usize = 2;
/// Blocks whose tile products are issued before the float steps of a block run: one more than
/// [`STORE_LAG`], so that the steps read sums stored an iteration earlier.
const LAG: usize = STORE_LAG + 1;
/// Buffers of sums (and sum tiles): more than [`LAG`], a power of two.
const SLOTS: usize = 4;

/// The integer sums of a block, one slot per block in flight.
#[repr(C, align(64))]
struct Sums([[i32; 256]; SLOTS]);

/// [`Pass`]: per block in order, the block's exact integer sums by one tile product, then per
/// output `acc = fma(dw·dx, sum, acc)` and for Q4_1 `acc = fma(mw, sx, acc)`, the 16×16
/// accumulators held in registers from the first block to the last. In the iteration that
/// issues block `b`'s tile product, block `b − STORE_LAG`'s sums are stored from their tile
/// and block `b − LAG`'s float steps run on the sums stored the iteration before; each output
/// still takes its blocks in order.
///
/// # Safety
/// The tiles are configured on this thread; `p` points at what it names; `out` holds 256 floats.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn pass<const Q4: bool>(p: &Pass, out: &mut [f32], sums: &mut Sums) {
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    for b in 0..p.nb + LAG {
        if b < p.nb {
            // SAFETY: block b's input tile and weights are in bounds (the contract).
            unsafe { tile_product::<Q4>(b % SLOTS, p.x.add(b * 32), p.k, p.w.add(b * 512)) };
        }
        if let Some(e) = b.checked_sub(STORE_LAG).filter(|e| *e < p.nb) {
            // SAFETY: block e's product went to sum tile e % SLOTS (STORE_LAG < SLOTS: not
            // reused since); the slot holds 16 rows of 64 bytes.
            unsafe { tile_store(e % SLOTS, sums.0[e % SLOTS].as_mut_ptr()) };
        }
        if let Some(e) = b.checked_sub(LAG) {
            // SAFETY: block e's scales are in bounds (the contract); its slot was stored in
            // the iteration before.
            unsafe { float_steps::<Q4>(p, e, &sums.0[e % SLOTS], &mut acc) };
        }
    }
    for t in 0..TILE_ROWS {
        // SAFETY: `out` holds 16 rows of 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * GROUP), acc[t]) };
    }
}

/// Block `b`'s float steps into the 16 accumulators (see [`pass`]).
///
/// # Safety
/// AVX-512F; block `b`'s scales, mins and input scales exist at `p`.
#[inline(always)]
unsafe fn float_steps<const Q4: bool>(
    p: &Pass,
    b: usize,
    sums: &[i32; 256],
    acc: &mut [__m512; TILE_ROWS],
) {
    // SAFETY: the caller's contract; `sums` is 64-byte aligned (`Sums`).
    unsafe {
        let dw = _mm512_loadu_ps(p.dw.add(b * GROUP));
        let mw = _mm512_loadu_ps(p.mw.add(b * GROUP));
        let (dx, sx) = (p.dx.add(b * TILE_ROWS), p.sx.add(b * TILE_ROWS));
        for t in 0..TILE_ROWS {
            let si = _mm512_cvtepi32_ps(_mm512_load_si512(sums.as_ptr().add(16 * t).cast()));
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*dx.add(t)));
            acc[t] = _mm512_fmadd_ps(scale, si, acc[t]);
            if Q4 {
                acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sx.add(t)), acc[t]);
            }
        }
    }
}

/// One block's tile product into sum tile `tmm{slot}`: loads the input tile (16 rows at stride
/// `k`) and the weight tile (8 rows of 64 bytes), zeroes the sums and multiplies (`tdpbsud` for
/// Q4_1, `tdpbssd` for Q8_0). Slot `i` uses the input and weight tiles `tmm{4 + i % 2}`,
/// `tmm{6 + i % 2}`, so consecutive blocks never wait on each other's tiles.
///
/// # Safety
/// The tiles are configured on this thread; the pointers hold what the tiles read.
#[inline(always)]
unsafe fn tile_product<const Q4: bool>(slot: usize, x: *const i8, k: usize, w: *const u8) {
    macro_rules! product {
        ($c:literal, $a:literal, $b:literal, $op:literal) => {
            asm!(
                concat!("tileloadd tmm", $a, ", [{x} + {k}*1]"),
                concat!("tileloadd tmm", $b, ", [{w} + {s}*1]"),
                concat!("tilezero tmm", $c),
                concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $b),
                x = in(reg) x, k = in(reg) k, w = in(reg) w, s = in(reg) 64usize,
                options(nostack)
            )
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        match (Q4, slot) {
            (true, 0) => product!("0", "4", "6", "tdpbsud"),
            (true, 1) => product!("1", "5", "7", "tdpbsud"),
            (true, 2) => product!("2", "4", "6", "tdpbsud"),
            (true, _) => product!("3", "5", "7", "tdpbsud"),
            (false, 0) => product!("0", "4", "6", "tdpbssd"),
            (false, 1) => product!("1", "5", "7", "tdpbssd"),
            (false, 2) => product!("2", "4", "6", "tdpbssd"),
            (false, _) => product!("3", "5", "7", "tdpbssd"),
        }
    }
}

/// Sum tile `tmm{slot}` (16 rows of 16 `i32`) into `sums`, 64 bytes a row.
///
/// # Safety
/// The tiles are configured on this thread; `sums` holds 256 `i32`.
#[inline(always)]
unsafe fn tile_store(slot: usize, sums: *mut i32) {
    macro_rules! store {
        ($c:literal) => {
            asm!(
                concat!("tilestored [{o} + {s}*1], tmm", $c),
                o = in(reg) sums, s = in(reg) 64usize, options(nostack)
            )
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        match slot {
            0 => store!("0"),
            1 => store!("1"),
            2 => store!("2"),
            _ => store!("3"),
        }
    }
}
