//! The Gateway API Inference Extension shape (`cargo xtask deploy render --gateway`, committed as
//! `deploy/k8s/inference-gateway.yaml`): unified workers as an `InferencePool` (inference.networking.k8s.io/v1)
//! whose endpoint picker (llm-d-router's EPP, the GIE reference picker's successor) chooses a pod per
//! request from the metrics it scrapes, under vLLM's names (the workers' aliases), and an
//! `HTTPRoute` from the operator's Gateway to the pool. The EPP's flags and config are its current
//! ones: metric names in `core-metrics-extractor`'s `engineConfigs` (the old `--*-metric` flags are
//! refused at its start).

use serde_json::{json, Value};

use super::manifests::{deployment, disruption_budget, meta, Params, HTTP_PORT, MODEL_NAME};

/// The endpoint picker's image (llm-d-router's release).
pub(crate) const EPP_IMAGE: &str = "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0";
/// The EPP's ext-proc (gRPC) port, its health port and its metrics port.
pub(crate) const EPP_GRPC_PORT: u16 = 9002;
const EPP_HEALTH_PORT: u16 = 9003;
const EPP_METRICS_PORT: u16 = 9090;
/// Where each worker publishes its KV events (vLLM's default port).
pub(crate) const KV_EVENTS_PORT: u16 = 5557;
/// The Secret holding the workers' API key (created by the operator: `deploy/README.md`).
pub(crate) const API_KEY_SECRET: &str = "pdserve-api-key";

/// The metrics the picker reads from each pod, as vLLM names them (a worker's aliases of its own
/// `requests_waiting`, `requests_running`, `kv_cache_usage_ratio`, and the cache configuration).
pub(crate) const PICKER_METRICS: [(&str, &str); 5] = [
    ("queuedRequestsSpec", "vllm:num_requests_waiting"),
    ("runningRequestsSpec", "vllm:num_requests_running"),
    ("kvUsageSpec", "vllm:kv_cache_usage_perc"),
    ("loraSpec", "vllm:lora_requests_info"),
    ("cacheInfoSpec", "vllm:cache_config_info"),
];

/// `v` as JSON text with every object's keys sorted, whichever order serde_json keeps (the
/// workspace's feature set decides it), so the committed YAML is the same from any build.
fn sorted_json(v: &Value) -> String {
    fn sort(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                Value::Object(keys.into_iter().map(|k| (k.clone(), sort(&m[k]))).collect())
            }
            Value::Array(a) => Value::Array(a.iter().map(sort).collect()),
            other => other.clone(),
        }
    }
    sort(v).to_string()
}

/// The worker pool: unified workers (each request computed where the picker sends it), taking
/// clients' requests with the API key, publishing KV events for pickers that read them.
fn workers(p: &Params, replicas: u32) -> Value {
    let mut d = deployment(p, "unified", replicas);
    let pod = &mut d["spec"]["template"];
    pod["metadata"]["labels"]["llm-d.ai/engine-type"] = json!("vllm");
    let c = &mut pod["spec"]["containers"][0];
    let mut args: Vec<String> = serde_json::from_value(c["args"].take()).unwrap_or_default();
    // A client's key in place of the stack's secret: the gateway forwards each client's requests.
    if let Some(i) = args.iter().position(|a| a == "--cluster-secret-file") {
        args.drain(i..i + 2);
    }
    let events = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://*:{KV_EVENTS_PORT}"), "topic": format!("kv@$(POD_NAME)@{MODEL_NAME}")});
    args.extend([
        "--api-key".into(),
        "$(PDSERVE_API_KEY)".into(),
        "--kv-events-config".into(),
        sorted_json(&events),
    ]);
    c["args"] = json!(args);
    if let Some(e) = c["env"].as_array_mut() {
        e.push(json!({"name": "PDSERVE_API_KEY",
                      "valueFrom": {"secretKeyRef": {"name": API_KEY_SECRET, "key": "api-key"}}}));
    }
    if let Some(ports) = c["ports"].as_array_mut() {
        ports.push(json!({"name": "kv-events", "containerPort": KV_EVENTS_PORT}));
    }
    c.as_object_mut().map(|o| o.remove("volumeMounts"));
    pod["spec"].as_object_mut().map(|o| o.remove("volumes"));
    d
}

/// The endpoint picker's configuration: load and KV-usage scorers on the metrics above, and the
/// approximate prefix scorer.
fn epp_config() -> String {
    let mut engine = serde_json::Map::new();
    engine.insert("name".into(), json!("vllm"));
    for (k, v) in PICKER_METRICS {
        engine.insert(k.into(), json!(v));
    }
    let config = json!({
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer"},
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor", "parameters": {"engineConfigs": [engine]}},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "queue-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
        ]}],
    });
    sorted_json(&config)
}

fn epp(p: &Params) -> Vec<Value> {
    let name = "pdserve-epp";
    let m = || meta(p, name, "epp");
    let selector = json!({"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "epp"});
    let read = json!(["get", "list", "watch"]);
    vec![
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": m()}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": m(), "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
            {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": read},
            {"apiGroups": ["llm-d.ai"], "resources": ["inferenceobjectives", "inferencemodelrewrites"], "verbs": read},
        ]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": m(),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": p.namespace}]}),
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": m(), "data": {"epp-config.yaml": epp_config()}}),
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": m(), "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": selector}, "spec": {
                "serviceAccountName": name,
                "terminationGracePeriodSeconds": 130,
                "containers": [{
                    "name": "epp",
                    "image": EPP_IMAGE,
                    "args": ["--pool-name", "pdserve", "--pool-namespace", p.namespace,
                             "--pool-group", "inference.networking.k8s.io",
                             "--config-file", "/config/epp-config.yaml",
                             "--grpc-port", EPP_GRPC_PORT.to_string(), "--grpc-health-port", EPP_HEALTH_PORT.to_string(),
                             "--metrics-port", EPP_METRICS_PORT.to_string(), "--metrics-endpoint-auth=false"],
                    "env": [
                        {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    ],
                    "ports": [
                        {"name": "grpc", "containerPort": EPP_GRPC_PORT},
                        {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
                        {"name": "metrics", "containerPort": EPP_METRICS_PORT},
                    ],
                    "livenessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 10},
                    "readinessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 2},
                    "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                    "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": true}],
                    "securityContext": {"runAsNonRoot": true, "allowPrivilegeEscalation": false,
                                        "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}},
                }],
                "volumes": [{"name": "config", "configMap": {"name": name}}],
            }},
        }}),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": m(), "spec": {
            "selector": selector,
            "ports": [
                {"name": "grpc-ext-proc", "protocol": "TCP", "port": EPP_GRPC_PORT, "targetPort": "grpc",
                 "appProtocol": "kubernetes.io/h2c"},
                {"name": "http-metrics", "protocol": "TCP", "port": EPP_METRICS_PORT, "targetPort": "metrics"},
            ],
        }}),
    ]
}

/// The gateway shape's objects: the namespace, the worker pool, the `InferencePool`, its endpoint
/// picker, and the `HTTPRoute` from `gateway` (a Gateway the operator runs) to the pool.
pub(crate) fn objects(p: &Params, replicas: u32, gateway: &str) -> Vec<Value> {
    let mut v = vec![json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": p.namespace, "labels": {"app.kubernetes.io/name": "pdserve"}},
    })];
    v.push(workers(p, replicas));
    v.push(disruption_budget(p, "unified"));
    v.push(json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": meta(p, "pdserve", "unified"),
        "spec": {
            "selector": {"matchLabels": super::manifests::labels("unified")},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {"name": "pdserve-epp", "port": {"number": EPP_GRPC_PORT}, "failureMode": "FailOpen"},
        },
    }));
    v.extend(epp(p));
    v.push(json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": meta(p, "pdserve", "unified"),
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway}],
            "rules": [{
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pdserve"}],
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "timeouts": {"request": "600s"},
            }],
        },
    }));
    v
}

/// The YAML stream of [`objects`], with its header.
pub(crate) fn render(p: &Params, replicas: u32, gateway: &str) -> String {
    let mut out = String::from(
        "# pdserve behind a Gateway API Inference Extension endpoint picker: generated by\n\
         # `cargo xtask deploy render --gateway` (do not edit by hand; change xtask/src/deploy/gateway.rs).\n\
         # Walkthrough: deploy/README.md, section 6.\n",
    );
    for o in objects(p, replicas, gateway) {
        out.push_str("---\n");
        super::yaml::write(&o, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find<'a>(objs: &'a [Value], kind: &str) -> &'a Value {
        objs.iter().find(|o| o["kind"] == kind).unwrap()
    }

    /// The pool selects the worker pods at the port they listen on; its picker reference names the
    /// EPP Service's ext-proc port; the EPP's flags name the pool and mount its config; the picker
    /// reads the metric names the workers expose; the route sends to the pool.
    #[test]
    fn pool_picker_and_route_agree() {
        let p = Params::default();
        let objs = objects(&p, 3, "inference-gateway");
        let d = find(&objs, "Deployment");
        let pool = find(&objs, "InferencePool");
        let pod_labels = &d["spec"]["template"]["metadata"]["labels"];
        for (k, v) in pool["spec"]["selector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(&pod_labels[k], v, "the pool selects the worker pods");
        }
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<&str> = c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        let port = args.iter().position(|a| *a == "--port").map(|i| args[i + 1]).unwrap();
        assert_eq!(pool["spec"]["targetPorts"][0]["number"].to_string(), port);
        assert!(!args.contains(&"--cluster-secret-file") && args.contains(&"--api-key"), "{args:?}");
        assert!(args.iter().any(|a| a.contains("enable_kv_cache_events")), "{args:?}");
        let epp = objs
            .iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "pdserve-epp")
            .unwrap();
        let svc =
            objs.iter().find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "pdserve-epp").unwrap();
        let r = &pool["spec"]["endpointPickerRef"];
        assert_eq!(
            (r["name"].as_str(), r["port"]["number"].as_u64()),
            (Some("pdserve-epp"), Some(u64::from(EPP_GRPC_PORT)))
        );
        assert_eq!(svc["spec"]["ports"][0]["port"], EPP_GRPC_PORT);
        assert_eq!(svc["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"]);
        let eargs: Vec<&str> = epp["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let flag = |f: &str| eargs.iter().position(|a| *a == f).map(|i| eargs[i + 1]);
        assert_eq!(flag("--pool-name"), pool["metadata"]["name"].as_str());
        assert!(!eargs.iter().any(|a| a.ends_with("-metric")), "the EPP refuses the old metric flags");
        let cm = find(&objs, "ConfigMap");
        let config: Value = serde_json::from_str(cm["data"]["epp-config.yaml"].as_str().unwrap()).unwrap();
        assert_eq!(flag("--config-file"), Some("/config/epp-config.yaml"));
        let engine = &config["plugins"][4]["parameters"]["engineConfigs"][0];
        assert_eq!(engine["name"], pod_labels["llm-d.ai/engine-type"]);
        for (k, name) in PICKER_METRICS {
            assert_eq!(engine[k], name);
        }
        let route = find(&objs, "HTTPRoute");
        assert_eq!(route["spec"]["rules"][0]["backendRefs"][0]["name"], pool["metadata"]["name"]);
    }

    #[test]
    fn the_committed_yaml_is_what_render_writes() {
        let path = crate::workspace_root().join("deploy/k8s/inference-gateway.yaml");
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == render(&Params::default(), 2, "inference-gateway"),
            "{} is stale: run `cargo xtask deploy render --gateway --out deploy/k8s/inference-gateway.yaml`",
            path.display()
        );
    }
}
