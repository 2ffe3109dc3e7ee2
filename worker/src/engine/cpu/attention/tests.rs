//! Specs of attention: the AVX-512 and AVX2 copies equal the recipe bit for bit however queries
//! are grouped,
//! each query gives the same bits alone, and the result is softmax attention (f64 reference).

use super::*;
use crate::engine::cpu::test_rng::rnd;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Softmax attention in f64 over `runs` (keys `0..lim` of their concatenation).
fn reference(q: &[f32], runs: &[KvRun], lim: usize, d: usize, scale: f64) -> Vec<f64> {
    let keys: Vec<(Vec<f64>, Vec<f64>)> = runs
        .iter()
        .flat_map(|run| {
            (0..run.len).map(move |t| {
                (
                    (0..d).map(|dd| run.kt[dd * run.cap + t] as f64).collect(),
                    (0..d).map(|dd| run.v[t * d + dd] as f64).collect(),
                )
            })
        })
        .take(lim)
        .collect();
    let sc: Vec<f64> = keys
        .iter()
        .map(|(k, _)| (0..d).map(|dd| q[dd] as f64 * k[dd]).sum::<f64>() * scale)
        .collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..d)
        .map(|dd| {
            keys.iter()
                .zip(&e)
                .map(|((_, v), e)| e * v[dd])
                .sum::<f64>()
                / z
        })
        .collect()
}

#[test]
fn grouped_queries_with_their_own_runs_match_the_recipe_and_softmax() {
    for d in [64, 128] {
        let cap = 70;
        let (kt, v) = (rnd(d * cap, 2), rnd(cap * d, 3));
        let common = [KvRun {
            kt: &kt,
            v: &v,
            cap,
            len: 61,
        }];
        // Own runs of different lengths (decode rows at different steps), 12 queries.
        let owns: Vec<(Vec<f32>, Vec<f32>)> = (0..4)
            .map(|r| (rnd(d * 20, 10 + r), rnd(20 * d, 20 + r)))
            .collect();
        let nq = 12;
        let own: Vec<KvRun> = (0..nq)
            .map(|i| {
                let (kt, v) = &owns[i / 3];
                KvRun {
                    kt,
                    v,
                    cap: 20,
                    len: 1 + (i * 7) % 20,
                }
            })
            .collect();
        let q = rnd(nq * d, 6);
        // Limits: everything visible, or cut inside the common run (a prefill position).
        let limits: Vec<usize> = (0..nq)
            .map(|i| if i % 4 == 3 { 17 + i } else { 61 + own[i].len })
            .collect();
        let mut s = Vec::new();
        let ends: Vec<usize> = (1..=nq).collect();
        let owned = Own {
            runs: &own,
            ends: &ends,
        };
        let out = both_copies(&q, &limits, &common, owned, d);
        for i in 0..nq {
            let qi = &q[i * d..(i + 1) * d];
            let mut one = vec![0f32; d];
            let own_i = [own[i]];
            attend(
                qi,
                1,
                &limits[i..i + 1],
                &common,
                Own {
                    runs: &own_i,
                    ends: &[1],
                },
                d,
                0.125,
                &mut s,
                &mut one,
            );
            assert_eq!(
                bits(&one),
                bits(&out[i * d..(i + 1) * d]),
                "d={d} query {i} alone"
            );
            // The same keys as one common list: the split into runs changes nothing.
            let both = [common[0], own[i]];
            attend(
                qi,
                1,
                &limits[i..i + 1],
                &both,
                Own::NONE,
                d,
                0.125,
                &mut s,
                &mut one,
            );
            assert_eq!(
                bits(&one),
                bits(&out[i * d..(i + 1) * d]),
                "d={d} query {i} runs"
            );
            let exact = reference(qi, &both, limits[i], d, 0.125);
            for dd in 0..d {
                let err = (out[i * d + dd] as f64 - exact[dd]).abs();
                assert!(err < 1e-4, "d={d} q{i} d{dd}: {err:e}");
            }
        }
    }
}

#[test]
fn a_prefill_block_gives_each_position_its_own_causal_result() {
    let d = 64;
    let cap = 48;
    let (kt, v) = (rnd(d * cap, 4), rnd(cap * d, 5));
    // 16 positions × 3 heads; position p sees keys 0..=p+20.
    let nq = 48;
    let limits: Vec<usize> = (0..nq).map(|i| 21 + i / 3).collect();
    let common = [KvRun {
        kt: &kt,
        v: &v,
        cap,
        len: 36,
    }];
    let q = rnd(nq * d, 8);
    let mut s = Vec::new();
    let mut out = vec![0f32; nq * d];
    attend(
        &q,
        nq,
        &limits,
        &common,
        Own::NONE,
        d,
        0.125,
        &mut s,
        &mut out,
    );
    for i in 0..nq {
        let one = alone(&q[i * d..(i + 1) * d], common[0], limits[i], d);
        assert_eq!(
            bits(&one),
            bits(&out[i * d..(i + 1) * d]),
            "position query {i}"
        );
    }
}

/// The vector copies this host runs (AVX-512 where it has AVX-512F, AVX2 where AVX2+FMA);
/// the others are named as skipped.
fn copies() -> Vec<F32Copy> {
    let v: Vec<F32Copy> = F32Copy::available()
        .into_iter()
        .filter(|c| *c != F32Copy::Scalar)
        .collect();
    if !v.contains(&F32Copy::Avx2) {
        eprintln!("skipped: this host has no AVX2 attention");
    } else if !v.contains(&F32Copy::Avx512) {
        eprintln!("skipped: this host has no AVX-512 attention");
    }
    v
}

/// Attention of the queries `q` (one per limit) by the copy in use and by every vector copy the
/// host has, each checked bit for bit against the recipe (the scalar copy).
fn both_copies(q: &[f32], limits: &[usize], common: &[KvRun], own: Own, d: usize) -> Vec<f32> {
    let nq = limits.len();
    let (mut s, mut out, mut want) = (Vec::new(), vec![0f32; nq * d], vec![0f32; nq * d]);
    attend_impl(q, nq, limits, common, own, d, 0.125, &mut s, &mut want);
    for copy in copies() {
        out.fill(f32::NAN);
        attend_with(copy, q, nq, limits, common, own, d, 0.125, &mut s, &mut out);
        assert_eq!(bits(&out), bits(&want), "d={d}: {copy:?} and scalar copies");
    }
    attend(q, nq, limits, common, own, d, 0.125, &mut s, &mut out);
    assert_eq!(bits(&out), bits(&want), "d={d}: the copy in use");
    out
}

/// One query alone against the first `limit` keys of `run`, as one common run.
fn alone(q: &[f32], run: KvRun, limit: usize, d: usize) -> Vec<f32> {
    let mut one = vec![0f32; d];
    let run = [KvRun { len: limit, ..run }];
    let mut s = Vec::new();
    attend(q, 1, &[limit], &run, Own::NONE, d, 0.125, &mut s, &mut one);
    one
}

/// Keys `from..from + n` of `run` copied into a run of their own (a block of `cap` positions).
fn block_of(run: &KvRun, from: usize, n: usize, cap: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let mut kt = vec![0f32; d * cap];
    let mut v = vec![0f32; cap * d];
    for t in 0..n {
        for dd in 0..d {
            kt[dd * cap + t] = run.kt[dd * run.cap + from + t];
        }
        v[t * d..(t + 1) * d].copy_from_slice(&run.v[(from + t) * d..(from + t + 1) * d]);
    }
    (kt, v)
}

#[test]
fn keys_paged_into_blocks_give_the_bits_of_one_run() {
    for d in [64, 128] {
        let cap = 100;
        let (kt, v) = (rnd(d * cap, 31), rnd(cap * d, 32));
        let whole = KvRun {
            kt: &kt,
            v: &v,
            cap,
            len: 75,
        };
        // Prompt 0..43 (common), three rows owning 44..75 at different lengths.
        let (b, prompt_len) = (16, 43);
        let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..cap.div_ceil(b))
            .map(|i| block_of(&whole, i * b, b.min(cap - i * b), b, d))
            .collect();
        let paged = |from: usize, to: usize| -> Vec<KvRun> {
            // Blocks of positions from..to, `from` at a block boundary.
            (from / b..to.div_ceil(b))
                .map(|i| KvRun {
                    kt: &blocks[i].0,
                    v: &blocks[i].1,
                    cap: b,
                    len: to.min((i + 1) * b) - i * b,
                })
                .collect()
        };
        let common_paged = paged(0, prompt_len);
        let q = rnd(3 * d, 33);
        let row_ends = [60, 75, 44];
        // Own positions in blocks of their own, from the block after the prompt's last.
        let own_blocks: Vec<Vec<(Vec<f32>, Vec<f32>)>> = row_ends
            .iter()
            .map(|&e| {
                (prompt_len..e)
                    .step_by(b)
                    .map(|f| block_of(&whole, f, b.min(e - f), b, d))
                    .collect()
            })
            .collect();
        let mut runs = Vec::new();
        let mut ends = Vec::new();
        for (r, &e) in row_ends.iter().enumerate() {
            for (i, (kt, v)) in own_blocks[r].iter().enumerate() {
                let len = (e - prompt_len - i * b).min(b);
                runs.push(KvRun { kt, v, cap: b, len });
            }
            ends.push(runs.len());
        }
        let limits = row_ends;
        let own = Own {
            runs: &runs,
            ends: &ends,
        };
        let out = both_copies(&q, &limits, &common_paged, own, d);
        for i in 0..3 {
            let one = alone(&q[i * d..(i + 1) * d], whole, limits[i], d);
            assert_eq!(bits(&one), bits(&out[i * d..(i + 1) * d]), "d={d} row {i}");
        }
    }
}

#[test]
fn long_prompts_give_every_copy_the_recipe_bits_at_any_cut() {
    // 300 keys: tiles of 32 and 16 keys (AVX-512), 8 (AVX2) and single keys all occur, and the
    // limits cut inside tiles; 7 queries fill groups of 4 and a remainder of 3.
    for d in [64, 128] {
        let cap = 304;
        let (kt, v) = (rnd(d * cap, 41), rnd(cap * d, 42));
        let common = [KvRun {
            kt: &kt,
            v: &v,
            cap,
            len: 300,
        }];
        let limits = [300, 299, 288, 257, 31, 17, 1];
        let q = rnd(limits.len() * d, 43);
        let out = both_copies(&q, &limits, &common, Own::NONE, d);
        for (i, &lim) in limits.iter().enumerate() {
            let exact = reference(&q[i * d..(i + 1) * d], &common, lim, d, 0.125);
            for dd in 0..d {
                let err = (out[i * d + dd] as f64 - exact[dd]).abs();
                assert!(err < 1e-4, "d={d} q{i} d{dd}: {err:e}");
            }
        }
    }
}

#[test]
fn queries_grouped_over_a_value_tile_keep_the_recipe_bits() {
    // A prefill block as the model sends it: 16 positions × 3 heads of a GQA group, in paged
    // runs of 64 keys; position p sees keys 0..=70+p. Their weighted sums go 2 to 4 queries at
    // a time over the tiles every one of them sees whole, one at a time where a limit cuts a
    // tile; each query must keep the bits of the recipe.
    for d in [64, 128] {
        let cap = 64;
        let store: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
            .map(|b| (rnd(d * cap, 50 + b), rnd(cap * d, 60 + b)))
            .collect();
        let common: Vec<KvRun> = store
            .iter()
            .map(|(kt, v)| KvRun {
                kt,
                v,
                cap,
                len: cap,
            })
            .collect();
        let nq = 48;
        let limits: Vec<usize> = (0..nq).map(|i| 71 + i / 3).collect();
        let q = rnd(nq * d, 70);
        both_copies(&q, &limits, &common, Own::NONE, d);
    }
}
