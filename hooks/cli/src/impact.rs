//! `probity policy impact CANDIDATE_DIR`: the recorded decisions decided again under
//! the live set and under a candidate, and every one whose answer would change,
//! grouped by the policy that changes it.
//!
//! Both sets decide now, against the same facts (an entities file and the first state
//! directory's store: its blocklist, its node facts), so a difference is the candidate's
//! doing, not the facts' drift since the record was written; how many records the live
//! set no longer decides as recorded is counted apart (`live_differs_from_record`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, Read};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use probity::state::{DecisionRecord, StateStore};
use probity::{Decision, Engine};
use serde::Serialize;
use serde_json::{Value, json};

use crate::{PolicyArgs, exit, out};

/// Examples kept per policy.
const EXAMPLES: usize = 5;
/// Records read from a state directory at a time.
const PAGE: usize = 4096;
/// The longest line of a records file (a record keeps at most 64 KiB of request).
const MAX_LINE_BYTES: u64 = 1024 * 1024;

#[derive(Args)]
pub struct ImpactArgs {
    /// The candidate policy directory.
    candidate: PathBuf,
    /// A state directory whose decision log is replayed (repeatable: each node keeps
    /// its own). The first one's store (blocklist, node facts) is the facts both sets
    /// decide on. It must not be open in a running server: export its log with
    /// `probity audit` and pass --records instead.
    #[arg(long = "state")]
    states: Vec<PathBuf>,
    /// A file of decision records, one JSON record per line, as `probity audit` prints
    /// them (repeatable).
    #[arg(long = "records")]
    records: Vec<PathBuf>,
    /// Cedar entity JSON both sets decide on (the cluster's facts).
    #[arg(long)]
    entities: Option<PathBuf>,
    /// Replay the records of this last stretch of time: `30m`, `12h`, `7d` [default:
    /// 1d].
    #[arg(long, default_value = "1d", conflicts_with = "all")]
    since: String,
    /// Replay every record, whatever its age.
    #[arg(long)]
    all: bool,
    /// Print the report as JSON (for CI pipelines).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    live: PolicyArgs,
}

/// What changed for one policy.
#[derive(Debug, Default, Serialize)]
struct PolicyImpact {
    allow_to_deny: u64,
    deny_to_allow: u64,
    obligations_gained: u64,
    obligations_lost: u64,
    findings_gained: u64,
    findings_lost: u64,
    examples: Vec<Value>,
}

#[derive(Debug, Default, Serialize)]
struct Report {
    replayed: u64,
    changed: u64,
    not_replayable: u64,
    /// Records the live set, deciding now, answers otherwise than recorded: the
    /// facts moved since (or the live set did).
    live_differs_from_record: u64,
    policies: BTreeMap<String, PolicyImpact>,
    /// Why records could not be replayed, with a count each.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    not_replayable_why: BTreeMap<String, u64>,
}

/// One record's outcome under both sets.
enum Outcome {
    /// The live and the candidate set's answers.
    Replayed(Box<(Decision, Decision)>),
    NotReplayable(String),
}

pub fn impact(args: &ImpactArgs) -> Result<u8> {
    if args.states.is_empty() && args.records.is_empty() {
        bail!("nothing to replay: give --state DIR or --records FILE");
    }
    let since_ms = if args.all {
        0
    } else {
        let span = parse_span(&args.since)?;
        now_ms().saturating_sub(span.saturating_mul(1000))
    };
    let live = crate::load(&args.live)?;
    let candidate = Engine::builder(&args.candidate)
        .build()
        .map_err(crate::report)
        .with_context(|| format!("the candidate set {}", args.candidate.display()))?;
    let stores: Vec<Arc<StateStore>> = args
        .states
        .iter()
        .map(|dir| {
            StateStore::open(dir)
                .map(Arc::new)
                .with_context(|| format!("cannot open the state directory {}", dir.display()))
        })
        .collect::<Result<_>>()?;
    if let Some(first) = stores.first() {
        for engine in [&live, &candidate] {
            engine.attach_state(first.clone())?;
        }
    }
    if let Some(path) = &args.entities {
        for engine in [&live, &candidate] {
            crate::load_entities(engine, path)?;
        }
    }
    let mut report = Report::default();
    let engines = (&live, &candidate);
    for (dir, store) in args.states.iter().zip(&stores) {
        let source = dir.display().to_string();
        let mut from = 0u64;
        loop {
            let page = store
                .decisions(from, PAGE)
                .with_context(|| format!("cannot read the decision log of {source}"))?;
            let Some(last) = page.last() else { break };
            from = last.seq + 1;
            let page: Vec<DecisionRecord> = page
                .into_iter()
                .filter(|r| r.time_unix_ms >= since_ms)
                .collect();
            replay_page(engines, &page, &source, &mut report);
        }
    }
    for path in &args.records {
        let source = path.display().to_string();
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot open the records file {source}"))?;
        let mut reader = std::io::BufReader::new(file);
        let mut page = Vec::with_capacity(PAGE);
        let mut line = Vec::new();
        let mut number = 0u64;
        loop {
            line.clear();
            let read = (&mut reader)
                .take(MAX_LINE_BYTES + 1)
                .read_until(b'\n', &mut line)
                .with_context(|| format!("cannot read {source}"))?;
            if read == 0 {
                break;
            }
            number += 1;
            if line.len() as u64 > MAX_LINE_BYTES {
                bail!("{source}:{number}: a line over {MAX_LINE_BYTES} bytes");
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let value: Value = serde_json::from_slice(&line)
                .with_context(|| format!("{source}:{number}: not a JSON record"))?;
            let mut record: DecisionRecord = serde_json::from_value(value.clone())
                .with_context(|| format!("{source}:{number}: not a decision record"))?;
            record.seq = value.get("seq").and_then(Value::as_u64).unwrap_or(number);
            if record.time_unix_ms >= since_ms {
                page.push(record);
            }
            if page.len() == PAGE {
                replay_page(engines, &page, &source, &mut report);
                page.clear();
            }
        }
        replay_page(engines, &page, &source, &mut report);
    }
    if args.json {
        out::line(serde_json::to_string_pretty(&report)?)?;
    } else {
        print_text(&report)?;
    }
    Ok(if report.changed == 0 {
        exit::ALLOW
    } else {
        exit::DENY
    })
}

/// Decides `page` under both sets, spread over the cores, and adds it to `report`.
fn replay_page(
    (live, candidate): (&Engine, &Engine),
    page: &[DecisionRecord],
    source: &str,
    report: &mut Report,
) {
    if page.is_empty() {
        return;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = page.len().div_ceil(threads).max(1);
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = page
            .chunks(chunk)
            .map(|records| {
                scope.spawn(move || {
                    records
                        .iter()
                        .map(
                            |r| match (live.decide_recorded(r), candidate.decide_recorded(r)) {
                                (Ok(live), Ok(candidate)) => {
                                    Outcome::Replayed(Box::new((live, candidate)))
                                }
                                (Err(why), _) | (_, Err(why)) => Outcome::NotReplayable(why),
                            },
                        )
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec![Outcome::NotReplayable("the replay failed".into())])
            })
            .collect()
    });
    for (record, outcome) in page.iter().zip(outcomes) {
        match outcome {
            Outcome::NotReplayable(why) => {
                report.not_replayable += 1;
                *report.not_replayable_why.entry(why).or_default() += 1;
            }
            Outcome::Replayed(answers) => {
                let (live, candidate) = *answers;
                report.replayed += 1;
                if live.decision != record.decision.decision {
                    report.live_differs_from_record += 1;
                }
                compare(record, source, &live, &candidate, report);
            }
        }
    }
}

/// What changes between `live` and `candidate` for `record`, by policy.
fn compare(
    record: &DecisionRecord,
    source: &str,
    live: &Decision,
    candidate: &Decision,
    report: &mut Report,
) {
    let mut touched: BTreeSet<String> = BTreeSet::new();
    let mut bump = |policy: &str, field: fn(&mut PolicyImpact) -> &mut u64| {
        let entry = report.policies.entry(policy.to_owned()).or_default();
        *field(entry) += 1;
        touched.insert(policy.to_owned());
    };
    match (live.is_allowed(), candidate.is_allowed()) {
        (true, false) => {
            for r in &candidate.reasons {
                bump(&r.policy, |p| &mut p.allow_to_deny);
            }
        }
        (false, true) => {
            for r in &live.reasons {
                bump(&r.policy, |p| &mut p.deny_to_allow);
            }
        }
        _ => {}
    }
    let obligations = |d: &Decision| -> BTreeSet<(String, String, Option<String>)> {
        d.obligations
            .iter()
            .map(|o| (o.policy.clone(), o.kind.clone(), o.target.clone()))
            .collect()
    };
    let (before, after) = (obligations(live), obligations(candidate));
    for (policy, _, _) in after.difference(&before) {
        bump(policy, |p| &mut p.obligations_gained);
    }
    for (policy, _, _) in before.difference(&after) {
        bump(policy, |p| &mut p.obligations_lost);
    }
    let findings = |d: &Decision| -> BTreeSet<String> {
        d.warnings
            .iter()
            .chain(&d.audit)
            .map(|n| n.policy.clone())
            .collect()
    };
    let (before, after) = (findings(live), findings(candidate));
    for policy in after.difference(&before) {
        bump(policy, |p| &mut p.findings_gained);
    }
    for policy in before.difference(&after) {
        bump(policy, |p| &mut p.findings_lost);
    }
    if touched.is_empty() {
        return;
    }
    report.changed += 1;
    let example = json!({
        "source": source,
        "seq": record.seq,
        "time_unix_ms": record.time_unix_ms,
        "principal": record.principal,
        "action": record.action,
        "resource": record.resource,
        "live": live,
        "candidate": candidate,
    });
    for policy in touched {
        if let Some(p) = report.policies.get_mut(&policy)
            && p.examples.len() < EXAMPLES
        {
            p.examples.push(example.clone());
        }
    }
}

fn print_text(report: &Report) -> Result<()> {
    out::line(format_args!(
        "replayed {} decisions; {} would change; {} not replayable",
        report.replayed, report.changed, report.not_replayable
    ))?;
    for (why, n) in &report.not_replayable_why {
        out::line(format_args!("  {n} not replayable: {why}"))?;
    }
    if report.live_differs_from_record > 0 {
        out::line(format_args!(
            "{} decided otherwise by the live set than recorded (the facts moved since)",
            report.live_differs_from_record
        ))?;
    }
    for (policy, p) in &report.policies {
        let mut parts = Vec::new();
        for (n, what) in [
            (p.allow_to_deny, "allow to deny"),
            (p.deny_to_allow, "deny to allow"),
            (p.obligations_gained, "obligations gained"),
            (p.obligations_lost, "obligations lost"),
            (p.findings_gained, "warn/audit findings gained"),
            (p.findings_lost, "warn/audit findings lost"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        out::line(format_args!("{policy}: {}", parts.join(", ")))?;
        for e in &p.examples {
            let text = |path: &str| e.pointer(path).and_then(Value::as_str).unwrap_or("");
            out::line(format_args!(
                "  e.g. {} #{}: {} {} {}: {} -> {}",
                text("/source"),
                e.pointer("/seq").and_then(Value::as_u64).unwrap_or(0),
                text("/principal"),
                text("/action"),
                text("/resource"),
                text("/live/decision"),
                text("/candidate/decision"),
            ))?;
        }
    }
    Ok(())
}

/// `30m`, `12h`, `7d` or seconds, in seconds.
fn parse_span(text: &str) -> Result<u64> {
    let (number, unit) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (text.get(..i).unwrap_or(""), c),
        _ => (text, 's'),
    };
    let n: u64 = number
        .parse()
        .with_context(|| format!("--since {text:?}: not a number of s, m, h or d"))?;
    let scale = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        other => bail!("--since {text:?}: unknown unit {other:?} (s, m, h or d)"),
    };
    Ok(n.saturating_mul(scale))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::parse_span;

    #[test]
    fn spans_are_read_with_their_units_and_a_bad_one_is_named() {
        assert_eq!(parse_span("90").unwrap(), 90);
        assert_eq!(parse_span("30m").unwrap(), 1800);
        assert_eq!(parse_span("1d").unwrap(), 86_400);
        assert!(
            parse_span("3w")
                .unwrap_err()
                .to_string()
                .contains("unknown unit 'w'")
        );
        assert!(parse_span("x1h").is_err());
    }
}
