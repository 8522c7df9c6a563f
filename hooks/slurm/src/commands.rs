//! Slurm's own commands (`scontrol`, `squeue`, `scancel`), run without a shell: each
//! argument is one argv entry, so a reason or a job field is never re-parsed, and each
//! call has a deadline (a hung slurmctld must not hang the Prolog or the controller).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::SlurmError;
use crate::nodes::{SlurmNode, parse_nodes};

/// Largest output read from one command (every node of a large cluster fits).
const MAX_OUTPUT: u64 = 16 * 1024 * 1024;

/// Where Slurm's commands are and how long each may take. Their environment is the
/// caller's (`SLURM_CONF` included).
#[derive(Debug, Clone)]
pub struct SlurmCommands {
    /// Directory of `scontrol`, `squeue` and `scancel`; `None`: found on `PATH`.
    pub bin_dir: Option<PathBuf>,
    /// Deadline of one command.
    pub timeout: Duration,
}

impl Default for SlurmCommands {
    fn default() -> Self {
        Self {
            bin_dir: None,
            timeout: Duration::from_secs(10),
        }
    }
}

/// What a job refused at start, or a reader of bad data, gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStop {
    /// `scontrol requeuehold`: back in the queue, held until an operator releases it.
    RequeueHold,
    /// `scancel`.
    Cancel,
}

impl JobStop {
    /// Its name in configuration and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            JobStop::RequeueHold => "requeue-hold",
            JobStop::Cancel => "cancel",
        }
    }

    /// Parses `requeue-hold` or `cancel`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "requeue-hold" => Ok(JobStop::RequeueHold),
            "cancel" => Ok(JobStop::Cancel),
            other => Err(format!(
                "{other:?} is not a job stop: requeue-hold or cancel"
            )),
        }
    }
}

impl SlurmCommands {
    fn program(&self, name: &str) -> PathBuf {
        match &self.bin_dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        }
    }

    /// Runs `program args`, its standard output on success; an error naming the
    /// command, its exit status and what it wrote to standard error otherwise.
    pub fn run(&self, program: &str, args: &[&str]) -> Result<String, SlurmError> {
        let what = || format!("{program} {}", args.join(" "));
        let mut child = Command::new(self.program(program))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| SlurmError::Command {
                command: what(),
                problem: format!("cannot start it: {e}"),
            })?;
        // Readers on threads of their own: a command that fills its pipe must not
        // block before it exits.
        let take = |pipe: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut out = Vec::new();
                if let Some(pipe) = pipe {
                    let _ = pipe.take(MAX_OUTPUT).read_to_end(&mut out);
                }
                out
            })
        };
        let stdout = take(
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        );
        let stderr = take(
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        );
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(SlurmError::Command {
                        command: what(),
                        problem: format!("no answer within {:?}: killed", self.timeout),
                    });
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(2)),
                Err(e) => {
                    return Err(SlurmError::Command {
                        command: what(),
                        problem: format!("cannot wait for it: {e}"),
                    });
                }
            }
        };
        let out = stdout.join().unwrap_or_default();
        let err = stderr.join().unwrap_or_default();
        if !status.success() {
            let text = String::from_utf8_lossy(&err);
            return Err(SlurmError::Command {
                command: what(),
                problem: format!("{status}: {}", text.trim()),
            });
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    /// Every node, or the one named.
    pub fn nodes(&self, name: Option<&str>) -> Result<Vec<SlurmNode>, SlurmError> {
        let mut args = vec!["show", "node"];
        args.extend(name);
        let text = self.run("scontrol", &args)?;
        parse_nodes(&text).map_err(|e| SlurmError::Output(e.to_string()))
    }

    /// One node; an error when Slurm does not know it.
    pub fn node(&self, name: &str) -> Result<SlurmNode, SlurmError> {
        self.nodes(Some(name))?
            .into_iter()
            .find(|n| n.name == name)
            .ok_or_else(|| SlurmError::Output(format!("scontrol knows no node {name}")))
    }

    /// Drains `node` with `reason` (already Probity's: see [`crate::reason`]).
    pub fn drain(&self, node: &str, reason: &str) -> Result<(), SlurmError> {
        let name = format!("NodeName={node}");
        let reason = format!("Reason={reason}");
        self.run("scontrol", &["update", &name, "State=DRAIN", &reason])
            .map(drop)
    }

    /// Resumes `node` (the caller checked the reason is Probity's).
    pub fn resume(&self, node: &str) -> Result<(), SlurmError> {
        let name = format!("NodeName={node}");
        self.run("scontrol", &["update", &name, "State=RESUME"])
            .map(drop)
    }

    /// The ids of the jobs running (or starting, or completing) on `node`.
    pub fn jobs_on(&self, node: &str) -> Result<Vec<String>, SlurmError> {
        let text = self.run(
            "squeue",
            &[
                "--noheader",
                "--nodelist",
                node,
                "--states",
                "RUNNING,CONFIGURING,COMPLETING",
                "--format",
                "%A",
            ],
        )?;
        Ok(text
            .lines()
            .map(str::trim)
            .filter(|id| is_job_id(id))
            .map(str::to_owned)
            .collect())
    }

    /// Requeues-and-holds or cancels job `id`.
    pub fn stop_job(&self, id: &str, how: JobStop) -> Result<(), SlurmError> {
        if !is_job_id(id) {
            return Err(SlurmError::Output(format!("{id:?} is not a job id")));
        }
        match how {
            JobStop::RequeueHold => self.run("scontrol", &["requeuehold", id]).map(drop),
            JobStop::Cancel => self.run("scancel", &[id]).map(drop),
        }
    }

    /// The submission token of job `id`, if job_submit.lua kept one.
    pub fn submission_of(&self, id: &str) -> Result<Option<String>, SlurmError> {
        if !is_job_id(id) {
            return Err(SlurmError::Output(format!("{id:?} is not a job id")));
        }
        Ok(submission_in(&self.run("scontrol", &["show", "job", id])?))
    }

    /// Puts Probity's word on a job an operator looks at (`scontrol show job`): its
    /// admin comment, on one line.
    pub fn annotate_job(&self, id: &str, text: &str) -> Result<(), SlurmError> {
        let job = format!("JobId={id}");
        let line: String = text
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(crate::reason::MAX_REASON)
            .collect();
        let comment = format!("AdminComment={line}");
        self.run("scontrol", &["update", &job, &comment]).map(drop)
    }
}

/// The submission token job_submit.lua kept in a job's admin comment
/// (`probity:<token>`), from `scontrol show job` output.
pub fn submission_in(show_job: &str) -> Option<String> {
    let at = show_job.find("AdminComment=")?;
    let rest = show_job.get(at..)?;
    let token_at = rest.find(SUBMISSION_PREFIX)? + SUBMISSION_PREFIX.len();
    let token: String = rest
        .get(token_at..)?
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .take(128)
        .collect();
    (!token.is_empty()).then_some(token)
}

/// The submission token job_submit.lua appended to a job's comment (the Prolog's
/// `SLURM_JOB_COMMENT`): the last `probity:<token>` word. The comment is the job
/// owner's, but job_submit.lua strips any `probity:` word they wrote and refuses their
/// later changes to it, so the last word is the Lua's.
pub fn submission_in_comment(comment: &str) -> Option<String> {
    let word = comment
        .split_whitespace()
        .filter_map(|w| w.strip_prefix(SUBMISSION_PREFIX))
        .next_back()?;
    let token: String = word
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .take(128)
        .collect();
    (!token.is_empty() && token.len() == word.len()).then_some(token)
}

/// What precedes the submission token in a job's admin comment.
pub const SUBMISSION_PREFIX: &str = "probity:";

/// Whether `text` is a job id (digits; an array task's `123_4` is named by its own id).
pub fn is_job_id(text: &str) -> bool {
    !text.is_empty() && text.len() <= 20 && text.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_are_digits_only() {
        assert!(is_job_id("12"));
        for bad in ["", "12a", "-1", "1 2", "12;rm", &"9".repeat(21)] {
            assert!(!is_job_id(bad), "{bad}");
        }
        assert_eq!(JobStop::parse("cancel"), Ok(JobStop::Cancel));
        let show = "JobId=12 JobName=wrap\n   Priority=1 Nice=0 Account=(null) QOS=(null)\n   AdminComment=probity:0a1b2c3d Probity: held\n";
        assert_eq!(submission_in(show).as_deref(), Some("0a1b2c3d"));
        assert_eq!(submission_in("JobId=12\n   Comment=probity:ff\n"), None);
        assert_eq!(submission_in("AdminComment=probity:"), None);
        assert_eq!(
            submission_in_comment("class=training probity:0a1b").as_deref(),
            Some("0a1b")
        );
        assert_eq!(
            submission_in_comment("probity:aa class=x probity:bb").as_deref(),
            Some("bb")
        );
        for bad in ["class=training", "probity:", "probity:ab;rm", "xprobity:ab"] {
            assert_eq!(submission_in_comment(bad), None, "{bad}");
        }
        assert!(
            JobStop::parse("hold")
                .unwrap_err()
                .contains("requeue-hold or cancel")
        );
    }

    #[test]
    fn a_failing_or_hung_command_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| {
            use std::os::unix::fs::PermissionsExt;
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        script(
            "scontrol",
            "echo 'slurm_load_node error: Unable to contact slurm controller' >&2; exit 1",
        );
        script("squeue", "exec sleep 30");
        let commands = SlurmCommands {
            bin_dir: Some(dir.path().to_owned()),
            timeout: Duration::from_millis(300),
        };
        let err = commands.nodes(None).unwrap_err().to_string();
        assert!(
            err.starts_with("scontrol show node: exit status: 1: slurm_load_node error"),
            "{err}"
        );
        let err = commands.jobs_on("n1").unwrap_err().to_string();
        assert!(err.contains("no answer within 300ms: killed"), "{err}");
        assert!(commands.stop_job("1;x", JobStop::Cancel).is_err());
    }
}
