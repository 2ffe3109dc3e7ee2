//! Specs of the integer path: the quantization recipe, every instruction set equal to the
//! scalar recipe bit for bit, batch invariance, and the size of the rounding.

use super::*;
use crate::engine::cpu::isa::detected;
use crate::engine::cpu::test_rng::rnd;

/// Q4_1 weights with scales of both signs and every nibble value.
fn q4_1(n: usize, k: usize) -> PackedMatrix {
    let mut bytes = Vec::new();
    for b in 0..n * k / 32 {
        let sign = if b % 3 == 0 { 0x80 } else { 0 };
        bytes.extend_from_slice(&[0x66, 0x2e, (b % 7) as u8, 0xa4 ^ sign]);
        bytes.extend((0..16).map(|j| ((b * 31 + j * 7) % 256) as u8));
    }
    PackedMatrix::from_q4_1(&bytes, n, k).unwrap()
}

/// Q8_0 weights including −128 (which `|w|` must carry as 128).
fn q8_0(n: usize, k: usize) -> PackedMatrix {
    let mut bytes = Vec::new();
    for b in 0..n * k / 32 {
        bytes.extend_from_slice(&[0x66, if b % 2 == 0 { 0x2e } else { 0xae }]);
        bytes.extend((0..32).map(|j| {
            if j == 5 {
                0x80
            } else {
                ((b * 13 + j * 5) % 256) as u8
            }
        }));
    }
    PackedMatrix::from_q8_0(&bytes, n, k).unwrap()
}

/// Activations with an all-zero block, a block of one huge value and ties at ±0.5 steps.
fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut x = rnd(m * k, seed);
    x[..32.min(k)].fill(0.0);
    if m > 1 && k >= 64 {
        x[k + 32..k + 64].fill(1e-3);
        x[k + 40] = 3e4;
    }
    if m > 2 {
        // 127·(j/254) hits exact ties of the rounding (x/d = j/2).
        for j in 0..32 {
            x[2 * k + j] = if j == 31 { 127.0 } else { j as f32 / 2.0 };
        }
    }
    x
}

/// The bit patterns of `v` (NaN payloads and zero signs included).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The instruction sets this host runs; the others are named as skipped.
fn isas() -> Vec<Isa> {
    let all = [
        Isa::Scalar,
        Isa::Avx2,
        Isa::Avx512Bw,
        Isa::Avx512Vnni,
        Isa::Amx,
    ];
    for isa in all.iter().filter(|i| **i > detected()) {
        eprintln!("skipped: this host has no {} kernels", isa.name());
    }
    all.into_iter().filter(|i| *i <= detected()).collect()
}

fn interleave(w: &PackedMatrix) -> PackedMatrix {
    PackedMatrix::Interleaved(Box::new(Interleaved::from_packed(w).unwrap()))
}

#[test]
fn quantization_rounds_to_even() {
    let mut x = vec![0f32; 2 * 96];
    for j in 0..32 {
        x[j] = if j == 31 { 127.0 } else { j as f32 / 2.0 };
    }
    x[96 + 40] = -2.0;
    let mut a = QuantizedRows::default();
    a.quantize(&x, 2, 96);
    assert_eq!((a.rows, a.k, a.nb), (2, 96, 3));
    // d = 1: ties go to the even neighbour (0.5 → 0, 1.5 → 2, 2.5 → 2).
    assert_eq!(&a.q[..6], &[0, 0, 1, 2, 2, 2]);
    assert_eq!(a.q[31], 127);
    assert_eq!(a.qu[31], 255);
    assert_eq!(a.qu[0], 128);
    assert_eq!(a.d[0], 1.0);
    assert_eq!(a.s[0], a.q[..32].iter().map(|&v| v as f32).sum::<f32>());
    // A block of zeros has scale 0; −2 alone is −127 at scale 2/127.
    assert_eq!(a.d[3], 0.0);
    assert_eq!(a.q[96 + 40], -127);
    assert_eq!(a.d[4], 2.0 / 127.0);
}

#[test]
fn every_copy_quantizes_alike_including_ties_zeros_and_non_finite_values() {
    let k = 8 * 32;
    let mut x = activations(3, k, 5);
    x[40] = f32::NAN;
    x[70] = f32::INFINITY;
    x[100] = -1e-40; // a block whose scale underflows
    x[101..128].fill(0.0);
    x[96..100].fill(0.0);
    x[130] = 1e38;
    x[131] = -1e38;
    for m in [1, 3] {
        let n = m * k;
        let (mut q, mut qu) = (vec![0i8; n], vec![0u8; n]);
        let (mut d, mut s) = (vec![0f32; n / 32], vec![0f32; n / 32]);
        quantize_row_impl(&x[..n], &mut q, &mut qu, &mut d, &mut s);
        for isa in isas() {
            // Every output starts as something the copy must overwrite.
            let (mut q2, mut qu2) = (vec![99i8; n], vec![99u8; n]);
            let (mut d2, mut s2) = (vec![f32::NAN; n / 32], vec![f32::NAN; n / 32]);
            quantize_row_with(isa, &x[..n], &mut q2, &mut qu2, &mut d2, &mut s2);
            assert_eq!(q, q2, "{isa:?}");
            assert_eq!(qu, qu2, "{isa:?}");
            assert_eq!(bits(&d), bits(&d2), "{isa:?}");
            assert_eq!(bits(&s), bits(&s2), "{isa:?}");
        }
    }
}

#[test]
fn interleaving_keeps_every_weight_and_pads_the_last_group() {
    for (n, k) in [(11, 96), (40, 64)] {
        for w in [q4_1(n, k), q8_0(n, k)] {
            let iw = Interleaved::from_packed(&w).unwrap();
            assert_eq!((iw.rows(), iw.cols(), iw.groups), (n, k, n.div_ceil(GROUP)));
            let mut got = vec![0f32; n * k];
            iw.dequant_rows(0, n, &mut got);
            assert_eq!(got, w.to_f32(), "same values, same bits");
            assert_eq!(interleave(&w).to_f32(), w.to_f32(), "through PackedMatrix");
            let pad = iw.groups * GROUP - n;
            if pad > 0 {
                assert!(iw.quants(iw.groups * GROUP - 1, 0).iter().all(|&q| q == 0));
            }
        }
    }
}

#[test]
fn every_instruction_set_equals_the_scalar_recipe_bit_for_bit() {
    // Blocks per row: 1 to 4 (fewer, as many and one more than the tile kernel's blocks in
    // flight), 18 and 48 (SmolLM2's 576 and 1536), 29; 11 rows pad a group, 40
    // span three. Batches of 16 and more run on tiles (AMX) with leftover rows on VNNI: 16 to
    // 83 cover one to five row tiles and their remainders.
    for nb in [1, 2, 3, 4, 18, 29, 48] {
        let k = nb * 32;
        for n in [11, 40, 64] {
            for (wname, w) in [("q4_1", q4_1(n, k)), ("q8_0", q8_0(n, k))] {
                let iw = Interleaved::from_packed(&w).unwrap();
                let ng = iw.groups;
                for m in [1, 3, 4, 8, 9, 13, 16, 17, 32, 33, 48, 50, 83] {
                    let mut a = QuantizedRows::default();
                    a.quantize(&activations(m, k, nb as u64), m, k);
                    let mut want = vec![0f32; ng * m * GROUP];
                    dots(Isa::Scalar, &a, &iw, 0, ng, &mut want);
                    for isa in isas() {
                        let mut got = vec![0f32; ng * m * GROUP];
                        dots(isa, &a, &iw, 0, ng, &mut got);
                        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                e.to_bits(),
                                "{} {wname} nb={nb} n={n} m={m} out {i}: {g} vs {e}",
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn tile_groups_and_offsets_match_the_recipe_in_every_slice() {
    // `matmul` hands the kernels slices of groups at an offset; each slice must match the
    // recipe's outputs of those groups.
    let (n, k, m) = (80, 96, 35);
    for w in [q4_1(n, k), q8_0(n, k)] {
        let iw = Interleaved::from_packed(&w).unwrap();
        let mut a = QuantizedRows::default();
        a.quantize(&activations(m, k, 9), m, k);
        for isa in isas() {
            for (g0, ng) in [(0, 5), (1, 3), (2, 2), (4, 1)] {
                let mut got = vec![f32::NAN; ng * m * GROUP];
                dots(isa, &a, &iw, g0, ng, &mut got);
                for g in 0..ng {
                    for r in 0..m {
                        for l in 0..GROUP {
                            let want = dot_scalar(&a, r, &iw, (g0 + g) * GROUP + l);
                            let at = (g * m + r) * GROUP + l;
                            assert_eq!(
                                got[at].to_bits(),
                                want.to_bits(),
                                "{} g{g0}+{g} r{r}",
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn tasks_of_many_groups_match_the_recipe_with_a_whole_or_a_partial_last_group() {
    // 40 groups: `matmul` hands each task several (the tiles lay each group out once per task,
    // then run every row tile over it). With 632 outputs a row the last group is partial (its
    // sums go back to rows by slice). One row (decode), 5 (vectors only) and 35 (two row tiles
    // and 3 rows left). `y` starts as NaN, and one workspace serves every shape in turn, so a
    // float the kernels did not write, or one left from a larger matrix, shows.
    let k = 96;
    let mut ws = Int8Workspace::default();
    for n in [640, 632] {
        for m in [1, 5, 35] {
            for w in [q4_1(n, k), q8_0(n, k)] {
                let w = interleave(&w);
                let PackedMatrix::Interleaved(iw) = &w else {
                    unreachable!()
                };
                let x = activations(m, k, 11);
                let mut y = vec![f32::NAN; m * n];
                matmul(&x, m, &w, &mut y, &mut ws);
                let mut a = QuantizedRows::default();
                a.quantize(&x, m, k);
                for r in 0..m {
                    for c in 0..n {
                        let want = dot_scalar(&a, r, iw, c);
                        assert_eq!(
                            y[r * n + c].to_bits(),
                            want.to_bits(),
                            "n{n} m{m} r{r} c{c}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_rows_start_on_cache_lines() {
    // A tile row of 32 bytes at a multiple of 32 then never straddles two lines.
    let mut a = QuantizedRows::default();
    for (m, k) in [(1, 32), (17, 576), (3, 96)] {
        a.quantize(&rnd(m * k, 1), m, k);
        assert_eq!(a.q.as_ptr() as usize % 64, 0);
        assert_eq!(a.qu.as_ptr() as usize % 64, 0);
        assert_eq!((a.q.len(), a.qu.len()), (m * k, m * k));
    }
}

#[test]
fn a_row_gives_the_same_bits_alone_and_in_any_batch() {
    let (n, k) = (40, 576);
    let w = interleave(&q4_1(n, k));
    let PackedMatrix::Interleaved(iw) = &w else {
        unreachable!()
    };
    let x = rnd(19 * k, 4);
    let mut ws = Int8Workspace::default();
    let mut all = vec![0f32; 19 * n];
    matmul(&x, 19, &w, &mut all, &mut ws);
    for r in 0..19 {
        let mut one = vec![0f32; n];
        matmul(&x[r * k..(r + 1) * k], 1, &w, &mut one, &mut ws);
        let mut a = QuantizedRows::default();
        a.quantize(&x[r * k..(r + 1) * k], 1, k);
        for c in 0..n {
            let want = dot_scalar(&a, 0, iw, c);
            assert_eq!(one[c].to_bits(), want.to_bits(), "b=1 r{r} c{c}");
            assert_eq!(all[r * n + c].to_bits(), want.to_bits(), "b=19 r{r} c{c}");
        }
    }
}

#[test]
fn rounding_error_stays_within_a_fraction_of_the_exact_dot_product() {
    // Relative to Σ|x·w| (the scale a dot product's rounding is measured against): 8-bit
    // activations give errors of order 1/254 per element, averaging out over k.
    let (n, k) = (16, 1536);
    for w in [q4_1(n, k), q8_0(n, k)] {
        let wf = w.to_f32();
        let x = rnd(3 * k, 7);
        let mut y = vec![0f32; 3 * n];
        matmul(
            &x,
            3,
            &interleave(&w),
            &mut y,
            &mut Int8Workspace::default(),
        );
        for r in 0..3 {
            for c in 0..n {
                let (xr, wr) = (&x[r * k..(r + 1) * k], &wf[c * k..(c + 1) * k]);
                let exact: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let scale: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let err = (y[r * n + c] as f64 - exact).abs() / scale;
                assert!(err < 2e-3, "r{r} c{c}: relative error {err:.2e}");
            }
        }
    }
}

#[test]
fn matmul_into_hands_its_function_the_rows_matmul_writes() {
    // 632 outputs (a partial last group), batches of one row to two row blocks and a part;
    // `f` gets every row once, with the matching rows of `out` (here 3 floats a row, to show
    // the two widths are kept apart), and sees the bits `matmul` writes.
    let (n, k) = (632, 96);
    let mut ws = Int8Workspace::default();
    for m in [1, 5, 16, 17, 35] {
        for w in [q4_1(n, k), q8_0(n, k)] {
            let w = interleave(&w);
            let x = activations(m, k, 13);
            let mut y = vec![f32::NAN; m * n];
            matmul(&x, m, &w, &mut y, &mut ws);
            let mut out = vec![f32::NAN; m * 3];
            let seen = std::sync::Mutex::new(vec![None; m]);
            let outs = out.par_chunks_mut(ROWS_PER_CALL * 3);
            matmul_into(&x, m, &w, &mut ws, outs, |rows, outs: &mut [f32]| {
                assert_eq!(rows.len() / n, outs.len() / 3, "rows and outs in step");
                for (row, o) in rows.chunks(n).zip(outs.chunks_mut(3)) {
                    // Which row this is: found among y's rows by its bits.
                    o.fill(0.0);
                    o[0] = row.iter().map(|v| f64::from(*v)).sum::<f64>() as f32;
                    let r = (0..m)
                        .find(|&r| bits(&y[r * n..(r + 1) * n]) == bits(row))
                        .expect("a row of matmul's output");
                    seen.lock().unwrap()[r] = Some(o[0]);
                }
            });
            let seen = seen.into_inner().unwrap();
            for r in 0..m {
                assert_eq!(
                    seen[r],
                    Some(out[r * 3]),
                    "m{m} row {r} seen once, in its place"
                );
            }
        }
    }
}
