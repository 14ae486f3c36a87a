//! Generates the parameter server's gRPC code (the `servers` feature) from
//! `proto/parameter_server.proto`, with the vendored protoc: nothing to install.

fn main() {
    println!("cargo::rerun-if-changed=proto/parameter_server.proto");
    #[cfg(feature = "servers")]
    {
        let protoc = protoc_bin_vendored::protoc_bin_path().expect("protoc-bin-vendored has a protoc for this machine");
        // SAFETY: a build script is single-threaded; prost-build reads PROTOC.
        unsafe { std::env::set_var("PROTOC", protoc) };
        tonic_prost_build::configure()
            // A place's part is saved in the server's checkpoint manifest.
            .type_attribute("zerotrain.ps.Part", "#[derive(serde::Serialize, serde::Deserialize)]")
            .compile_protos(&["proto/parameter_server.proto"], &["proto"])
            .expect("proto/parameter_server.proto compiles");
    }
}
