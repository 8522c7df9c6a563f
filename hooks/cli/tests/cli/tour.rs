//! README.md's transcripts kept true: every fenced `console` block is run and its output
//! compared with what the binary prints today.
//!
//! A `console` block is a transcript run from the repository root: a line `$ COMMAND`
//! (continued by a trailing `\`) runs `probity` (written `probity ARGS` or
//! `cargo run -q -p probity-cli -- ARGS`; arguments are split at whitespace, so no
//! quoting), and the lines after it, up to the next `$ ` line, are its standard output.
//! A shown line must equal the printed one (trailing spaces aside), except that `…`
//! stands for any text within the line (a digest that changes with every policy edit)
//! and a line `...` for any number of lines, up to the first that matches the shown line
//! after it.

use std::process::Command;

use crate::{root, text};

/// A command of a transcript and the output shown for it.
struct Step {
    command: String,
    args: Vec<String>,
    shown: Vec<String>,
}

const PREFIXES: [&str; 2] = ["cargo run -q -p probity-cli -- ", "probity "];

/// The steps of every `console` block of `markdown`.
fn transcripts(markdown: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut in_console = false;
    let mut continued = false;
    for line in markdown.lines() {
        if !in_console {
            in_console = line.trim() == "```console";
            continue;
        }
        if line.trim() == "```" {
            in_console = false;
            continue;
        }
        let step_command = |s: &mut Step, part: &str| {
            let part = part.trim();
            let part = part.strip_suffix('\\').unwrap_or(part).trim();
            if !s.command.is_empty() {
                s.command.push(' ');
            }
            s.command.push_str(part);
        };
        if continued {
            let step = steps.last_mut().unwrap();
            step_command(step, line);
            continued = line.trim_end().ends_with('\\');
        } else if let Some(command) = line.strip_prefix("$ ") {
            let mut step = Step {
                command: String::new(),
                args: Vec::new(),
                shown: Vec::new(),
            };
            step_command(&mut step, command);
            steps.push(step);
            continued = line.trim_end().ends_with('\\');
        } else {
            let step = steps
                .last_mut()
                .unwrap_or_else(|| panic!("output before any `$ ` command: {line}"));
            step.shown.push(line.trim_end().to_owned());
        }
    }
    for step in &mut steps {
        let args = PREFIXES
            .iter()
            .find_map(|p| step.command.strip_prefix(p))
            .unwrap_or_else(|| panic!("not a probity command: {}", step.command));
        assert!(
            !args.contains(['"', '\'']),
            "quoting is not supported: {}",
            step.command
        );
        step.args = args.split_whitespace().map(str::to_owned).collect();
    }
    steps
}

/// Whether `printed` is `shown`, where `…` in `shown` stands for any text.
fn line_matches(shown: &str, printed: &str) -> bool {
    let mut parts = shown.split('…');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = printed.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

/// `None` if `printed` matches `shown`, else the first difference, in words.
fn difference(shown: &[String], printed: &[&str]) -> Option<String> {
    let mut at = 0;
    let mut skipping = false;
    for (n, want) in shown.iter().enumerate() {
        if want == "..." {
            skipping = true;
            continue;
        }
        if skipping {
            match printed[at..].iter().position(|p| line_matches(want, p)) {
                Some(found) => at += found,
                None => return Some(format!("no line after `...` matches `{want}`")),
            }
            skipping = false;
        }
        match printed.get(at) {
            Some(got) if line_matches(want, got) => at += 1,
            Some(got) => {
                return Some(format!(
                    "shown line {} is `{want}`, the command prints `{got}`",
                    n + 1
                ));
            }
            None => {
                return Some(format!(
                    "shown line {} is `{want}`, the command's output ended",
                    n + 1
                ));
            }
        }
    }
    match printed.get(at) {
        Some(got) if !skipping => Some(format!(
            "the command prints more than is shown, from `{got}`"
        )),
        _ => None,
    }
}

fn check_transcripts(markdown: &str) -> Vec<String> {
    let mut failures = Vec::new();
    for step in transcripts(markdown) {
        let out = Command::new(env!("CARGO_BIN_EXE_probity"))
            .args(&step.args)
            .current_dir(root())
            .output()
            .unwrap();
        let stdout = text(&out.stdout);
        let printed: Vec<&str> = stdout.lines().map(str::trim_end).collect();
        if let Some(diff) = difference(&step.shown, &printed) {
            let stderr = text(&out.stderr);
            let stderr = match stderr.trim() {
                "" => String::new(),
                s => format!("\n  standard error: {s}"),
            };
            failures.push(format!("`{}`: {diff}{stderr}", step.command));
        }
    }
    failures
}

#[test]
fn tour_prints_what_readme_shows() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let steps = transcripts(&readme);
    // The tour's check, eval and test transcripts at least: a renamed fence must not
    // silently turn this test into one that checks nothing.
    for command in ["check", "eval", "test"] {
        assert!(
            steps
                .iter()
                .any(|s| s.args.first().is_some_and(|a| a == command)),
            "README.md has no `console` transcript of `probity {command}`"
        );
    }
    let failures = check_transcripts(&readme);
    assert!(
        failures.is_empty(),
        "README.md's transcripts differ from what probity prints:\n{}",
        failures.join("\n")
    );
}

#[test]
fn transcript_matching_names_the_first_difference() {
    let shown = |lines: &[&str]| lines.iter().map(|l| (*l).to_owned()).collect::<Vec<_>>();
    let printed = ["ok: 39 policies, digest 7b1c9f", "a", "b", "105 passed"];
    assert_eq!(
        difference(
            &shown(&["ok: 39 policies, digest …", "...", "105 passed"]),
            &printed
        ),
        None
    );
    assert_eq!(
        difference(
            &shown(&["ok: 39 policies, digest 7b1c…", "a", "b", "…passed"]),
            &printed
        ),
        None
    );
    assert_eq!(
        difference(&shown(&["ok: 22 policies, digest …", "..."]), &printed).as_deref(),
        Some(
            "shown line 1 is `ok: 22 policies, digest …`, the command prints \
             `ok: 39 policies, digest 7b1c9f`"
        )
    );
    assert!(difference(&shown(&["ok: …", "...", "41 passed"]), &printed).is_some());
    assert!(difference(&shown(&["ok: …", "a"]), &printed).is_some());
    let steps = transcripts(
        "```console\n$ cargo run -q -p probity-cli -- eval --request r.json \\\n      \
         --entities e.json\n{\n}\n$ probity test\nok\n```\n```sh\n$ probity no\n```\n",
    );
    assert_eq!(steps.len(), 2);
    assert_eq!(
        steps[0].args,
        ["eval", "--request", "r.json", "--entities", "e.json"]
    );
    assert_eq!(steps[0].shown, ["{", "}"]);
    assert_eq!(steps[1].args, ["test"]);
}
