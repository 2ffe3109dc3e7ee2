//! Draft tokens by prompt lookup: a row's guess at its next tokens, taken from what followed
//! the last earlier occurrence of its latest few tokens in its own context (the prompt, then
//! what it generated). The guesses are fed after the row's sampled token in the same forward
//! call, so one call computes the logits of several positions; the row then samples each
//! position in order and keeps the guesses up to the first one its draw does not confirm
//! (`rows.rs`). Reflection answers copy ticket ids and guidance text from their prompts and
//! repeat themselves, so most guesses hold; a decode step of one row reads every weight and
//! the whole KV cache whatever the positions it feeds, so the ones that hold come almost free.
//!
//! Nothing here can change a result: a guess is only ever confirmed by the token the row
//! samples at that position from that position's logits (the logits of a position depend only
//! on the tokens before it), and a draw is `uniform_at(seed, token index)`, whatever the call
//! that computed the logits. The guesses choose how much work a call does, never its outcome.

/// The longest run of latest tokens looked up (longer runs tried first).
pub(super) const MAX_NGRAM: usize = 3;

/// The shortest run of latest tokens looked up.
pub(super) const MIN_NGRAM: usize = 1;

/// Positions a decode step feeds at most once drafts are added: while a step has few rows it
/// reads every weight and the whole KV cache once whatever it feeds, so a draft costs only its
/// own arithmetic (measured on two cores at a 2.6k-token context: 20 ms for one position,
/// about 3 ms more for each further one); a step of many rows already does the arithmetic of
/// all of them, and drafts there would only add to it.
pub(super) const STEP_POSITIONS: usize = 5;

/// Draft tokens each row may be fed in a step of `rows` live rows ([`STEP_POSITIONS`] shared
/// out): 4 for a row alone, 1 each for two, none from three rows on.
pub(super) fn per_row(rows: usize) -> usize {
    match rows {
        0 => 0,
        n => STEP_POSITIONS.saturating_sub(n) / n,
    }
}

/// Up to `max` guesses at what follows `prompt ++ tokens`, into `out` (cleared first): the
/// tokens after the latest earlier occurrence of its last `n` tokens, for the largest `n` in
/// [`MIN_NGRAM`]`..=`[`MAX_NGRAM`] that occurs. A continuation that reaches the end of the
/// context goes on with the guesses themselves (a repeating cycle is guessed whole). Empty
/// when nothing matches.
pub(super) fn propose(prompt: &[u32], tokens: &[u32], max: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = prompt.len() + tokens.len();
    let at = |i: usize| match i.checked_sub(prompt.len()) {
        Some(k) => tokens[k],
        None => prompt[i],
    };
    if max == 0 {
        return;
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if len <= n {
            continue;
        }
        let tail = len - n;
        let matches = |start: usize| (0..n).all(|i| at(start + i) == at(tail + i));
        let Some(start) = (0..tail).rev().find(|&s| matches(s)) else {
            continue;
        };
        for i in 0..max {
            let idx = start + n + i;
            let t = if idx < len { at(idx) } else { out[idx - len] };
            out.push(t);
        }
        return;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guess(prompt: &[u32], tokens: &[u32], max: usize) -> Vec<u32> {
        let mut out = vec![99];
        propose(prompt, tokens, max, &mut out);
        out
    }

    #[test]
    fn the_latest_occurrence_of_the_longest_tail_names_the_guess() {
        // Tail [2, 3]: it occurs at 1 (followed by 4) and at 5 (followed by 7); the latest wins.
        assert_eq!(guess(&[1, 2, 3, 4, 5, 2, 3, 7, 8], &[2, 3], 2), vec![7, 8]);
        // A longer tail beats a later, shorter match: [9, 2, 3] occurs only at the start.
        assert_eq!(guess(&[9, 2, 3, 4, 2, 3, 5], &[9, 2, 3], 1), vec![4]);
    }

    #[test]
    fn the_context_spans_the_prompt_and_the_generated_tokens() {
        assert_eq!(guess(&[5, 6, 7], &[1, 5], 2), vec![6, 7]);
        assert_eq!(guess(&[], &[4, 1, 2, 4], 2), vec![1, 2]);
    }

    #[test]
    fn a_cycle_reaching_the_end_is_guessed_whole() {
        // "a b a b": tail [a, b] occurred at 0, so the guess runs on: a b a b ...
        assert_eq!(guess(&[], &[1, 2, 1, 2], 5), vec![1, 2, 1, 2, 1]);
    }

    #[test]
    fn drafts_go_to_steps_of_few_rows() {
        assert_eq!((per_row(0), per_row(1), per_row(2)), (0, 4, 1));
        assert!((3..64).all(|n| per_row(n) == 0));
    }

    #[test]
    fn nothing_is_guessed_without_a_match_or_room() {
        assert!(guess(&[1, 2, 3], &[4], 4).is_empty());
        assert!(guess(&[1, 1], &[1], 0).is_empty());
        assert!(guess(&[], &[7], 3).is_empty());
        assert!(guess(&[], &[], 3).is_empty());
    }
}
