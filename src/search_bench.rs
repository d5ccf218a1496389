//! `vacancy bench-search`: `/v1/search` under load beside the same question
//! asked of the owner in SQL. (Being written.)

#[derive(Debug, clap::Args)]
pub struct SearchBenchArgs {}

#[derive(Debug, thiserror::Error)]
pub enum SearchBenchError {}

pub async fn run(_args: SearchBenchArgs) -> Result<(), SearchBenchError> {
    Ok(())
}
