//! Compiles `proto/stageb/v1/stageb.proto` with protox (pure Rust), so building stageb never
//! needs a system `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto");
    let fds = protox::compile(["stageb/v1/stageb.proto"], ["../proto"])?;
    // Decode failures of a peer's message are its fault: INVALID_ARGUMENT, not INTERNAL.
    tonic_prost_build::configure()
        .codec_path("crate::wire::EdgeCodec")
        .compile_fds(fds)?;
    Ok(())
}
