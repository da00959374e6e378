//! Building an engine from its configuration: the model files, the backend for the device, the KV
//! transfer endpoint for the role.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use pdserve_api::Role;
use pdserve_model::{
    Backend, CpuBackend, DeepseekV4, KvDtype, KvStore, ModelConfig, PreparedWeights, V4Backend, WeightFormat,
    Weights,
};
use pdserve_pd_transfer::transport::shm::SharedRegion;
use pdserve_pd_transfer::{
    Dtype, Endpoint, EndpointConfig, Layout, SenderConfig, SharedMemoryTransport, TcpTransport, Transport,
};

use crate::{Device, EngineConfig, EngineError};

/// A prefill worker's KV memory in a shared region, as the CPU backend stores its cache in it.
#[derive(Debug)]
struct SharedKv(SharedRegion);

impl KvStore for SharedKv {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}

/// The backend, and what the engine reports about it.
pub(crate) struct Built {
    pub backend: Box<dyn Backend>,
    /// What every step's products read (see `EngineInfo::multi_row_weights`).
    pub multi_row_weights: &'static str,
    /// Bytes of the weights the backend holds (host memory on the CPU, device memory on a GPU).
    pub weight_bytes: usize,
    /// Bytes of the KV pool.
    pub kv_bytes: usize,
    /// Bytes of KV one token holds over every layer (a latent-attention model's latent rows).
    pub kv_bytes_per_token: usize,
    /// The shared KV file, when the KV memory is in one.
    pub kv_shm_path: Option<PathBuf>,
    /// Bytes per token of each kind of row a block holds (see `EngineInfo::kv_rows`).
    pub kv_rows: Vec<(String, f64)>,
}

pub(crate) fn backend(
    config: &EngineConfig,
    model: &ModelConfig,
    weights: Arc<Weights>,
    prepared: Option<PreparedWeights>,
    v4: Option<Arc<DeepseekV4>>,
) -> Result<Built, EngineError> {
    let (blocks, block_size) = (config.kv_blocks, config.block_size);
    if let Some(v4) = v4 {
        return v4_backend(config, model, v4);
    }
    if let Device::Cuda(n) = config.device {
        if config.kv_shm || (config.kv_ucx && config.role == Role::Prefill) {
            return Err(EngineError::GpuSharedKv);
        }
        if config.int8_activations {
            return Err(EngineError::Config {
                field: "activations",
                value: "q8 on a GPU (a CPU option)".into(),
            });
        }
        if config.weights != WeightFormat::F32 {
            return Err(EngineError::GpuWeights { weights: config.weights.name() });
        }
        if let Some(d) = config.kv_dtype.filter(|&d| d != KvDtype::F32) {
            return Err(EngineError::GpuKvDtype { dtype: d.name() });
        }
        let b = pdserve_model::GpuBackend::new(model.clone(), &weights, blocks, block_size, n)?;
        let (kv_bytes, kv_bytes_per_token) =
            (b.kv_layout().block_bytes() * blocks, b.kv_layout().bytes_per_token());
        // Uploaded as bf16.
        let weight_bytes = weights.bytes() / 2;
        return Ok(Built {
            backend: Box::new(b),
            multi_row_weights: "bf16",
            weight_bytes,
            kv_bytes,
            kv_bytes_per_token,
            kv_shm_path: None,
            kv_rows: Vec::new(),
        });
    }
    let dtype = config.resolved_kv_dtype();
    let (b, kv_shm_path) = if (config.kv_shm || config.kv_ucx) && config.role == Role::Prefill {
        let bytes =
            pdserve_model::KvLayout::for_model(model, blocks, block_size, dtype).block_bytes() * blocks;
        let region = SharedRegion::create(&config.shm_scope, bytes)?;
        let path = region.path().to_path_buf();
        let b = CpuBackend::with_kv_store(
            model.clone(),
            weights,
            (blocks, block_size),
            dtype,
            Box::new(SharedKv(region)),
        )?;
        (b, Some(path))
    } else {
        (CpuBackend::with_kv_dtype(model.clone(), weights, blocks, block_size, dtype), None)
    };
    let b = match prepared {
        Some(p) => b.with_prepared(p)?,
        None => b.with_weight_format(config.weights)?,
    };
    if config.int8_activations && !matches!(b.weight_format(), WeightFormat::Q8 | WeightFormat::Q4) {
        let value = format!("q8: int8 activations need q8 or q4 weights, not {}", b.weight_format().name());
        return Err(EngineError::Config { field: "activations", value });
    }
    let b = b.with_int8_activations(config.int8_activations);
    Ok(Built {
        multi_row_weights: b.multi_row_format(),
        weight_bytes: b.weight_bytes(),
        kv_bytes: b.kv_layout().block_bytes() * blocks,
        kv_bytes_per_token: b.kv_layout().bytes_per_token(),
        backend: Box::new(b),
        kv_shm_path,
        kv_rows: Vec::new(),
    })
}

/// DeepSeek V4's backend: on the CPU, its projections as shipped (`EngineConfig::weights` is their
/// format), its KV in the compact layout: compressed rows in paged blocks, each request's windows and
/// partial groups in a state slot (one per running request and per transfer lease, and as many again
/// for restore points), whose positions go back as far as a step's draft tokens.
fn v4_backend(config: &EngineConfig, model: &ModelConfig, v4: Arc<DeepseekV4>) -> Result<Built, EngineError> {
    let refuse = |field: &'static str, value: &str| {
        let value = format!("{value} (DeepSeek V4 runs on the CPU, with f32 activations)");
        Err(EngineError::Config { field, value })
    };
    if config.device != Device::Cpu {
        return refuse("device", "a GPU");
    }
    if config.int8_activations {
        return refuse("activations", "q8");
    }
    let (blocks, block_size, dtype) = (config.kv_blocks, config.block_size, config.resolved_kv_dtype());
    if config.speculative.is_on() && config.speculative.max_draft > V4_REWIND_TOKENS {
        let value = format!(
            "{} draft tokens a step (DeepSeek V4's state goes back {V4_REWIND_TOKENS} positions)",
            config.speculative.max_draft
        );
        return Err(EngineError::Config { field: "speculative", value });
    }
    let states = (v4_state_slots(config), V4_REWIND_TOKENS);
    let (layout, _) = V4Backend::layout(model, (blocks, block_size), dtype, states)?;
    let (b, kv_shm_path) = if (config.kv_shm || config.kv_ucx) && config.role == Role::Prefill {
        let region = SharedRegion::create(&config.shm_scope, layout.block_bytes() * layout.num_blocks)?;
        let path = region.path().to_path_buf();
        let store = Some(Box::new(SharedKv(region)) as Box<dyn KvStore>);
        (V4Backend::new(v4, model.clone(), (blocks, block_size), dtype, states, store)?, Some(path))
    } else {
        (V4Backend::new(v4, model.clone(), (blocks, block_size), dtype, states, None)?, None)
    };
    Ok(Built {
        multi_row_weights: config.weights.name(),
        weight_bytes: b.weight_bytes(),
        kv_bytes: layout.block_bytes() * layout.num_blocks,
        kv_bytes_per_token: layout.bytes_per_token(),
        kv_rows: b.group_bytes_per_token(),
        backend: Box::new(b),
        kv_shm_path,
    })
}

/// Positions a V4 request's state goes back (rejected draft tokens), the same on every worker
/// whatever its drafting, so prefill and decode workers of one checkpoint agree on the state's
/// layout (its rings' lengths).
const V4_REWIND_TOKENS: usize = 8;

/// State slots of a model that keeps per-request state: every running request, plus 16 for
/// transfer leases and restore points (a full pool evicts the least recently used point first;
/// a request waits for a slot as for blocks).
fn v4_state_slots(config: &EngineConfig) -> usize {
    config.scheduler.running_requests_max + 16
}

/// What a KV transfer transport is made for: the engine's role, where a prefill engine listens, and the
/// KV layout its blocks have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportSpec {
    pub role: Role,
    /// A prefill engine's transfer address (`EngineConfig::transfer_addr`); `None` for a decode engine,
    /// which only connects.
    pub listen: Option<SocketAddr>,
    pub layout: Layout,
    /// The stack's scope for shared KV files (`EngineConfig::shm_scope`).
    pub shm_scope: String,
    /// KV over UCX (`EngineConfig::kv_ucx`).
    pub ucx: bool,
    /// A prefill engine's shared KV region file, if its KV memory is one.
    pub region: Option<PathBuf>,
}

/// The transports [`Engine::start`](crate::Engine::start) uses: TCP for a prefill engine (it sends
/// block bytes inline, or names them in its shared region when the receiver asks), and for a decode
/// engine the shared-memory transport, which reads a same-host sender's blocks out of its region and
/// takes any other sender's inline. With `ucx`, UCX on both sides: the prefill engine exports its
/// region, the decode engine reads named blocks with one-sided gets.
pub fn default_transport(spec: &TransportSpec) -> io::Result<Box<dyn Transport>> {
    if spec.ucx {
        return ucx_transport(spec);
    }
    Ok(match spec.role {
        Role::Decode => Box::new(
            SharedMemoryTransport::bind(spec.listen, spec.layout.block_bytes())?.with_scope(&spec.shm_scope),
        ),
        _ => Box::new(TcpTransport::bind(spec.listen)?),
    })
}

#[cfg(feature = "ucx")]
fn ucx_transport(spec: &TransportSpec) -> io::Result<Box<dyn Transport>> {
    let export = if spec.role == Role::Prefill { spec.region.as_deref() } else { None };
    Ok(Box::new(pdserve_pd_transfer::UcxTransport::bind(spec.listen, spec.layout.block_bytes(), export)?))
}

#[cfg(not(feature = "ucx"))]
fn ucx_transport(_: &TransportSpec) -> io::Result<Box<dyn Transport>> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "this build has no UCX transport: build with `--features ucx` (needs libucx-dev)",
    ))
}

/// Prefill and decode roles: the endpoint of every KV transfer (prefill listens at `transfer_addr`),
/// over the transport `make` gives.
pub(crate) fn endpoint(
    config: &EngineConfig,
    kv: pdserve_model::KvLayout,
    region: Option<&std::path::Path>,
    make: impl FnOnce(&TransportSpec) -> io::Result<Box<dyn Transport>>,
) -> Result<Option<Endpoint>, EngineError> {
    if config.role == Role::Unified {
        return Ok(None);
    }
    let layout = Layout {
        num_layers: kv.num_layers as u32,
        num_kv_heads: kv.num_kv_heads as u32,
        head_dim: kv.head_dim as u32,
        block_size: kv.block_size as u32,
        dtype: match kv.dtype {
            KvDtype::F32 => Dtype::F32,
            KvDtype::F16 => Dtype::F16,
            KvDtype::Bf16 => Dtype::Bf16,
        },
        latent: kv.latent,
    };
    let listen = (config.role == Role::Prefill).then_some(config.transfer_addr);
    let shm_scope = config.shm_scope.clone();
    let (ucx, region_path) = (config.kv_ucx, region.map(std::path::Path::to_path_buf));
    let transport =
        make(&TransportSpec { role: config.role, listen, layout, shm_scope, ucx, region: region_path })?;
    let ep_config = EndpointConfig {
        sender: SenderConfig { shared_region: region.is_some(), ..SenderConfig::default() },
        // Epochs differ per process, so a handle from an earlier incarnation is refused as stale.
        epoch_seed: std::process::id().wrapping_mul(2_654_435_761),
        faults: config.test_transfer_faults,
        ..EndpointConfig::default()
    };
    Ok(Some(Endpoint::new(transport, layout, ep_config)))
}
