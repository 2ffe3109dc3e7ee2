//! The kernels' CPU references against plain candle compositions, batch invariance of the
//! paged attention, prefix sharing, the fused ops, and the self-check's fallback.

use candle_core::{DType, Device, Tensor};

use super::self_check::{Rng, check_all};
use super::*;
use crate::engine::switches::KernelsOn;

const CPU: Device = Device::Cpu;

fn rand(rng: &mut Rng, dims: &[usize], dtype: DType) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(rng.uniform(n, -1.0, 1.0), dims, &CPU)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// `max |a - b| / max(1, max |b|)`, the self-check's measure (non-finite: infinite).
fn max_err(a: &Tensor, b: &Tensor) -> f32 {
    super::self_check::error(a, b).unwrap()
}

#[test]
fn self_check_error_is_infinite_where_a_kernel_wrote_nan_which_a_device_max_drops() {
    let cpu = Device::Cpu;
    let want = Tensor::new(&[1f32, 2.0, 3.0], &cpu).unwrap();
    let nan = Tensor::new(&[1f32, f32::NAN, 3.0], &cpu).unwrap();
    let inf = Tensor::new(&[1f32, 2.0, f32::INFINITY], &cpu).unwrap();
    assert_eq!(max_err(&nan, &want), f32::INFINITY);
    assert_eq!(max_err(&inf, &want), f32::INFINITY);
    assert_eq!(max_err(&want, &nan), f32::INFINITY);
    let close = Tensor::new(&[1f32, 2.0, 3.5], &cpu).unwrap();
    assert_eq!(max_err(&close, &want), 0.5 / 3.0);
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn tol(dtype: DType) -> f32 {
    if dtype == DType::F32 { 2e-5 } else { 2e-2 }
}

/// A pool of one layer whose every block holds random keys and values.
fn random_pool(rng: &mut Rng, n_kv: usize, d: usize, blocks: usize, dtype: DType) -> PagedKvPool {
    let shape = PoolShape {
        n_layer: 1,
        n_kv_head: n_kv,
        head_dim: d,
        num_blocks: blocks,
    };
    let pool = PagedKvPool::new(shape, dtype, &CPU).unwrap();
    let fill = rand(rng, &[blocks, 2, BLOCK, n_kv, d], dtype);
    pool.layer(0).slice_set(&fill, 0, 0).unwrap();
    pool
}

fn tables_of(pool: &mut PagedKvPool, lens: &[usize]) -> Vec<BlockTable> {
    lens.iter()
        .map(|&n| {
            let mut t = pool.empty_table();
            pool.append_slots(&mut t, n).unwrap();
            t
        })
        .collect()
}

fn attend(pool: &PagedKvPool, q: &Tensor, rows: &[&BlockTable]) -> Tensor {
    let table = row_table_tensor(rows, &CPU).unwrap();
    let scale = 1.0 / (q.dim(2).unwrap() as f32).sqrt();
    paged_decode_attention(q, pool.layer(0), &table, scale).unwrap()
}

#[test]
fn the_paged_reference_equals_dense_attention_with_gqa_in_f32_and_bf16() {
    for dtype in [DType::F32, DType::BF16] {
        for d in [64, 128] {
            let mut rng = Rng(d as u64 + 1);
            let mut pool = random_pool(&mut rng, 2, d, 128, dtype);
            let tables = tables_of(&mut pool, &[1, 15, 16, 17, PARTITION + 1, 2 * PARTITION]);
            let rows: Vec<&BlockTable> = tables.iter().collect();
            let q = rand(&mut rng, &[rows.len(), 8, d], dtype);
            let table = row_table_tensor(&rows, &CPU).unwrap();
            let scale = 1.0 / (d as f32).sqrt();
            let got = paged_decode_attention(&q, pool.layer(0), &table, scale).unwrap();
            let want = reference::paged_decode_attention(&q, pool.layer(0), &table, scale).unwrap();
            let err = max_err(&got, &want);
            assert!(err < tol(dtype), "{dtype:?} d={d}: {err}");
        }
    }
}

#[test]
fn a_row_is_bit_identical_alone_in_a_batch_reordered_and_with_jobs_joining() {
    for dtype in [DType::F32, DType::BF16] {
        let (d, n_head) = (64, 4);
        let mut rng = Rng(7);
        let mut pool = random_pool(&mut rng, 2, d, 96, dtype);
        let tables = tables_of(&mut pool, &[3, 40, PARTITION + 9, 1, 700]);
        let q = rand(&mut rng, &[tables.len(), n_head, d], dtype);
        let alone: Vec<Vec<u32>> = (0..tables.len())
            .map(|r| bits(&attend(&pool, &q.narrow(0, r, 1).unwrap(), &[&tables[r]])))
            .collect();
        let batches: [&[usize]; 4] = [&[0, 1, 2, 3, 4], &[4, 3, 2, 1, 0], &[2, 0], &[1, 3, 0, 4]];
        for order in batches {
            let idx = Tensor::new(order.iter().map(|&i| i as u32).collect::<Vec<_>>(), &CPU);
            let qb = q.index_select(&idx.unwrap(), 0).unwrap();
            let rows: Vec<&BlockTable> = order.iter().map(|&i| &tables[i]).collect();
            let out = attend(&pool, &qb, &rows);
            for (slot, &i) in order.iter().enumerate() {
                let got = bits(&out.narrow(0, slot, 1).unwrap());
                assert_eq!(got, alone[i], "{dtype:?}: row {i} in batch {order:?}");
            }
        }
    }
}

#[test]
fn a_prefix_shared_by_reference_attends_like_a_copied_one() {
    for dtype in [DType::F32, DType::BF16] {
        let (d, n_head) = (128, 4);
        let mut rng = Rng(11);
        let mut pool = random_pool(&mut rng, 1, d, 16, dtype);
        let prompt = tables_of(&mut pool, &[2 * BLOCK + 5]).remove(0);
        let shared = pool.share_prefix(&prompt, 2 * BLOCK + 5).unwrap();
        // The same positions copied block by block into blocks of their own.
        let mut copied = pool.empty_table();
        pool.append_slots(&mut copied, 2 * BLOCK + 5).unwrap();
        for (&from, &to) in prompt.blocks().iter().zip(copied.blocks()) {
            let b = pool
                .layer(0)
                .narrow(0, from as usize, 1)
                .unwrap()
                .copy()
                .unwrap();
            pool.layer(0).slice_set(&b, 0, to as usize).unwrap();
        }
        assert_ne!(shared.blocks(), copied.blocks());
        let q = rand(&mut rng, &[2, n_head, d], dtype);
        let out = attend(&pool, &q, &[&shared, &copied]);
        let (a, b) = (out.narrow(0, 0, 1).unwrap(), out.narrow(0, 1, 1).unwrap());
        let q1 = q.narrow(0, 0, 1).unwrap();
        assert_eq!(bits(&a), bits(&attend(&pool, &q1, &[&copied])));
        assert_eq!(bits(&a), bits(&attend(&pool, &q1, &[&prompt])));
        assert_ne!(bits(&a), bits(&b), "different queries attend differently");
        for t in [prompt, shared, copied] {
            pool.release(t);
        }
        assert_eq!(pool.stats().used, 0);
    }
}

fn qkv_case(d: usize, dtype: DType) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    let mut rng = Rng(d as u64 * 3);
    let qkv = rand(&mut rng, &[3, (4 + 2 * 2) * d], dtype);
    let wq = Tensor::from_vec(rng.uniform(d, 0.5, 1.5), d, &CPU).unwrap();
    let wk = Tensor::from_vec(rng.uniform(d, 0.5, 1.5), d, &CPU).unwrap();
    let ang: Vec<f32> = (0..40 * d / 2)
        .map(|i| (i / (d / 2)) as f32 * 0.37 / (1 + i % (d / 2)) as f32)
        .collect();
    let ang = Tensor::from_vec(ang, (40, d / 2), &CPU).unwrap();
    let cos = ang.cos().unwrap().to_dtype(dtype).unwrap();
    let sin = ang.sin().unwrap().to_dtype(dtype).unwrap();
    (qkv, wq, wk, cos, sin)
}

#[test]
fn the_qk_norm_rope_and_kv_write_equal_their_composition() {
    for dtype in [DType::F32, DType::BF16] {
        for d in [64, 128] {
            let (qkv, wq, wk, cos, sin) = qkv_case(d, dtype);
            for (pairs, norms) in [(RopePairs::Halves, true), (RopePairs::Interleaved, false)] {
                let spec = QkvSpec {
                    n_head: 4,
                    n_kv: 2,
                    head_dim: d,
                    q_norm: norms.then_some(&wq),
                    k_norm: norms.then_some(&wk),
                    eps: 1e-6,
                };
                let rope = Rope {
                    cos: &cos,
                    sin: &sin,
                    pairs,
                };
                let pos = Tensor::new(&[0u32, 39, 12], &CPU).unwrap();
                let slots = Tensor::new(&[31u32, 0, 17], &CPU).unwrap();
                let shape = PoolShape {
                    n_layer: 1,
                    n_kv_head: 2,
                    head_dim: d,
                    num_blocks: 2,
                };
                let pool = PagedKvPool::new(shape, dtype, &CPU).unwrap();
                let q = q_norm_rope(&qkv, &spec, &rope, &pos).unwrap();
                kv_norm_rope_write(pool.layer(0), &qkv, &spec, &rope, &pos, &slots).unwrap();
                let (k, v) = reference::gather_slots(pool.layer(0), &slots).unwrap();
                let (rk, rv) = reference::kv_norm_rope(&qkv, &spec, &rope, &pos).unwrap();
                let rq = reference::q_norm_rope(&qkv, &spec, &rope, &pos).unwrap();
                let what = format!("{dtype:?} d={d} {pairs:?}");
                assert!(
                    max_err(&q, &rq) < tol(dtype),
                    "q {what}: {}",
                    max_err(&q, &rq)
                );
                assert!(
                    max_err(&k, &rk) < tol(dtype),
                    "k {what}: {}",
                    max_err(&k, &rk)
                );
                assert_eq!(bits(&v), bits(&rv), "v is copied as is ({what})");
                let untouched = Tensor::new(&[1u32], &CPU).unwrap();
                let (k0, _) = reference::gather_slots(pool.layer(0), &untouched).unwrap();
                assert_eq!(
                    k0.abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap(),
                    0.0
                );
            }
        }
    }
}

#[test]
fn add_rms_norm_and_silu_mul_equal_their_compositions() {
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = Rng(5);
        let x = rand(&mut rng, &[5, 96], dtype);
        let r = rand(&mut rng, &[5, 96], dtype);
        let w = Tensor::from_vec(rng.uniform(96, 0.5, 1.5), 96, &CPU).unwrap();
        let (s, n) = add_rms_norm(&x, &r, &w, 1e-5).unwrap();
        let (rs, rn) = reference::add_rms_norm(&x, &r, &w, 1e-5).unwrap();
        assert_eq!(
            bits(&s),
            bits(&rs),
            "the sum is rounded like the composition's"
        );
        assert!(
            max_err(&n, &rn) < tol(dtype),
            "{dtype:?}: {}",
            max_err(&n, &rn)
        );
        let gu = (rand(&mut rng, &[4, 2 * 72], dtype) * 4.0).unwrap();
        let (got, want) = (silu_mul(&gu).unwrap(), reference::silu_mul(&gu).unwrap());
        assert_eq!(got.dims(), &[4, 72]);
        assert!(
            max_err(&got, &want) < tol(dtype),
            "{dtype:?}: {}",
            max_err(&got, &want)
        );
    }
}

#[test]
fn concatenated_projections_split_into_the_separate_outputs_bit_for_bit_on_the_cpu() {
    // Each output column of the wide GEMM is the same dot product over the same inputs, and
    // candle's CPU GEMM blocks the reduction by the input width only, so the bits match.
    for dtype in [DType::F32, DType::BF16] {
        for (rows, hidden, outs) in [(7, 64, [48, 16, 16]), (8, 576, [576, 192, 192])] {
            let mut rng = Rng(13);
            let x = rand(&mut rng, &[rows, hidden], dtype);
            let ws: Vec<Tensor> = outs
                .iter()
                .map(|&o| rand(&mut rng, &[hidden, o], dtype))
                .collect();
            let bs: Vec<Tensor> = outs.iter().map(|&o| rand(&mut rng, &[o], dtype)).collect();
            let cat = weights::concat_dense(&ws.iter().collect::<Vec<_>>()).unwrap();
            let bias = weights::concat_bias(&bs.iter().map(Some).collect::<Vec<_>>()).unwrap();
            let y = x
                .matmul(&cat)
                .unwrap()
                .broadcast_add(&bias.unwrap())
                .unwrap();
            let parts = weights::split_outputs(&y, &outs).unwrap();
            for ((p, w), b) in parts.iter().zip(&ws).zip(&bs) {
                let alone = x.matmul(w).unwrap().broadcast_add(b).unwrap();
                assert_eq!(
                    bits(p),
                    bits(&alone),
                    "{dtype:?} {hidden}: {}",
                    max_err(p, &alone)
                );
            }
        }
    }
    let b = Tensor::zeros(4, DType::F32, &CPU).unwrap();
    assert!(weights::concat_bias(&[Some(&b), None]).is_err());
    assert!(weights::concat_bias(&[None, None]).unwrap().is_none());
}

#[test]
fn decoding_rows_alone_or_together_with_a_job_joining_gives_the_same_bits() {
    // Two jobs: a prompt of 21 positions decoded by two rows, and a second job of one row
    // joining at step 2. Each step writes every live row's key and value into its slot and
    // attends; every row's output must be the same bits as when its job runs alone.
    let (d, n_head, n_kv) = (64, 4, 2);
    let (_, _, _, cos, sin) = qkv_case(d, DType::BF16);
    let rope = Rope {
        cos: &cos,
        sin: &sin,
        pairs: RopePairs::Halves,
    };
    let spec = QkvSpec {
        n_head,
        n_kv,
        head_dim: d,
        q_norm: None,
        k_norm: None,
        eps: 1e-6,
    };
    let run = |together: bool, job: usize| -> Vec<Vec<u32>> {
        let mut rng = Rng(21);
        let mut pool = random_pool(&mut rng, n_kv, d, 32, DType::BF16);
        let prompts = tables_of(&mut pool, &[21, 9]);
        let mut rows = [
            pool.fork(&prompts[0]),
            pool.fork(&prompts[0]),
            pool.fork(&prompts[1]),
        ];
        let owner = [0, 0, 1];
        let mut out = Vec::new();
        for step in 0..4 {
            let qkv = rand(&mut rng, &[3, spec.width()], DType::BF16);
            let live: Vec<usize> = (0..3)
                .filter(|&r| (together || owner[r] == job) && (owner[r] == 0 || step >= 2))
                .collect();
            if live.is_empty() {
                continue;
            }
            let (mut pos, mut slots) = (Vec::new(), Vec::new());
            for &r in &live {
                slots.push(pool.append_slots(&mut rows[r], 1).unwrap()[0]);
                pos.push(rows[r].len() as u32 - 1);
            }
            let idx =
                Tensor::new(live.iter().map(|&r| r as u32).collect::<Vec<_>>(), &CPU).unwrap();
            let qkv = qkv.index_select(&idx, 0).unwrap();
            let pos = Tensor::new(pos, &CPU).unwrap();
            let slots = Tensor::new(slots, &CPU).unwrap();
            kv_norm_rope_write(pool.layer(0), &qkv, &spec, &rope, &pos, &slots).unwrap();
            let q = q_norm_rope(&qkv, &spec, &rope, &pos).unwrap();
            let tabs: Vec<&BlockTable> = live.iter().map(|&r| &rows[r]).collect();
            let o = attend(&pool, &q, &tabs);
            for (i, &r) in live.iter().enumerate() {
                if owner[r] == job {
                    out.push(bits(&o.narrow(0, i, 1).unwrap()));
                }
            }
        }
        out
    };
    for job in [0, 1] {
        let alone = run(false, job);
        assert_eq!(alone.len(), if job == 0 { 8 } else { 2 });
        assert_eq!(run(true, job), alone, "job {job}");
    }
}

/// The GPU check of 2026-11-29: the q/k rope kernel passed its checks at head dims 64 and 128,
/// then refused the parity fixture's head dim 16 at the model's first step, and the model
/// failed to load. The self-check now runs every kernel at the model's own attention shape
/// too, so a shape a kernel's launcher does not take fails its check and the reference runs.
#[test]
fn regression_the_self_check_runs_every_kernel_at_the_model_s_own_head_dim_and_heads() {
    let model = AttnShape {
        head_dim: 16,
        n_head: 6,
        n_kv: 2,
        hidden: 96,
    };
    let report = self_check_for(&CPU, model);
    assert_eq!(report.checks.len(), 2 * 3 * KernelId::ALL.len());
    for kernel in KernelId::ALL {
        for dtype in [DType::F32, DType::BF16] {
            let at_16 = |c: &&KernelCheck| c.kernel == kernel && c.dtype == dtype;
            assert!(
                report.checks.iter().filter(at_16).any(|c| c.head_dim == 16),
                "{kernel:?} {dtype:?} not checked at the model's head dim"
            );
        }
    }
    // The CPU references take any shape.
    for c in &report.checks {
        assert!(c.passed(), "{c:?}");
    }
}

#[test]
fn the_self_check_passes_on_the_cpu_and_names_the_kernels_in_use() {
    let report = self_check(&CPU);
    for c in &report.checks {
        assert!(c.passed(), "{c:?}");
    }
    assert_eq!(report.checks.len(), 2 * 2 * KernelId::ALL.len());
    let on = |paged, fused, flash_prefill| KernelsOn {
        paged,
        fused,
        flash_prefill,
    };
    assert_eq!(
        report.fingerprint_suffix(on(true, true, false)),
        "kernels=paged-attn+add-rmsnorm+qk-rope-kv+silu-mul"
    );
    assert_eq!(
        report.fingerprint_suffix(KernelsOn::ALL),
        "kernels=paged-attn+add-rmsnorm+qk-rope-kv+silu-mul+flash-prefill"
    );
    assert_eq!(
        report.fingerprint_suffix(on(false, false, true)),
        "kernels=flash-prefill"
    );
    assert_eq!(
        report.fingerprint_suffix(on(true, false, false)),
        "kernels=paged-attn"
    );
    assert_eq!(
        report.fingerprint_suffix(KernelsOn::default()),
        "kernels=none"
    );
    for s in ["kernels=flash-prefill", "kernels=paged-attn+flash-prefill"] {
        assert!(suffix_known(s), "{s}");
    }
    assert!(
        !suffix_known("kernels=flash-prefill+paged-attn"),
        "fixed order"
    );
}

#[test]
fn a_kernel_forced_to_disagree_is_not_used() {
    for bad in KernelId::ALL {
        let report = check_all(&CPU, Some(bad), None);
        assert!(!report.usable(bad), "{bad:?} passed while perturbed");
        let failed = report.checks.iter().filter(|c| !c.passed());
        assert!(
            failed
                .clone()
                .all(|c| c.kernel == bad && c.error > c.tolerance)
        );
        assert_eq!(failed.count(), 4, "every dtype and head dim of {bad:?}");
        assert!(!report.in_use(KernelsOn::ALL).contains(&bad));
        assert!(
            !report
                .fingerprint_suffix(KernelsOn::ALL)
                .contains(bad.name())
        );
        let used = KernelUse::new(&report, KernelsOn::ALL);
        assert_eq!(
            used,
            KernelUse {
                paged_attention: bad != KernelId::PagedAttention,
                add_rms_norm: bad != KernelId::AddRmsNorm,
                qk_rope_kv: bad != KernelId::QkNormRopeKv,
                silu_mul: bad != KernelId::SiluMul,
                flash_prefill: bad != KernelId::FlashPrefill,
            },
            "only {bad:?} falls back to its composition"
        );
        for good in KernelId::ALL.into_iter().filter(|&k| k != bad) {
            assert!(report.usable(good), "{good:?}");
        }
    }
    let empty = SelfCheckReport { checks: Vec::new() };
    assert!(
        !empty.usable(KernelId::SiluMul),
        "an unchecked kernel is never used"
    );
}

#[test]
fn pad_rows_write_nothing_and_attend_to_zeros() {
    let d = 64;
    let (qkv, _, _, cos, sin) = qkv_case(d, DType::F32);
    let spec = QkvSpec {
        n_head: 4,
        n_kv: 2,
        head_dim: d,
        q_norm: None,
        k_norm: None,
        eps: 1e-6,
    };
    let rope = Rope {
        cos: &cos,
        sin: &sin,
        pairs: RopePairs::Halves,
    };
    let shape = PoolShape {
        n_layer: 1,
        n_kv_head: 2,
        head_dim: d,
        num_blocks: 2,
    };
    let mut pool = PagedKvPool::new(shape, DType::F32, &CPU).unwrap();
    let mut row = pool.empty_table();
    let slot = pool.append_slots(&mut row, 1).unwrap()[0];
    let pos = Tensor::new(&[0u32, 0, 0], &CPU).unwrap();
    let slots = Tensor::new(&[PAD_SLOT, slot, PAD_SLOT], &CPU).unwrap();
    kv_norm_rope_write(pool.layer(0), &qkv, &spec, &rope, &pos, &slots).unwrap();
    let written = pool
        .layer(0)
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let (k, v) = reference::kv_norm_rope(
        &qkv.narrow(0, 1, 1).unwrap(),
        &spec,
        &rope,
        &pos.narrow(0, 0, 1).unwrap(),
    )
    .unwrap();
    let want = (k.abs().unwrap().sum_all().unwrap() + v.abs().unwrap().sum_all().unwrap())
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        (written - want).abs() <= 1e-3 * want,
        "only the real row wrote: {written} vs {want}"
    );
    let pad = pool.empty_table();
    let q = q_norm_rope(&qkv, &spec, &rope, &pos)
        .unwrap()
        .narrow(0, 0, 2)
        .unwrap();
    let out = attend(&pool, &q, &[&pad, &row]);
    assert!(
        bits(&out.get(0).unwrap()).iter().all(|&b| b == 0),
        "a pad row attends to zeros"
    );
    let v0 = v.reshape((2, d)).unwrap();
    let mine = out.get(1).unwrap().reshape((4, d)).unwrap();
    assert!(
        max_err(
            &mine.narrow(0, 0, 2).unwrap(),
            &Tensor::stack(&[v0.get(0).unwrap(), v0.get(0).unwrap()], 0).unwrap()
        ) < 1e-6,
        "one position: its value"
    );
}

/// The decode step pads its rows to a whole tile: a kernel the self-check rejected runs its
/// composition on pad rows too (once a softmax over no position panicked there).
#[test]
fn regression_the_compositions_take_pad_rows_like_the_kernels() {
    let d = 64;
    let (qkv, _, _, cos, sin) = qkv_case(d, DType::F32);
    let spec = QkvSpec {
        n_head: 4,
        n_kv: 2,
        head_dim: d,
        q_norm: None,
        k_norm: None,
        eps: 1e-6,
    };
    let rope = Rope {
        cos: &cos,
        sin: &sin,
        pairs: RopePairs::Halves,
    };
    let shape = PoolShape {
        n_layer: 1,
        n_kv_head: 2,
        head_dim: d,
        num_blocks: 2,
    };
    let (mut kernel, composed) = (
        PagedKvPool::new(shape, DType::F32, &CPU).unwrap(),
        PagedKvPool::new(shape, DType::F32, &CPU).unwrap(),
    );
    let mut row = kernel.empty_table();
    let slot = kernel.append_slots(&mut row, 1).unwrap()[0];
    let pos = Tensor::new(&[0u32, 0, 0], &CPU).unwrap();
    let host = [PAD_SLOT, slot, PAD_SLOT];
    let slots = Tensor::new(&host, &CPU).unwrap();
    kv_norm_rope_write(kernel.layer(0), &qkv, &spec, &rope, &pos, &slots).unwrap();
    let (k, v) = reference::kv_norm_rope(&qkv, &spec, &rope, &pos).unwrap();
    reference::write_slots(composed.layer(0), &k, &v, &host).unwrap();
    assert!(
        max_err(kernel.layer(0), composed.layer(0)) < 1e-6,
        "the scatter writes the real row only, as the kernel"
    );
    let q = q_norm_rope(&qkv, &spec, &rope, &pos).unwrap();
    let pad = BlockTable::default();
    let table = row_table_tensor(&[&pad, &row, &pad], &CPU).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    let want = paged_decode_attention(&q, kernel.layer(0), &table, scale).unwrap();
    let got = reference::paged_decode_attention(&q, composed.layer(0), &table, scale).unwrap();
    assert!(
        max_err(&got, &want) < 1e-6,
        "pad rows attend to zeros in both"
    );
}

/// Runs only where a CUDA device is present (a GPU check); elsewhere it says so and passes.
#[cfg(feature = "cuda")]
#[test]
fn on_a_cuda_device_every_kernel_passes_its_self_check_and_rows_are_batch_invariant() {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: the device half of the kernel checks did not run");
        return;
    };
    let report = self_check(&dev);
    for c in &report.checks {
        assert!(c.passed(), "{c:?}");
    }
    // Shapes the launchers do not take fail their check (the model then runs the reference).
    let tiny = AttnShape {
        head_dim: 16,
        n_head: 4,
        n_kv: 2,
        hidden: 1024,
    };
    let at_16 = self_check_for(&dev, tiny);
    assert!(!at_16.usable(KernelId::QkNormRopeKv) && !at_16.usable(KernelId::PagedAttention));
    for dtype in [DType::F32, DType::BF16] {
        let (d, n_head, n_kv) = (128, 8, 2);
        let mut rng = Rng(3);
        let shape = PoolShape {
            n_layer: 1,
            n_kv_head: n_kv,
            head_dim: d,
            num_blocks: 160,
        };
        let mut pool = PagedKvPool::new(shape, dtype, &dev).unwrap();
        let fill = rand(&mut rng, &[160, 2, BLOCK, n_kv, d], dtype);
        pool.layer(0)
            .slice_set(&fill.to_device(&dev).unwrap(), 0, 0)
            .unwrap();
        let tables = tables_of(&mut pool, &[1, 300, PARTITION + 40, 1500]);
        let q = rand(&mut rng, &[4, n_head, d], dtype)
            .to_device(&dev)
            .unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let run = |order: &[usize]| {
            let idx: Vec<u32> = order.iter().map(|&i| i as u32).collect();
            let qb = q.index_select(&Tensor::new(idx, &dev).unwrap(), 0).unwrap();
            let rows: Vec<&BlockTable> = order.iter().map(|&i| &tables[i]).collect();
            let table = row_table_tensor(&rows, &dev).unwrap();
            paged_decode_attention(&qb, pool.layer(0), &table, scale).unwrap()
        };
        let all = run(&[0, 1, 2, 3]);
        let reversed = run(&[3, 2, 1, 0]);
        for i in 0..4 {
            let alone = bits(&run(&[i]));
            assert_eq!(
                bits(&all.get(i).unwrap()),
                alone,
                "{dtype:?} row {i} in order"
            );
            assert_eq!(
                bits(&reversed.get(3 - i).unwrap()),
                alone,
                "{dtype:?} row {i} reversed"
            );
        }
    }
}

/// `decode_attn=v2` computes `v1`'s bits: the same sums in the same order, only with more loads
/// in flight (lengths that end mid-group and mid-block, 1 to 16 query heads a KV head, head
/// dims 64 to 256).
#[test]
fn on_a_cuda_device_the_two_decode_attention_kernels_compute_the_same_bits() {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: the decode attention kernels were not compared");
        return;
    };
    let lens = [1, 3, 17, 301, PARTITION, PARTITION + 5, 1999];
    let blocks: usize = lens.iter().map(|n| n.div_ceil(BLOCK)).sum();
    for dtype in [DType::F32, DType::BF16] {
        for (d, n_head, n_kv) in [
            (128, 32, 8),
            (64, 9, 3),
            (128, 32, 2),
            (256, 16, 2),
            (64, 2, 2),
        ] {
            let mut rng = Rng(11);
            let shape = PoolShape {
                n_layer: 1,
                n_kv_head: n_kv,
                head_dim: d,
                num_blocks: blocks,
            };
            let mut pool = PagedKvPool::new(shape, dtype, &dev).unwrap();
            let fill = rand(&mut rng, &[blocks, 2, BLOCK, n_kv, d], dtype);
            pool.layer(0)
                .slice_set(&fill.to_device(&dev).unwrap(), 0, 0)
                .unwrap();
            let tables = tables_of(&mut pool, &lens);
            let q = rand(&mut rng, &[lens.len(), n_head, d], dtype)
                .to_device(&dev)
                .unwrap();
            let rows: Vec<&BlockTable> = tables.iter().collect();
            let table = row_table_tensor(&rows, &dev).unwrap();
            let scale = 1.0 / (d as f32).sqrt();
            let run =
                |v1| paged_decode_attention_with(&q, pool.layer(0), &table, scale, v1).unwrap();
            assert_eq!(
                bits(&run(true)),
                bits(&run(false)),
                "{dtype:?} d {d}, {n_head}/{n_kv} heads"
            );
        }
    }
}

mod flash;
