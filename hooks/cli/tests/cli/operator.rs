//! The command line as operators expect it: a version that names its commit, shell
//! completions and man pages generated from the command definitions.

use crate::{probity, root};

#[test]
fn the_version_names_the_commit_it_was_built_from() {
    let out = probity(&["--version"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next().unwrap();
    let commit = first
        .strip_prefix(&format!("probity {} (commit ", env!("CARGO_PKG_VERSION")))
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{first:?}"));
    // Inside a git checkout (the test command's clone), the commit is HEAD's.
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    match head {
        Some(head) => assert_eq!(commit.trim_end_matches("-dirty"), head, "{text}"),
        None => assert_eq!(commit, "unknown", "{text}"),
    }
    assert!(
        text.contains("built in: ") && text.contains("slurm"),
        "{text}"
    );
}

#[test]
fn completions_cover_every_shell_and_subcommand() {
    for shell in ["bash", "zsh", "fish"] {
        let out = probity(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        for word in ["serve", "agent", "controller", "slurm", "prolog", "socket"] {
            assert!(text.contains(word), "{shell} completions lack {word}");
        }
    }
    let out = probity(&["completions", "tcsh"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'tcsh'"));
}

#[test]
fn man_pages_are_written_for_the_command_and_each_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let out = probity(&["man", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let top = std::fs::read_to_string(dir.path().join("probity.1")).unwrap();
    assert!(top.contains(".TH probity 1"), "{top}");
    assert!(
        top.contains("Policy, compliance and data\\-integrity engine"),
        "{top}"
    );
    let prolog = std::fs::read_to_string(dir.path().join("probity-slurm-prolog.1")).unwrap();
    assert!(prolog.contains(".TH probity-slurm-prolog 1"), "{prolog}");
    assert!(prolog.contains("\\-\\-job\\-refusal"), "{prolog}");
    let pages = std::fs::read_dir(dir.path()).unwrap().count();
    assert!(pages >= 40, "{pages} pages");
    assert!(!dir.path().join("probity-help.1").exists());
}
