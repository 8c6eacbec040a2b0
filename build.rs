//! Compiles `proto/` with prost-build through protox, so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/hivemesh/averaging.proto",
        "proto/hivemesh/dht.proto",
        "proto/hivemesh/matchmaking.proto",
        "proto/hivemesh/rpc.proto",
        "proto/hivemesh/state.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    prost_build::Config::new().bytes(["."]).compile_fds(fds)?;
    Ok(())
}
