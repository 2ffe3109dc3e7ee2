//! Compiles `proto/stageb/v1/stageb.proto` with protox (pure Rust), so building stageb never
//! needs a system `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto");
    let fds = protox::compile(["stageb/v1/stageb.proto"], ["../proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
