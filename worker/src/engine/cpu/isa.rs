//! The instruction sets the CPU kernels run with, chosen once per process from what the CPU
//! has and the kernel choice (`--kernels`, [`choose`], else `STAGEB_KERNELS`): the integer
//! kernels' level ([`int8_isa`]: AMX tiles, AVX-512 VNNI, AVX-512BW, AVX2 or scalar, capped by
//! the choice; AMX only where the OS grants the tile state, see [`super::int8::amx`]) and the f32 kernels' ([`f32_isa`]: AVX2+FMA, or scalar when the choice is
//! `scalar`). Every choice gives the same bits.

use std::sync::OnceLock;

/// The instruction set of the integer kernels, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512Bw,
    Avx512Vnni,
    /// AMX int8 tiles for batches of 16 rows or more, AVX-512 VNNI for the rest.
    Amx,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Bw => "avx512bw",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Amx => "amx",
        }
    }
}

/// Which kernels to use: the best the CPU has, or at most a given level (benchmarks, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelChoice {
    #[default]
    Auto,
    AtMost(Isa),
}

impl std::str::FromStr for KernelChoice {
    type Err = String;

    /// `auto`, `amx`, `avx512vnni`, `avx512bw`, `avx2` or `scalar`.
    fn from_str(s: &str) -> Result<Self, String> {
        let isa = match s {
            "auto" => return Ok(KernelChoice::Auto),
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avx512bw" => Isa::Avx512Bw,
            "avx512vnni" => Isa::Avx512Vnni,
            "amx" => Isa::Amx,
            _ => {
                return Err(format!(
                    "unknown kernels `{s}` (auto, amx, avx512vnni, avx512bw, avx2, scalar)"
                ));
            }
        };
        Ok(KernelChoice::AtMost(isa))
    }
}

static CHOICE: OnceLock<KernelChoice> = OnceLock::new();
static ISA: OnceLock<Isa> = OnceLock::new();

/// Caps the kernels of this process (the CLI's `--kernels`). Effective only before the first
/// kernel runs; returns false when the choice was already made. Without it, the environment
/// variable `STAGEB_KERNELS` (same values) is read.
pub fn choose(choice: KernelChoice) -> bool {
    CHOICE.set(choice).is_ok() && ISA.get().is_none()
}

/// The best instruction set this CPU supports (AMX: the CPU has the tiles and the OS granted
/// this process their state; asked once, see [`super::int8::amx::available`]).
pub fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        let bw =
            avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
        if bw && is_x86_feature_detected!("avx512vnni") {
            if super::int8::amx::available() {
                return Isa::Amx;
            }
            return Isa::Avx512Vnni;
        }
        if bw {
            return Isa::Avx512Bw;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// The kernels asked for: [`choose`]'s choice, else `STAGEB_KERNELS`, else auto.
pub fn choice() -> KernelChoice {
    CHOICE.get().copied().unwrap_or_else(|| {
        std::env::var("STAGEB_KERNELS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_default()
    })
}

/// The instruction set the integer kernels ([`super::int8`]) run with in this process: the
/// detected one, capped by [`choice`]. Every choice gives the same bits.
pub fn int8_isa() -> Isa {
    *ISA.get_or_init(|| match choice() {
        KernelChoice::Auto => detected(),
        KernelChoice::AtMost(cap) => detected().min(cap),
    })
}

/// The instruction set of the f32 kernels ([`super::kernels`], [`super::attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Isa {
    Avx2,
    Scalar,
}

fn detect_f32() -> F32Isa {
    if choice() == KernelChoice::AtMost(Isa::Scalar) {
        return F32Isa::Scalar;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return F32Isa::Avx2;
        }
    }
    F32Isa::Scalar
}

/// The instruction set of the f32 kernels in this process (`--kernels scalar` or
/// `STAGEB_KERNELS=scalar` forces the fallback).
pub fn f32_isa() -> F32Isa {
    static F32: OnceLock<F32Isa> = OnceLock::new();
    *F32.get_or_init(detect_f32)
}

/// Whether the f32 kernels run their 16-lane copies (attention, and the elementwise kernels'
/// AVX-512 copy, [`super::kernels::F32Copy`]): AVX-512F is there and the choice allows AVX-512
/// (`--kernels avx2` keeps 8 lanes). Every choice gives the same bits.
pub fn f32_wide() -> bool {
    f32_isa() == F32Isa::Avx2 && int8_isa() >= Isa::Avx512Bw
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_choice_parses_and_caps_at_what_the_cpu_has() {
        assert_eq!("auto".parse::<KernelChoice>(), Ok(KernelChoice::Auto));
        assert_eq!(
            "avx2".parse::<KernelChoice>(),
            Ok(KernelChoice::AtMost(Isa::Avx2))
        );
        assert_eq!(
            "amx".parse::<KernelChoice>(),
            Ok(KernelChoice::AtMost(Isa::Amx))
        );
        assert!(
            Isa::Amx > Isa::Avx512Vnni,
            "capping at VNNI turns the tiles off"
        );
        assert!("sse9".parse::<KernelChoice>().is_err());
        assert!(int8_isa() <= detected());
    }
}
