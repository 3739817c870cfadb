//! Model and device presets with real geometry and datasheet numbers.
//!
//! A model preset gives what the KV cache and the step model need: layers, attention
//! heads, key/value heads (fewer than attention heads for grouped-query attention), head
//! dimension and parameter count (weights are stored in 16-bit floats). A device preset
//! gives memory, memory bandwidth, dense 16-bit tensor throughput and host-link bandwidth
//! (for swapping). The KV budget is `memory × mem_fraction − weights`, as an engine that
//! leaves a share of memory for activations and the CUDA context would compute it.

use std::fmt;

/// A transformer's shape, as far as the KV cache and the step model are concerned.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Preset name (or `custom`).
    pub name: String,
    /// Transformer layers.
    pub layers: u32,
    /// Query (attention) heads per layer.
    pub heads: u32,
    /// Key/value heads per layer (`heads` for multi-head attention).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Parameters, for weight bytes and matmul FLOPs.
    pub params: f64,
    /// Bytes per weight (2 for f16/bf16 weights).
    pub weight_bytes_per_param: f64,
}

impl ModelSpec {
    /// Bytes of the weights.
    pub fn weight_bytes(&self) -> f64 {
        self.params * self.weight_bytes_per_param
    }
}

/// A GPU, as far as the step model and the KV budget are concerned.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceSpec {
    /// Preset name (or `custom`).
    pub name: String,
    /// Device memory in bytes (as `nvidia-smi` reports it).
    pub memory_bytes: f64,
    /// Peak memory bandwidth, bytes per second.
    pub mem_bw: f64,
    /// Peak dense f16/bf16 tensor-core throughput, FLOP per second.
    pub flops: f64,
    /// Host link bandwidth for swapping, bytes per second (PCIe, one direction, achieved).
    pub host_bw: f64,
}

/// A model preset row: `(names, layers, heads, kv_heads, head_dim, params)`.
type ModelRow = (&'static [&'static str], u32, u32, u32, u32, f64);

/// Model presets.
const MODELS: &[ModelRow] = &[
    // Llama 2 7B: multi-head attention.
    (&["llama-2-7b", "7b"], 32, 32, 32, 128, 6.74e9),
    // Llama 2 13B: multi-head attention.
    (&["llama-2-13b", "13b"], 40, 40, 40, 128, 13.02e9),
    // Llama 3.1 8B: grouped-query attention, 8 KV heads.
    (
        &["llama-3.1-8b", "llama-3-8b", "8b"],
        32,
        32,
        8,
        128,
        8.03e9,
    ),
    // Mistral 7B v0.1: grouped-query attention, 8 KV heads.
    (&["mistral-7b"], 32, 32, 8, 128, 7.24e9),
    // Llama 3.1 70B: grouped-query attention, 8 KV heads.
    (
        &["llama-3.1-70b", "llama-3-70b", "70b"],
        80,
        64,
        8,
        128,
        70.55e9,
    ),
];

const MIB: f64 = 1024.0 * 1024.0;

/// A device preset row: `(names, memory MiB, bandwidth B/s, dense f16 FLOP/s, host B/s)`.
type DeviceRow = (&'static [&'static str], f64, f64, f64, f64);

/// Device presets.
const DEVICES: &[DeviceRow] = &[
    // A100 SXM 80 GB: HBM2e 2.039 TB/s, 312 TFLOP/s, PCIe 4.0 x16 (~25 GB/s achieved).
    (&["a100-80gb", "a100"], 81_920.0, 2.039e12, 312e12, 25e9),
    // H100 SXM 80 GB: HBM3 3.35 TB/s, 989 TFLOP/s, PCIe 5.0 x16 (~50 GB/s achieved).
    (&["h100-80gb", "h100"], 81_559.0, 3.35e12, 989e12, 50e9),
    // H200 SXM 141 GB: HBM3e 4.8 TB/s, 989 TFLOP/s, PCIe 5.0 x16 (~50 GB/s achieved).
    (&["h200-141gb", "h200"], 143_771.0, 4.8e12, 989e12, 50e9),
];

/// An unknown preset name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPreset {
    /// The flag it was given to.
    pub flag: &'static str,
    /// The name given.
    pub name: String,
    /// The names that exist.
    pub known: Vec<&'static str>,
}

impl fmt::Display for UnknownPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:?} is not a known preset; known: {}",
            self.flag,
            self.name,
            self.known.join(", ")
        )
    }
}

impl std::error::Error for UnknownPreset {}

/// The model preset called `name` (case-insensitive; short aliases like `13b` work).
///
/// # Errors
/// [`UnknownPreset`] listing the known names.
pub fn model(name: &str) -> Result<ModelSpec, UnknownPreset> {
    let lower = name.to_ascii_lowercase();
    MODELS
        .iter()
        .find(|m| m.0.contains(&lower.as_str()))
        .map(
            |&(names, layers, heads, kv_heads, head_dim, params)| ModelSpec {
                name: names[0].to_string(),
                layers,
                heads,
                kv_heads,
                head_dim,
                params,
                weight_bytes_per_param: 2.0,
            },
        )
        .ok_or_else(|| UnknownPreset {
            flag: "--model",
            name: name.to_string(),
            known: MODELS.iter().flat_map(|m| m.0.iter().copied()).collect(),
        })
}

/// The device preset called `name` (case-insensitive; `a100`, `h100`, `h200` work).
///
/// # Errors
/// [`UnknownPreset`] listing the known names.
pub fn device(name: &str) -> Result<DeviceSpec, UnknownPreset> {
    let lower = name.to_ascii_lowercase();
    DEVICES
        .iter()
        .find(|d| d.0.contains(&lower.as_str()))
        .map(|&(names, mib, mem_bw, flops, host_bw)| DeviceSpec {
            name: names[0].to_string(),
            memory_bytes: mib * MIB,
            mem_bw,
            flops,
            host_bw,
        })
        .ok_or_else(|| UnknownPreset {
            flag: "--device",
            name: name.to_string(),
            known: DEVICES.iter().flat_map(|d| d.0.iter().copied()).collect(),
        })
}

/// Names of the model presets (first name of each), for help texts.
pub fn model_names() -> Vec<&'static str> {
    MODELS.iter().map(|m| m.0[0]).collect()
}

/// Names of the device presets (first name of each), for help texts.
pub fn device_names() -> Vec<&'static str> {
    DEVICES.iter().map(|d| d.0[0]).collect()
}

/// The KV-cache budget: `memory × mem_fraction − weights` over `gpus` devices (tensor
/// parallel: weights and KV heads are split, memory adds up). `None` if the weights
/// leave nothing. Pure arithmetic, O(1).
pub fn kv_budget_bytes(
    model: &ModelSpec,
    device: &DeviceSpec,
    gpus: u32,
    mem_fraction: f64,
) -> Option<f64> {
    let left = device.memory_bytes * f64::from(gpus) * mem_fraction - model.weight_bytes();
    (left > 0.0).then_some(left)
}

/// The KV dtype named on a command line (`--kv-dtype`): f16, bf16, f32, int8 or fp8
/// (E4M3), with a few aliases. O(1).
///
/// # Errors
/// A message naming the flag and the accepted names.
pub fn kv_dtype(s: &str) -> Result<kvpage_core::DType, String> {
    use kvpage_core::DType;
    match s.to_ascii_lowercase().as_str() {
        "f16" | "fp16" | "half" => Ok(DType::F16),
        "bf16" => Ok(DType::Bf16),
        "f32" | "fp32" => Ok(DType::F32),
        "int8" | "i8" => Ok(DType::Int8),
        "fp8" | "fp8-e4m3" | "e4m3" => Ok(DType::Fp8E4m3),
        _ => Err(format!(
            "--kv-dtype {s:?}: expected f16, bf16, f32, int8 or fp8"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_real_geometry() {
        let m = model("13B").unwrap();
        assert_eq!(
            (m.layers, m.heads, m.kv_heads, m.head_dim),
            (40, 40, 40, 128)
        );
        let m = model("llama-3-8b").unwrap();
        assert_eq!((m.name.as_str(), m.kv_heads), ("llama-3.1-8b", 8));
        let d = device("H200").unwrap();
        assert_eq!(d.memory_bytes, 143_771.0 * MIB);
        let e = model("gpt-5").unwrap_err();
        assert!(e
            .to_string()
            .starts_with("--model \"gpt-5\" is not a known preset; known: llama-2-7b"));
        assert!(device("tpu").unwrap_err().to_string().contains("a100-80gb"));
    }

    #[test]
    fn budget_is_memory_fraction_minus_weights() {
        let m = model("13b").unwrap();
        let d = device("a100").unwrap();
        let b = kv_budget_bytes(&m, &d, 1, 0.9).unwrap();
        // 0.9 × 80 GiB − 26.04 GB = 51.27 GB
        assert!((b / 1e9 - 51.27).abs() < 0.01, "{b}");
        assert_eq!(kv_budget_bytes(&model("70b").unwrap(), &d, 1, 0.9), None);
        assert!(kv_budget_bytes(&model("70b").unwrap(), &d, 2, 0.9).is_some());
    }
}
