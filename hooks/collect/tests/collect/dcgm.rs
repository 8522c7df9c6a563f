//! DCGM exporter: both real captures, our own fixture, and the scrape over loopback HTTP.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use probity_collect::dcgm::{self, DcgmError, DcgmScrape, GpuKey};
use probity_collect::{Absent, CollectError, Collected, Unavailable, Value};

use crate::common::fixture;

const AREA: &str = "dcgm";

#[test]
fn sampled_h100_capture_keys_eight_gpus_despite_pod_labels() {
    let r = dcgm::parse_dcgm(&fixture(AREA, "h100-8gpu-sampled-aicr.prom")).unwrap();
    assert_eq!(r.gpus.len(), 8);
    let g0 = &r.gpus[0];
    assert_eq!(
        g0.key,
        GpuKey::HostGpu {
            hostname: "gpu-node-1".into(),
            gpu: 0
        }
    );
    assert_eq!(
        g0.uuid.as_deref(),
        Some("GPU-c4529c8d-69c4-b61d-e0bc-7b2460096005")
    );
    assert_eq!(g0.model_name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(g0.driver_version.as_deref(), Some("580.105.08"));
    assert_eq!(g0.pci_bus_id.as_deref(), Some("00000000:53:00.0"));
    assert_eq!(g0.temperature_c, Value::Present(30.0));
    assert_eq!(g0.power_w, Value::Present(113.611));
    assert_eq!(g0.gpu_util_pct, Value::Present(0.0));
    // The sampled file has no FB series: absent, not 0 MiB.
    assert_eq!(g0.fb_used_mib, Value::Absent(Absent::NotQueried));
    assert_eq!(r.gpus[7].power_w, Value::Present(66.997));
    assert_eq!(r.gpus[5].pci_bus_id.as_deref(), Some("00000000:A8:00.0"));
}

#[test]
fn full_l4_capture_maps_every_field() {
    let r = dcgm::parse_dcgm(&fixture(AREA, "l4-1gpu-full-kops.prom")).unwrap();
    assert_eq!(r.gpus.len(), 1);
    let g = &r.gpus[0];
    assert_eq!(
        g.key,
        GpuKey::HostGpu {
            hostname: "i-030791dc5a37cd257".into(),
            gpu: 0
        }
    );
    assert_eq!(g.model_name.as_deref(), Some("NVIDIA L4"));
    assert_eq!(g.temperature_c, Value::Present(31.0));
    assert_eq!(g.power_w, Value::Present(16.365));
    assert_eq!(g.fb_free_mib, Value::Present(22563.0));
    assert_eq!(g.fb_used_mib, Value::Present(0.0));
    assert_eq!(g.gpu_util_pct, Value::Present(0.0));
    assert!(g.mig_instances.is_empty());
    // Every sample line parses, HELP and TYPE included.
    let text = fixture(AREA, "l4-1gpu-full-kops.prom");
    let samples = dcgm::parse_exposition(&text).unwrap();
    assert_eq!(samples.len(), 23);
}

#[test]
fn own_fixture_with_differing_label_sets_and_mig() {
    let r = dcgm::parse_dcgm(&fixture(AREA, "own-8gpu-mig-mixed-labels.prom")).unwrap();
    assert_eq!(r.gpus.len(), 8);
    // GPU 1 carries pod labels (one with escaped quotes) and another label order.
    let g1 = &r.gpus[1];
    assert_eq!(g1.temperature_c, Value::Present(36.0));
    assert_eq!(g1.power_w, Value::Present(497.801));
    assert_eq!(g1.fb_used_mib, Value::Present(61440.0));
    assert_eq!(g1.fb_free_mib, Value::Present(81559.0 - 551.0 - 61440.0));
    assert_eq!(g1.gpu_util_pct, Value::Present(97.0));
    // GPU 6 is in MIG mode: FB_USED only per instance, attached to the parent.
    let g6 = &r.gpus[6];
    assert_eq!(g6.fb_used_mib, Value::Absent(Absent::NotQueried));
    let instances: Vec<(&str, Option<&str>, Option<f64>)> = g6
        .mig_instances
        .iter()
        .map(|m| {
            (
                m.gpu_instance_id.as_str(),
                m.profile.as_deref(),
                m.fb_used_mib.value(),
            )
        })
        .collect();
    assert_eq!(
        instances,
        vec![
            ("1", Some("3g.40gb"), Some(2048.0)),
            ("5", Some("1g.10gb"), Some(512.0)),
            ("6", Some("1g.10gb"), Some(512.0)),
        ]
    );
    // A NaN utilisation is no value, not 0 %.
    assert_eq!(
        g6.mig_instances[0].gpu_util_pct,
        Value::Absent(Absent::NotAvailable)
    );
    assert_eq!(g6.gpu_util_pct, Value::Present(4.0));
    let text = fixture(AREA, "own-8gpu-mig-mixed-labels.prom");
    let samples = dcgm::parse_exposition(&text).unwrap();
    let pod = samples.iter().find_map(|s| s.label("pod")).unwrap();
    assert_eq!(pod, "llama-\"ft\"-0");
    let energy = samples
        .iter()
        .find(|s| s.name == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
        .unwrap();
    assert_eq!(energy.timestamp_ms, Some(1_767_225_600_000));
    assert!(
        samples
            .iter()
            .any(|s| s.name == "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" && s.value == f64::INFINITY)
    );
}

#[test]
fn a_malformed_scrape_is_located() {
    let mut text = fixture(AREA, "l4-1gpu-full-kops.prom");
    text.extend_from_slice(b"DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",Hostname=\"x\" 31\n");
    let err = dcgm::parse_dcgm(&text).unwrap_err();
    let DcgmError::Exposition(inner) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(
        inner.to_string(),
        "line 70, column 43: expected ',' or '}' after a label"
    );
}

// --- the scrape, against a one-shot HTTP server on loopback ------------------------------

/// Serves one connection with `response` (or holds it open without answering when `None`)
/// and returns the URL.
fn serve_once(response: Option<Vec<u8>>) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        read_request(&mut conn);
        match response {
            Some(r) => {
                let _ = conn.write_all(&r);
            }
            // Hold the connection until the client gives up and closes it.
            None => {
                let mut sink = [0u8; 64];
                while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
            }
        }
    });
    (url, handle)
}

fn read_request(conn: &mut TcpStream) {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    assert!(got.starts_with(b"GET /metrics HTTP/1.1\r\n"));
}

fn http_200(body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

#[test]
fn scrape_over_loopback_http() {
    let body = fixture(AREA, "own-8gpu-mig-mixed-labels.prom");
    let (url, server) = serve_once(Some(http_200(&body)));
    let c = DcgmScrape::new(&url).scrape();
    server.join().unwrap();
    let r = &c.reading().unwrap_or_else(|| panic!("{c:?}")).value;
    assert_eq!(r.gpus.len(), 8);
    assert_eq!(r.gpus[5].temperature_c, Value::Present(71.0));
}

#[test]
fn scrape_of_a_closed_port_is_unavailable() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let c = DcgmScrape::new(format!("http://127.0.0.1:{port}/metrics")).scrape();
    assert!(
        matches!(
            c,
            Collected::Unavailable {
                reason: Unavailable::NotListening { .. },
                ..
            }
        ),
        "{c:?}"
    );
}

#[test]
fn scrape_of_a_silent_server_times_out() {
    let (url, server) = serve_once(None);
    let c = DcgmScrape::new(&url)
        .timeout(Duration::from_millis(300))
        .scrape();
    server.join().unwrap();
    assert!(
        matches!(
            c,
            Collected::Error {
                error: CollectError::Dcgm(DcgmError::Http { .. }),
                ..
            }
        ),
        "{c:?}"
    );
}

#[test]
fn scrape_body_over_the_cap_is_an_error() {
    let body = fixture(AREA, "own-8gpu-mig-mixed-labels.prom");
    let (url, server) = serve_once(Some(http_200(&body)));
    let c = DcgmScrape::new(&url).body_limit(1024).scrape();
    server.join().unwrap();
    assert!(
        matches!(
            c,
            Collected::Error {
                error: CollectError::Dcgm(DcgmError::BodyTooLarge { limit: 1024, .. }),
                ..
            }
        ),
        "{c:?}"
    );
}

#[test]
fn scrape_with_an_error_status_is_an_error() {
    let (url, server) = serve_once(Some(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            .to_vec(),
    ));
    let c = DcgmScrape::new(&url).scrape();
    server.join().unwrap();
    assert!(
        matches!(
            c,
            Collected::Error {
                error: CollectError::Dcgm(DcgmError::HttpStatus { status: 503, .. }),
                ..
            }
        ),
        "{c:?}"
    );
}

#[test]
fn scrape_with_no_gpu_series_is_unavailable() {
    let (url, server) = serve_once(Some(http_200(b"# HELP up x\nup 1\n")));
    let c = DcgmScrape::new(&url).scrape();
    server.join().unwrap();
    assert!(
        matches!(
            c,
            Collected::Unavailable {
                reason: Unavailable::Empty { .. },
                ..
            }
        ),
        "{c:?}"
    );
}
