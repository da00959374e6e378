//! `cargo xtask deploy render`: the Kubernetes manifests of a stack (router, prefill and decode
//! Deployments, headless Services for discovery, PodDisruptionBudgets) as YAML. The default render is
//! committed as `deploy/k8s/pdserve.yaml`; `cargo xtask chaos k8s_topology` runs the same command
//! lines on network namespaces standing in for nodes. `--gateway` renders the Gateway API Inference
//! Extension shape instead (`gateway.rs`, committed as `deploy/k8s/inference-gateway.yaml`).

mod gateway;
pub(crate) mod manifests;
mod yaml;

use anyhow::{bail, Context, Result};

use manifests::Params;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let Some(("render", rest)) = args.split_first().map(|(c, r)| (c.as_str(), r)) else {
        bail!("usage: cargo xtask deploy render [--namespace NS] [--image IMAGE] [--routers N] [--prefill N] [--decode N] [--out FILE]\n\
               \x20      cargo xtask deploy render --gateway [--workers N] [--gateway-name NAME] [--namespace NS] [--image IMAGE] [--out FILE]");
    };
    let mut p = Params::default();
    let mut out = None;
    let (mut gateway, mut workers, mut gateway_name) = (false, 2u32, "inference-gateway".to_owned());
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        if a == "--gateway" {
            gateway = true;
            continue;
        }
        let v = it.next().with_context(|| format!("{a} needs a value"))?;
        let n = || v.parse::<u32>().with_context(|| format!("{a} {v}: a number"));
        match a.as_str() {
            "--namespace" => p.namespace = v.clone(),
            "--image" => p.image = v.clone(),
            "--routers" => p.routers = n()?,
            "--prefill" => p.prefill = n()?,
            "--decode" => p.decode = n()?,
            "--out" => out = Some(v.clone()),
            "--workers" => workers = n()?,
            "--gateway-name" => gateway_name = v.clone(),
            other => bail!("unknown option {other}"),
        }
    }
    let text = if gateway { gateway::render(&p, workers, &gateway_name) } else { manifests::render(&p) };
    match out {
        Some(path) => std::fs::write(&path, text).with_context(|| format!("writing {path}")),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}
