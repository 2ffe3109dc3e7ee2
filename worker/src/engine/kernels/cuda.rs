//! Launching the CUDA kernels: the PTX nvcc wrote at build time (`build.rs`, from
//! `worker/kernels/*.cu`), loaded once per device through candle's custom-module store
//! (`CudaDevice::get_or_load_custom_func`) and launched on the device's stream. Each launch
//! reads its inputs' contiguous ranges; the shapes were checked by the op before.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Storage, StorageRef, Tensor};

use super::params::{
    AttnDims, KEY_TILE, PARTITION, PrefillDims, QkvRope, RopePairs, silu_mul_shape,
};
use super::pool::BLOCK;

const PAGED_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));
const FUSED_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));

/// Threads of the attention's partition blocks (four warps).
const ATTN_THREADS: u32 = 128;

fn suffix(dtype: DType) -> candle_core::Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => candle_core::bail!("no stageb kernel for {d:?}"),
    }
}

/// Loads `name_<dtype>` from the paged (`$paged` true) or fused module of `$dev`.
macro_rules! load {
    ($dev:expr, $paged:expr, $name:expr, $dtype:expr) => {{
        let (module, ptx) = match $paged {
            true => ("stageb_paged_attention", PAGED_PTX),
            false => ("stageb_fused", FUSED_PTX),
        };
        let name = format!("{}_{}", $name, suffix($dtype)?);
        $dev.get_or_load_custom_func(&name, module, ptx)?
    }};
}

fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("a kernel input must be contiguous".into()))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// An extra input's storage, read-locked while the launch is built.
fn storage(t: &Tensor) -> (StorageRef<'_>, &Layout) {
    t.storage_and_layout()
}

fn cuda(s: &Storage) -> candle_core::Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("a kernel's extra input is not on the CUDA device"),
    }
}

fn dim(x: usize) -> candle_core::Result<i32> {
    i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{x} does not fit a kernel")))
}

/// `kernel`: the scale, and whether to run the first partial kernel (`decode_attn=v1`).
pub(super) fn paged_attention(
    kernel: (f32, bool),
    dims: AttnDims,
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    match (&s1.slice, &s2.slice) {
        (CudaStorageSlice::F32(_), CudaStorageSlice::F32(_)) => {
            attention_t::<f32>(kernel, dims, (s1, l1), (s2, l2), (s3, l3))
        }
        (CudaStorageSlice::BF16(q), CudaStorageSlice::BF16(_)) => {
            attention_like(q, kernel, dims, (s1, l1), (s2, l2), (s3, l3))
        }
        _ => candle_core::bail!("paged attention: f32 or bf16 inputs of one dtype"),
    }
}

/// [`attention_t`] for the element type of `_witness` (names bf16 without the `half` crate).
fn attention_like<T: CudaDType + DeviceRepr>(
    _witness: &CudaSlice<T>,
    kernel: (f32, bool),
    dims: AttnDims,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    c: (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    attention_t::<T>(kernel, dims, a, b, c)
}

fn attention_t<T: CudaDType + DeviceRepr>(
    (scale, v1): (f32, bool),
    dims: AttnDims,
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    let AttnDims {
        rows,
        n_head,
        n_kv,
        d,
        width,
        ..
    } = dims;
    let n_rep = n_head / n_kv;
    if !d.is_multiple_of(32) || d > 256 || n_rep > 16 {
        candle_core::bail!(
            "paged attention kernel: head dim {d} (a multiple of 32 up to 256), {n_rep} heads per KV head (up to 16)"
        )
    }
    let dev = s1.device().clone();
    let (q, pool, table) = (view::<T>(s1, l1)?, view::<T>(s2, l2)?, view::<u32>(s3, l3)?);
    // Partitions a row can have at most: bounded by its table's width, not by the batch.
    let max_parts = ((width - 1) * BLOCK).div_ceil(PARTITION).max(1);
    // SAFETY: the combine kernel reads a row's partitions below its count only, each written
    // by the partial kernel; the rest stays unread.
    let mut acc = unsafe { dev.alloc::<f32>(rows * n_head * max_parts * d)? };
    // SAFETY: as above.
    let mut ml = unsafe { dev.alloc::<f32>(rows * n_head * max_parts * 2)? };
    let (w, nh, nk, dd, mp) = (
        dim(width)?,
        dim(n_head)?,
        dim(n_kv)?,
        dim(d)?,
        dim(max_parts)?,
    );
    let shared = (n_rep * d + n_rep * PARTITION + 32) * std::mem::size_of::<f32>();
    if shared > 48 * 1024 {
        candle_core::bail!(
            "paged attention kernel: {n_rep} heads per KV head of {d} need {shared} bytes of shared memory (48 KiB at most)"
        )
    }
    let partial = match v1 {
        true => load!(dev, true, "paged_attn_partial", s1.dtype()),
        false => load!(dev, true, "paged_attn_partial_v2", s1.dtype()),
    };
    let mut b = partial.builder();
    b.arg(&q)
        .arg(&pool)
        .arg(&table)
        .arg(&w)
        .arg(&nh)
        .arg(&nk)
        .arg(&dd)
        .arg(&scale)
        .arg(&mp);
    b.arg(&mut acc).arg(&mut ml);
    let cfg = LaunchConfig {
        grid_dim: (n_kv as u32, rows as u32, max_parts as u32),
        block_dim: (ATTN_THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    // SAFETY: the shapes were checked by the op; every index the kernel reads is bounded by
    // the row's length and table, which the pool's tables keep within the pool.
    unsafe { b.launch(cfg) }.w()?;
    // SAFETY: every element is written by the combine kernel below.
    let mut out = unsafe { dev.alloc::<T>(rows * n_head * d)? };
    let combine = load!(dev, true, "paged_attn_combine", s1.dtype());
    let mut b = combine.builder();
    b.arg(&acc)
        .arg(&ml)
        .arg(&table)
        .arg(&w)
        .arg(&nh)
        .arg(&dd)
        .arg(&mp)
        .arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (n_head as u32, rows as u32, 1),
        block_dim: (d.min(128) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above; `out` holds rows * n_head * d elements.
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Query rows per thread block of the flash prefill (`QROWS` in the kernel).
const FLASH_QROWS: usize = 8;

/// Threads of the flash prefill's blocks (`FLASH_THREADS` in the kernel).
const FLASH_THREADS: u32 = 128;

pub(super) fn flash_prefill(
    scale: f32,
    dims: PrefillDims,
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        _witness: &CudaSlice<T>,
        scale: f32,
        dims: PrefillDims,
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (s3, l3): (&CudaStorage, &Layout),
    ) -> candle_core::Result<CudaStorage> {
        let PrefillDims {
            rows,
            n_head,
            n_kv,
            d,
            width,
            ..
        } = dims;
        if d > 256 {
            candle_core::bail!("flash prefill kernel: head dim {d} (up to 256)")
        }
        let dev = s1.device().clone();
        let (q, pool, table) = (view::<T>(s1, l1)?, view::<T>(s2, l2)?, view::<u32>(s3, l3)?);
        let floats = FLASH_QROWS * d + KEY_TILE * d + FLASH_QROWS * KEY_TILE + 3 * FLASH_QROWS;
        let shared = (floats + FLASH_QROWS) * std::mem::size_of::<f32>();
        // SAFETY: every element is written: each (row, head) by its block, zeros for a table
        // that does not hold the chunk.
        let mut out = unsafe { dev.alloc::<T>(rows * n_head * d)? };
        let (w, c, nh, nk, dd) = (dim(width)?, dim(rows)?, dim(n_head)?, dim(n_kv)?, dim(d)?);
        let f = load!(dev, true, "flash_prefill", s1.dtype());
        let mut b = f.builder();
        b.arg(&q)
            .arg(&pool)
            .arg(&table)
            .arg(&w)
            .arg(&c)
            .arg(&nh)
            .arg(&nk)
            .arg(&dd)
            .arg(&scale)
            .arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (n_head as u32, rows.div_ceil(FLASH_QROWS) as u32, 1),
            block_dim: (FLASH_THREADS, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        // SAFETY: the shapes were checked by the op; the kernel reads positions below the
        // table's length only, through blocks the pool's tables keep within the pool, and
        // checks the length against the table's width and the chunk first.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    match (&s1.slice, &s2.slice) {
        (CudaStorageSlice::F32(x), CudaStorageSlice::F32(_)) => {
            run(x, scale, dims, (s1, l1), (s2, l2), (s3, l3))
        }
        (CudaStorageSlice::BF16(x), CudaStorageSlice::BF16(_)) => {
            run(x, scale, dims, (s1, l1), (s2, l2), (s3, l3))
        }
        _ => candle_core::bail!("flash prefill: f32 or bf16 inputs of one dtype"),
    }
}

pub(super) fn add_rms_norm(
    eps: f32,
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        _witness: &CudaSlice<T>,
        eps: f32,
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (s3, l3): (&CudaStorage, &Layout),
    ) -> candle_core::Result<CudaStorage> {
        let dev = s1.device().clone();
        let h = *l1.dims().last().unwrap_or(&0);
        let n = l1.shape().elem_count();
        if h == 0 || l3.shape().elem_count() != h {
            candle_core::bail!("add_rms_norm: a weight of the hidden size")
        }
        let (x, r, w) = (view::<T>(s1, l1)?, view::<T>(s2, l2)?, view::<f32>(s3, l3)?);
        // SAFETY: every element (sums then normed sums) is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(2 * n)? };
        let (rows, hh) = (dim(n / h)?, dim(h)?);
        let f = load!(dev, false, "add_rms_norm", s1.dtype());
        let mut b = f.builder();
        b.arg(&x)
            .arg(&r)
            .arg(&w)
            .arg(&mut out)
            .arg(&rows)
            .arg(&hh)
            .arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: ((n / h) as u32, 1, 1),
            block_dim: (if h >= 1024 { 1024 } else { 256 }, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x, r and out hold rows * h elements, w holds h.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    match (&s1.slice, &s2.slice) {
        (CudaStorageSlice::F32(x), CudaStorageSlice::F32(_)) => {
            run(x, eps, (s1, l1), (s2, l2), (s3, l3))
        }
        (CudaStorageSlice::BF16(x), CudaStorageSlice::BF16(_)) => {
            run(x, eps, (s1, l1), (s2, l2), (s3, l3))
        }
        _ => candle_core::bail!("add_rms_norm: f32 or bf16 inputs of one dtype"),
    }
}

pub(super) fn silu_mul(s: &CudaStorage, l: &Layout) -> candle_core::Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        _witness: &CudaSlice<T>,
        s: &CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let dev = s.device().clone();
        let (rows, ff) = silu_mul_shape(l)?;
        let gu = view::<T>(s, l)?;
        // SAFETY: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(rows * ff)? };
        let f = load!(dev, false, "silu_mul", s.dtype());
        let mut b = f.builder();
        let (r, c) = (dim(rows)?, dim(ff)?);
        b.arg(&gu).arg(&mut out).arg(&r).arg(&c);
        let blocks = (rows * ff).div_ceil(256).clamp(1, 65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: gu holds rows * 2ff elements, out rows * ff (a grid-stride loop).
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    match &s.slice {
        CudaStorageSlice::F32(x) => run(x, s, l),
        CudaStorageSlice::BF16(x) => run(x, s, l),
        _ => candle_core::bail!("silu_mul: f32 or bf16"),
    }
}

pub(super) fn q_norm_rope(
    op: &QkvRope,
    rows: usize,
    s: &CudaStorage,
    l: &Layout,
) -> candle_core::Result<CudaStorage> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("q|k|v must be contiguous".into()))?;
    let (dev, dtype) = (s.device(), s.dtype());
    match &s.slice {
        CudaStorageSlice::F32(x) => {
            qk_rope_t(op, rows, (dev, dtype), x.slice(a..b), Target::Queries)
        }
        CudaStorageSlice::BF16(x) => {
            qk_rope_t(op, rows, (dev, dtype), x.slice(a..b), Target::Queries)
        }
        _ => candle_core::bail!("q/k rope: f32 or bf16"),
    }
    .map(|out| out.expect("the query launch returns its output"))
}

pub(super) fn kv_norm_rope_write(
    op: &QkvRope,
    rows: usize,
    pool: &mut CudaStorage,
    l: &Layout,
) -> candle_core::Result<()> {
    fn run<T: CudaDType + DeviceRepr>(
        op: &QkvRope,
        rows: usize,
        (dev, dtype): (&CudaDevice, DType),
        dst: &mut CudaViewMut<'_, T>,
    ) -> candle_core::Result<()> {
        let (qkv, _) = op.write.expect("the write op holds its q|k|v rows");
        let (g, ql) = storage(qkv);
        let qkv = view::<T>(cuda(&g)?, ql)?;
        qk_rope_t(op, rows, (dev, dtype), qkv, Target::Pool(dst)).map(|_| ())
    }
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("the pool layer must be contiguous".into()))?;
    let (dev, dtype) = (pool.device().clone(), pool.dtype());
    match &mut pool.slice {
        CudaStorageSlice::F32(p) => run(op, rows, (&dev, dtype), &mut p.slice_mut(a..b)),
        CudaStorageSlice::BF16(p) => run(op, rows, (&dev, dtype), &mut p.slice_mut(a..b)),
        _ => candle_core::bail!("q/k rope: f32 or bf16"),
    }
}

/// Where the q/k rope launch writes: new query rows, or a pool layer's slots.
enum Target<'a, 'b, T> {
    Queries,
    Pool(&'a mut CudaViewMut<'b, T>),
}

fn qk_rope_t<T: CudaDType + DeviceRepr>(
    op: &QkvRope,
    rows: usize,
    (dev, dtype): (&CudaDevice, DType),
    qkv: CudaView<'_, T>,
    target: Target<'_, '_, T>,
) -> candle_core::Result<Option<CudaStorage>> {
    let spec = &op.spec;
    let d = spec.head_dim;
    if !d.is_multiple_of(64) || d > 256 {
        candle_core::bail!("q/k rope kernel: head dim {d} (a multiple of 64 up to 256)")
    }
    let (gp, lp) = storage(op.positions);
    let positions = view::<u32>(cuda(&gp)?, lp)?;
    let (gc, lc) = storage(op.rope.cos);
    let cos = view::<T>(cuda(&gc)?, lc)?;
    let (gs, ls) = storage(op.rope.sin);
    let sin = view::<T>(cuda(&gs)?, ls)?;
    let queries = matches!(target, Target::Queries);
    let norm_t = if queries { spec.q_norm } else { spec.k_norm };
    let norm_g = norm_t.map(storage);
    let norm = match &norm_g {
        Some((g, l)) => Some(view::<f32>(cuda(g)?, l)?),
        None => None,
    };
    let null: u64 = 0;
    let (width, has_norm) = (dim(spec.width())?, i32::from(norm.is_some()));
    let (nh, nk, dd) = (dim(spec.n_head)?, dim(spec.n_kv)?, dim(d)?);
    let interleaved = i32::from(op.rope.pairs == RopePairs::Interleaved);
    let heads = if queries { spec.n_head } else { spec.n_kv };
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, rows as u32, 1),
        block_dim: ((d / 2) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = if queries { "q_rope" } else { "kv_rope_write" };
    let f = load!(dev, false, name, dtype);
    let mut b = f.builder();
    b.arg(&qkv).arg(&width);
    match &norm {
        Some(n) => b.arg(n),
        None => b.arg(&null),
    };
    b.arg(&has_norm)
        .arg(&cos)
        .arg(&sin)
        .arg(&positions)
        .arg(&nh)
        .arg(&nk)
        .arg(&dd);
    b.arg(&spec.eps).arg(&interleaved);
    match target {
        Target::Queries => {
            // SAFETY: every element is written: one block per (head, row), a pair per thread.
            let mut out = unsafe { dev.alloc::<T>(rows * spec.n_head * d)? };
            b.arg(&mut out);
            // SAFETY: qkv holds rows * width elements; positions index the RoPE tables, whose
            // length the caller keeps above every position.
            unsafe { b.launch(cfg) }.w()?;
            Ok(Some(CudaStorage::wrap_cuda_slice(out, dev.clone())))
        }
        Target::Pool(dst) => {
            let (gsl, lsl) = storage(op.write.expect("a write has slots").1);
            let slots = view::<u32>(cuda(&gsl)?, lsl)?;
            b.arg(dst).arg(&slots);
            // SAFETY: as above; slots index the pool layer, the pool's tables keep them in it.
            unsafe { b.launch(cfg) }.w()?;
            Ok(None)
        }
    }
}
