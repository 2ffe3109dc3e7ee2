//! The AMX copy of the integer recipe ([`super::dot_scalar`]) for batches of 16 rows or more:
//! one tile instruction computes a block's exact integer sums for 16 input rows × 16 weight rows
//! (`tdpbssd` for signed Q8_0 weights, `tdpbsud` for Q4_1's unsigned nibbles, the input signed),
//! and the block's float steps then run per row of the tile in AVX-512, in the recipe's order.
//!
//! # Tiles
//! One configuration for every kernel, loaded once per thread that runs one ([`ensure_config`]):
//! `tmm0..3` are the sums (16 rows × 16 `i32`), `tmm4..5` two tiles of input rows (16 rows × one
//! block, 32 bytes, read in place from [`QuantizedRows`]), `tmm6..7` two groups' weights for one
//! block (8 rows of 64 bytes: row `t` holds elements `4t..4t+4` of the 16 weight rows, which is
//! exactly the [`Interleaved`] Q8_0 layout; Q4_1's nibbles are unpacked into it per task).
//!
//! # The OS
//! Linux hands out the tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`), once per process ([`available`]); where the CPU lacks the tiles or the
//! request is refused, the kernels stay at AVX-512 VNNI and a log line says why.
//!
//! The instructions are written in `asm!`: the AMX intrinsics are not stable Rust.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::sync::OnceLock;

use super::super::weights::{BlockKind, GROUP, Interleaved};
use super::QuantizedRows;

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
    let m = a.rows;
    let full = m - m % TILE_ROWS;
    // SAFETY: the caller's contract.
    unsafe { ensure_config() };
    let mut unpacked = Vec::new();
    let mut g = 0;
    while g < ng {
        let gt = if ng - g >= 2 { 2 } else { 1 };
        let weights = match w.kind {
            // SAFETY: groups g0+g..g0+g+gt exist (the contract).
            BlockKind::Q8_0 => unsafe { w.qs.as_ptr().add((g0 + g) * w.nb * 512) },
            BlockKind::Q4_1 => {
                unpacked.resize(gt * w.nb * 512, 0);
                // SAFETY: as above; `unpacked` holds gt·nb blocks of 512 bytes.
                unsafe { unpack_q4_1(w, g0 + g, gt, &mut unpacked) };
                unpacked.as_ptr()
            }
        };
        let span = &mut out[g * m * GROUP..];
        span[..gt * m * GROUP].fill(0.0);
        let mut r = 0;
        while r < full {
            let rt = if full - r >= 2 * TILE_ROWS { 2 } else { 1 };
            // SAFETY: rows r..r+16·rt < m; `weights` holds gt·nb blocks of 512 bytes; `span`
            // holds gt·m·16 floats; the tiles are configured on this thread.
            unsafe {
                match (rt, gt) {
                    (2, 2) => tiles::<2, 2>(a, r, w, g0 + g, weights, span),
                    (2, _) => tiles::<2, 1>(a, r, w, g0 + g, weights, span),
                    (_, 2) => tiles::<1, 2>(a, r, w, g0 + g, weights, span),
                    _ => tiles::<1, 1>(a, r, w, g0 + g, weights, span),
                }
            }
            r += rt * TILE_ROWS;
        }
        g += gt;
    }
}

/// Groups `g..g+gt` of a Q4_1 matrix in the tile layout: per group and block, 8 rows of 64
/// bytes, row `t < 4` the low nibbles of interleaved vector `t` (elements `4t..4t+4`), row
/// `t ≥ 4` the high nibbles of vector `t − 4` (elements `16 + 4(t−4)..`), so row `t` holds
/// elements `4t..4t+4` of each of the 16 weight rows.
///
/// # Safety
/// AVX-512BW; groups `g..g+gt` exist; `dst.len() >= gt·nb·512`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn unpack_q4_1(w: &Interleaved, g: usize, gt: usize, dst: &mut [u8]) {
    let low = _mm512_set1_epi8(0x0f);
    for gb in 0..gt * w.nb {
        // SAFETY: block g·nb + gb holds 4 vectors of 64 bytes; dst block gb holds 512 bytes.
        unsafe {
            let src = w.qs.as_ptr().add((g * w.nb + gb) * 256);
            let d = dst.as_mut_ptr().add(gb * 512);
            for t in 0..4 {
                let v = _mm512_loadu_si512(src.add(t * 64).cast());
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                _mm512_storeu_si512(d.add(t * 64).cast(), _mm512_and_si512(v, low));
                _mm512_storeu_si512(d.add((t + 4) * 64).cast(), hi);
            }
        }
    }
}

/// `RT` tiles of input rows from `r` times `GT` groups from `g`, every block in order: the
/// block's integer sums by the tiles, then per output `acc = fma(dw·dx, sum, acc)` and for Q4_1
/// `acc = fma(mw, s, acc)`, accumulated in `span` (group `gi`'s row `r'` at `(gi·m + r')·16`,
/// zero at the start). The tiles of block `b + 1` are issued before the float steps of block
/// `b` (two buffers of sums), so the vector loads of a block's sums never wait on its tile
/// stores; each output still takes its blocks in order.
///
/// # Safety
/// As [`dots`]'s loop: rows `r..r+16·RT` exist, `weights` holds `GT·nb` blocks of 512 bytes in
/// the tile layout, `span` holds `GT·m·16` floats, the tiles are configured on this thread.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn tiles<const RT: usize, const GT: usize>(
    a: &QuantizedRows,
    r: usize,
    w: &Interleaved,
    g: usize,
    weights: *const u8,
    span: &mut [f32],
) {
    let (nb, k) = (w.nb, a.k);
    let mut sums = [Sums([[0; 256]; 4]), Sums([[0; 256]; 4])];
    for b in 0..=nb {
        if b < nb {
            let xa: [*const i8; RT] =
                core::array::from_fn(|i| a.q[(r + TILE_ROWS * i) * k + b * 32..].as_ptr());
            // SAFETY: block b of each of the GT groups is 512 bytes at `weights` (the contract).
            let wb: [*const u8; GT] =
                core::array::from_fn(|j| unsafe { weights.add((j * nb + b) * 512) });
            let q4 = w.kind == BlockKind::Q4_1;
            // SAFETY: the tiles read 16 rows of 32 bytes at stride k from rows that exist, 8
            // rows of 64 bytes of weights, and write 16 rows of 64 bytes into `sums`.
            unsafe { tile_block::<RT, GT>(xa, k, wb, q4, &mut sums[b & 1]) };
        }
        if b > 0 {
            // SAFETY: AVX-512F (this function's features); the shapes of the contract.
            unsafe { float_steps::<RT, GT>(a, r, w, g, b - 1, &sums[(b - 1) & 1], span) };
        }
    }
}

/// Block `b`'s float steps for the `RT × GT` tiles of sums (see [`tiles`]).
///
/// # Safety
/// AVX-512F; as [`tiles`].
#[inline]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn float_steps<const RT: usize, const GT: usize>(
    a: &QuantizedRows,
    r: usize,
    w: &Interleaved,
    g: usize,
    b: usize,
    sums: &Sums,
    span: &mut [f32],
) {
    let (m, nb) = (a.rows, w.nb);
    let q4 = w.kind == BlockKind::Q4_1;
    for i in 0..RT {
        for j in 0..GT {
            let at = (g + j) * nb + b;
            // SAFETY: group g + j's block b has 16 scales (and mins for Q4_1).
            let dw = unsafe { _mm512_loadu_ps(w.d.as_ptr().add(at * GROUP)) };
            let mw = if q4 {
                unsafe { _mm512_loadu_ps(w.m.as_ptr().add(at * GROUP)) }
            } else {
                _mm512_setzero_ps()
            };
            let sum = &sums.0[i * 2 + j];
            let rows = r + TILE_ROWS * i;
            let o = &mut span[(j * m + rows) * GROUP..(j * m + rows + TILE_ROWS) * GROUP];
            let (dx, sx) = (&a.d[rows * nb..], &a.s[rows * nb..]);
            for t in 0..TILE_ROWS {
                // SAFETY: `o` holds 16 rows of 16 floats, `sum` 16 rows of 16 integers.
                unsafe {
                    let op = o.as_mut_ptr().add(t * GROUP);
                    let si =
                        _mm512_cvtepi32_ps(_mm512_loadu_si512(sum.as_ptr().add(16 * t).cast()));
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[t * nb + b]));
                    let mut acc = _mm512_fmadd_ps(scale, si, _mm512_loadu_ps(op));
                    if q4 {
                        acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[t * nb + b]), acc);
                    }
                    _mm512_storeu_ps(op, acc);
                }
            }
        }
    }
}

/// The integer sums of one block: tile `i·2 + j` is input tile `i` times group `j`.
#[repr(C, align(64))]
struct Sums([[i32; 256]; 4]);

/// One block's tile products into `sums`: loads `RT` input tiles (stride `k`) and `GT` weight
/// tiles (stride 64), zeroes the sums, multiplies (`tdpbsud` for Q4_1, `tdpbssd` for Q8_0) and
/// stores them (stride 64 bytes).
///
/// # Safety
/// The tiles are configured on this thread; the pointers hold what the tiles read.
#[inline(always)]
unsafe fn tile_block<const RT: usize, const GT: usize>(
    xa: [*const i8; RT],
    k: usize,
    wb: [*const u8; GT],
    q4: bool,
    sums: &mut Sums,
) {
    let s = sums.0.as_mut_ptr();
    macro_rules! load {
        ($t:literal, $p:expr, $stride:expr) => {
            asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $p, s = in(reg) $stride, options(nostack, readonly))
        };
    }
    macro_rules! product {
        ($c:literal, $a:literal, $b:literal) => {
            if q4 {
                asm!(
                    concat!("tilezero tmm", $c),
                    concat!("tdpbsud tmm", $c, ", tmm", $a, ", tmm", $b),
                    options(nostack, nomem)
                )
            } else {
                asm!(
                    concat!("tilezero tmm", $c),
                    concat!("tdpbssd tmm", $c, ", tmm", $a, ", tmm", $b),
                    options(nostack, nomem)
                )
            }
        };
    }
    macro_rules! store {
        ($c:literal, $i:expr) => {
            asm!(concat!("tilestored [{p} + {s}*1], tmm", $c), p = in(reg) s.add($i), s = in(reg) 64usize, options(nostack))
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        load!(4, xa[0], k);
        load!(6, wb[0], 64usize);
        product!(0, 4, 6);
        if GT == 2 {
            load!(7, wb[GT - 1], 64usize);
            product!(1, 4, 7);
        }
        if RT == 2 {
            load!(5, xa[RT - 1], k);
            product!(2, 5, 6);
            if GT == 2 {
                product!(3, 5, 7);
            }
        }
        store!(0, 0);
        if GT == 2 {
            store!(1, 1);
        }
        if RT == 2 {
            store!(2, 2);
            if GT == 2 {
                store!(3, 3);
            }
        }
    }
}
