//! Slurm's nodes as `scontrol show node` prints them: the name, the state and its
//! flags, and the reason an operator or Probity gave for a drain.
//!
//! The multi-line form is read (not `-o`): there `Reason=` has a line of its own, so a
//! reason holding spaces or `=` is never split. Every line is `Key=Value` pairs
//! separated by spaces, except `Reason=` and `OS=`, which run to the end of the line.

/// One node as Slurm reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmNode {
    /// `NodeName`.
    pub name: String,
    /// The base state, upper case (`IDLE`, `ALLOCATED`, `MIXED`, `DOWN`, ...).
    pub state: String,
    /// The state's flags (`DRAIN`, `NOT_RESPONDING`, `COMPLETING`, ...).
    pub flags: Vec<String>,
    /// The reason of a drain or down, without Slurm's ` [user@time]` suffix.
    pub reason: Option<String>,
    /// The partitions it is in.
    pub partitions: Vec<String>,
    /// Its active features (`ActiveFeatures`), the node sets a job may ask for.
    pub features: Vec<String>,
}

impl SlurmNode {
    /// Whether it is drained or draining: Slurm starts no new job on it.
    pub fn drained(&self) -> bool {
        self.flags.iter().any(|f| f == "DRAIN")
            || matches!(self.state.as_str(), "DRAINED" | "DRAINING")
    }

    /// Whether its drain reason is Probity's own ([`crate::reason::PREFIX`]).
    pub fn drained_by_probity(&self) -> bool {
        self.drained()
            && self
                .reason
                .as_deref()
                .is_some_and(crate::reason::is_probitys)
    }
}

/// Why `scontrol show node`'s output was not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scontrol show node, line {line}: {problem}")]
pub struct NodeParseError {
    /// The 1-based line.
    pub line: usize,
    /// What is wrong there.
    pub problem: String,
}

/// Parses every node of `scontrol show node` (all nodes, or one). An empty answer is no
/// node; a node without `State=` is an error (a drain decided on a guessed state would
/// be acting by mistake).
pub fn parse_nodes(text: &str) -> Result<Vec<SlurmNode>, NodeParseError> {
    let mut nodes = Vec::new();
    let mut current: Option<(usize, SlurmNode, bool)> = None;
    let finish = |entry: Option<(usize, SlurmNode, bool)>,
                  nodes: &mut Vec<SlurmNode>|
     -> Result<(), NodeParseError> {
        if let Some((line, node, has_state)) = entry {
            if !has_state {
                return Err(NodeParseError {
                    line,
                    problem: format!("node {} has no State=", node.name),
                });
            }
            nodes.push(node);
        }
        Ok(())
    };
    for (index, raw) in text.lines().enumerate() {
        let line_no = index + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("NodeName=") {
            finish(current.take(), &mut nodes)?;
            let name = rest.split_whitespace().next().unwrap_or("");
            if name.is_empty() {
                return Err(NodeParseError {
                    line: line_no,
                    problem: "NodeName= is empty".into(),
                });
            }
            current = Some((
                line_no,
                SlurmNode {
                    name: name.to_owned(),
                    state: String::new(),
                    flags: Vec::new(),
                    reason: None,
                    partitions: Vec::new(),
                    features: Vec::new(),
                },
                false,
            ));
            continue;
        }
        let Some((_, node, has_state)) = current.as_mut() else {
            return Err(NodeParseError {
                line: line_no,
                problem: format!("{line:?} comes before any NodeName="),
            });
        };
        if let Some(reason) = line.strip_prefix("Reason=") {
            node.reason = Some(strip_stamp(reason).to_owned());
            continue;
        }
        if line.starts_with("OS=") {
            continue;
        }
        for pair in line.split_whitespace() {
            let Some((key, value)) = pair.split_once('=') else {
                continue;
            };
            match key {
                "State" => {
                    let mut parts = value.split('+');
                    node.state = parts.next().unwrap_or("").to_ascii_uppercase();
                    node.flags = parts.map(|f| f.trim_end_matches('*').to_owned()).collect();
                    // `IDLE*`: not responding, written as a suffix.
                    if node.state.ends_with('*') {
                        node.state.pop();
                        node.flags.push("NOT_RESPONDING".into());
                    }
                    *has_state = !node.state.is_empty();
                }
                "Partitions" => node.partitions = list(value),
                "ActiveFeatures" => node.features = list(value),
                _ => {}
            }
        }
    }
    finish(current, &mut nodes)?;
    Ok(nodes)
}

fn list(value: &str) -> Vec<String> {
    if value == "(null)" {
        return Vec::new();
    }
    value
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A reason without Slurm's ` [user@time]` suffix.
fn strip_stamp(reason: &str) -> &str {
    let reason = reason.trim_end();
    match reason.rfind(" [") {
        Some(at) if reason.ends_with(']') && reason.get(at..).is_some_and(|s| s.contains('@')) => {
            reason.get(..at).unwrap_or(reason)
        }
        _ => reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = "NodeName=node1 Arch=x86_64 CoresPerSocket=1 \n   CPUAlloc=0 CPUEfctv=32 CPUTot=32 CPULoad=0.41\n   AvailableFeatures=rlhf,a100\n   ActiveFeatures=rlhf,a100\n   Gres=gpu:4\n   NodeAddr=localhost NodeHostName=localhost Version=22.05.8\n   OS=Linux 6.1.0-27-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.115-1 (2024-11-01) \n   RealMemory=1 AllocMem=0 FreeMem=20000 Sockets=32 Boards=1\n   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n   Partitions=train,rlhf \n   CfgTRES=cpu=32,mem=1M,billing=32,gres/gpu=4\n   Reason=Probity: security.blocked-node: node node1 is blocked (x=y) [root@2026-12-05T07:01:02]\n\nNodeName=node2 Arch=x86_64 CoresPerSocket=1 \n   ActiveFeatures=(null)\n   State=MIXED ThreadsPerCore=1\n   Partitions=train \n";

    #[test]
    fn nodes_states_flags_and_reasons_are_read() {
        let nodes = parse_nodes(TWO).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].name, "node1");
        assert_eq!(nodes[0].state, "IDLE");
        assert_eq!(nodes[0].flags, ["DRAIN"]);
        assert_eq!(
            nodes[0].reason.as_deref(),
            Some("Probity: security.blocked-node: node node1 is blocked (x=y)")
        );
        assert_eq!(nodes[0].partitions, ["train", "rlhf"]);
        assert_eq!(nodes[0].features, ["rlhf", "a100"]);
        assert!(nodes[0].drained_by_probity());
        assert_eq!(nodes[1].state, "MIXED");
        assert!(!nodes[1].drained());
        assert!(nodes[1].features.is_empty());
    }

    #[test]
    fn an_operators_reason_is_not_probitys() {
        let text = "NodeName=n3\n   State=IDLE+DRAIN\n   Reason=disk replacement, ticket 42 [alice@2026-12-05T07:01:02]\n";
        let node = &parse_nodes(text).unwrap()[0];
        assert!(node.drained());
        assert!(!node.drained_by_probity());
        assert_eq!(node.reason.as_deref(), Some("disk replacement, ticket 42"));
    }

    #[test]
    fn a_not_responding_node_and_no_nodes() {
        let node = &parse_nodes("NodeName=n4\n   State=DOWN*+DRAIN\n").unwrap()[0];
        assert_eq!(node.state, "DOWN");
        assert!(node.flags.contains(&"NOT_RESPONDING".to_owned()));
        assert!(parse_nodes("").unwrap().is_empty());
    }

    #[test]
    fn hostile_output_is_an_error_naming_the_line() {
        let err = parse_nodes("   State=IDLE\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "scontrol show node, line 1: \"State=IDLE\" comes before any NodeName="
        );
        let err = parse_nodes("NodeName=n1\n   Partitions=a\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "scontrol show node, line 1: node n1 has no State="
        );
        assert!(parse_nodes("NodeName=\n").is_err());
        // Odd bytes and half lines never panic.
        for text in [
            "NodeName=x\n State=+\n",
            "NodeName=é\n   Reason= [",
            "NodeName=a b\n State===",
        ] {
            let _ = parse_nodes(text);
        }
    }
}
