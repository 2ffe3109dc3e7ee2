//! The candle backend's flash prefill (the `flash_prefill` engine switch: each prefill chunk
//! writes its keys and values into the paged pool and attends over it, on the CPU through the
//! kernel's CPU reference): a job gives the same tokens alone, with others, in another
//! arrival order and joining mid-decode, in f32 and bf16, with prompts of one chunk and of
//! several; greedy decoding matches the old prefill (one-row cache, host mask) in f32; a
//! prompt shared from the prefix store gives what it gives prefilled; the fingerprint names
//! the kernel only when its switch is on.

use crate::common::{depth, model_path};
use crate::engine_paged::{
    Ids, alone, batched, decode, jobs, load, qwen3, same_alone_and_batched, smollm, texts_alone,
};
use stageb_worker::engine::{Engine, ModelEngine, Numerics, RolloutOutput, numerics_known};

/// Every kernel on, the prefill through the flash prefill.
const FLASH: &str = "paged=on,fused=on,flash_prefill=on";
/// The same paged decode step, the prefill as before.
const OLD_PREFILL: &str = "paged=on,fused=on,flash_prefill=off";

#[test]
fn flash_prefilled_jobs_give_the_same_tokens_alone_together_reordered_and_joining_mid_decode() {
    // The demo model in the long suite only, as in engine_paged (CI time); its greedy tokens
    // after this prefill are checked below on every run.
    if crate::common::full_depth() {
        same_alone_and_batched(smollm(FLASH), 49_152, "smollm f32");
    }
    same_alone_and_batched(load(&qwen3(), Numerics::F32, FLASH), 1024, "qwen3 f32");
    same_alone_and_batched(load(&qwen3(), Numerics::Bf16, FLASH), 1024, "qwen3 bf16");
    // The flash prefill alone: the decode step runs the compositions on the pool.
    let alone = "paged=off,fused=off,flash_prefill=on";
    same_alone_and_batched(load(&qwen3(), Numerics::Bf16, alone), 1024, "flash alone");
}

/// Jobs whose prompts take one, two and three prefill chunks (of 512), a sampled decode of two
/// rows and a greedy one each.
fn long_jobs() -> Vec<Ids> {
    [40u32, 530, 1100]
        .iter()
        .enumerate()
        .map(|(k, &len)| Ids {
            prompt: (0..len)
                .map(|i| (i * 7919 + k as u32 * 13) % 1000 + 3)
                .collect(),
            decodes: vec![decode(0, 0.8, 6, vec![1, 2]), decode(1, 0.0, 6, vec![3])],
        })
        .collect()
}

#[test]
fn chunked_flash_prefills_are_batch_invariant_in_f32_and_bf16() {
    for numerics in [Numerics::F32, Numerics::Bf16] {
        let mut eng = load(&qwen3(), numerics, FLASH);
        eng.set_ignore_eos(true);
        eng.set_prefix_cache_bytes(0);
        let jobs = long_jobs();
        let want = texts_alone(&mut eng, &jobs);
        let what = format!("{numerics:?}");
        assert_eq!(
            batched(&mut eng, &jobs, &[0, 0, 0]),
            want,
            "{what}: together"
        );
        assert_eq!(
            batched(&mut eng, &jobs, &[2, 0, 1]),
            want,
            "{what}: joining while others prefill and decode"
        );
        let mut reversed = jobs.clone();
        reversed.reverse();
        let mut got = batched(&mut eng, &reversed, &[0, 0, 3]);
        got.reverse();
        assert_eq!(got, want, "{what}: reversed");
        assert_eq!(eng.kv_blocks().unwrap().used, 0, "{what}: every block back");
    }
}

fn greedy(jobs: Vec<Ids>) -> Vec<Ids> {
    jobs.into_iter()
        .map(|mut j| {
            j.decodes = vec![decode(0, 0.0, 16, vec![1])];
            j
        })
        .collect()
}

/// Greedy decoding after the flash prefill against the old prefill, the same paged decode
/// step, f32 on the CPU. Not the same bits: the flash prefill reduces each (row, head) in key
/// tiles of 32 with an online softmax, the old prefill in candle's matmuls and one softmax;
/// its self-check holds it within 1e-4 of the masked composition in f32. So the greedy tokens
/// match unless two logits were within that noise, which these models' greedy steps are not.
#[test]
fn greedy_tokens_after_the_flash_prefill_match_the_old_prefill_in_f32() {
    let cases = [
        // Two of the demo model's four jobs in CI, all four in the long suite.
        (
            model_path(),
            greedy(jobs(49_152)).into_iter().take(depth(2, 4)).collect(),
        ),
        (qwen3(), greedy(jobs(1024))),
        (qwen3(), greedy(long_jobs())),
    ];
    for (path, jobs) in cases {
        let mut flash = load(&path, Numerics::F32, FLASH);
        let mut old = load(&path, Numerics::F32, OLD_PREFILL);
        for e in [&mut flash, &mut old] {
            e.set_ignore_eos(true);
        }
        for j in &jobs {
            let what = format!("{} prompt of {}", path.display(), j.prompt.len());
            assert_eq!(alone(&mut flash, j), alone(&mut old, j), "{what}");
        }
    }
}

/// A prompt longer than a prefill chunk: the second job's table shares the first one's whole
/// chunk from the prefix store (the same blocks, nothing copied into a prefill cache), and it
/// gives what it gives prefilled in full.
#[test]
fn a_prompt_shared_from_the_prefix_store_gives_the_same_tokens_as_prefilled() {
    let head: Vec<u32> = (0..600u32).map(|i| (i * 7919) % 1000 + 3).collect();
    let job = |tail: u32| Ids {
        prompt: head.iter().copied().chain([tail, tail + 1]).collect(),
        decodes: vec![decode(0, 0.8, 6, vec![1, 2]), decode(1, 0.0, 6, vec![3])],
    };
    let jobs = [job(11), job(500)];
    for numerics in [Numerics::F32, Numerics::Bf16] {
        let mut plain = load(&qwen3(), numerics, FLASH);
        plain.set_prefix_cache_bytes(0);
        let want = texts_alone(&mut plain, &jobs);
        let mut shared = load(&qwen3(), numerics, FLASH);
        shared.set_prefix_cache_bytes(16 << 20);
        let run = |e: &mut ModelEngine, j: &Ids| e.rollout_ids(&j.prompt, &j.decodes, false);
        let first = run(&mut shared, &jobs[0]).unwrap().0;
        let second = run(&mut shared, &jobs[1]).unwrap().0;
        assert_eq!(first.prefix_tokens, 0, "an empty store");
        assert_eq!(second.prefix_tokens, 512, "the first one's whole chunk");
        let texts = |o: RolloutOutput| -> Vec<String> {
            o.candidates.into_iter().map(|c| c.text).collect()
        };
        assert_eq!(
            vec![texts(first), texts(second)],
            want,
            "{numerics:?}: sharing changes no bit"
        );
        let stats = shared.kv_blocks().unwrap();
        assert_eq!(stats.used, 512 / 16, "the store keeps the chunk's blocks");
        let mut together = load(&qwen3(), numerics, FLASH);
        together.set_prefix_cache_bytes(16 << 20);
        assert_eq!(batched(&mut together, &jobs, &[0, 0]), want, "together");
    }
}

#[test]
fn the_fingerprint_names_the_flash_prefill_only_when_its_switch_is_on() {
    let dtype = |e: &ModelEngine| e.fingerprint().dtype.clone();
    let numerics = |e: &ModelEngine| {
        let id = e.fingerprint().id();
        id.split_once('|').unwrap().1.to_string()
    };
    let flash = smollm(FLASH);
    assert_eq!(
        dtype(&flash),
        "f32-dequantized;kernels=paged-attn+add-rmsnorm+qk-rope-kv+silu-mul+flash-prefill"
    );
    assert_eq!(
        dtype(&smollm(OLD_PREFILL)),
        "f32-dequantized;kernels=paged-attn+add-rmsnorm+qk-rope-kv+silu-mul"
    );
    assert_eq!(
        dtype(&smollm("")),
        "f32-dequantized",
        "auto is off on the CPU"
    );
    let only = load(&qwen3(), Numerics::Bf16, "flash_prefill=on");
    assert_eq!(dtype(&only), "cpu-bf16;kernels=flash-prefill");
    assert_eq!(
        only.kv_block_positions(),
        16,
        "the flash prefill keeps a pool"
    );
    for e in [&flash, &only] {
        assert!(numerics_known(&numerics(e)), "{}", numerics(e));
    }
}
