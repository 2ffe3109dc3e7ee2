//! The radix path draws exactly the exhaustive sampler's token: on arbitrary logits (flat,
//! peaked, tied, non-finite, far apart), tiny and full vocabularies, and every setting the
//! sampler takes, valid or not.

use proptest::prelude::*;
use stageb_shared::seed::{splitmix64, uniform_at};

use super::super::sample_exhaustive;
use super::*;

fn params(temperature: f32, top_p: f32, repetition_penalty: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p,
        repetition_penalty,
    }
}

/// The radix path and the combined sampler both draw the exhaustive sampler's token; returns it.
fn same_draw(
    logits: &[f32],
    p: &SamplingParams,
    seen: Option<&SeenTokens>,
    allowed: Option<&AllowedTokens>,
    u: f64,
) -> Option<u32> {
    let mut s = Scratch::default();
    let want = sample_exhaustive(logits, p, seen, allowed, u, &mut s);
    assert_eq!(sample(logits, p, seen, allowed, u, &mut s), want, "radix");
    if handles(p) && want.is_some() {
        ranking_is_the_comparison_sorts(&s);
    }
    assert_eq!(
        super::super::sample(logits, p, seen, allowed, u, &mut s),
        want,
        "sampler::sample"
    );
    want
}

/// The radix path's last ranking is the leading part of the exhaustive sampler's order over
/// its weights (weight descending, ties by id), token for token and bit for bit: checked
/// directly, since most misorderings would move a draw only rarely.
fn ranking_is_the_comparison_sorts(s: &Scratch) {
    let mut want: Vec<(f64, u32)> = s
        .weights
        .iter()
        .copied()
        .zip(s.ids.iter().copied())
        .collect();
    want.sort_by(super::super::common::by_weight_then_id);
    let top_bits = s.weights.iter().map(|w| w.to_bits()).max().unwrap();
    let got: Vec<(u64, u32)> = if s.wide.is_empty() {
        let id_bits = bit_len(u64::from(*s.ids.last().unwrap())).max(1);
        s.narrow
            .iter()
            .map(|x| (top_bits - (x >> id_bits), (x & ((1 << id_bits) - 1)) as u32))
            .collect()
    } else {
        s.wide
            .iter()
            .map(|x| (top_bits - (x >> 32) as u64, *x as u32))
            .collect()
    };
    let want: Vec<(u64, u32)> = want[..got.len()]
        .iter()
        .map(|&(w, id)| (w.to_bits(), id))
        .collect();
    assert_eq!(got, want, "ranking");
}

/// A uniform number in [0, 1) from `seed` and `i`.
fn unit(seed: u64, i: u64) -> f32 {
    (splitmix64(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 40) as f32 / (1u64 << 24) as f32
}

/// Shapes of a row of logits.
#[derive(Debug, Clone)]
enum Shape {
    /// Every logit within `width` of `base`, as a random-weight model gives.
    Flat { base: f32, width: f32 },
    /// A bulk `spread` wide.
    Spread { spread: f32 },
    /// A normal-like bulk of spread 2 and `lead` tokens 10-20 above it, as a trained model gives.
    Peaked { lead: usize },
    /// Only `levels` distinct values, `step` apart: ties everywhere.
    Levels { levels: u64, step: f32 },
    /// Magnitudes up to `1e30` and down to subnormals: most weights underflow to 0.
    Extreme,
}

fn logits_of(shape: &Shape, vocab: usize, seed: u64) -> Vec<f32> {
    (0..vocab as u64)
        .map(|i| {
            let r = unit(seed, i);
            match *shape {
                Shape::Flat { base, width } => base + (r - 0.5) * width,
                Shape::Spread { spread } => (r - 0.5) * spread,
                Shape::Peaked { lead } => {
                    let bulk = (unit(seed, i) + unit(seed + 1, i) + unit(seed + 2, i) - 1.5) * 4.0;
                    if (i as usize) < lead * 97 && i % 97 == 0 {
                        bulk + 10.0 + 10.0 * unit(seed + 3, i)
                    } else {
                        bulk
                    }
                }
                Shape::Levels { levels, step } => (splitmix64(seed ^ i) % levels) as f32 * step,
                Shape::Extreme => match splitmix64(seed ^ i) % 6 {
                    0 => 1e30 * (r - 0.5),
                    1 => 1e-40 * r,
                    2 => -1e4 * r,
                    3 => 700.0 * r,
                    _ => r,
                },
            }
        })
        .collect()
}

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        (-30.0f32..30.0, prop_oneof![Just(0.0f32), 1e-6f32..1e-2])
            .prop_map(|(base, width)| Shape::Flat { base, width }),
        (0.0f32..80.0).prop_map(|spread| Shape::Spread { spread }),
        (1usize..8).prop_map(|lead| Shape::Peaked { lead }),
        (1u64..6, prop_oneof![Just(0.25f32), 0.001f32..3.0])
            .prop_map(|(levels, step)| Shape::Levels { levels, step }),
        Just(Shape::Extreme),
    ]
}

/// Every setting the sampler accepts, and temperatures and top-p the engine refuses (the
/// sampler still answers as the exhaustive one does). Penalties stay finite and positive: on
/// others a weight can be NaN among numbers, where the exhaustive sampler's comparator is not
/// a total order and its answer (or panic) is the standard library's sort's.
fn settings() -> impl Strategy<Value = SamplingParams> {
    let temperature = prop_oneof![
        4 => 0.05f32..3.0,
        1 => Just(0.0f32),
        1 => 1e-4f32..0.05,
        1 => Just(1e4f32),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NAN),
    ];
    let top_p = prop_oneof![
        2 => Just(1.0f32),
        2 => Just(0.9f32),
        4 => 0.0f32..1.0,
        1 => Just(1e-7f32),
        1 => Just(0.0f32),
        1 => Just(1.5f32),
    ];
    let penalty = prop_oneof![
        4 => Just(1.0f32),
        4 => 0.5f32..2.0,
        1 => Just(1e-3f32),
        1 => Just(1e3f32),
        1 => Just(f32::MIN_POSITIVE),
    ];
    (temperature, top_p, penalty).prop_map(|(t, p, r)| params(t, p, r))
}

/// The engine's draws, and the edges of [0, 1] (1 only through the public function).
fn draw_u() -> impl Strategy<Value = f64> {
    prop_oneof![
        8 => (any::<u64>(), 0u64..1_000_000).prop_map(|(seed, step)| uniform_at(seed, step)),
        1 => Just(0.0f64),
        1 => Just(1.0 - f64::EPSILON / 2.0),
        1 => Just(1.0f64),
    ]
}

/// Runs one generated case: specials (`-inf`, NaN, `+inf`) sprinkled in, a seen set, a mask.
#[allow(clippy::too_many_arguments)]
fn run_case(
    shape: &Shape,
    vocab: usize,
    seed: u64,
    p: &SamplingParams,
    specials: usize,
    seen_every: u64,
    mask_every: u64,
    u: f64,
) {
    let mut logits = logits_of(shape, vocab, seed);
    for k in 0..specials.min(vocab) {
        logits[(splitmix64(seed + k as u64) as usize) % vocab] =
            [f32::NEG_INFINITY, f32::NAN, f32::INFINITY][k % 3];
    }
    let seen = (seen_every > 0).then(|| {
        let mut s = SeenTokens::new(vocab);
        for id in (0..vocab as u64).filter(|i| splitmix64(seed ^ i).is_multiple_of(seen_every)) {
            s.insert(id as u32);
        }
        s
    });
    let allowed = (mask_every > 0).then(|| {
        let mut a = AllowedTokens::none(vocab);
        for id in (0..vocab as u64).filter(|i| splitmix64(i ^ !seed).is_multiple_of(mask_every)) {
            a.allow(id as u32);
        }
        a
    });
    let got = same_draw(&logits, p, seen.as_ref(), allowed.as_ref(), u);
    if let Some(t) = got {
        assert!(logits[t as usize].is_finite(), "drew a non-finite logit");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn the_radix_path_draws_exactly_what_the_exhaustive_sampler_draws(
        shape in shape(),
        vocab in prop_oneof![1usize..64, 64usize..4000],
        seed: u64,
        p in settings(),
        specials in 0usize..4,
        seen_every in prop_oneof![Just(0u64), 1u64..50],
        mask_every in prop_oneof![3 => Just(0u64), 1 => 1u64..5, 1 => Just(100_000u64)],
        u in draw_u(),
    ) {
        run_case(&shape, vocab, seed, &p, specials, seen_every, mask_every, u);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Full vocabularies (Qwen3's and SmolLM2's), where flat rows used to be sorted by
    /// comparisons: the exhaustive sampler is slow here, so fewer cases.
    #[test]
    fn on_full_vocabularies_the_radix_path_draws_the_exhaustive_token(
        shape in prop_oneof![
            (-10.0f32..10.0, 1e-4f32..2e-3).prop_map(|(base, width)| Shape::Flat { base, width }),
            (1usize..8).prop_map(|lead| Shape::Peaked { lead }),
            (1.0f32..10.0).prop_map(|spread| Shape::Spread { spread }),
        ],
        vocab in prop_oneof![Just(151_936usize), Just(49_152usize)],
        seed: u64,
        temperature in 0.1f32..2.0,
        top_p in prop_oneof![Just(0.9f32), Just(1.0f32), 0.01f32..1.0],
        penalty in prop_oneof![Just(1.0f32), 1.0f32..1.5],
        mask_every in prop_oneof![3 => Just(0u64), 1 => 1u64..8],
        u in draw_u(),
    ) {
        let p = params(temperature, top_p, penalty);
        run_case(&shape, vocab, seed, &p, 3, 40, mask_every, u);
    }
}

#[test]
fn flat_logits_over_a_full_vocabulary_draw_the_exhaustive_token() {
    // A random-weight model's row: 151,936 logits within 1e-3 of each other, where the
    // prefilter cannot decide and the doubling selection ended up sorting everything.
    let logits = logits_of(
        &Shape::Flat {
            base: 0.3,
            width: 1e-3,
        },
        151_936,
        7,
    );
    let mut drawn = std::collections::BTreeSet::new();
    for step in 0..20 {
        let u = uniform_at(11, step);
        drawn.insert(same_draw(&logits, &params(0.7, 0.9, 1.0), None, None, u));
    }
    assert!(drawn.len() > 15, "{} distinct tokens", drawn.len());
}

#[test]
fn equal_logits_rank_by_lower_id() {
    // Ten equal weights: the running sums are 1, 2, ..., 10, and the draw u·10 lands on the
    // token whose rank, and so id, is its integer part.
    let logits = [2.5f32; 10];
    for k in 0..10 {
        let u = (k as f64 + 0.5) / 10.0;
        assert_eq!(
            same_draw(&logits, &params(0.7, 1.0, 1.0), None, None, u),
            Some(k)
        );
    }
}

#[test]
fn weights_that_round_equal_rank_by_lower_id_whatever_the_logits() {
    // Token 1 is the maximum, token 0 is 1e-20 below it: both weigh exactly 1.0 in f64, so the
    // exhaustive sampler ranks token 0 first. Ranking by logit instead would draw token 1.
    let logits = [-1e-20f32, 0.0];
    let mut s = Scratch::default();
    let p = params(1.0, 1.0, 1.0);
    assert_eq!(
        sample_exhaustive(&logits, &p, None, None, 0.25, &mut s),
        Some(0)
    );
    assert_eq!(same_draw(&logits, &p, None, None, 0.25), Some(0));
    assert_eq!(same_draw(&logits, &p, None, None, 0.75), Some(1));
}

#[test]
fn underflowed_weights_tie_and_a_draw_of_one_takes_the_highest_id() {
    // Every token but the first lies past exp's range: weight 0, all tied, ranked by id. A
    // draw of exactly 1 keeps the whole ranking and takes its last token.
    let mut logits = vec![-2000.0f32; 50];
    logits[7] = 0.0;
    logits[20] = -1500.0;
    assert_eq!(
        same_draw(&logits, &params(1.0, 1.0, 1.0), None, None, 1.0),
        Some(49)
    );
    assert_eq!(
        same_draw(&logits, &params(1.0, 0.9, 1.0), None, None, 0.999),
        Some(7)
    );
}

#[test]
fn weights_spanning_every_exponent_take_the_wide_packing() {
    // Keys of ~60 bits and 17-bit ids do not fit one u64 together.
    let logits: Vec<f32> = (0..100_000u64).map(|i| -(i as f32) * 7e-3).collect();
    let p = params(1.0, 1.0, 1.0);
    let u = 1.0 - f64::EPSILON / 2.0;
    let mut s = Scratch::default();
    let want = sample_exhaustive(&logits, &p, None, None, u, &mut s);
    assert_eq!(sample(&logits, &p, None, None, u, &mut s), want);
    assert!(!s.wide.is_empty(), "the narrow packing was used");
    for step in 0..5 {
        same_draw(&logits, &p, None, None, uniform_at(1, step));
    }
}

#[test]
fn a_cut_past_the_chosen_buckets_ranks_everything() {
    // Rank only the first histogram bucket: the cut lies past it, so the path must rank all
    // tokens and still draw the exhaustive token.
    let logits = logits_of(&Shape::Spread { spread: 12.0 }, 5000, 3);
    let mut s = Scratch::default();
    for (top_p, step) in [(0.9f32, 1u64), (1.0, 2), (0.5, 3)] {
        let p = params(0.8, top_p, 1.0);
        let u = uniform_at(5, step);
        let want = sample_exhaustive(&logits, &p, None, None, u, &mut s);
        let w = weigh(&logits, &p, None, None, &mut s).unwrap();
        let first_bucket = (1 << w.shift) - 1;
        let prefix = Prefix {
            limit: first_bucket,
            top_key: first_bucket,
        };
        assert_eq!(Some(draw(&w, &p, u, prefix, &mut s)), want, "top_p {top_p}");
        assert_eq!(
            s.narrow.len() + s.wide.len(),
            5000,
            "not everything was ranked"
        );
    }
}

#[test]
fn greedy_decoding_and_settings_the_engine_refuses_are_the_exhaustive_samplers() {
    let logits = logits_of(&Shape::Spread { spread: 5.0 }, 300, 9);
    let mut seen = SeenTokens::new(300);
    for id in (0..300).step_by(3) {
        seen.insert(id);
    }
    for p in [
        params(0.0, 0.9, 1.1),
        params(f32::NAN, 0.9, 1.0),
        params(f32::INFINITY, 0.9, 1.1),
        params(0.7, f32::NAN, 1.0),
        params(0.7, 2.0, 1.0),
    ] {
        assert!(
            same_draw(&logits, &p, Some(&seen), None, 0.4).is_some(),
            "{p:?}"
        );
    }
    assert!(!handles(&params(0.0, 0.9, 1.0)));
    assert!(!handles(&params(0.7, 0.9, f32::INFINITY)));
    assert!(handles(&params(0.7, 0.9, 1.05)));
}

#[test]
fn no_finite_allowed_logit_draws_nothing() {
    let logits = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 1.0];
    let mut only_last_blocked = AllowedTokens::none(4);
    for id in 0..3 {
        only_last_blocked.allow(id);
    }
    let p = params(0.7, 0.9, 1.0);
    assert_eq!(
        same_draw(&logits, &p, None, Some(&only_last_blocked), 0.5),
        None
    );
    assert_eq!(same_draw(&logits, &p, None, None, 0.5), Some(3));
}

#[test]
fn radix_sort_orders_by_key_and_keeps_id_order_among_equal_keys() {
    // Keys above 4 id bits; equal keys 3 and 0 enter in id order.
    let mut v: Vec<u64> = [(3u64, 1u64), (0, 2), (0x7f_ffff, 3), (3, 4), (0, 5), (1, 6)]
        .iter()
        .map(|&(k, id)| (k << 4) | id)
        .collect();
    radix_sort(&mut v, &mut [0; 6], 4, 23);
    let got: Vec<(u64, u64)> = v.iter().map(|x| (x >> 4, x & 15)).collect();
    assert_eq!(
        got,
        [(0, 2), (0, 5), (1, 6), (3, 1), (3, 4), (0x7f_ffff, 3)]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Keys spread, clustered under one far key (long runs sharing the top bits), tied, or
    /// wide: the packed sort orders by key, then id, as a comparison sort does.
    #[test]
    fn the_packed_sort_orders_by_key_then_id_whatever_the_keys(
        key_bits in 1u32..64,
        cluster_bits in 0u32..64,
        len in 0usize..3000,
        seed: u64,
        ties in 1u64..4,
    ) {
        let id_bits = 12;
        let cluster = cluster_bits.min(key_bits);
        let keys: Vec<u64> = (0..len as u64)
            .map(|i| {
                let r = splitmix64(seed ^ i) / ties * ties;
                if i == 0 {
                    u64::MAX >> (64 - key_bits)
                } else {
                    r >> (64 - cluster.max(1)) >> u32::from(cluster == 0)
                }
            })
            .collect();
        let mut want: Vec<(u64, u64)> = keys.iter().enumerate().map(|(i, &k)| (k, i as u64)).collect();
        want.sort_unstable();
        if key_bits + id_bits <= 64 {
            let mut v: Vec<u64> = want.iter().map(|&(k, i)| (k << id_bits) | i).collect();
            v.sort_unstable_by_key(|x| x & ((1 << id_bits) - 1));
            sort_packed(&mut v, &mut Vec::new(), id_bits, key_bits);
            let got: Vec<(u64, u64)> = v.iter().map(|x| (x >> id_bits, x & ((1 << id_bits) - 1))).collect();
            prop_assert_eq!(got, want.clone());
        }
        let mut v: Vec<u128> = keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (u128::from(k) << 32) | i as u128)
            .collect();
        sort_packed(&mut v, &mut Vec::new(), 32, key_bits);
        let got: Vec<(u64, u64)> = v.iter().map(|x| ((x >> 32) as u64, *x as u32 as u64)).collect();
        prop_assert_eq!(got, want);
    }
}
