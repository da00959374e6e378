//! `cargo xtask deploy render`: the Kubernetes manifests of a stack (router, prefill and decode
//! Deployments, headless Services for discovery, PodDisruptionBudgets) as YAML. The default render is
//! committed as `deploy/k8s/pdserve.yaml`; `cargo xtask chaos k8s_topology` runs the same command
//! lines on network namespaces standing in for nodes.

pub(crate) mod manifests;
mod yaml;

use anyhow::{bail, Context, Result};

use manifests::Params;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let Some(("render", rest)) = args.split_first().map(|(c, r)| (c.as_str(), r)) else {
        bail!("usage: cargo xtask deploy render [--namespace NS] [--image IMAGE] [--routers N] [--prefill N] [--decode N] [--out FILE]");
    };
    let mut p = Params::default();
    let mut out = None;
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        let v = it.next().with_context(|| format!("{a} needs a value"))?;
        let n = || v.parse::<u32>().with_context(|| format!("{a} {v}: a number"));
        match a.as_str() {
            "--namespace" => p.namespace = v.clone(),
            "--image" => p.image = v.clone(),
            "--routers" => p.routers = n()?,
            "--prefill" => p.prefill = n()?,
            "--decode" => p.decode = n()?,
            "--out" => out = Some(v.clone()),
            other => bail!("unknown option {other}"),
        }
    }
    let text = manifests::render(&p);
    match out {
        Some(path) => std::fs::write(&path, text).with_context(|| format!("writing {path}")),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}
