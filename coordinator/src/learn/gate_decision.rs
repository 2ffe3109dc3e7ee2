//! The gate's verdict on a candidate guidance (`reflection.gate.check_edits`): the candidate
//! and its parent were rolled out on the same gate tickets with the same seeds, and each ticket
//! came out correct (a verdict equal to its label) or not under each. The candidate passes when
//!
//! - its gate accuracy ≥ the parent's − `tolerance`, and
//! - with `min_p_better` > 0, a paired bootstrap over the gate tickets finds the candidate
//!   strictly better in at least that share of the resamples.
//!
//! The bootstrap resamples tickets (pairs stay together) [`BOOTSTRAP_SAMPLES`] times, driven by
//! a seed the caller derives from the run seed and the cycle, so the verdict is a pure function
//! of its inputs. An edit that changes no gate ticket is never strictly better in any resample:
//! with `min_p_better` > 0 it is refused (it did not earn its place).
//!
//! [`contribution`] is the same resampling for rule ablation: a learned rule's gate accuracy
//! with it minus without it, with a 90% interval.

use serde::{Deserialize, Serialize};
use stageb_shared::seed::splitmix64;

/// Odd multiplier spreading consecutive draw counters over the generator's input.
const DRAW_STRIDE: u64 = 0xD1B5_4A32_D192_ED03;

/// Resamples of the paired bootstrap.
pub const BOOTSTRAP_SAMPLES: u64 = 2000;

/// What the gate measured and decided, as `reflection.jsonl` records it (`gate`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GateFigures {
    /// Gate tickets evaluated.
    pub tickets: usize,
    /// Of them, decided correctly under the parent guidance.
    pub parent_correct: usize,
    /// Of them, decided correctly under the candidate guidance.
    pub candidate_correct: usize,
    pub parent_accuracy: f64,
    pub candidate_accuracy: f64,
    /// Tickets the candidate fixed (wrong under the parent, right under it).
    pub fixed: usize,
    /// Tickets the candidate broke (right under the parent, wrong under it).
    pub broken: usize,
    /// Share of bootstrap resamples in which the candidate is strictly better; absent when
    /// `min_p_better` is 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p_better: Option<f64>,
    pub tolerance: f64,
    pub min_p_better: f64,
    /// Whether the candidate was applied.
    pub passed: bool,
}

/// Judge a candidate: `parent[i]` and `candidate[i]` say whether gate ticket `i` was decided
/// correctly under each guidance (same tickets, same order).
pub fn judge(
    parent: &[bool],
    candidate: &[bool],
    tolerance: f64,
    min_p_better: f64,
    seed: u64,
) -> GateFigures {
    assert_eq!(parent.len(), candidate.len(), "paired outcomes");
    let n = parent.len();
    let count = |v: &[bool]| v.iter().filter(|c| **c).count();
    let (parent_correct, candidate_correct) = (count(parent), count(candidate));
    let accuracy = |c: usize| if n == 0 { 0.0 } else { c as f64 / n as f64 };
    let diffs: Vec<i8> = parent
        .iter()
        .zip(candidate)
        .map(|(p, c)| i8::from(*c) - i8::from(*p))
        .collect();
    let fixed = diffs.iter().filter(|d| **d > 0).count();
    let broken = diffs.iter().filter(|d| **d < 0).count();
    let (parent_accuracy, candidate_accuracy) =
        (accuracy(parent_correct), accuracy(candidate_correct));
    // A tiny slack so that equal accuracies never fail on rounding.
    let within = candidate_accuracy + 1e-12 >= parent_accuracy - tolerance;
    let p_better = (min_p_better > 0.0).then(|| p_better(&diffs, seed));
    let passed = within && p_better.is_none_or(|p| p >= min_p_better);
    GateFigures {
        tickets: n,
        parent_correct,
        candidate_correct,
        parent_accuracy,
        candidate_accuracy,
        fixed,
        broken,
        p_better,
        tolerance,
        min_p_better,
        passed,
    }
}

/// One rule's contribution on the gate split (leave-one-rule-out): accuracy with the rule
/// minus accuracy without it, and a 90% paired-bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Contribution {
    pub mean: f64,
    pub low: f64,
    pub high: f64,
}

/// [`Contribution`] of a rule: `with[i]`/`without[i]` say whether gate ticket `i` was decided
/// correctly with the rule and without it.
pub fn contribution(with: &[bool], without: &[bool], seed: u64) -> Contribution {
    assert_eq!(with.len(), without.len(), "paired outcomes");
    let diffs: Vec<i8> = with
        .iter()
        .zip(without)
        .map(|(w, o)| i8::from(*w) - i8::from(*o))
        .collect();
    let n = diffs.len();
    if n == 0 {
        return Contribution {
            mean: 0.0,
            low: 0.0,
            high: 0.0,
        };
    }
    let mean = diffs.iter().map(|d| f64::from(*d)).sum::<f64>() / n as f64;
    let mut means: Vec<f64> = resampled_sums(&diffs, seed)
        .map(|s| s as f64 / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (means.len() - 1) as f64).round() as usize).min(means.len() - 1)];
    Contribution {
        mean,
        low: at(0.05),
        high: at(0.95),
    }
}

/// The summed difference of each of the [`BOOTSTRAP_SAMPLES`] paired resamples of `diffs`
/// (not empty).
fn resampled_sums(diffs: &[i8], seed: u64) -> impl Iterator<Item = i64> + '_ {
    let n = diffs.len() as u64;
    (0..BOOTSTRAP_SAMPLES).map(move |b| {
        (0..n)
            .map(|j| {
                // One splitmix64 output per draw; the modulo bias is below 2^-40 for any gate.
                let draw = b * n + j;
                let i = splitmix64(seed ^ draw.wrapping_mul(DRAW_STRIDE)) % n;
                i64::from(diffs[i as usize])
            })
            .sum()
    })
}

/// Share of paired-bootstrap resamples whose summed difference is > 0. Without a discordant
/// ticket no resample can be better: 0 without drawing.
fn p_better(diffs: &[i8], seed: u64) -> f64 {
    if diffs.iter().all(|d| *d == 0) {
        return 0.0;
    }
    let better = resampled_sums(diffs, seed).filter(|s| *s > 0).count();
    better as f64 / BOOTSTRAP_SAMPLES as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use stageb_shared::seed::{derived_seed, uniform_at};

    #[test]
    fn an_edit_that_changes_no_gate_ticket_is_refused_unless_only_the_tolerance_is_asked() {
        let same = [true, false, true, true, false];
        let strict = judge(&same, &same, 0.0, 0.8, 1);
        assert_eq!(strict.p_better, Some(0.0));
        assert!(!strict.passed);
        let lenient = judge(&same, &same, 0.0, 0.0, 1);
        assert_eq!(lenient.p_better, None);
        assert!(lenient.passed, "accuracy held within the tolerance");
    }

    #[test]
    fn a_clear_gain_passes_and_a_regression_beyond_the_tolerance_does_not() {
        let parent = [
            false, false, true, true, false, true, false, true, true, false,
        ];
        let better = [true, true, true, true, true, true, false, true, true, false];
        let good = judge(&parent, &better, 0.0, 0.8, 7);
        assert_eq!((good.fixed, good.broken), (3, 0));
        assert!(good.passed, "{good:?}");
        assert!(good.p_better.unwrap() > 0.9);

        let worse = [
            false, false, true, false, false, true, false, true, true, false,
        ];
        let lost = judge(&parent, &worse, 0.05, 0.0, 7);
        assert_eq!((lost.fixed, lost.broken), (0, 1));
        assert!(!lost.passed, "lost 10 points with a tolerance of 5");
        assert!(
            judge(&parent, &worse, 0.1, 0.0, 7).passed,
            "within a tolerance of 10"
        );
    }

    #[test]
    fn the_verdict_is_a_function_of_its_inputs() {
        let parent = [true, false, false, true, false, true];
        let cand = [true, true, false, false, true, true];
        assert_eq!(
            judge(&parent, &cand, 0.0, 0.5, 3),
            judge(&parent, &cand, 0.0, 0.5, 3)
        );
    }

    /// One noisy gate evaluation: each ticket's label is flipped with probability 10%, and its
    /// decision under each guidance is right with the ticket's own probability (the edit is a
    /// no-op: both guidances give the same distribution).
    fn null_outcomes(seed: u64, n: usize) -> (Vec<bool>, Vec<bool>) {
        let mut parent = Vec::with_capacity(n);
        let mut cand = Vec::with_capacity(n);
        for i in 0..n as u64 {
            let u = |k: u64| uniform_at(splitmix64(seed ^ k), i);
            let skill = 0.5 + 0.45 * u(1);
            let noisy_label = u(2) < 0.1;
            let right = |k: u64| (u(k) < skill) != noisy_label;
            parent.push(right(3));
            cand.push(right(4));
        }
        (parent, cand)
    }

    #[test]
    fn a_rule_that_fixes_a_third_of_the_gate_contributes_a_third_with_an_interval_around_it() {
        let with: Vec<bool> = (0..30).map(|i| i % 3 != 0 || i % 2 == 0).collect();
        let without: Vec<bool> = (0..30).map(|i| i % 2 == 0).collect();
        let c = contribution(&with, &without, 5);
        assert!((c.mean - 10.0 / 30.0).abs() < 1e-12, "{c:?}");
        assert!(c.low > 0.1 && c.low < c.mean && c.mean < c.high, "{c:?}");
        let none = contribution(&with, &with, 5);
        assert_eq!((none.mean, none.low, none.high), (0.0, 0.0, 0.0));
    }

    proptest! {
        // A statistical claim, so its inputs are drawn from a fixed seed: with fresh seeds
        // every run, a rate a little over the margin now and then failed CI (seen at 39 of
        // 150, n 41, min_p_better 0.8) without anything having changed.
        #![proptest_config(ProptestConfig {
            cases: 6,
            rng_seed: proptest::test_runner::RngSeed::Fixed(20_261_127),
            ..ProptestConfig::default()
        })]
        /// Over many seeds, with 10% label noise and a noisy sampler, a no-op edit passes the
        /// bootstrap at most at about `1 − min_p_better` (the configured false-acceptance rate).
        #[test]
        fn noop_edits_pass_at_most_at_the_configured_rate(
            base in any::<u64>(),
            n in 10usize..60,
            min_p_better in prop::sample::select(vec![0.8, 0.9, 0.95]),
        ) {
            let trials = 150u64;
            let accepted = (0..trials)
                .filter(|t| {
                    let seed = derived_seed(base, "null", &[&t.to_le_bytes()]);
                    let (parent, cand) = null_outcomes(seed, n);
                    judge(&parent, &cand, 0.0, min_p_better, seed).passed
                })
                .count();
            let rate = accepted as f64 / trials as f64;
            let allowed = (1.0 - min_p_better) + 0.06;
            // The bound in whole trials: 0.26 × 150 must allow 39, which 1 − 0.8 + 0.06
            // (0.25999999999999995 in floating point) did not.
            let allowed_trials = (allowed * trials as f64 + 1e-9).floor() as usize;
            prop_assert!(
                accepted <= allowed_trials,
                "no-op accepted {rate} > {allowed} (n {n})"
            );
        }
    }
}
