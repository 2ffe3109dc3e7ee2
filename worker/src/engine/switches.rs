//! The engine's run-time switches: one binary A/Bs every engine change on a GPU without a
//! rebuild. They are read from one environment variable, [`SWITCHES_VAR`], a comma-separated
//! list of `name=value` (unset or empty: every default):
//!
//! | name          | values        | default | what it selects |
//! |---------------|---------------|---------|-----------------|
//! | events        | on, off       | off     | cudarc event tracking on the CUDA device (off: one explicit stream) |
//! | readback      | once, per-job | once    | logits copied to the host once a step into a reused buffer, or per job (the old path) |
//! | paged         | auto, on, off | auto    | paged batched decode attention on the candle backend |
//! | fused         | auto, on, off | auto    | fused kernels (add+RMSnorm, q/k-norm+RoPE+KV write, SiLU*mul) |
//! | flash_prefill | auto, on, off | auto    | the prefill's attention read from and written to the paged KV pool (no host mask, no score matrix) |
//! | graphs        | on, off       | off     | CUDA graphs for the decode step |
//! | draft         | auto, on, off | auto    | draft tokens by prompt lookup fed after each row's token, checked by its own draws (changes no bit; where rows take several tokens a call: the CPU fast path) |
//! | prefetch      | on, off       | on      | the CPU fast path's vector attention asks for the next KV block's lines while it computes one (a cache hint: changes no bit) |
//! | decode_attn   | v1, v2        | v2      | the CUDA decode attention's partial kernel: v2 computes v1's bits with more loads in flight |
//!
//! `auto` is on for a model on CUDA and off on the CPU ([`EngineSwitches::kernels_on`]), so the
//! CPU candle path stays what it was unless asked; `flash_prefill=auto` is off on both: on an
//! H200 (the GPU check of 2026-11-29) a 512-token prefill chunk of Qwen3-8B's shape took 161 ms
//! a step with the flash kernel (CUDA cores, one thread per row for the softmax step) against
//! 58 ms through cuBLAS with the score matrix. With any of the three on, the candle
//! backend runs on the paged KV pool, each kernel only where the device's self-check passed
//! it: the decode step batched (`paged`, `fused`), the prefill through the flash prefill
//! kernel (`flash_prefill`; where that kernel did not pass, the prefill runs as before).
//! On CUDA the pool also needs the paged attention kernel (`paged` on and passed): without it
//! the attention's composition took over a second a step on an H200, so the backend then
//! decodes on its plain path, as with every kernel switch off.
//!
//! An unknown name or value is an error ([`SwitchError`], stable code [`SWITCH_ERROR_CODE`]),
//! never ignored: a typo must not silently measure the default. [`EngineSwitches`]' `Display`
//! is the canonical list, every switch in the order above, which `stageb probe rollout` prints.

use std::fmt;

/// The environment variable the switches are read from.
pub const SWITCHES_VAR: &str = "STAGEB_ENGINE_SWITCHES";

/// The stable code of a bad switch list.
pub const SWITCH_ERROR_CODE: &str = "E_ENGINE_SWITCH";

/// How the decode step's logits reach the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Readback {
    /// The live rows' logits gathered on the device and copied once a step into a host buffer
    /// the engine keeps.
    #[default]
    Once,
    /// Each job's logits copied on their own (the path before the gather; kept to A/B it).
    PerJob,
}

/// The switches in force. Each field's doc names its switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineSwitches {
    /// `events`: cudarc's event tracking on the CUDA device. Off (the default) opens the
    /// device on one explicit stream with tracking disabled before any tensor exists.
    pub events: bool,
    /// `readback`.
    pub readback: Readback,
    /// `paged`: paged batched decode attention; `None` is `auto` (see [`Self::kernels_on`]).
    pub paged: Option<bool>,
    /// `fused`: fused kernels and concatenated projections; `None` is `auto`.
    pub fused: Option<bool>,
    /// `flash_prefill`: the prefill's attention over the paged pool; `None` is `auto`.
    pub flash_prefill: Option<bool>,
    /// `graphs`: CUDA graphs for the decode step (not built: parsed, no effect).
    pub graphs: bool,
    /// `draft`: draft tokens fed after each row's sampled token; `None` is `auto` (on wherever
    /// the backend takes several tokens of a row in one call).
    pub draft: Option<bool>,
    /// `prefetch`: software prefetch of the next KV block in the CPU fast path's attention;
    /// `None` is the default (on).
    pub prefetch: Option<bool>,
    /// `decode_attn`: the CUDA decode attention's partial kernel, `v2` (the default) or the
    /// first one, `v1` (kept to A/B them on a GPU; they compute the same bits).
    pub decode_attn_v1: bool,
}

/// A switch list that names an unknown switch or value, or names one twice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("E_ENGINE_SWITCH: {SWITCHES_VAR}: {0}")]
pub struct SwitchError(String);

impl SwitchError {
    /// The stable code ([`SWITCH_ERROR_CODE`]).
    pub fn code(&self) -> &'static str {
        SWITCH_ERROR_CODE
    }
}

const NAMES: [&str; 9] = [
    "events",
    "readback",
    "paged",
    "fused",
    "flash_prefill",
    "graphs",
    "draft",
    "prefetch",
    "decode_attn",
];

/// The kernel switches in force on one device (`auto` resolved): which kernels the candle
/// backend may run, each only where the self-check passed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelsOn {
    /// Paged batched decode attention.
    pub paged: bool,
    /// The fused kernels and concatenated projections.
    pub fused: bool,
    /// The flash prefill attention over the paged pool.
    pub flash_prefill: bool,
}

impl KernelsOn {
    /// Every kernel switch on.
    pub const ALL: KernelsOn = KernelsOn {
        paged: true,
        fused: true,
        flash_prefill: true,
    };

    /// Whether any is on (the candle backend then keeps the paged pool).
    pub fn any(&self) -> bool {
        self.paged || self.fused || self.flash_prefill
    }
}

fn auto_on_off(name: &str, value: &str) -> Result<Option<bool>, SwitchError> {
    match value {
        "auto" => Ok(None),
        "on" => Ok(Some(true)),
        "off" => Ok(Some(false)),
        _ => Err(SwitchError(format!(
            "`{name}={value}`: {name} is `auto`, `on` or `off`"
        ))),
    }
}

fn on_off(name: &str, value: &str) -> Result<bool, SwitchError> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(SwitchError(format!(
            "`{name}={value}`: {name} is `on` or `off`"
        ))),
    }
}

impl EngineSwitches {
    /// The switches in `list` (`name=value,...`; whitespace around items is ignored, empty
    /// items are skipped); every switch not named keeps its default.
    pub fn parse(list: &str) -> Result<EngineSwitches, SwitchError> {
        let mut s = EngineSwitches::default();
        let mut seen = Vec::new();
        for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let Some((name, value)) = item.split_once('=') else {
                return Err(SwitchError(format!(
                    "`{item}` is not `name=value` (switches: {})",
                    NAMES.join(", ")
                )));
            };
            let (name, value) = (name.trim(), value.trim());
            if seen.contains(&name) {
                return Err(SwitchError(format!("`{name}` is given twice")));
            }
            match name {
                "events" => s.events = on_off(name, value)?,
                "readback" => {
                    s.readback = match value {
                        "once" => Readback::Once,
                        "per-job" => Readback::PerJob,
                        _ => {
                            return Err(SwitchError(format!(
                                "`readback={value}`: readback is `once` or `per-job`"
                            )));
                        }
                    }
                }
                "paged" => s.paged = auto_on_off(name, value)?,
                "fused" => s.fused = auto_on_off(name, value)?,
                "flash_prefill" => s.flash_prefill = auto_on_off(name, value)?,
                "graphs" => s.graphs = on_off(name, value)?,
                "draft" => s.draft = auto_on_off(name, value)?,
                "prefetch" => s.prefetch = Some(on_off(name, value)?),
                "decode_attn" => {
                    s.decode_attn_v1 = match value {
                        "v1" => true,
                        "v2" => false,
                        _ => {
                            return Err(SwitchError(format!(
                                "`decode_attn={value}`: decode_attn is `v1` or `v2`"
                            )));
                        }
                    }
                }
                _ => {
                    return Err(SwitchError(format!(
                        "unknown switch `{name}` (switches: {})",
                        NAMES.join(", ")
                    )));
                }
            }
            seen.push(name);
        }
        Ok(s)
    }

    /// The kernel switches for a model on CUDA (`cuda`) or on the CPU: `auto` is on on CUDA,
    /// but for the flash prefill, which `auto` leaves off (see the module header).
    pub fn kernels_on(&self, cuda: bool) -> KernelsOn {
        KernelsOn {
            paged: self.paged.unwrap_or(cuda),
            fused: self.fused.unwrap_or(cuda),
            flash_prefill: self.flash_prefill.unwrap_or(false),
        }
    }

    /// The switches [`SWITCHES_VAR`] sets (unset or empty: the defaults).
    pub fn from_env() -> Result<EngineSwitches, SwitchError> {
        match std::env::var(SWITCHES_VAR) {
            Ok(list) => Self::parse(&list),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(SwitchError("the value is not UTF-8".into()))
            }
        }
    }
}

impl fmt::Display for EngineSwitches {
    /// The canonical list: every switch, in a fixed order, e.g.
    /// `events=off,readback=once,paged=auto,fused=auto,flash_prefill=auto,graphs=off,draft=auto,prefetch=on,decode_attn=v2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let oo = |b: bool| if b { "on" } else { "off" };
        let auto = |b: Option<bool>| b.map_or("auto", oo);
        let readback = match self.readback {
            Readback::Once => "once",
            Readback::PerJob => "per-job",
        };
        write!(
            f,
            "events={},readback={readback},paged={},fused={},flash_prefill={},graphs={},draft={},\
             prefetch={},decode_attn={}",
            oo(self.events),
            auto(self.paged),
            auto(self.fused),
            auto(self.flash_prefill),
            oo(self.graphs),
            auto(self.draft),
            oo(self.prefetch.unwrap_or(true)),
            if self.decode_attn_v1 { "v1" } else { "v2" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_list_is_every_default() {
        let d = EngineSwitches::parse("").unwrap();
        assert_eq!(d, EngineSwitches::default());
        assert_eq!(
            d.to_string(),
            "events=off,readback=once,paged=auto,fused=auto,flash_prefill=auto,graphs=off,draft=auto,\
             prefetch=on,decode_attn=v2"
        );
        let cuda_default = KernelsOn {
            flash_prefill: false,
            ..KernelsOn::ALL
        };
        assert_eq!(
            d.kernels_on(true),
            cuda_default,
            "auto is on on CUDA, flash prefill aside"
        );
        assert_eq!(
            d.kernels_on(false),
            KernelsOn::default(),
            "auto is off on the CPU"
        );
        assert!(!d.kernels_on(false).any());
        let s = EngineSwitches::parse("paged=on,fused=off").unwrap();
        let paged_only = KernelsOn {
            paged: true,
            ..KernelsOn::default()
        };
        assert_eq!(s.kernels_on(false), paged_only);
        assert_eq!(s.kernels_on(true), paged_only);
        let s = EngineSwitches::parse("flash_prefill=on").unwrap();
        let on = s.kernels_on(false);
        assert!(on.flash_prefill && !on.paged && !on.fused && on.any());
        let s = EngineSwitches::parse("flash_prefill=off").unwrap();
        assert!(!s.kernels_on(true).flash_prefill);
    }

    #[test]
    fn named_switches_change_and_the_canonical_list_reads_back() {
        let s = EngineSwitches::parse(
            " readback=per-job , events=on,graphs=on,draft=off,prefetch=off,decode_attn=v1",
        )
        .unwrap();
        assert_eq!(s.readback, Readback::PerJob);
        assert!(s.decode_attn_v1);
        assert!(s.events && s.graphs && s.paged.is_none() && s.fused.is_none());
        assert_eq!((s.draft, s.prefetch), (Some(false), Some(false)));
        let canonical = s.to_string();
        assert_eq!(
            canonical,
            "events=on,readback=per-job,paged=auto,fused=auto,flash_prefill=auto,graphs=on,draft=off,\
             prefetch=off,decode_attn=v1"
        );
        assert_eq!(EngineSwitches::parse(&canonical).unwrap(), s);
    }

    #[test]
    fn unknown_names_values_and_repeats_are_refused_with_the_stable_code() {
        for bad in [
            "readback=twice",
            "evnets=on",
            "paged",
            "fused=yes",
            "paged=maybe",
            "flash_prefill=yes",
            "decode_attn=v3",
            "draft=4",
            "prefetch=auto",
            "events=on,events=off",
        ] {
            let e = EngineSwitches::parse(bad).unwrap_err();
            assert_eq!(e.code(), "E_ENGINE_SWITCH", "{bad}");
            assert!(e.to_string().starts_with("E_ENGINE_SWITCH"), "{e}");
        }
        let e = EngineSwitches::parse("evnets=on").unwrap_err().to_string();
        assert!(e.contains("evnets") && e.contains("readback"), "{e}");
    }
}
