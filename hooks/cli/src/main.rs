//! `probity`: check, evaluate and test policies from the command line.
//!
//! Exit codes (also in README.md):
//! 0 allow / success, 1 deny, 2 usage error, 3 invalid policy set,
//! 4 failed policy tests, 8 unreadable or malformed input.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use probity::{Engine, LoadError, Request};

mod exit {
    pub const ALLOW: u8 = 0;
    pub const DENY: u8 = 1;
    pub const INVALID_POLICIES: u8 = 3;
    pub const TESTS_FAILED: u8 = 4;
    pub const BAD_INPUT: u8 = 8;
}

/// Largest entities file `probity eval` reads.
const MAX_ENTITIES_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Parser)]
#[command(
    name = "probity",
    version,
    about = "Policy, compliance and data-integrity engine for GPU clusters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Parse and validate a policy directory (policies, schema, thresholds).
    Check {
        /// The policy directory.
        #[arg(default_value = "policies")]
        dir: PathBuf,
        #[command(flatten)]
        files: SchemaConfig,
    },
    /// Decide one request and print the decision as JSON.
    Eval {
        /// The request: a JSON file, or - for standard input.
        #[arg(long)]
        request: PathBuf,
        /// Cluster facts to load into the entity store first (Cedar entity JSON).
        #[arg(long)]
        entities: Option<PathBuf>,
        #[command(flatten)]
        policies: PolicyArgs,
    },
    /// Run policy test cases (scenario files) and report each.
    Test {
        /// A scenario file or a directory of them.
        #[arg(default_value = "testdata/scenarios")]
        path: PathBuf,
        #[command(flatten)]
        policies: PolicyArgs,
    },
}

#[derive(Args)]
struct SchemaConfig {
    /// Schema file [default: DIR/probity.cedarschema].
    #[arg(long)]
    schema: Option<PathBuf>,
    /// Thresholds file [default: DIR/probity.toml].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Plugin manifest [default: DIR/plugins.toml when it exists; none otherwise].
    #[arg(long)]
    plugins: Option<PathBuf>,
}

#[derive(Args)]
struct PolicyArgs {
    /// Policy directory [default: ./policies if it holds probity.cedarschema, else the
    /// embedded defaults].
    #[arg(long)]
    policies: Option<PathBuf>,
    #[command(flatten)]
    files: SchemaConfig,
}

/// A failure that has already been reported and maps to an exit code.
#[derive(Debug)]
struct Exit(u8);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}", self.0)
    }
}
impl std::error::Error for Exit {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if let Some(Exit(code)) = e.downcast_ref::<Exit>() {
                return ExitCode::from(*code);
            }
            eprintln!("error: {e:#}");
            ExitCode::from(exit::BAD_INPUT)
        }
    }
}

fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Check { dir, files } => check(&dir, &files),
        Command::Eval {
            request,
            entities,
            policies,
        } => eval(&request, entities.as_deref(), &policies),
        Command::Test { path, policies } => test(&path, &policies),
    }
}

fn build(dir: &Path, files: &SchemaConfig) -> Result<Engine, LoadError> {
    let mut b = Engine::builder(dir);
    if let Some(s) = &files.schema {
        b = b.schema(s);
    }
    if let Some(c) = &files.config {
        b = b.config(c);
    }
    if let Some(p) = &files.plugins {
        b = b.plugins(p);
    }
    b.build()
}

fn report(e: LoadError) -> anyhow::Error {
    eprintln!("{:?}", miette::Report::new(e));
    Exit(exit::INVALID_POLICIES).into()
}

fn load(args: &PolicyArgs) -> Result<Engine> {
    let dir = args.policies.clone().or_else(|| {
        let local = PathBuf::from("policies");
        local.join("probity.cedarschema").is_file().then_some(local)
    });
    match dir {
        Some(dir) => {
            eprintln!("policies: {}", dir.display());
            build(&dir, &args.files).map_err(report)
        }
        None => {
            eprintln!("policies: embedded defaults");
            Engine::from_embedded_defaults().map_err(report)
        }
    }
}

fn check(dir: &Path, files: &SchemaConfig) -> Result<u8> {
    let engine = build(dir, files).map_err(report)?;
    let status = engine.status();
    if status.policies == 0 {
        eprintln!(
            "error: no policies (*.cedar) under {}: the engine would deny every request",
            dir.display()
        );
        return Ok(exit::INVALID_POLICIES);
    }
    println!(
        "ok: {} policies in {} files, digest {}",
        status.policies,
        status.files.len(),
        status.digest
    );
    for p in &status.plugins {
        println!(
            "plugin {} {} for {} ({}, {} ms, {} MiB)",
            p.name,
            p.version,
            p.actions.join(", "),
            p.path,
            p.timeout_ms,
            p.memory_mib
        );
        if !p.trapping_imports.is_empty() {
            println!(
                "  WASI imports linked as traps: {}",
                p.trapping_imports.join(", ")
            );
        }
    }
    Ok(exit::ALLOW)
}

/// Reads a file (or standard input for `-`), refusing anything over `limit` bytes.
fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    if path == Path::new("-") {
        std::io::stdin()
            .take(limit + 1)
            .read_to_end(&mut buf)
            .context("cannot read standard input")?;
    } else {
        let len = std::fs::metadata(path)
            .with_context(|| format!("cannot read {}", path.display()))?
            .len();
        if len > limit {
            bail!(
                "{} is {len} bytes, over the limit of {limit}",
                path.display()
            );
        }
        std::fs::File::open(path)
            .and_then(|f| f.take(limit + 1).read_to_end(&mut buf))
            .with_context(|| format!("cannot read {}", path.display()))?;
    }
    if buf.len() as u64 > limit {
        bail!("{} is over the limit of {limit} bytes", path.display());
    }
    Ok(buf)
}

fn eval(request: &Path, entities: Option<&Path>, policies: &PolicyArgs) -> Result<u8> {
    let engine = load(policies)?;
    if let Some(path) = entities {
        let bytes = read_limited(path, MAX_ENTITIES_BYTES)?;
        let json: serde_json::Value = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        engine
            .upsert_entities(&json)
            .with_context(|| format!("cannot load entities from {}", path.display()))?;
    }
    let bytes = read_limited(request, probity::MAX_REQUEST_BYTES as u64)?;
    let request = Request::from_json_slice(&bytes)
        .with_context(|| format!("cannot read the request in {}", request.display()))?;
    let decision = engine.decide(&request);
    println!("{}", serde_json::to_string_pretty(&decision)?);
    Ok(if decision.is_allowed() {
        exit::ALLOW
    } else {
        exit::DENY
    })
}

fn test(path: &Path, policies: &PolicyArgs) -> Result<u8> {
    let engine = load(policies)?;
    let files = probity::scenario::discover(path)
        .with_context(|| format!("cannot list scenarios under {}", path.display()))?;
    if files.is_empty() {
        bail!("no scenario files (*.json) under {}", path.display());
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for file in files {
        match probity::scenario::run_file(&engine, &file) {
            Ok(results) => {
                for r in results {
                    println!("{r}");
                    if r.passed() {
                        passed += 1;
                    } else {
                        failed += 1;
                    }
                }
            }
            Err(e) => {
                println!("FAILED  {}: {e:#}", file.display());
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    Ok(if failed == 0 {
        exit::ALLOW
    } else {
        exit::TESTS_FAILED
    })
}
