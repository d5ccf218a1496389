//! `vacancy bench`: measurements that print figures, each beside the
//! baseline its issue names, measured in the same run. (Being written.)

/// Which measurement to run.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {}

pub async fn run(command: BenchCommand) -> Result<(), BenchError> {
    match command {}
}
