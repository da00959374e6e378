//! The Kubernetes objects of a stack, built in one place so the committed YAML
//! (`deploy/k8s/pdserve.yaml`), `cargo xtask deploy render` and the topology check
//! (`cargo xtask chaos k8s_topology`) can never disagree.

use serde_json::{json, Value};

/// Every worker's and the router's HTTP port.
pub(crate) const HTTP_PORT: u16 = 8000;
/// Where prefill workers serve KV to decode workers.
pub(crate) const TRANSFER_PORT: u16 = 8100;
/// Where the image holds the default model (`deploy/Dockerfile`).
pub(crate) const MODEL_DIR: &str = "/models/SmolLM2-135M-Instruct";
/// The name it is served under (its folder's).
pub(crate) const MODEL_NAME: &str = "SmolLM2-135M-Instruct";
/// Where the cluster secret is mounted.
pub(crate) const SECRET_FILE: &str = "/var/run/pdserve/secret/cluster-secret";
/// The Secret's name (created by the operator: `deploy/README.md`).
pub(crate) const SECRET_NAME: &str = "pdserve-cluster-secret";
/// Seconds a pod's requests in flight get after SIGTERM (`--drain-timeout-s`), below the grace
/// period Kubernetes waits before SIGKILL.
pub(crate) const DRAIN_S: u32 = 30;
pub(crate) const GRACE_S: u32 = 50;
/// The pause before SIGTERM (preStop) while the pod's address leaves DNS and Service endpoints
/// (the cluster DNS's TTL, 5 s with CoreDNS, plus a router's lookup interval).
pub(crate) const PRESTOP_SLEEP_S: u32 = 10;
/// What a worker's drain may take past `--drain-timeout-s` before it exits regardless (twice the
/// engine's watchdog grace).
const WORKER_DRAIN_EXTRA_S: u32 = 4;
/// How often the router reads the pools' DNS names (well below the preStop pause).
pub(crate) const DISCOVER_S: u32 = 2;
// The router sees a terminating pod leave DNS within its preStop pause, and the drain fits in
// the grace period after it.
const _: () =
    assert!(5 + DISCOVER_S < PRESTOP_SLEEP_S && PRESTOP_SLEEP_S + DRAIN_S + WORKER_DRAIN_EXTRA_S < GRACE_S);

/// What an operator chooses.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub namespace: String,
    pub image: String,
    pub routers: u32,
    pub prefill: u32,
    pub decode: u32,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            namespace: "pdserve".into(),
            image: "pdserve:latest".into(),
            routers: 2,
            prefill: 1,
            decode: 2,
        }
    }
}

/// The headless Service (DNS name) of a worker pool.
pub(crate) fn pool_service(role: &str) -> String {
    format!("pdserve-{role}")
}

/// The name the router's `--discover` looks up for a pool: fully qualified (the trailing dot), so
/// no lookup goes through the pod's search list first.
pub(crate) fn pool_dns(p: &Params, role: &str) -> String {
    format!("{}.{}.svc.cluster.local.", pool_service(role), p.namespace)
}

pub(crate) fn labels(component: &str) -> Value {
    json!({"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component})
}

pub(crate) fn meta(p: &Params, name: &str, component: &str) -> Value {
    json!({"name": name, "namespace": p.namespace, "labels": labels(component)})
}

fn http_get(path: &str, period_s: u32, failures: u32) -> Value {
    json!({
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    })
}

/// The environment every container gets from the downward API: `$(POD_IP)` and `$(POD_NAME)` in
/// its arguments.
fn pod_env() -> Value {
    json!([
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ])
}

/// The container's command line (binary first), as the manifests give it.
pub(crate) fn command(p: &Params, component: &str) -> Vec<String> {
    let port = HTTP_PORT.to_string();
    let drain = DRAIN_S.to_string();
    let mut c: Vec<String> = match component {
        "router" => {
            // Looked up again well within the preStop pause, so a terminating pod is out of
            // rotation before its SIGTERM.
            let mut c =
                vec!["pdserve-router".to_owned(), "--discover-interval-s".to_owned(), DISCOVER_S.to_string()];
            for role in ["prefill", "decode"] {
                c.push("--discover".into());
                c.push(format!("{role}=dns:{}:{HTTP_PORT}", pool_dns(p, role)));
            }
            c
        }
        role => {
            let mut c: Vec<String> =
                ["pdserve-server", "--role", role, "--model", MODEL_DIR, "--open-probes"]
                    .map(str::to_owned)
                    .into();
            if role == "prefill" {
                c.extend(["--transfer-addr".to_owned(), format!("$(POD_IP):{TRANSFER_PORT}")]);
            }
            c
        }
    };
    let common = ["--host", "0.0.0.0", "--port", &port, "--name", "$(POD_NAME)"];
    c.extend(common.iter().map(|s| (*s).to_owned()));
    c.extend(["--cluster-secret-file", SECRET_FILE, "--drain-timeout-s", &drain].map(str::to_owned));
    c
}

pub(crate) fn deployment(p: &Params, component: &str, replicas: u32) -> Value {
    let cmd = command(p, component);
    let worker = component != "router";
    let mut ports = vec![json!({"name": "http", "containerPort": HTTP_PORT})];
    if component == "prefill" {
        ports.push(json!({"name": "kv-transfer", "containerPort": TRANSFER_PORT}));
    }
    let resources = if worker {
        json!({"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "4Gi"}})
    } else {
        json!({"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}})
    };
    let mut container = json!({
        "name": component,
        "image": p.image,
        "command": [cmd[0]],
        "args": cmd[1..],
        "env": pod_env(),
        "ports": ports,
        "resources": resources,
        "livenessProbe": http_get("/health/live", 10, 3),
        "readinessProbe": http_get("/health/ready", 2, 2),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", PRESTOP_SLEEP_S.to_string()]}}},
        "volumeMounts": [{"name": "cluster-secret", "mountPath": "/var/run/pdserve/secret", "readOnly": true}],
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": 65532,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"]},
        },
    });
    if worker {
        // Loading the model takes a while: liveness starts counting once it listens.
        container["startupProbe"] = http_get("/health/live", 2, 150);
    }
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(p, &format!("pdserve-{component}"), component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels(component)},
            "template": {
                "metadata": {"labels": labels(component)},
                "spec": {
                    "terminationGracePeriodSeconds": GRACE_S,
                    "containers": [container],
                    "volumes": [{
                        "name": "cluster-secret",
                        "secret": {"secretName": SECRET_NAME, "items": [{"key": "secret", "path": "cluster-secret"}]},
                    }],
                },
            },
        },
    })
}

fn service(p: &Params, name: &str, component: &str, headless: bool) -> Value {
    let mut spec = json!({
        "selector": labels(component),
        "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}],
    });
    if headless {
        // One DNS record per ready pod, which is what the router's --discover reads.
        spec["clusterIP"] = json!("None");
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": meta(p, name, component), "spec": spec})
}

pub(crate) fn disruption_budget(p: &Params, component: &str) -> Value {
    json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(p, &format!("pdserve-{component}"), component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(component)}},
    })
}

/// Every object, in the order `kubectl apply` should meet them.
pub(crate) fn objects(p: &Params) -> Vec<Value> {
    let mut v = vec![json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": p.namespace, "labels": {"app.kubernetes.io/name": "pdserve"}},
    })];
    v.push(service(p, "pdserve", "router", false));
    for role in ["prefill", "decode"] {
        v.push(service(p, &pool_service(role), role, true));
    }
    for (component, n) in [("prefill", p.prefill), ("decode", p.decode), ("router", p.routers)] {
        v.push(deployment(p, component, n));
        v.push(disruption_budget(p, component));
    }
    v
}

/// The YAML stream of [`objects`], with a header saying where it comes from.
pub(crate) fn render(p: &Params) -> String {
    let mut out = String::from(
        "# pdserve on Kubernetes: generated by `cargo xtask deploy render` (do not edit by hand;\n\
         # change xtask/src/deploy/manifests.rs). Walkthrough: deploy/README.md.\n",
    );
    for o in objects(p) {
        out.push_str("---\n");
        super::yaml::write(&o, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
        objs.iter().find(|o| o["kind"] == kind && o["metadata"]["name"] == name).unwrap()
    }

    #[test]
    fn ports_names_and_probes_agree() {
        let p = Params::default();
        let objs = objects(&p);
        for component in ["router", "prefill", "decode"] {
            let d = find(&objs, "Deployment", &format!("pdserve-{component}"));
            let spec = &d["spec"]["template"]["spec"];
            let c = &spec["containers"][0];
            // The port the process listens on is the container's `http` port.
            let args: Vec<&str> = c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
            let port = args.iter().position(|a| *a == "--port").map(|i| args[i + 1]).unwrap();
            assert_eq!(port, c["ports"][0]["containerPort"].to_string());
            assert_eq!(c["ports"][0]["name"], "http");
            for probe in ["livenessProbe", "readinessProbe"] {
                assert_eq!(c[probe]["httpGet"]["port"], "http", "{component} {probe}");
            }
            // The drain fits in the grace period, preStop pause included.
            assert!(
                DRAIN_S + PRESTOP_SLEEP_S < spec["terminationGracePeriodSeconds"].as_u64().unwrap() as u32
            );
            // The pod's labels are what its Deployment, Service and PDB select.
            assert_eq!(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]);
            let pdb = find(&objs, "PodDisruptionBudget", &format!("pdserve-{component}"));
            assert_eq!(pdb["spec"]["selector"]["matchLabels"], d["spec"]["selector"]["matchLabels"]);
        }
        // The router looks up exactly the headless Services' names, at their port.
        let router = command(&p, "router");
        for role in ["prefill", "decode"] {
            let svc = find(&objs, "Service", &pool_service(role));
            assert_eq!(svc["spec"]["clusterIP"], "None");
            assert_eq!(svc["spec"]["ports"][0]["port"], HTTP_PORT);
            let want = format!(
                "{role}=dns:{}.{}.svc.cluster.local.:{HTTP_PORT}",
                svc["metadata"]["name"].as_str().unwrap(),
                p.namespace
            );
            assert!(router.contains(&want), "{router:?}");
        }
        // Decode workers reach the prefill worker's transfer port at its pod address.
        let prefill = command(&p, "prefill");
        assert!(prefill.contains(&format!("$(POD_IP):{TRANSFER_PORT}")), "{prefill:?}");
    }

    #[test]
    fn the_committed_yaml_is_what_render_writes() {
        let path = crate::workspace_root().join("deploy/k8s/pdserve.yaml");
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == render(&Params::default()),
            "{} is stale: run `cargo xtask deploy render --out deploy/k8s/pdserve.yaml`",
            path.display()
        );
    }
}
