//! probity-kube's integration tests: a real kube-apiserver, kube-controller-manager and
//! kube-scheduler (built by scripts/build-control-plane.sh) calling a real `probity serve`
//! through the webhook configurations and the scheduler configuration the Helm chart
//! renders. Each test starts its own control plane on loopback and stops it by PID.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "../../../testsupport/services.rs"]
mod services;
#[path = "../../../testsupport/tls_client.rs"]
mod tls_client;

mod admission;
mod alerts;
mod chart;
mod cluster;
mod controller;
mod install;
mod outage;
mod placement;
mod smoke;
