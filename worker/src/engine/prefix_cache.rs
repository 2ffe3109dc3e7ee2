//! The prompt-prefix store: the KV of recently prefilled rollout prompts, kept so the next
//! ticket's prefill starts where its tokens stop matching.
//!
//! Every rollout of a step carries the same system prompt, mission and guidance, and only the
//! ticket's own summaries differ at the end, so most of a prompt was already prefilled by the
//! ticket before. The store keeps whole prompts (their token ids and the prompt part of their
//! KV cache) and a lookup returns the entry sharing the longest common token prefix with the
//! new prompt. Matching token ids directly, not digests at fixed boundaries, because the worker
//! does not know where the guidance ends and the ticket begins (BPE may even merge across that
//! boundary); the longest common prefix finds it exactly, and edited guidance is a miss at the
//! first changed token without any invalidation.
//!
//! Bounded by bytes (the values' sizes as the caller states them), least recently used entries
//! evicted first; a budget of 0 turns the store off. Generic over the stored value, so it knows
//! no model and its rules are specified without one (the engine stores the CPU fast path's
//! prompt caches, and prefills from them).

/// A bounded store of prompts and their prefilled state.
#[derive(Debug)]
pub struct PrefixStore<T> {
    budget: usize,
    bytes: usize,
    clock: u64,
    entries: Vec<Entry<T>>,
}

#[derive(Debug)]
struct Entry<T> {
    tokens: Vec<u32>,
    value: T,
    bytes: usize,
    last_used: u64,
}

/// The best entry for a prompt: reuse its first `len` positions.
#[derive(Debug)]
pub struct PrefixHit<'a, T> {
    pub len: usize,
    pub value: &'a T,
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<T> PrefixStore<T> {
    /// A store holding at most `budget` bytes; 0 keeps nothing.
    pub fn new(budget: usize) -> Self {
        PrefixStore {
            budget,
            bytes: 0,
            clock: 0,
            entries: Vec::new(),
        }
    }

    /// Bytes it may hold.
    pub fn budget(&self) -> usize {
        self.budget
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry sharing the longest token prefix with `prompt` (the most recently used among
    /// equals), or `None` when no entry shares a token. The reusable length leaves at least the
    /// prompt's last token to prefill: its logits start the decode. A hit counts as a use.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<PrefixHit<'_, T>> {
        let limit = prompt.len().saturating_sub(1);
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let len = common_prefix(&e.tokens, prompt).min(limit);
            let better = match best {
                None => len > 0,
                Some((bi, bl)) => {
                    len > bl || (len == bl && e.last_used > self.entries[bi].last_used)
                }
            };
            if better {
                best = Some((i, len));
            }
        }
        let (i, len) = best?;
        self.clock += 1;
        let e = &mut self.entries[i];
        e.last_used = self.clock;
        Some(PrefixHit {
            len,
            value: &e.value,
        })
    }

    /// Keeps `value`, the prefilled state of `tokens` (`bytes` large), evicting the least
    /// recently used entries until it fits. Not kept when it alone exceeds the budget, or when
    /// an entry already starts with all of `tokens` (that entry serves every lookup this one
    /// would; it is marked used instead).
    /// Marks the entry whose tokens start with `tokens` as just used, as
    /// [`insert`](Self::insert) would; false when none does (so a caller can skip making a
    /// value the store would not keep).
    pub fn refresh(&mut self, tokens: &[u32]) -> bool {
        self.clock += 1;
        let clock = self.clock;
        self.entries
            .iter_mut()
            .find(|e| e.tokens.starts_with(tokens))
            .map(|e| e.last_used = clock)
            .is_some()
    }

    pub fn insert(&mut self, tokens: Vec<u32>, value: T, bytes: usize) {
        if bytes > self.budget || tokens.is_empty() {
            return;
        }
        self.clock += 1;
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.tokens.starts_with(&tokens))
        {
            e.last_used = self.clock;
            return;
        }
        while self.bytes + bytes > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used)
            else {
                break;
            };
            let gone = self.entries.swap_remove(oldest);
            self.bytes -= gone.bytes;
        }
        self.bytes += bytes;
        self.entries.push(Entry {
            tokens,
            value,
            bytes,
            last_used: self.clock,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt: a shared head (system prompt + guidance) then a ticket's own tokens.
    fn prompt(head: &[u32], ticket: u32, len: usize) -> Vec<u32> {
        let mut p = head.to_vec();
        p.extend((0..len as u32).map(|i| 1000 * ticket + i));
        p
    }

    #[test]
    fn a_ticket_after_another_reuses_their_shared_head() {
        let head: Vec<u32> = (1..=50).collect();
        let mut s = PrefixStore::new(1000);
        assert!(s.lookup(&prompt(&head, 1, 10)).is_none(), "empty store");
        s.insert(prompt(&head, 1, 10), "t1", 100);
        let hit = s.lookup(&prompt(&head, 2, 7)).expect("hit");
        assert_eq!((hit.len, *hit.value), (50, "t1"));
    }

    #[test]
    fn a_refreshed_entry_is_kept_and_a_prompt_no_entry_holds_is_not_refreshed() {
        let mut s = PrefixStore::new(20);
        s.insert(vec![1, 2, 3], "a", 10);
        s.insert(vec![4, 5], "b", 10);
        assert!(s.refresh(&[1, 2]), "an entry starts with these tokens");
        assert!(!s.refresh(&[9]), "none does");
        s.insert(vec![6], "c", 10);
        assert!(
            s.lookup(&[1, 2, 3, 0]).is_some(),
            "the refreshed entry stays"
        );
        assert!(
            s.lookup(&[4, 5, 0]).is_none(),
            "the least recently used one went"
        );
    }

    #[test]
    fn the_longest_common_prefix_wins_whatever_the_insertion_order() {
        let head: Vec<u32> = (1..=20).collect();
        let mut longer = head.clone();
        longer.extend([7, 8, 9]);
        let mut s = PrefixStore::new(1000);
        s.insert(prompt(&longer, 1, 5), "long", 10);
        s.insert(prompt(&head, 2, 5), "short", 10);
        let mut q = longer.clone();
        q.extend([4, 4]);
        let hit = s.lookup(&q).unwrap();
        assert_eq!((hit.len, *hit.value), (23, "long"));
    }

    #[test]
    fn at_least_the_last_prompt_token_is_left_to_prefill() {
        let p: Vec<u32> = (1..=30).collect();
        let mut s = PrefixStore::new(1000);
        s.insert(p.clone(), (), 10);
        assert_eq!(s.lookup(&p).unwrap().len, 29, "the same prompt again");
        assert_eq!(s.lookup(&p[..12]).unwrap().len, 11, "a prefix of an entry");
        assert!(
            s.lookup(&p[..1]).is_none(),
            "a one-token prompt reuses nothing"
        );
    }

    #[test]
    fn changed_guidance_is_a_miss_at_the_first_changed_token() {
        let mut s = PrefixStore::new(1000);
        let before: Vec<u32> = (1..=40).collect();
        s.insert(before.clone(), (), 10);
        let mut after = before.clone();
        after[15] = 999; // a rule edited at token 15
        assert_eq!(s.lookup(&after).unwrap().len, 15);
        let mut other_system = before;
        other_system[0] = 999;
        assert!(s.lookup(&other_system).is_none());
    }

    #[test]
    fn eviction_is_by_bytes_least_recently_used_first() {
        let mut s = PrefixStore::new(100);
        s.insert(vec![1, 1], "a", 40);
        s.insert(vec![2, 2], "b", 40);
        assert!(
            s.lookup(&[1, 1, 5]).is_some(),
            "a is now more recent than b"
        );
        s.insert(vec![3, 3], "c", 40); // 120 > 100: b goes
        assert_eq!((s.len(), s.bytes()), (2, 80));
        assert!(s.lookup(&[2, 2, 5]).is_none());
        assert_eq!(*s.lookup(&[1, 1, 5]).unwrap().value, "a");
        s.insert(vec![4, 4], "d", 100); // needs everything
        assert_eq!((s.len(), s.bytes()), (1, 100));
        assert_eq!(*s.lookup(&[4, 4, 5]).unwrap().value, "d");
    }

    #[test]
    fn an_entry_over_the_budget_or_a_zero_budget_keeps_nothing() {
        let mut s = PrefixStore::new(100);
        s.insert(vec![1, 2, 3], (), 101);
        assert!(s.is_empty());
        let mut off = PrefixStore::new(0);
        assert!(!off.enabled());
        off.insert(vec![1, 2, 3], (), 1);
        assert!(off.is_empty() && off.lookup(&[1, 2, 3, 4]).is_none());
    }

    #[test]
    fn a_prompt_an_entry_already_covers_is_not_stored_twice() {
        let mut s = PrefixStore::new(100);
        s.insert(vec![1, 2, 3, 4], "whole", 40);
        s.insert(vec![1, 2, 3], "part", 30);
        assert_eq!((s.len(), s.bytes()), (1, 40));
        s.insert(vec![1, 2, 3, 4, 5], "longer", 40);
        assert_eq!(s.len(), 2, "a longer prompt is new information");
    }
}
