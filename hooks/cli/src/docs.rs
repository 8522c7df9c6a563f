//! `probity completions` and `probity man`: generated from the command definitions, so
//! they never drift from `--help`.

use std::path::Path;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::{Cli, exit, out};

/// Prints `shell`'s completions for the whole command line.
pub fn completions(shell: clap_complete::Shell) -> Result<u8> {
    use std::io::Write as _;
    let mut command = Cli::command();
    let mut text = Vec::new();
    clap_complete::generate(shell, &mut command, "probity", &mut text);
    std::io::stdout()
        .lock()
        .write_all(&text)
        .context("cannot write the completions")?;
    Ok(exit::ALLOW)
}

/// Writes `probity.1` and one page per subcommand (`probity-slurm-prolog.1`, ...), as
/// clap describes them.
pub fn man_pages(dir: &Path) -> Result<u8> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut written = 0;
    let mut pending = vec![(String::from("probity"), Cli::command())];
    while let Some((name, command)) = pending.pop() {
        let command = command
            .display_name(name.clone())
            .bin_name(name.replace('-', " "));
        for sub in command.get_subcommands() {
            if sub.get_name() != "help" {
                pending.push((format!("{name}-{}", sub.get_name()), sub.clone()));
            }
        }
        let mut page = Vec::new();
        clap_mangen::Man::new(command)
            .render(&mut page)
            .with_context(|| format!("cannot render the man page of {name}"))?;
        let path = dir.join(format!("{name}.1"));
        std::fs::write(&path, page).with_context(|| format!("cannot write {}", path.display()))?;
        written += 1;
    }
    out::line(format_args!("{written} man pages in {}", dir.display()))?;
    Ok(exit::ALLOW)
}
