//! The flash prefill's CPU reference against its masked dense composition, its reduction
//! order fixed by position (any chunking of the same keys and values gives a row the same
//! bits), prefixes shared by reference, bad tables refused, and on a CUDA device the kernel
//! against the CPU reference.

use super::*;

/// A job's table of `len` positions over `pool` (the first `shared` of them shared with
/// `prefix`, whose partial last block is then copied on write).
fn job_table(
    pool: &mut PagedKvPool,
    prefix: Option<(&BlockTable, usize)>,
    len: usize,
) -> BlockTable {
    let mut t = match prefix {
        Some((p, shared)) => pool.share_prefix(p, shared).unwrap(),
        None => pool.empty_table(),
    };
    let more = len - t.len();
    pool.append_slots(&mut t, more).unwrap();
    t
}

fn flash(pool: &PagedKvPool, q: &Tensor, table: &BlockTable) -> Tensor {
    let t = row_table_tensor(&[table], q.device()).unwrap();
    let scale = 1.0 / (q.dim(2).unwrap() as f32).sqrt();
    flash_prefill_attention(q, pool.layer(0), &t, scale).unwrap()
}

fn composed(pool: &PagedKvPool, q: &Tensor, table: &BlockTable) -> Tensor {
    let t = row_table_tensor(&[table], q.device()).unwrap();
    let scale = 1.0 / (q.dim(2).unwrap() as f32).sqrt();
    reference::flash_prefill_attention(q, pool.layer(0), &t, scale).unwrap()
}

#[test]
fn the_flash_prefill_reference_equals_masked_dense_attention_with_gqa_in_f32_and_bf16() {
    for dtype in [DType::F32, DType::BF16] {
        for (d, n_head, n_kv) in [(64, 8, 2), (128, 4, 4), (64, 6, 1)] {
            let mut rng = Rng(d as u64 + n_kv as u64);
            let mut pool = random_pool(&mut rng, n_kv, d, 64, dtype);
            let first = job_table(&mut pool, None, 300);
            // (table, chunk rows): a whole prompt, a chunk after a prefix inside a key tile,
            // a one-row chunk, and a chunk after a shared prefix ending mid-block.
            let after = job_table(&mut pool, Some((&first, 37)), 37 + 90);
            let cases = [(&first, 300), (&first, 300 - 45), (&first, 1), (&after, 90)];
            for (table, c) in cases {
                let q = rand(&mut rng, &[c, n_head, d], dtype);
                let err = max_err(&flash(&pool, &q, table), &composed(&pool, &q, table));
                assert!(
                    err < tol(dtype),
                    "{dtype:?} d={d} {n_head}/{n_kv} c={c}: {err}"
                );
            }
        }
    }
}

/// The recipe's promise: a row's reduction order depends on its position alone, so the rows
/// of one chunk of 100 and of the same positions cut 33 | 1 | 66 (the same keys and values
/// in the pool) are the same bits, whatever the chunk around them.
#[test]
fn a_row_gives_the_same_bits_in_any_chunking_of_the_prompt() {
    for dtype in [DType::F32, DType::BF16] {
        let (d, n_head, n_kv) = (64, 4, 2);
        let mut rng = Rng(11);
        let mut pool = random_pool(&mut rng, n_kv, d, 32, dtype);
        let whole = job_table(&mut pool, None, 100);
        let q = rand(&mut rng, &[100, n_head, d], dtype);
        let all = flash(&pool, &q, &whole);
        let mut at = 0;
        for c in [33, 1, 66] {
            let upto = pool.share_prefix(&whole, at + c).unwrap();
            let part = flash(&pool, &q.narrow(0, at, c).unwrap(), &upto);
            assert_eq!(
                bits(&part),
                bits(&all.narrow(0, at, c).unwrap()),
                "{dtype:?}: rows {at}..{}",
                at + c
            );
            pool.release(upto);
            at += c;
        }
    }
}

#[test]
fn a_prefix_shared_by_reference_attends_like_its_copy() {
    let (d, n_head, n_kv, dtype) = (64, 4, 2, DType::F32);
    let mut rng = Rng(5);
    let mut pool = random_pool(&mut rng, n_kv, d, 32, dtype);
    let stored = job_table(&mut pool, None, 64);
    let shared = job_table(&mut pool, Some((&stored, 64)), 64 + 20);
    assert_eq!(&shared.blocks()[..4], stored.blocks(), "full blocks shared");
    // The same positions in blocks of the job's own: the prefix copied block by block.
    let copied = job_table(&mut pool, None, 64 + 20);
    for (i, &b) in stored.blocks().iter().enumerate() {
        let block = pool.layer(0).narrow(0, b as usize, 1).unwrap();
        let dst = copied.blocks()[i] as usize;
        pool.layer(0)
            .slice_set(&block.force_contiguous().unwrap(), 0, dst)
            .unwrap();
    }
    let tail = |t: &BlockTable| t.blocks()[4..].to_vec();
    for (src, dst) in tail(&shared).into_iter().zip(tail(&copied)) {
        let block = pool.layer(0).narrow(0, src as usize, 1).unwrap();
        let dst = dst as usize;
        pool.layer(0)
            .slice_set(&block.force_contiguous().unwrap(), 0, dst)
            .unwrap();
    }
    let q = rand(&mut rng, &[20, n_head, d], dtype);
    assert_eq!(
        bits(&flash(&pool, &q, &shared)),
        bits(&flash(&pool, &q, &copied))
    );
}

#[test]
fn a_table_that_does_not_hold_the_chunk_is_refused() {
    let mut rng = Rng(9);
    let mut pool = random_pool(&mut rng, 2, 64, 8, DType::F32);
    let t = job_table(&mut pool, None, 10);
    let q = rand(&mut rng, &[11, 4, 64], DType::F32);
    let table = row_table_tensor(&[&t], &CPU).unwrap();
    let e = flash_prefill_attention(&q, pool.layer(0), &table, 0.125).unwrap_err();
    assert!(e.to_string().contains("does not hold"), "{e}");
    let outside = Tensor::new(&[[10u32, 99]], &CPU).unwrap();
    let q = q.narrow(0, 0, 10).unwrap();
    assert!(flash_prefill_attention(&q, pool.layer(0), &outside, 0.125).is_err());
    let wrong_dtype = Tensor::new(&[[10f32, 0.0]], &CPU).unwrap();
    assert!(flash_prefill_attention(&q, pool.layer(0), &wrong_dtype, 0.125).is_err());
}

/// The last row of a prefill is the decode attention of that position: the two recipes
/// agree to rounding.
#[test]
fn the_last_prefill_row_matches_the_decode_attention_of_its_position() {
    let (d, n_head, n_kv, dtype) = (64, 8, 2, DType::F32);
    let mut rng = Rng(13);
    let mut pool = random_pool(&mut rng, n_kv, d, 64, dtype);
    let t = job_table(&mut pool, None, PARTITION + 70);
    let q = rand(&mut rng, &[70, n_head, d], dtype);
    let last = flash(&pool, &q, &t).narrow(0, 69, 1).unwrap();
    let decode = attend(&pool, &q.narrow(0, 69, 1).unwrap(), &[&t]);
    let err = max_err(&last, &decode);
    assert!(err < tol(dtype), "{err}");
}

/// Runs only where a CUDA device is present (a GPU check); elsewhere it says so and passes.
#[cfg(feature = "cuda")]
#[test]
fn on_a_cuda_device_the_flash_prefill_matches_the_cpu_reference_and_any_chunking() {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: the device half of the flash prefill checks did not run");
        return;
    };
    for dtype in [DType::F32, DType::BF16] {
        for d in [64, 128, 256] {
            let (n_head, n_kv, blocks) = (8, 2, 96);
            let mut rng = Rng(17 + d as u64);
            let cpu_pool = random_pool(&mut rng, n_kv, d, blocks, dtype);
            let mut pool = PagedKvPool::new(cpu_pool.shape(), dtype, &dev).unwrap();
            pool.layer(0)
                .slice_set(&cpu_pool.layer(0).to_device(&dev).unwrap(), 0, 0)
                .unwrap();
            let whole = job_table(&mut pool, None, 700);
            let q = rand(&mut rng, &[700, n_head, d], dtype);
            let on_gpu = flash(&pool, &q.to_device(&dev).unwrap(), &whole);
            let on_cpu = flash(&cpu_pool, &q, &whole);
            let err = max_err(&on_gpu.to_device(&CPU).unwrap(), &on_cpu);
            assert!(err < tol(dtype), "{dtype:?} d={d}: {err}");
            let upto = pool.share_prefix(&whole, 513).unwrap();
            let part = flash(
                &pool,
                &q.narrow(0, 500, 13).unwrap().to_device(&dev).unwrap(),
                &upto,
            );
            assert_eq!(
                bits(&part),
                bits(&on_gpu.narrow(0, 500, 13).unwrap()),
                "{dtype:?} d={d}: a chunk's rows are the whole prompt's"
            );
            pool.release(upto);
        }
    }
}
