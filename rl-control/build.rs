//! Embeds the XDP object built by `cargo xtask build`. The object is built
//! with nightly for bpfel-unknown-none, which a host build cannot do itself.
use std::path::PathBuf;

fn main() {
    let obj = match std::env::var_os("RL_EBPF_OBJ") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../target/bpf/bpfel-unknown-none/release/rl-ebpf"),
    };
    println!("cargo:rerun-if-env-changed=RL_EBPF_OBJ");
    println!("cargo:rerun-if-changed={}", obj.display());
    if !obj.exists() {
        panic!(
            "the XDP object {} is missing: build it with `cargo xtask build` \
             (or run `cargo xtask test`, which builds everything)",
            obj.display()
        );
    }
    println!(
        "cargo:rustc-env=RL_EBPF_OBJ={}",
        obj.canonicalize().unwrap().display()
    );
}
