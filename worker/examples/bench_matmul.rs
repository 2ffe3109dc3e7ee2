//! The integer GEMM of the CPU fast path against the machine's ceiling: first the int8 peak of
//! every instruction path this CPU has (AMX tiles, AVX-512 VNNI, AVX-VNNI, AVX-512BW, AVX2),
//! each a tight loop of independent multiply-adds on every thread; then the engine's
//! `int8::matmul` at m = 1, 8, 64, 512 on SmolLM2-135M's shapes and a Qwen3-8B-like 4096×4096
//! (synthetic Q4_1 / Q8_0 weights), as GMAC/s and as a fraction of the peak of the path it uses.
//!
//! ```text
//! cargo run --release -p stageb-worker --example bench_matmul -- [--threads 2] [--kernels amx]
//!     [--repeat 3] [--f32]
//! ```
//! `--f32` adds the f32 kernels' rate for comparison. Rates are per CPU-second of the process
//! times the threads (what the threads would do with the cores to themselves), so a shared,
//! loaded machine changes them less than wall time; the wall-time rate is printed beside them
//! with the load average.

use std::arch::asm;
use std::time::Instant;

use stageb_worker::engine::cpu::int8::{self, Int8Workspace};
use stageb_worker::engine::cpu::isa::{self, Isa, KernelChoice};
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

/// Iterations of each peak loop per thread.
const ITERS: u64 = 4_000_000;

/// A peak loop: returns the int8 multiply-adds it did.
type Peak = fn() -> u64;

/// 12 independent `vpdpbusd zmm` a round: 64 MACs each.
fn peak_avx512vnni() -> u64 {
    for _ in 0..ITERS {
        // SAFETY: run only where the CPU has AVX-512 VNNI; registers only.
        unsafe {
            asm!(
                "vpdpbusd zmm0, zmm12, zmm13", "vpdpbusd zmm1, zmm12, zmm13",
                "vpdpbusd zmm2, zmm12, zmm13", "vpdpbusd zmm3, zmm12, zmm13",
                "vpdpbusd zmm4, zmm12, zmm13", "vpdpbusd zmm5, zmm12, zmm13",
                "vpdpbusd zmm6, zmm12, zmm13", "vpdpbusd zmm7, zmm12, zmm13",
                "vpdpbusd zmm8, zmm12, zmm13", "vpdpbusd zmm9, zmm12, zmm13",
                "vpdpbusd zmm10, zmm12, zmm13", "vpdpbusd zmm11, zmm12, zmm13",
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
                out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _,
                options(nostack, nomem),
            )
        }
    }
    ITERS * 12 * 64
}

/// 12 independent `{vex} vpdpbusd ymm` (AVX-VNNI) a round: 32 MACs each.
fn peak_avxvnni() -> u64 {
    for _ in 0..ITERS {
        // SAFETY: run only where the CPU has AVX-VNNI; registers only.
        unsafe {
            asm!(
                "{{vex}} vpdpbusd ymm0, ymm12, ymm13", "{{vex}} vpdpbusd ymm1, ymm12, ymm13",
                "{{vex}} vpdpbusd ymm2, ymm12, ymm13", "{{vex}} vpdpbusd ymm3, ymm12, ymm13",
                "{{vex}} vpdpbusd ymm4, ymm12, ymm13", "{{vex}} vpdpbusd ymm5, ymm12, ymm13",
                "{{vex}} vpdpbusd ymm6, ymm12, ymm13", "{{vex}} vpdpbusd ymm7, ymm12, ymm13",
                "{{vex}} vpdpbusd ymm8, ymm12, ymm13", "{{vex}} vpdpbusd ymm9, ymm12, ymm13",
                "{{vex}} vpdpbusd ymm10, ymm12, ymm13", "{{vex}} vpdpbusd ymm11, ymm12, ymm13",
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
                out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
                out("ymm10") _, out("ymm11") _, out("ymm12") _, out("ymm13") _,
                options(nostack, nomem),
            )
        }
    }
    ITERS * 12 * 32
}

/// `vpmaddubsw` + `vpmaddwd` + `vpaddd`, 4 chains of `$r`-registers (`$w` bytes each).
macro_rules! peak_madd {
    ($name:ident, $r:literal, $bytes:expr) => {
        fn $name() -> u64 {
            for _ in 0..ITERS {
                // SAFETY: run only where the CPU has the registers' instruction set.
                unsafe {
                    asm!(
                        concat!("vpmaddubsw ", $r, "4, ", $r, "12, ", $r, "13"),
                        concat!("vpmaddubsw ", $r, "5, ", $r, "12, ", $r, "13"),
                        concat!("vpmaddubsw ", $r, "6, ", $r, "12, ", $r, "13"),
                        concat!("vpmaddubsw ", $r, "7, ", $r, "12, ", $r, "13"),
                        concat!("vpmaddwd ", $r, "4, ", $r, "4, ", $r, "14"),
                        concat!("vpmaddwd ", $r, "5, ", $r, "5, ", $r, "14"),
                        concat!("vpmaddwd ", $r, "6, ", $r, "6, ", $r, "14"),
                        concat!("vpmaddwd ", $r, "7, ", $r, "7, ", $r, "14"),
                        concat!("vpaddd ", $r, "0, ", $r, "0, ", $r, "4"),
                        concat!("vpaddd ", $r, "1, ", $r, "1, ", $r, "5"),
                        concat!("vpaddd ", $r, "2, ", $r, "2, ", $r, "6"),
                        concat!("vpaddd ", $r, "3, ", $r, "3, ", $r, "7"),
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                        out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                        out("zmm12") _, out("zmm13") _, out("zmm14") _,
                        options(nostack, nomem),
                    )
                }
            }
            ITERS * 4 * $bytes
        }
    };
}
peak_madd!(peak_avx512bw, "zmm", 64);
peak_madd!(peak_avx2, "ymm", 32);

/// The tile configuration: `tmm0..3` 16×64 bytes, `tmm4..5` 16 rows of `k` bytes, `tmm6..7`
/// `k/4` rows of 64 bytes.
fn tile_config(k: u16) -> [u8; 64] {
    let mut c = [0u8; 64];
    c[0] = 1;
    for t in 0..8 {
        let (rows, colsb) = match t {
            0..4 => (16, 64),
            4 | 5 => (16, k),
            _ => (k / 4, 64),
        };
        c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
        c[48 + t] = rows as u8;
    }
    c
}

/// 4 independent `tdpbssd` a round (2 input tiles × 2 weight tiles) of depth `K` bytes.
fn peak_amx<const K: u16>() -> u64 {
    #[repr(align(64))]
    struct Cfg([u8; 64]);
    let cfg = Cfg(tile_config(K));
    let zeros = vec![0u8; 1024];
    // SAFETY: run only after `int8::amx::available()` (CPU and OS); the tiles read `zeros`
    // (16 rows of at most 64 bytes) and touch no other memory.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack));
        asm!(
            "tileloadd tmm4, [{p} + {s}*1]", "tileloadd tmm5, [{p} + {s}*1]",
            "tileloadd tmm6, [{p} + {s}*1]", "tileloadd tmm7, [{p} + {s}*1]",
            p = in(reg) zeros.as_ptr(), s = in(reg) 64usize, options(nostack, readonly),
        );
        for _ in 0..ITERS / 4 {
            asm!(
                "tdpbssd tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tdpbssd tmm2, tmm5, tmm6",
                "tdpbssd tmm3, tmm5, tmm7",
                options(nostack, nomem),
            );
        }
        asm!("tilerelease", options(nostack, nomem));
    }
    ITERS / 4 * 4 * 16 * 16 * K as u64
}

/// CPU seconds this process has used (every thread).
fn cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec the call fills.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Times `f`: (CPU seconds / threads, wall seconds), the best of `repeat` by CPU time.
fn timed(threads: usize, repeat: usize, f: &mut dyn FnMut()) -> (f64, f64) {
    (0..repeat)
        .map(|_| {
            let (c, t) = (cpu_seconds(), Instant::now());
            f();
            (
                (cpu_seconds() - c) / threads as f64,
                t.elapsed().as_secs_f64(),
            )
        })
        .fold((f64::INFINITY, f64::INFINITY), |a, b| {
            if b.0 < a.0 { b } else { a }
        })
}

/// GMAC/s of `f` on `threads` threads at once (the sum; CPU time, see the module docs).
fn peak_rate(f: Peak, threads: usize, repeat: usize) -> f64 {
    let mut macs = 0;
    let (cpu, _) = timed(threads, repeat, &mut || {
        macs = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads).map(|_| s.spawn(f)).collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
    });
    macs as f64 / cpu / 1e9
}

/// The peak of every path this CPU has: (path, GMAC/s).
fn peaks(threads: usize, repeat: usize) -> Vec<(&'static str, f64)> {
    let has = |f: &str| {
        std::arch::is_x86_feature_detected!("avx2")
            && match f {
                "avx512vnni" => std::arch::is_x86_feature_detected!("avx512vnni"),
                "avxvnni" => std::arch::is_x86_feature_detected!("avxvnni"),
                "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
                _ => true,
            }
    };
    let mut out = Vec::new();
    if int8::amx::available() {
        out.push((
            "amx (tdpbssd, 64-byte depth)",
            peak_rate(peak_amx::<64>, threads, repeat),
        ));
        out.push((
            "amx (32-byte depth: one block)",
            peak_rate(peak_amx::<32>, threads, repeat),
        ));
    }
    let paths: [(&str, &str, Peak); 4] = [
        ("avx512vnni", "avx512vnni (vpdpbusd zmm)", peak_avx512vnni),
        ("avxvnni", "avxvnni (vpdpbusd ymm)", peak_avxvnni),
        (
            "avx512bw",
            "avx512bw (vpmaddubsw+vpmaddwd zmm)",
            peak_avx512bw,
        ),
        ("avx2", "avx2 (vpmaddubsw+vpmaddwd ymm)", peak_avx2),
    ];
    for (feature, name, f) in paths {
        if has(feature) {
            out.push((name, peak_rate(f, threads, repeat)));
        }
    }
    out
}

/// The peak the engine's path is measured against.
fn peak_of(isa: Isa, peaks: &[(&str, f64)]) -> f64 {
    let prefix = match isa {
        Isa::Amx => "amx (tdpbssd",
        Isa::Avx512Vnni => "avx512vnni",
        Isa::Avx512Bw => "avx512bw",
        Isa::Avx2 => "avx2",
        Isa::Scalar => return f64::NAN,
    };
    peaks
        .iter()
        .find(|(n, _)| n.starts_with(prefix))
        .map_or(f64::NAN, |p| p.1)
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let (mut threads, mut repeat, mut f32_too) = (2, 3, false);
    let mut i = 0;
    while i < argv.len() {
        match argv[i].as_str() {
            "--threads" => threads = argv[i + 1].parse().expect("--threads N"),
            "--repeat" => repeat = argv[i + 1].parse().expect("--repeat N"),
            "--kernels" => {
                isa::choose(argv[i + 1].parse::<KernelChoice>().expect("--kernels"));
            }
            "--f32" => {
                f32_too = true;
                i += 1;
                continue;
            }
            a => panic!("unknown argument {a}"),
        }
        i += 2;
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "threads {threads}, best of {repeat}; load average {}",
        load.trim()
    );
    let peaks = peaks(threads, repeat);
    for (name, rate) in &peaks {
        println!("peak {name:38} {rate:8.1} GMAC/s");
    }
    let path = isa::int8_isa();
    let peak = peak_of(path, &peaks);
    println!(
        "engine kernels: int8 {} (m >= 16 on tiles when amx), f32 {:?}",
        path.name(),
        kernels::F32Copy::in_use()
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| gemms(peak, threads, repeat, f32_too));
}

/// The engine's GEMM at each `m` and shape, best of `repeat`, against `peak`.
fn gemms(peak: f64, threads: usize, repeat: usize, f32_too: bool) {
    // (name, n, k, q8_0)
    let shapes = [
        ("smollm2 qkv 576->960", 960, 576, false),
        ("smollm2 gate_up 576->3072", 3072, 576, false),
        ("smollm2 down 1536->576", 576, 1536, false),
        ("smollm2 head 576->49152 q8_0", 49152, 576, true),
        ("8b-like 4096->4096", 4096, 4096, false),
    ];
    for m in [1usize, 8, 64, 512] {
        for (name, n, k, q8) in shapes {
            let w = weights(n, k, q8);
            let wi = PackedMatrix::Interleaved(Box::new(Interleaved::from_packed(&w).unwrap()));
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let mut y = vec![0f32; m * n];
            let reps = (4e9 / (m * n * k) as f64).clamp(1.0, 400.0) as usize;
            let time = |f: &mut dyn FnMut()| {
                f();
                let (cpu, wall) = timed(threads, repeat, &mut || {
                    for _ in 0..reps {
                        f();
                    }
                });
                (cpu / reps as f64, wall / reps as f64)
            };
            let gmac = (m * n * k) as f64 / 1e9;
            let mut ws = Int8Workspace::default();
            let (ti, wall) = time(&mut || int8::matmul(&x, m, &wi, &mut y, &mut ws));
            let mut line = format!(
                "m={m:3} {name:30} int8 {:9.3} ms {:7.1} GMAC/s {:5.1}% of peak (wall {:7.1})",
                ti * 1e3,
                gmac / ti,
                100.0 * gmac / ti / peak,
                gmac / wall
            );
            if f32_too {
                let mut yt = Vec::new();
                let (tf, _) = time(&mut || kernels::matmul(&x, m, &w, &mut y, &mut yt));
                line += &format!("  f32 {:7.1} GMAC/s", gmac / tf);
            }
            println!("{line}");
        }
    }
}
