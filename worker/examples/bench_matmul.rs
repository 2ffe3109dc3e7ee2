//! Matmul throughput of the CPU fast path, f32 vs the integer kernels, on SmolLM2-135M's
//! shapes (synthetic Q4_1 / Q8_0 weights): the kernel-level view behind `bench_engine`.
//!
//! ```text
//! cargo run --release -p stageb-worker --example bench_matmul -- [--threads 2] [--kernels avx2]
//! ```

use std::time::Instant;

use stageb_worker::engine::cpu::int8::{self, Int8Workspace};
use stageb_worker::engine::cpu::isa::{self, KernelChoice};
use stageb_worker::engine::cpu::kernels;
use stageb_worker::engine::cpu::weights::{Interleaved, PackedMatrix};

fn weights(n: usize, k: usize, q8: bool) -> PackedMatrix {
    let nb = n * k / 32;
    if q8 {
        let mut b = Vec::with_capacity(nb * 34);
        for i in 0..nb {
            b.extend_from_slice(&[0x66, 0x2e]);
            b.extend((0..32).map(|j| ((i * 13 + j * 5) % 256) as u8));
        }
        PackedMatrix::from_q8_0(&b, n, k).unwrap()
    } else {
        let mut b = Vec::with_capacity(nb * 20);
        for i in 0..nb {
            b.extend_from_slice(&[0x66, 0x2e, (i % 7) as u8, 0xa4]);
            b.extend((0..16).map(|j| ((i * 31 + j * 7) % 256) as u8));
        }
        PackedMatrix::from_q4_1(&b, n, k).unwrap()
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut threads = 2;
    let mut i = 0;
    while i < argv.len() {
        match argv[i].as_str() {
            "--threads" => threads = argv[i + 1].parse().expect("--threads N"),
            "--kernels" => {
                isa::choose(argv[i + 1].parse::<KernelChoice>().expect("--kernels"));
            }
            a => panic!("unknown argument {a}"),
        }
        i += 2;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    println!(
        "kernels: f32 {:?}, int8 {}",
        isa::f32_isa(),
        isa::int8_isa().name()
    );
    // (name, n, k, q8_0)
    let shapes = [
        ("qkv 576->960", 960, 576, false),
        ("gate_up 576->3072", 3072, 576, false),
        ("down 1536->576", 576, 1536, false),
        ("head 576->49152 (q8_0)", 49152, 576, true),
    ];
    pool.install(|| {
        for m in [8usize, 512] {
            for (name, n, k, q8) in shapes {
                let w = weights(n, k, q8);
                let wi = PackedMatrix::Interleaved(Box::new(Interleaved::from_packed(&w).unwrap()));
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
                let mut y = vec![0f32; m * n];
                let reps = (2e9 / (m * n * k) as f64).clamp(1.0, 200.0) as usize;
                let (mut yt, mut ws) = (Vec::new(), Int8Workspace::default());
                let time = |f: &mut dyn FnMut()| {
                    f();
                    let t = Instant::now();
                    for _ in 0..reps {
                        f();
                    }
                    t.elapsed().as_secs_f64() / reps as f64
                };
                let tf = time(&mut || kernels::matmul(&x, m, &w, &mut y, &mut yt));
                let ti = time(&mut || int8::matmul(&x, m, &wi, &mut y, &mut ws));
                let gmac = (m * n * k) as f64 / 1e9;
                println!(
                    "m={m:3} {name:24} f32 {:8.3} ms ({:6.1} GMAC/s)  int8 {:8.3} ms ({:6.1} GMAC/s)  f32/int8 {:.2}x",
                    tf * 1e3,
                    gmac / tf,
                    ti * 1e3,
                    gmac / ti,
                    tf / ti
                );
            }
        }
    });
}
