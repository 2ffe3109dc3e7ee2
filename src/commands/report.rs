//! `stageb report`: write a run's HTML report and print its path.

use anyhow::Result;
use stageb::exit;

use crate::cli::ReportCommandArgs;

pub(crate) async fn run(args: ReportCommandArgs) -> Result<u8> {
    let run_dir = args.run_dir;
    let options = stageb_inspect::report::Options {
        out: args.out,
        audit: args.audit.into(),
    };
    let path =
        tokio::task::spawn_blocking(move || stageb_inspect::report::write(&run_dir, &options))
            .await??;
    println!("{}", path.display());
    Ok(exit::OK)
}
