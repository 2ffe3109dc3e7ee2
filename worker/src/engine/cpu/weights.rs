//! The weight matrices of the CPU fast path, in every format they are held in: GGUF Q4_1 and
//! Q8_0 blocks as read from the file, f32 (other formats, dequantized exactly at load), and the
//! interleaved copy the integer kernels read ([`Interleaved`], 16 rows side by side). Parsing,
//! stacking (fused projections) and exact dequantization; the kernels that multiply them are
//! [`super::kernels`] (f32) and [`super::int8`] (integer).

// Block layouts are indexed explicitly, byte by byte.
#![allow(clippy::needless_range_loop)]

/// Weight rows per interleaved group: the f32 lanes of one 512-bit register.
pub const GROUP: usize = 16;

/// A weight matrix of `rows` outputs × `cols` inputs, row-major, in one of the block formats
/// the fast path reads directly (others are dequantized to [`PackedMatrix::F32`] at load).
#[derive(Debug, Clone)]
pub enum PackedMatrix {
    /// GGUF Q4_1 blocks of 32: `(d, m)` as f32 (exact from f16) and 16 bytes of nibbles
    /// (element `j` in the low nibble of byte `j`, element `16 + j` in its high nibble).
    Q4_1 {
        rows: usize,
        cols: usize,
        dm: Vec<[f32; 2]>,
        qs: Vec<[u8; 16]>,
    },
    /// GGUF Q8_0 blocks of 32: `d` as f32 and 32 signed bytes.
    Q8_0 {
        rows: usize,
        cols: usize,
        d: Vec<f32>,
        qs: Vec<[i8; 32]>,
    },
    F32 {
        rows: usize,
        cols: usize,
        w: Vec<f32>,
    },
    /// Q4_1 / Q8_0 rows interleaved 16 at a time for the integer kernels ([`Interleaved`];
    /// same values).
    Interleaved(Box<Interleaved>),
}

fn f16_to_f32(bits: u16) -> f32 {
    half_to_f32(bits)
}

/// IEEE binary16 → binary32 (exact).
fn half_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: value = man · 2^-24, exactly representable in f32.
            let v = man as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

impl PackedMatrix {
    /// Parses GGUF Q4_1 bytes (20 per block) of a `rows × cols` matrix.
    pub fn from_q4_1(bytes: &[u8], rows: usize, cols: usize) -> Option<PackedMatrix> {
        let nb = rows.checked_mul(cols)? / 32;
        if !cols.is_multiple_of(32) || bytes.len() != nb * 20 {
            return None;
        }
        let mut dm = Vec::with_capacity(nb);
        let mut qs = Vec::with_capacity(nb);
        for b in bytes.chunks_exact(20) {
            let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            let m = f16_to_f32(u16::from_le_bytes([b[2], b[3]]));
            dm.push([d, m]);
            qs.push(b[4..20].try_into().ok()?);
        }
        Some(PackedMatrix::Q4_1 { rows, cols, dm, qs })
    }

    /// Parses GGUF Q8_0 bytes (34 per block) of a `rows × cols` matrix.
    pub fn from_q8_0(bytes: &[u8], rows: usize, cols: usize) -> Option<PackedMatrix> {
        let nb = rows.checked_mul(cols)? / 32;
        if !cols.is_multiple_of(32) || bytes.len() != nb * 34 {
            return None;
        }
        let mut d = Vec::with_capacity(nb);
        let mut qs = Vec::with_capacity(nb);
        for b in bytes.chunks_exact(34) {
            d.push(f16_to_f32(u16::from_le_bytes([b[0], b[1]])));
            let mut q = [0i8; 32];
            for (o, &x) in q.iter_mut().zip(&b[2..34]) {
                *o = x as i8;
            }
            qs.push(q);
        }
        Some(PackedMatrix::Q8_0 { rows, cols, d, qs })
    }

    pub fn rows(&self) -> usize {
        match self {
            PackedMatrix::Q4_1 { rows, .. }
            | PackedMatrix::Q8_0 { rows, .. }
            | PackedMatrix::F32 { rows, .. } => *rows,
            PackedMatrix::Interleaved(m) => m.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            PackedMatrix::Q4_1 { cols, .. }
            | PackedMatrix::Q8_0 { cols, .. }
            | PackedMatrix::F32 { cols, .. } => *cols,
            PackedMatrix::Interleaved(m) => m.cols(),
        }
    }

    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        match self {
            PackedMatrix::Q4_1 { dm, .. } => dm.len() * 24,
            PackedMatrix::Q8_0 { d, .. } => d.len() * 36,
            PackedMatrix::F32 { w, .. } => w.len() * 4,
            PackedMatrix::Interleaved(m) => m.bytes(),
        }
    }

    /// The whole matrix as f32 (exact).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows() * self.cols()];
        dequant_rows_impl(self, 0, self.rows(), &mut out);
        out
    }

    /// Stacks matrices with the same `cols` (fused projections: q|k|v, gate|up). Mixed formats
    /// are stored as f32 (exact, more memory).
    pub fn concat(parts: &[&PackedMatrix]) -> Option<PackedMatrix> {
        let cols = parts.first()?.cols();
        if parts.iter().any(|p| p.cols() != cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows()).sum();
        match parts[0] {
            PackedMatrix::Q4_1 { .. }
                if parts.iter().all(|p| matches!(p, PackedMatrix::Q4_1 { .. })) =>
            {
                let (mut dm, mut qs) = (Vec::new(), Vec::new());
                for p in parts {
                    if let PackedMatrix::Q4_1 { dm: a, qs: b, .. } = p {
                        dm.extend_from_slice(a);
                        qs.extend_from_slice(b);
                    }
                }
                Some(PackedMatrix::Q4_1 { rows, cols, dm, qs })
            }
            PackedMatrix::Q8_0 { .. }
                if parts.iter().all(|p| matches!(p, PackedMatrix::Q8_0 { .. })) =>
            {
                let (mut d, mut qs) = (Vec::new(), Vec::new());
                for p in parts {
                    if let PackedMatrix::Q8_0 { d: a, qs: b, .. } = p {
                        d.extend_from_slice(a);
                        qs.extend_from_slice(b);
                    }
                }
                Some(PackedMatrix::Q8_0 { rows, cols, d, qs })
            }
            _ => {
                let mut w = Vec::with_capacity(rows * cols);
                for p in parts {
                    w.extend(p.to_f32());
                }
                Some(PackedMatrix::F32 { rows, cols, w })
            }
        }
    }
}

/// Rows `r0..r0+n` of `m` as f32 into `out[..n*cols]` (exact): the body of
/// [`super::kernels::dequant_rows`], which compiles it once per instruction set.
#[inline(always)]
pub(super) fn dequant_rows_impl(m: &PackedMatrix, r0: usize, n: usize, out: &mut [f32]) {
    match m {
        PackedMatrix::Q4_1 { cols, dm, qs, .. } => {
            let nb = cols / 32;
            let blocks = r0 * nb..(r0 + n) * nb;
            for ((o, s), q) in out
                .chunks_exact_mut(32)
                .zip(&dm[blocks.clone()])
                .zip(&qs[blocks])
            {
                let (d, mm) = (s[0], s[1]);
                let (lo, hi) = o.split_at_mut(16);
                for j in 0..16 {
                    // Two roundings (no FMA), exactly GGUF's / candle's dequantization.
                    lo[j] = (q[j] & 0x0f) as f32 * d + mm;
                    hi[j] = (q[j] >> 4) as f32 * d + mm;
                }
            }
        }
        PackedMatrix::Q8_0 { cols, d, qs, .. } => {
            let nb = cols / 32;
            let blocks = r0 * nb..(r0 + n) * nb;
            for ((o, &s), q) in out
                .chunks_exact_mut(32)
                .zip(&d[blocks.clone()])
                .zip(&qs[blocks])
            {
                for j in 0..32 {
                    o[j] = q[j] as f32 * s;
                }
            }
        }
        PackedMatrix::F32 { cols, w, .. } => {
            out[..n * cols].copy_from_slice(&w[r0 * cols..(r0 + n) * cols]);
        }
        PackedMatrix::Interleaved(m) => m.dequant_rows(r0, n, out),
    }
}

/// The block format of an [`Interleaved`] matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Q4_1,
    Q8_0,
}

/// A Q4_1 or Q8_0 matrix with its rows interleaved in groups of [`GROUP`] (the last group
/// padded with zero rows). For group `g` and block `b` (`gb = g·nb + b`):
/// - Q4_1: 4 vectors of 64 bytes at `qs[(gb·4 + t)·64]`; bytes `4i..4i+4` of vector `t` are
///   bytes `4t..4t+4` of row `i`'s block, whose low nibbles are elements `4t..4t+4` and high
///   nibbles elements `16+4t..16+4t+4`; `d` and `m` at `[gb·16 + i]`;
/// - Q8_0: 8 vectors of 64 bytes at `qs[(gb·8 + t)·64]`, bytes `4i..4i+4` = elements
///   `4t..4t+4` of row `i` (signed); `d` at `[gb·16 + i]`, and `bias[gb·16 + i] = −128·Σw`
///   (the VNNI kernel multiplies `x + 128`, unsigned, by the signed weights).
#[derive(Debug, Clone)]
pub struct Interleaved {
    pub(super) kind: BlockKind,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) nb: usize,
    pub(super) groups: usize,
    pub(super) qs: Vec<u8>,
    pub(super) d: Vec<f32>,
    pub(super) m: Vec<f32>,
    pub(super) bias: Vec<i32>,
}

impl Interleaved {
    /// The interleaved copy of a Q4_1 / Q8_0 matrix (`None` for other formats).
    pub fn from_packed(w: &PackedMatrix) -> Option<Interleaved> {
        let (kind, rows, cols) = match w {
            PackedMatrix::Q4_1 { rows, cols, .. } => (BlockKind::Q4_1, *rows, *cols),
            PackedMatrix::Q8_0 { rows, cols, .. } => (BlockKind::Q8_0, *rows, *cols),
            _ => return None,
        };
        let nb = cols / 32;
        let groups = rows.div_ceil(GROUP);
        let vectors = if kind == BlockKind::Q4_1 { 4 } else { 8 };
        let mut out = Interleaved {
            kind,
            rows,
            cols,
            nb,
            groups,
            qs: vec![0; groups * nb * vectors * 64],
            d: vec![0.0; groups * nb * GROUP],
            m: Vec::new(),
            bias: Vec::new(),
        };
        match w {
            PackedMatrix::Q4_1 { dm, qs, .. } => {
                out.m = vec![0.0; groups * nb * GROUP];
                for row in 0..rows {
                    let (g, i) = (row / GROUP, row % GROUP);
                    for b in 0..nb {
                        let gb = g * nb + b;
                        let src = &qs[row * nb + b];
                        for t in 0..4 {
                            let at = (gb * 4 + t) * 64 + i * 4;
                            out.qs[at..at + 4].copy_from_slice(&src[4 * t..4 * t + 4]);
                        }
                        out.d[gb * GROUP + i] = dm[row * nb + b][0];
                        out.m[gb * GROUP + i] = dm[row * nb + b][1];
                    }
                }
            }
            PackedMatrix::Q8_0 { d, qs, .. } => {
                out.bias = vec![0; groups * nb * GROUP];
                for row in 0..rows {
                    let (g, i) = (row / GROUP, row % GROUP);
                    for b in 0..nb {
                        let gb = g * nb + b;
                        let src = &qs[row * nb + b];
                        for t in 0..8 {
                            let at = (gb * 8 + t) * 64 + i * 4;
                            for u in 0..4 {
                                out.qs[at + u] = src[4 * t + u] as u8;
                            }
                        }
                        out.d[gb * GROUP + i] = d[row * nb + b];
                        out.bias[gb * GROUP + i] =
                            -128 * src.iter().map(|&v| v as i32).sum::<i32>();
                    }
                }
            }
            _ => return None,
        }
        Some(out)
    }

    pub fn kind(&self) -> BlockKind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        self.qs.len() + 4 * (self.d.len() + self.m.len() + self.bias.len())
    }

    /// The 32 quantized values of row `row`'s block `b` (zeros for padded rows).
    pub(super) fn quants(&self, row: usize, b: usize) -> [i32; 32] {
        let (g, i) = (row / GROUP, row % GROUP);
        let gb = g * self.nb + b;
        let mut v = [0i32; 32];
        match self.kind {
            BlockKind::Q4_1 => {
                for t in 0..4 {
                    for u in 0..4 {
                        let byte = self.qs[(gb * 4 + t) * 64 + i * 4 + u];
                        v[4 * t + u] = (byte & 0x0f) as i32;
                        v[16 + 4 * t + u] = (byte >> 4) as i32;
                    }
                }
            }
            BlockKind::Q8_0 => {
                for t in 0..8 {
                    for u in 0..4 {
                        v[4 * t + u] = self.qs[(gb * 8 + t) * 64 + i * 4 + u] as i8 as i32;
                    }
                }
            }
        }
        v
    }

    /// Rows `r0..r0+n` as f32 into `out[..n·cols]`, exactly as GGUF dequantizes them (Q4_1:
    /// `q·d + m`, two roundings; Q8_0: `q·d`), so embedding lookups are unchanged.
    pub fn dequant_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        for (row, o) in (r0..r0 + n).zip(out.chunks_exact_mut(self.cols)) {
            let (g, i) = (row / GROUP, row % GROUP);
            for b in 0..self.nb {
                let at = (g * self.nb + b) * GROUP + i;
                let q = self.quants(row, b);
                for j in 0..32 {
                    o[b * 32 + j] = match self.kind {
                        BlockKind::Q4_1 => q[j] as f32 * self.d[at] + self.m[at],
                        BlockKind::Q8_0 => q[j] as f32 * self.d[at],
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversion_is_exact() {
        assert_eq!(half_to_f32(0x3c00), 1.0);
        assert_eq!(half_to_f32(0xc000), -2.0);
        assert_eq!(half_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(half_to_f32(0x7bff), 65504.0);
        assert!(half_to_f32(0x7c00).is_infinite());
    }

    #[test]
    fn q4_1_dequantization_matches_gguf_definition() {
        let mut bytes = vec![0x00, 0x3c, 0x00, 0xbc]; // d = 1, m = -1
        bytes.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let w = PackedMatrix::from_q4_1(&bytes, 1, 32).unwrap().to_f32();
        for j in 0..16 {
            assert_eq!(w[j], j as f32 - 1.0);
            assert_eq!(w[16 + j], (15 - j) as f32 - 1.0);
        }
        let mut b8 = vec![0x00, 0x40]; // d = 2
        b8.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let w = PackedMatrix::from_q8_0(&b8, 1, 32).unwrap().to_f32();
        assert_eq!(w[0], -32.0);
        assert_eq!(w[31], 30.0);
    }
}
