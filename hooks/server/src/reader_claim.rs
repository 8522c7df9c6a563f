//! Checking a local reader's claim to be a pod: the pod uid it names must be the one
//! in its process's cgroup path (`/proc/<pid>/cgroup`, the pid from SO_PEERCRED).
//!
//! Why: a failed read's block stops the reading workload's pods, so a process that
//! could name any pod could have another workload stopped. Kubelet puts each pod's
//! containers under a cgroup named after the pod's uid: `pod<uid>` with the cgroupfs
//! driver (`/kubepods/burstable/pod3f1c…/<container>`), and with the systemd driver
//! `kubepods-burstable-pod<uid with _ for ->.slice`; the same on cgroup v1 and v2.

use std::collections::BTreeSet;

/// Largest `/proc/<pid>/cgroup` read: a real one is a few hundred bytes to a few KiB.
pub(crate) const MAX_CGROUP_BYTES: usize = 64 * 1024;

/// The process at the other end of a Unix socket connection, from SO_PEERCRED, put
/// into each request's extensions by the Unix listener (in the server's pid
/// namespace; 0 when the peer is in a namespace the server cannot see).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerProcess {
    /// Its process id.
    pub pid: i32,
}

/// Why a local caller's claim to be a pod is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReaderClaimError {
    /// The peer's pid is not visible to the server (another pid namespace).
    #[error("the calling process's pid is not visible to the server, so its pod cannot be checked")]
    NoPid,
    /// Its cgroup file could not be read (it exited, or /proc is not the host's).
    #[error("cannot read the cgroup of calling process {pid}: {problem}")]
    Unreadable {
        /// The peer's pid.
        pid: i32,
        /// Why.
        problem: String,
    },
    /// Its cgroup file is larger than any real one.
    #[error("the caller's cgroup file is over {MAX_CGROUP_BYTES} bytes")]
    TooLarge,
    /// The caller runs in no pod's cgroup.
    #[error(
        "reader.uid: the calling process is in no pod's cgroup, so it cannot read as pod {claimed}"
    )]
    NoPod {
        /// The pod it claimed.
        claimed: String,
    },
    /// The caller runs in another pod.
    #[error("reader.uid: the calling process runs in pod uid {found}, not the claimed {claimed}")]
    OtherPod {
        /// The uid it claimed.
        claimed: String,
        /// The uid(s) its cgroup names.
        found: String,
    },
}

/// The pod uids named in a cgroup file's paths (lower case, with dashes).
pub(crate) fn pod_uids_in_cgroup(cgroup: &str) -> BTreeSet<String> {
    let mut uids = BTreeSet::new();
    for line in cgroup.lines() {
        // `hierarchy-id:controllers:path`; the path may itself hold `:`.
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        for segment in path.split('/') {
            let mut rest = segment;
            while let Some(at) = rest.find("pod") {
                let after = rest.get(at + 3..).unwrap_or("");
                if let Some(uid) = after.get(..36).and_then(uid_of) {
                    uids.insert(uid);
                }
                rest = after;
            }
        }
    }
    uids
}

/// `text` as a pod uid, if it is one written with `-` or `_` between its groups.
fn uid_of(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let dashes = [8, 13, 18, 23];
    let ok = bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, b)| {
            if dashes.contains(&i) {
                matches!(b, b'-' | b'_')
            } else {
                b.is_ascii_hexdigit()
            }
        });
    ok.then(|| text.replace('_', "-").to_ascii_lowercase())
}

/// Checks a claim against the caller's cgroup file: the file must name exactly one pod,
/// and that pod's uid must be `claimed` when the claim has a uid. The uid to record.
pub(crate) fn check_claim(
    cgroup: &[u8],
    claimed_pod: &str,
    claimed_uid: Option<&str>,
) -> Result<String, ReaderClaimError> {
    if cgroup.len() > MAX_CGROUP_BYTES {
        return Err(ReaderClaimError::TooLarge);
    }
    let text = String::from_utf8_lossy(cgroup);
    let found = pod_uids_in_cgroup(&text);
    let claimed = claimed_uid.map(str::to_ascii_lowercase);
    match (found.len(), found.iter().next(), claimed) {
        (0, _, claimed) => Err(ReaderClaimError::NoPod {
            claimed: claimed.unwrap_or_else(|| claimed_pod.to_owned()),
        }),
        (1, Some(uid), None) => Ok(uid.clone()),
        (1, Some(uid), Some(claimed)) if *uid == claimed => Ok(claimed),
        (_, _, claimed) => Err(ReaderClaimError::OtherPod {
            claimed: claimed.unwrap_or_else(|| claimed_pod.to_owned()),
            found: found.into_iter().collect::<Vec<_>>().join(", "),
        }),
    }
}

/// Reads the cgroup file of process `pid` (at most [`MAX_CGROUP_BYTES`] and one more,
/// so an oversized one is refused rather than cut).
pub(crate) fn read_cgroup(pid: i32) -> Result<Vec<u8>, ReaderClaimError> {
    use std::io::Read;
    if pid <= 0 {
        return Err(ReaderClaimError::NoPid);
    }
    let unreadable = |e: std::io::Error| ReaderClaimError::Unreadable {
        pid,
        problem: e.to_string(),
    };
    let file = std::fs::File::open(format!("/proc/{pid}/cgroup")).map_err(unreadable)?;
    let mut out = Vec::new();
    file.take(MAX_CGROUP_BYTES as u64 + 1)
        .read_to_end(&mut out)
        .map_err(unreadable)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b";
    const OTHER: &str = "0a9b8c7d-6e5f-4a3b-2c1d-0e9f8a7b6c5d";

    /// cgroup v1 with the cgroupfs driver (kubelet's default before 1.22).
    const V1_CGROUPFS: &str = "12:pids:/kubepods/burstable/pod3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b/6f1e0b0c9d8a\n\
11:memory:/kubepods/burstable/pod3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b/6f1e0b0c9d8a\n\
2:cpu,cpuacct:/kubepods/burstable/pod3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b/6f1e0b0c9d8a\n\
1:name=systemd:/kubepods/burstable/pod3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b/6f1e0b0c9d8a\n";

    /// cgroup v1 with the systemd driver.
    const V1_SYSTEMD: &str = "11:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod3f1c2a7e_5b4d_4e8f_9a0b_1c2d3e4f5a6b.slice/cri-containerd-6f1e0b.scope\n\
1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod3f1c2a7e_5b4d_4e8f_9a0b_1c2d3e4f5a6b.slice/cri-containerd-6f1e0b.scope\n";

    /// cgroup v2 with the systemd driver, a guaranteed pod (no QoS slice).
    const V2_SYSTEMD: &str = "0::/kubepods.slice/kubepods-pod3f1c2a7e_5b4d_4e8f_9a0b_1c2d3e4f5a6b.slice/cri-containerd-0123abcd.scope\n";

    /// A process on the host, outside any pod.
    const HOST: &str = "0::/system.slice/kubelet.service\n";

    #[test]
    fn the_pod_uid_is_found_in_v1_and_v2_cgroup_paths() {
        for file in [V1_CGROUPFS, V1_SYSTEMD, V2_SYSTEMD] {
            assert_eq!(
                pod_uids_in_cgroup(file).into_iter().collect::<Vec<_>>(),
                [UID],
                "{file}"
            );
            assert_eq!(
                check_claim(file.as_bytes(), "train/llm-0", Some(UID)),
                Ok(UID.to_owned())
            );
            // Upper case in the claim is the same uid.
            assert!(check_claim(file.as_bytes(), "train/llm-0", Some(&UID.to_uppercase())).is_ok());
            // No uid claimed: the cgroup's is the one recorded.
            assert_eq!(
                check_claim(file.as_bytes(), "train/llm-0", None),
                Ok(UID.to_owned())
            );
        }
    }

    #[test]
    fn a_claim_of_another_pods_uid_is_refused_naming_both() {
        let err = check_claim(V2_SYSTEMD.as_bytes(), "train/llm-0", Some(OTHER)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "reader.uid: the calling process runs in pod uid {UID}, not the claimed {OTHER}"
            )
        );
    }

    #[test]
    fn hostile_cgroup_files_are_refused_without_a_panic() {
        assert_eq!(
            check_claim(HOST.as_bytes(), "train/llm-0", Some(UID)),
            Err(ReaderClaimError::NoPod {
                claimed: UID.into()
            })
        );
        assert!(matches!(
            check_claim(b"", "train/llm-0", None),
            Err(ReaderClaimError::NoPod { .. })
        ));
        let huge = V2_SYSTEMD.repeat(MAX_CGROUP_BYTES / V2_SYSTEMD.len() + 1);
        assert_eq!(
            check_claim(huge.as_bytes(), "train/llm-0", Some(UID)),
            Err(ReaderClaimError::TooLarge)
        );
        // Two pods' paths in one file: which is it? Refused.
        let two = format!("{V1_CGROUPFS}3:blkio:/kubepods/pod{OTHER}/x\n");
        assert!(matches!(
            check_claim(two.as_bytes(), "train/llm-0", Some(UID)),
            Err(ReaderClaimError::OtherPod { .. })
        ));
        // Near misses are not uids: too short, mixed case groups of the wrong length,
        // separators in the wrong place, a `pod` at the end, non-UTF-8 bytes.
        for text in [
            "0::/kubepods/pod3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6\n",
            "0::/kubepods/pod3f1c2a7e5-b4d-4e8f-9a0b-1c2d3e4f5a6b\n",
            "0::/kubepods/pod\n",
            "0::/pod",
            "garbage without colons pod3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b",
        ] {
            assert!(pod_uids_in_cgroup(text).is_empty(), "{text}");
        }
        let mut bytes = V2_SYSTEMD.as_bytes().to_vec();
        bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
        assert_eq!(
            check_claim(&bytes, "train/llm-0", Some(UID)),
            Ok(UID.to_owned())
        );
        assert_eq!(read_cgroup(0), Err(ReaderClaimError::NoPid));
    }
}
