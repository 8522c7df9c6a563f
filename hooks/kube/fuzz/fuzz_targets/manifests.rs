//! Multi-document YAML as `helm template` or an operator writes it: objects or an error
//! naming a document, and what their workloads mount; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_kube::{KubeError, mounted_objects, parse_manifests};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_manifests(text) {
        Ok(manifests) => {
            for m in &manifests {
                assert!(m.document >= 1 && !m.kind().is_empty() && !m.name().is_empty());
            }
            let _ = mounted_objects(&manifests, "default");
        }
        Err(KubeError::Manifest { document, .. }) => assert!(document >= 1),
        Err(_) => {}
    }
});
