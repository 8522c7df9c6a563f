//! What a pod requests (GPUs, CPU millicores), counted as the scheduler counts it.

use serde_json::Value;

use super::quantity;

/// What a pod asks for, counted as the scheduler counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Amounts {
    pub(super) gpus: i64,
    pub(super) cpu_millis: i64,
}

impl Amounts {
    fn plus(self, o: Amounts) -> Amounts {
        Amounts {
            gpus: self.gpus.saturating_add(o.gpus),
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
        }
    }

    fn max(self, o: Amounts) -> Amounts {
        Amounts {
            gpus: self.gpus.max(o.gpus),
            cpu_millis: self.cpu_millis.max(o.cpu_millis),
        }
    }
}

/// The pod's effective request, as Kubernetes computes it: the larger of (a) its
/// containers plus its restartable init containers (sidecars, `restartPolicy:
/// Always`, which run beside them) and (b) each ordinary init container plus the
/// sidecars started before it; then `spec.overhead` on top. Per resource.
pub(super) fn pod_requests(
    spec: &Value,
    cfg: &crate::config::AdmissionConfig,
) -> Result<Amounts, String> {
    let list = |field: &str| spec.get(field).and_then(Value::as_array);
    let mut regular = Amounts::default();
    for (i, c) in list("containers").into_iter().flatten().enumerate() {
        regular = regular.plus(container_requests(c, &format!("containers[{i}]"), cfg)?);
    }
    let mut sidecars = Amounts::default();
    let mut init_peak = Amounts::default();
    for (i, c) in list("initContainers").into_iter().flatten().enumerate() {
        let a = container_requests(c, &format!("initContainers[{i}]"), cfg)?;
        if c.get("restartPolicy").and_then(Value::as_str) == Some("Always") {
            sidecars = sidecars.plus(a);
        } else {
            init_peak = init_peak.max(a.plus(sidecars));
        }
    }
    let overhead = match spec.get("overhead") {
        None | Some(Value::Null) => Amounts::default(),
        Some(o) => resource_list(o, "overhead", cfg, true)?,
    };
    Ok(regular.plus(sidecars).max(init_peak).plus(overhead))
}

/// One container's request: GPUs from limits (extended resources must have equal
/// requests and limits), CPU from requests (defaulted to the limit when unset).
fn container_requests(
    c: &Value,
    at: &str,
    cfg: &crate::config::AdmissionConfig,
) -> Result<Amounts, String> {
    let resources = c.get("resources");
    let limits = resources.and_then(|r| r.get("limits"));
    let requests = resources.and_then(|r| r.get("requests"));
    let from_limits = match limits {
        Some(l) => resource_list(l, &format!("{at}.resources.limits"), cfg, false)?,
        None => Amounts::default(),
    };
    let from_requests = match requests {
        Some(r) => resource_list(r, &format!("{at}.resources.requests"), cfg, false)?,
        None => Amounts::default(),
    };
    let has_cpu_request = requests.and_then(|r| r.get("cpu")).is_some();
    Ok(Amounts {
        gpus: from_limits.gpus.max(from_requests.gpus),
        cpu_millis: if has_cpu_request {
            from_requests.cpu_millis
        } else {
            from_limits.cpu_millis
        },
    })
}

/// GPUs and CPU millicores in one resource list (`limits`, `requests`, `overhead`).
fn resource_list(
    list: &Value,
    at: &str,
    cfg: &crate::config::AdmissionConfig,
    overhead: bool,
) -> Result<Amounts, String> {
    let Some(map) = list.as_object() else {
        return Err(format!("{at} is not an object"));
    };
    let mut out = Amounts::default();
    for (name, q) in map {
        if name == "cpu" {
            let m = quantity::cpu_millis(q)
                .ok_or_else(|| format!("{at}.cpu: {q} is not a CPU quantity"))?;
            out.cpu_millis = out.cpu_millis.saturating_add(m);
        } else if let Some(weight) = gpu_weight(name, cfg) {
            let n = quantity::count(q)
                .ok_or_else(|| format!("{at}.{name}: {q} is not a whole number"))?;
            if overhead && n > 0 {
                return Err(format!("{at}.{name}: a pod's overhead cannot hold GPUs"));
            }
            out.gpus = out.gpus.saturating_add(n.saturating_mul(i64::from(weight)));
        }
    }
    Ok(out)
}

/// How many GPUs one unit of resource `name` is, if it is a GPU resource.
fn gpu_weight(name: &str, cfg: &crate::config::AdmissionConfig) -> Option<u32> {
    if name == cfg.gpu_resource {
        return Some(1);
    }
    cfg.gpu_resources.iter().find_map(|(pattern, w)| {
        let hit = match pattern.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == pattern,
        };
        hit.then_some(*w)
    })
}
