//! The engine's metrics, every name with its unit.

use pdserve_telemetry::{
    Buckets, Counter, CounterVec, Gauge, GaugeVec, LatencyHistogram, Registry, TelemetryError,
};

#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    pub registry: Registry,
    pub finished: CounterVec,
    pub queued: Gauge,
    pub running: Gauge,
    pub kv_blocks: GaugeVec,
    pub kv_usage: Gauge,
    pub kv_config: GaugeVec,
    pub ttft: LatencyHistogram,
    pub itl: LatencyHistogram,
    pub e2e: LatencyHistogram,
    pub queue_wait: LatencyHistogram,
    pub step: LatencyHistogram,
    pub greedy_steps: Counter,
    pub tokens_generated: Counter,
    pub tokens_prompt: Counter,
    pub preemptions: Counter,
    pub rejected: CounterVec,
    pub transfers_in_flight: Gauge,
    pub transfer_bytes: CounterVec,
    pub transfers_finished: CounterVec,
    pub transfer_time: LatencyHistogram,
    pub transfer_blocks: CounterVec,
    pub prefix_tokens: CounterVec,
    pub evicted_blocks: Counter,
    pub offload_blocks: GaugeVec,
    pub offload_moves: CounterVec,
    pub state_slots: GaugeVec,
    pub state_restores: Counter,
    pub draft_tokens: Counter,
    pub draft_accepted: Counter,
    pub grammar_compile: LatencyHistogram,
    pub kv_event_batches: CounterVec,
    pub kv_event_subscribers: Gauge,
}

impl Metrics {
    pub(crate) fn new() -> Result<Metrics, TelemetryError> {
        let r = Registry::new();
        Ok(Metrics {
            finished: r.counter_vec(
                "requests_finished_total",
                "Requests that reached a terminal state.",
                &["outcome", "stage"],
            )?,
            queued: r.gauge("requests_waiting", "Requests in the admission queue.")?,
            running: r.gauge("requests_running", "Requests in the running batch.")?,
            kv_blocks: r.gauge_vec(
                "kv_blocks",
                "KV cache blocks by owner (free, sequence, cache, transfer).",
                &["owner"],
            )?,
            kv_usage: r.gauge(
                "kv_cache_usage_ratio",
                "Share of the KV pool held by requests and transfers (0-1); free and cached-but-unused blocks are not.",
            )?,
            kv_config: r.gauge_vec(
                "kv_cache_block_size_tokens",
                "Tokens per KV block; the labels give it and the pool's size in blocks, as fleet \
                 routers read them (vLLM's cache_config_info).",
                &["block_size", "num_gpu_blocks"],
            )?,
            ttft: r.histogram(
                "time_to_first_token_seconds",
                "From request received to first token.",
                Buckets::latency_seconds(),
            )?,
            itl: r.histogram(
                "inter_token_latency_seconds",
                "Between consecutive tokens of a request.",
                Buckets::latency_seconds(),
            )?,
            e2e: r.histogram(
                "request_latency_seconds",
                "From request received to its end.",
                Buckets::latency_seconds(),
            )?,
            queue_wait: r.histogram(
                "queue_wait_seconds",
                "From admission to the first scheduled step.",
                Buckets::latency_seconds(),
            )?,
            step: r.histogram(
                "engine_step_seconds",
                "Duration of one engine step (forward pass and sampling).",
                Buckets::latency_seconds(),
            )?,
            greedy_steps: r.counter(
                "engine_greedy_pick_steps_total",
                "Engine steps whose sampling requests were all plain greedy, so the backend returned picks \
                 only (on a GPU the logits stay on the device).",
            )?,
            tokens_generated: r.counter("tokens_generated_total", "Tokens sampled.")?,
            tokens_prompt: r.counter("tokens_prompt_total", "Prompt tokens of admitted requests.")?,
            preemptions: r.counter("requests_preempted_total", "Running requests preempted for KV space.")?,
            rejected: r.counter_vec(
                "requests_rejected_total",
                "Requests refused at admission, by reason.",
                &["reason"],
            )?,
            transfers_in_flight: r
                .gauge("kv_transfers_in_flight", "KV transfers offered or being pulled.")?,
            transfer_bytes: r.counter_vec(
                "kv_transfer_bytes_total",
                "KV bytes moved between workers.",
                &["direction"],
            )?,
            transfers_finished: r.counter_vec(
                "kv_transfers_finished_total",
                "KV transfers ended, by side and outcome (completed or the failure reason).",
                &["side", "outcome"],
            )?,
            transfer_time: r.histogram(
                "kv_transfer_seconds",
                "From offer (prefill) or pull (decode) to the end of a completed KV transfer.",
                Buckets::latency_seconds(),
            )?,
            transfer_blocks: r.counter_vec(
                "kv_transfer_blocks_total",
                "Decode side, per completed pull: prompt KV blocks pulled from the prefill worker (transferred) or found in this worker's prefix cache instead (skipped).",
                &["result"],
            )?,
            prefix_tokens: r.counter_vec(
                "prefix_cache_tokens_total",
                "Prompt tokens at admission found in the prefix cache (hit) or not (miss); on a decode worker, whose KV needed no transfer.",
                &["result"],
            )?,
            evicted_blocks: r.counter(
                "kv_evicted_blocks_total",
                "Cached KV blocks evicted (least recently used first) to make room.",
            )?,
            offload_blocks: r.gauge_vec(
                "kv_offload_blocks",
                "Blocks of the KV offload tier by medium (host, disk) and state (used, total).",
                &["medium", "state"],
            )?,
            state_slots: r.gauge_vec(
                "kv_state_entries",
                "Per-request state slots of a model that keeps one (DeepSeek V4's windows and partial groups) \
                 by use: total, free, parked (given back, free once a pending copy of it is made), restore_points \
                 (states saved at block boundaries for prefix hits).",
                &["state"],
            )?,
            state_restores: r.counter(
                "kv_state_restores_total",
                "Prefix hits of a model with per-request state resumed from a restore point.",
            )?,
            offload_moves: r.counter_vec(
                "kv_offload_blocks_moved_total",
                "KV blocks moved by the offload tier: offloaded (an evicted pool block kept), demoted (host \
                 to disk), restored (back into the pool on a prefix match, instead of computed), dropped \
                 (forgotten for room).",
                &["move"],
            )?,
            draft_tokens: r.counter(
                "spec_draft_tokens_total",
                "Speculative decoding: draft tokens verified (prompt lookup, or the model's draft layer).",
            )?,
            draft_accepted: r.counter(
                "spec_accepted_tokens_total",
                "Speculative decoding: draft tokens the verifying samples confirmed; accepted / draft is the acceptance rate.",
            )?,
            grammar_compile: r.histogram(
                "grammar_compile_seconds",
                "Compiling a request's output constraint (schema, regex, grammar, forced tool call), on \
                 the compiling threads; those past the compile timeout are not observed.",
                Buckets::latency_seconds(),
            )?,
            kv_event_batches: r.counter_vec(
                "kv_event_batches_total",
                "KV event batches (--kv-events-config): published, dropped (the publisher's queue was \
                 full), subscriber_dropped (a subscriber's queue was full or it blocked a write).",
                &["result"],
            )?,
            kv_event_subscribers: r.gauge(
                "kv_event_subscriber_connections",
                "Subscribers connected to the KV event publisher.",
            )?,
            registry: r,
        })
    }
}
