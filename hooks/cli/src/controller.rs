//! `probity controller`: run the Kubernetes controller, or change its shared state.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use probity_kube::controller::{self, BreakerLimits, Controller, ControllerOptions, ProbityApi};
use probity_kube::{Cluster, Retries};

use crate::exit;

#[derive(Subcommand)]
pub enum ControllerCommand {
    /// Make the cluster show Probity's blocks: taint blocked nodes, release unblocked
    /// ones (one active replica per cluster, through a Lease).
    Run(Box<RunArgs>),
    /// Print the controller's shared state: pause, dry run, breaker, report (JSON).
    Status(Target),
    /// Stop acting (every replica) until `resume`.
    Pause(Target),
    /// Act again after `pause`.
    Resume(Target),
    /// Reset a tripped circuit breaker, with a fresh window.
    Reset {
        #[command(flatten)]
        target: Target,
        /// Also forget the release tombstones: after Probity's store was replaced (a new
        /// etcd, a wiped state directory), whose block numbers start again below them.
        #[arg(long)]
        tombstones: bool,
    },
    /// Report what would be done, change nothing (`on`), or act again (`off`).
    DryRun {
        #[command(flatten)]
        target: Target,
        /// `on` or `off`.
        #[arg(value_parser = ["on", "off"])]
        mode: String,
    },
}

/// Which cluster and which controller state.
#[derive(Args)]
pub struct Target {
    /// The kubeconfig (default: the pod's service account).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The namespace of the controller's Lease and state ConfigMap.
    #[arg(long, default_value = "probity-system")]
    namespace: String,
    /// The Lease's name.
    #[arg(long, default_value = "probity-controller")]
    lease_name: String,
    /// The state ConfigMap's name.
    #[arg(long, default_value = "probity-controller-state")]
    state_name: String,
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    probity: ProbityArgs,
    /// This replica's name in the Lease and in Events (default: POD_NAME, else
    /// hostname and process id).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a lease holds without renewal.
    #[arg(long, default_value_t = 15)]
    lease_seconds: u64,
    /// Milliseconds between reconcile passes.
    #[arg(long, default_value_t = 500)]
    interval_ms: u64,
    #[command(flatten)]
    breaker: BreakerArgs,
    /// A node label whose values make pools for the breaker (repeat; default: the
    /// Probity zone, the Kubernetes zone and the GPU model labels).
    #[arg(long = "pool-label")]
    pool_labels: Vec<String>,
    /// Report what would be done, change nothing (whatever the shared state says).
    #[arg(long)]
    dry_run: bool,
    /// The node label Probity keeps equal to each node's zone in its store (the
    /// server's `[admission] zone_label`).
    #[arg(long, default_value = "topology.probity.io/zone")]
    zone_label: String,
    /// The Node attribute that names a node's zone in Probity's store (the schema's
    /// `@placement_group`).
    #[arg(long, default_value = "zone")]
    zone_attribute: String,
    /// Seconds between comparisons of the zone labels with the store, and between
    /// sends of the Nodes' facts when they have not changed.
    #[arg(long, default_value_t = 30)]
    label_interval_seconds: u64,
    /// Delete a pod whose evictions a disruption budget has refused for this many
    /// seconds (default: never; keep retrying with back-off and reporting).
    #[arg(long)]
    evict_escalate_after_seconds: Option<u64>,
    /// Seconds between PolicyReports (wgpolicyk8s.io/v1alpha2) of what the warn and
    /// audit policies find (Probity's GET /v1/reports); 0: write none.
    #[arg(long, default_value_t = 60)]
    report_interval_seconds: u64,
    /// Pods evicted per window from a zone asked to `migrate`, when its policy gives no
    /// `@param_pods_per_window`.
    #[arg(long, default_value_t = 2)]
    migrate_per_window: u32,
    /// The `migrate` window in seconds, when the policy gives no `@param_window_seconds`.
    #[arg(long, default_value_t = 300)]
    migrate_window_seconds: u64,
    /// Serve /metrics and /healthz here (e.g. 127.0.0.1:9102).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// `text` or `json` log lines.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

/// Probity's API, as a controller reads it.
#[derive(Args)]
pub struct ProbityArgs {
    /// Probity's API (`https://host:port`), whose blocklist the controller follows.
    #[arg(long)]
    probity_url: String,
    /// The CA bundle that signed Probity's server certificate (PEM).
    #[arg(long)]
    probity_ca: PathBuf,
    /// A client certificate to present to Probity (PEM), with --probity-key.
    #[arg(long, requires = "probity_key")]
    pub probity_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, requires = "probity_cert")]
    probity_key: Option<PathBuf>,
}

impl ProbityArgs {
    /// The API client these name.
    pub fn api(&self) -> Result<ProbityApi> {
        let read = |path: &PathBuf| {
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
        };
        let ca = read(&self.probity_ca)?;
        let identity_files = match (&self.probity_cert, &self.probity_key) {
            (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
            _ => None,
        };
        Ok(ProbityApi::new(
            &self.probity_url,
            &ca,
            identity_files
                .as_ref()
                .map(|(c, k)| (c.as_slice(), k.as_slice())),
        )?)
    }
}

/// The circuit breaker's limits.
#[derive(Args)]
pub struct BreakerArgs {
    /// Circuit breaker: most nodes newly blocked per window.
    #[arg(long, default_value_t = 10)]
    max_nodes: usize,
    /// Circuit breaker: most nodes newly blocked per window in one pool, in percent of
    /// the pool (at least one node).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(1..=100))]
    max_percent: u8,
    /// Circuit breaker: the window, in seconds.
    #[arg(long, default_value_t = 600)]
    window_seconds: u64,
}

impl BreakerArgs {
    /// The limits.
    pub fn limits(&self) -> BreakerLimits {
        BreakerLimits {
            max_nodes: self.max_nodes,
            max_percent: self.max_percent,
            window_secs: self.window_seconds,
        }
    }
}

/// A name for this process when none is given: the host, the pid and a time fraction
/// (the pid alone repeats across hosts with one pid namespace per container).
pub fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{}-{}-{nanos:08x}", host.trim(), std::process::id())
}

/// Starts the log output in `format` (`text` or `json`).
pub fn init_logging(format: &str) {
    probity_server::init_logging(&probity_server::LogConfig {
        format: if format == "json" {
            probity_server::LogFormat::Json
        } else {
            probity_server::LogFormat::Text
        },
        ..probity_server::LogConfig::default()
    });
}

impl Target {
    fn options(&self) -> ControllerOptions {
        ControllerOptions {
            namespace: self.namespace.clone(),
            lease_name: self.lease_name.clone(),
            state_name: self.state_name.clone(),
            ..ControllerOptions::default()
        }
    }

    async fn cluster(&self) -> Result<Cluster> {
        // The controller retries what the apiserver refuses for now (an eviction a
        // disruption budget forbids) itself, reporting each refusal.
        Ok(match &self.kubeconfig {
            Some(path) => Cluster::from_kubeconfig_with(path, Retries::Caller).await?,
            None => Cluster::in_cluster(Retries::Caller)?,
        })
    }
}

pub fn controller(command: ControllerCommand) -> Result<u8> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        match command {
            ControllerCommand::Run(args) => run(*args).await,
            ControllerCommand::Status(target) => {
                let cluster = target.cluster().await?;
                let state = controller::status(cluster.client().clone(), &target.options()).await?;
                crate::out::line(serde_json::to_string_pretty(&state)?)?;
                Ok(exit::ALLOW)
            }
            ControllerCommand::Pause(target) => change(&target, |s| s.paused = true).await,
            ControllerCommand::Resume(target) => change(&target, |s| s.paused = false).await,
            ControllerCommand::Reset { target, tombstones } => {
                change(&target, move |s| {
                    s.breaker.reset();
                    if tombstones {
                        s.tombstones.clear();
                        s.released_revisions.clear();
                    }
                })
                .await
            }
            ControllerCommand::DryRun { target, mode } => {
                let on = mode == "on";
                change(&target, move |s| {
                    s.dry_run = on;
                    if !on {
                        s.would.clear();
                    }
                })
                .await
            }
        }
    })
}

async fn change(
    target: &Target,
    change: impl Fn(&mut controller::ControlState) + Send,
) -> Result<u8> {
    let cluster = target.cluster().await?;
    let state = controller::command(cluster.client().clone(), &target.options(), change).await?;
    crate::out::line(format_args!(
        "paused: {}, dry run: {}, breaker: {}",
        state.paused,
        state.dry_run,
        match &state.breaker.tripped {
            Some(trip) => format!("tripped ({})", trip.reason),
            None => "closed".into(),
        }
    ))?;
    Ok(exit::ALLOW)
}

async fn run(args: RunArgs) -> Result<u8> {
    init_logging(&args.log_format);
    let probity = args.probity.api()?;
    let cluster = args.target.cluster().await?;
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    let mut options = args.target.options();
    options.identity = identity;
    options.lease_duration = Duration::from_secs(args.lease_seconds.max(1));
    options.interval = Duration::from_millis(args.interval_ms.max(10));
    options.limits = args.breaker.limits();
    if !args.pool_labels.is_empty() {
        options.pool_labels = args.pool_labels.clone();
    }
    options.dry_run = args.dry_run;
    options.zone_label = args.zone_label.clone();
    options.zone_attribute = args.zone_attribute.clone();
    options.label_interval = Duration::from_secs(args.label_interval_seconds.max(1));
    options.evict_escalation = args.evict_escalate_after_seconds.map(Duration::from_secs);
    options.report_interval = (args.report_interval_seconds > 0)
        .then(|| Duration::from_secs(args.report_interval_seconds));
    options.migrate = controller::migrate::MigrateLimits {
        per_window: args.migrate_per_window,
        window: Duration::from_secs(args.migrate_window_seconds.max(1)),
    };
    // With a client certificate the controller can be let record its actions in
    // Probity's event log (the api policies' `event-recorders` group).
    options.record_events = args.probity.probity_cert.is_some();
    // And send the Nodes' facts (the `cluster-reporters` group): anonymous, it could not.
    options.cluster_facts = args.probity.probity_cert.is_some();
    let controller = Controller::new(cluster.client().clone(), probity, options);
    if let Some(addr) = args.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} for metrics"))?;
        tokio::spawn(controller::metrics::serve(listener, controller.metrics()));
    }
    controller.run(probity_server::shutdown_signal()).await;
    Ok(exit::ALLOW)
}
