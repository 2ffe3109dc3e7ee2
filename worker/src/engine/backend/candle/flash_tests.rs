//! The flash prefill's fallback on the candle backend: a kernel the self-check rejects (one
//! forced to disagree) is not used, the fingerprint does not name it, and the prefill runs the
//! old way (a one-row cache, then copied into the pool), bit for bit as with the switch off.
//! Where it passed, the prompt goes straight into the pool and the logits agree to rounding.

use candle_core::{DType, Device};

use super::{CandleBackend, CandleJob};
use crate::engine::backend::readback::StepLogits;
use crate::engine::backend::{Backend, Input, PREFILL_CHUNK, StepOut, kv_ref};
use crate::engine::kernels::{BLOCK, KernelId, SelfCheckReport, self_check};
use crate::engine::step_split::StepSplit;
use crate::engine::switches::{EngineSwitches, KernelsOn};

fn qwen3(dtype: DType) -> crate::engine::transformer::Transformer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parity/qwen3");
    crate::engine::safetensors::load(&dir, &Device::Cpu, 2048, dtype).expect("the fixture loads")
}

/// The backend on the paged path with the kernels `report` passed that `on` selects, and the
/// fingerprint suffix.
fn backend(dtype: DType, on: KernelsOn, report: &SelfCheckReport) -> (CandleBackend, String) {
    let off = EngineSwitches::parse("paged=off,fused=off,flash_prefill=off").unwrap();
    let (mut b, none) = CandleBackend::new(qwen3(dtype), 0, &off).unwrap();
    assert!(none.is_none());
    let suffix = b.enable_paging_checked(on, report).unwrap();
    (b, suffix)
}

/// `prompt` prefilled chunk by chunk: the last chunk's logits, and whether the job kept a
/// one-row prefill cache until the prompt was sealed.
fn prefill(b: &mut CandleBackend, prompt: &[u32]) -> (Vec<f32>, bool) {
    let mut kv = b.new_job(prompt.len()).unwrap();
    let cache = matches!(kv_ref::<CandleJob>(&kv), Ok(CandleJob::Paged(p)) if p.prefill.is_some());
    let mut logits = StepLogits::new(b.config().vocab_size);
    let mut split = StepSplit::default();
    let mut last = None;
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        let out = StepOut {
            logits: &mut logits,
            split: &mut split,
        };
        last = b
            .forward(vec![&mut kv], &[Input::chunk(0, chunk.to_vec())], out)
            .unwrap();
    }
    b.prompt_prefilled(&mut kv).unwrap();
    let Ok(CandleJob::Paged(p)) = kv_ref::<CandleJob>(&kv) else {
        panic!("a paged job")
    };
    assert_eq!(p.prompt.len(), prompt.len(), "the prompt is in the pool");
    assert_eq!(b.paged_stats().unwrap().used, prompt.len().div_ceil(BLOCK));
    (last.expect("the last chunk's logits"), cache)
}

#[test]
fn a_flash_prefill_kernel_failing_its_self_check_falls_back_to_the_old_prefill() {
    let prompt: Vec<u32> = (0..700u32).map(|i| (i * 7919) % 1000 + 3).collect();
    let good = self_check(&Device::Cpu);
    let bad = crate::engine::kernels::self_check::check_all(
        &Device::Cpu,
        Some(KernelId::FlashPrefill),
        None,
    );
    assert!(
        !bad.usable(KernelId::FlashPrefill),
        "the forced disagreement is caught"
    );
    let without = KernelsOn {
        flash_prefill: false,
        ..KernelsOn::ALL
    };
    for dtype in [DType::F32, DType::BF16] {
        let (mut old, old_suffix) = backend(dtype, without, &good);
        let (mut fell_back, fb_suffix) = backend(dtype, KernelsOn::ALL, &bad);
        let (mut flash, flash_suffix) = backend(dtype, KernelsOn::ALL, &good);
        assert_eq!(
            fb_suffix, old_suffix,
            "the fingerprint does not name a rejected kernel"
        );
        assert!(flash_suffix.ends_with("+flash-prefill"), "{flash_suffix}");
        let (want, old_cache) = prefill(&mut old, &prompt);
        let (got, fb_cache) = prefill(&mut fell_back, &prompt);
        assert!(
            old_cache && fb_cache,
            "the old prefill fills a one-row cache"
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{dtype:?}: the fallback is the old prefill"
        );
        let (fast, flash_cache) = prefill(&mut flash, &prompt);
        assert!(!flash_cache, "the flash prefill keeps no prefill cache");
        let tol = if dtype == DType::F32 { 1e-3 } else { 0.25 };
        let worst = fast
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < tol, "{dtype:?}: logits {worst} apart");
    }
}

/// On an H200 the paged pool without its attention kernel (`unpaged@8`) did not finish 63
/// decode steps in 88 s: on CUDA the pool now needs the kernel, switched on and passed.
#[test]
fn regression_on_cuda_the_paged_pool_is_used_only_with_its_attention_kernel() {
    use super::paged::paging_pays;
    let good = self_check(&Device::Cpu);
    let bad = crate::engine::kernels::self_check::check_all(
        &Device::Cpu,
        Some(KernelId::PagedAttention),
        None,
    );
    let unpaged = KernelsOn {
        paged: false,
        ..KernelsOn::ALL
    };
    assert!(paging_pays(true, KernelsOn::ALL, &good));
    assert!(
        !paging_pays(true, KernelsOn::ALL, &bad),
        "the kernel failed its check"
    );
    assert!(
        !paging_pays(true, unpaged, &good),
        "the kernel switched off"
    );
    for on in [KernelsOn::ALL, unpaged] {
        assert!(
            paging_pays(false, on, &bad),
            "the CPU keeps every combination"
        );
    }
}
