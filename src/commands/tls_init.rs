//! `stageb tls-init`: a job's CA and certificate, the written paths on stdout.

use anyhow::Result;
use stageb::exit;

use crate::cli::TlsInitArgs;

pub(crate) fn run(args: TlsInitArgs) -> Result<u8> {
    let written = stageb::certs::write_job_certificates(&args.dir, &args.hosts, args.days)?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(exit::OK)
}
